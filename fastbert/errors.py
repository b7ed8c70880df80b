"""The errors a `fastbert` command reports in one line (no traceback), their exit codes, and the checks that raise
them: numeric option ranges (an argparse type) and a text reader that names the file and line of a bad byte.

Exit code 2: a usage error (an option out of range or inconsistent with another, a device this machine lacks, an
optional dependency the command needs that is not installed).
Exit code 1: a data error (a missing, empty or undecodable file, a bad column or label, a bad checkpoint or config),
an unwritable output folder, or a result that failed its own check. Anything else is a bug: it keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
from collections.abc import Callable
from types import ModuleType


class UsageError(ValueError):
    """A command-line option (or API argument) that cannot be used as given: exit code 2."""


class MissingExtraError(ImportError):
    """An optional dependency (a `fastbert-kernels[extra]`) that a feature needs is not installed: exit code 2."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import `module`, or raise MissingExtraError saying which extra installs it (one line, not a traceback)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        message = f"{what} needs the `{module}` package: pip install 'fastbert-kernels[{extra}]'"
        raise MissingExtraError(message) from exc


class DataError(ValueError):
    """Input data that cannot be used as asked: exit code 1."""


class CheckError(RuntimeError):
    """A result that failed its own check (e.g. ONNX parity): exit code 1."""


def exit_code(exc: BaseException) -> int | None:
    """The exit code of an error the user can act on (2 usage, 1 data/files/checks); None for a bug."""
    if isinstance(exc, (UsageError, MissingExtraError)):
        return 2
    if isinstance(exc, (ValueError, OSError, CheckError)):  # ValueError: DataError, CheckpointError, config errors
        return 1
    return None


def ranged(
    kind: type, low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: a `kind` number in [low, high] (open ends where asked), so nonsense is a usage error
    (exit code 2, naming the option) before any work starts."""
    bounds = [f"{'>' if low_open else '>='} {low}"] if low is not None else []
    bounds += [f"{'<' if high_open else '<='} {high}"] if high is not None else []
    span = " and ".join(bounds)

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if not math.isfinite(value) or too_low or too_high:
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    return parse


def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file's content (newlines as in the file, a leading byte-order mark dropped, as Excel and
    Notepad write one); a missing, empty or binary file is a DataError."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise DataError(f"{path}: the file is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); convert it to UTF-8") from None
    text = text.removeprefix("\ufeff")
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise DataError(f"{path}:{line}: a NUL byte: this looks like a binary file, not text")
    return text
