"""First-use GEMM timings kept across processes, per machine: a restarted server does not time again.

A settled verdict (fastbert.backends.timing) holds for the machine that measured it: the same CPU, ISA, thread count,
torch and fastbert build. Settled verdicts are written to one JSON file per such fingerprint, under
`FASTBERT_CACHE_DIR` (default `~/.cache/fastbert`); the next process reads its verdicts from there instead of timing
(BERT-base's first 8 x 128 forward on a 2-core CPU: 4.1 s with timing, 0.9 s without). Provisional verdicts (timed on a
busy machine) are never written, nor verdicts timed while other processes took the CPUs; each kept verdict carries
the best times and checks it rests on. `FASTBERT_TIMING_CACHE=0` turns the store off; a file that cannot be read or
written is passed over with one log line, never an error. Only a regular file of at most MAX_FILE_BYTES is ever read (a
FIFO at the path would block, a link to /dev/zero never end), and the file keeps at most MAX_ENTRIES verdicts.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
import platform
import stat
import tempfile
import threading
from pathlib import Path

import torch

from fastbert.backends import scope

log = logging.getLogger("fastbert.timing")

ENV_DIR, ENV_SWITCH = "FASTBERT_CACHE_DIR", "FASTBERT_TIMING_CACHE"
ONEDNN_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "MKL_ENABLE_INSTRUCTIONS")
FORMAT = 2  # the verdicts' meaning: raised when timing's rules change (a margin, what a path is compared with)
MAX_FILE_BYTES = 4 << 20  # a store this large is not one fastbert wrote (MAX_ENTRIES verdicts take well under 2 MiB)
MAX_ENTRIES = 4096  # verdicts kept in the file: GEMM shapes of a few models, many times over
_lock = threading.Lock()
_files: dict[Path, dict[str, list]] = {}  # each file read so far: verdict key -> [wins, why]
_state = {"read": 0, "written": 0, "note": "", "unkept": 0, "share": 0.0}
_passed_over: set[Path] = set()  # files not read (PassedOver): nor written, whatever they are


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def fingerprint() -> dict[str, str]:
    """What a timing depends on besides the call: the CPU, the ISA each library runs, threads, and the builds."""
    from fastbert import capabilities
    from fastbert.version import __version__

    return {
        "cpu": capabilities.cpu_model(),
        "cpu id": _cpu_id(),
        "cores": str(os.cpu_count()),
        "machine": platform.machine(),
        "forced isa": str(capabilities.forced_isa()),
        "aten isa": torch.backends.cpu.get_cpu_capability(),
        "onednn settings": " ".join(f"{v}={os.environ[v]}" for v in ONEDNN_ENV if v in os.environ) or "none",
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "fastbert": f"{__version__} (timings format {FORMAT})",
        "native build": _native_build(),
    }


@functools.cache
def _cpu_id() -> str:
    """Family, model, stepping and cache size (Linux): a guest's model name can hide which generation it runs on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return platform.processor() or "unknown"
    fields = ("cpu family", "model", "stepping", "cache size")
    return ", ".join(line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() in fields)


@functools.cache
def _native_build() -> str:
    """The native extensions' build record (compiler, flags, torch), hashed: a rebuilt kernel is timed again."""
    info = Path(__file__).resolve().parents[1] / "_build_info.json"
    return hashlib.sha1(info.read_bytes()).hexdigest()[:12] if info.exists() else "no native build"


def path() -> Path | None:
    """This machine's file, one per fingerprint, named by its hash; None when there is no directory to keep it in."""
    digest = hashlib.sha1(json.dumps(fingerprint(), sort_keys=True).encode()).hexdigest()[:16]
    try:
        root = Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "fastbert")
    except RuntimeError as e:  # no HOME and a user without a passwd entry (containers run as an arbitrary uid)
        _state["note"] = f"no directory for them ({e}; set {ENV_DIR})"
        return None
    return root / f"gemm-timings-{digest}.json"


def _key(store: str, key: tuple) -> str:
    """The file's key for a verdict: the paths compared, the GEMM shape, and what decides the paths compared
    (FASTBERT_CPU_GEMM, FASTBERT_CPU_FP32: the fp32 kernel an int8 GEMM is timed against, backends excluded in this
    block)."""
    paths = f"FASTBERT_CPU_GEMM={os.environ.get('FASTBERT_CPU_GEMM', 'auto')}"
    paths += f" FASTBERT_CPU_FP32={os.environ.get('FASTBERT_CPU_FP32', 'auto')}"
    if excluded := scope.excluded_backends():
        paths += f" without {','.join(sorted(excluded))}"
    return "|".join([store, paths, *map(str, key)])


class PassedOver(ValueError):
    """A store path that is not read at all: not a regular file, or larger than MAX_FILE_BYTES."""


def _check_regular(file: Path, st: os.stat_result) -> None:
    """Raise PassedOver unless `st` (the file's, links followed) is a regular file of at most MAX_FILE_BYTES."""
    if not stat.S_ISREG(st.st_mode):
        raise PassedOver(f"{file} is not a regular file: passed over")
    if st.st_size > MAX_FILE_BYTES:
        raise PassedOver(f"{file} is larger than {MAX_FILE_BYTES} bytes: passed over")


def _read(file: Path) -> dict[str, list]:
    """The file's well-formed verdicts ([bool, str] each, at most MAX_ENTRIES); a missing file is empty, a bad one
    raises. Checked before it is opened and again on the open descriptor (no blocking open, no race), and never
    read past MAX_FILE_BYTES: a FIFO, a device or a huge file at the path is PassedOver, not a hang."""
    try:
        _check_regular(file, os.stat(file))
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return {}
    with os.fdopen(fd, "rb") as f:
        _check_regular(file, os.fstat(f.fileno()))
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:  # grew since it was checked
        raise PassedOver(f"{file} is larger than {MAX_FILE_BYTES} bytes: passed over")
    verdicts = json.loads(data).get("verdicts", {})
    good = ((k, v) for k, v in verdicts.items() if isinstance(v, list) and len(v) in (2, 3) and isinstance(v[0], bool)
            and isinstance(v[1], str) and (len(v) == 2 or isinstance(v[2], dict)))  # fmt: skip
    return dict(itertools.islice(good, MAX_ENTRIES))


def _entries(file: Path) -> dict[str, list]:
    if file not in _files:
        try:
            _files[file] = _read(file)
        except PassedOver as e:
            _files[file] = {}
            _passed_over.add(file)
            _state["note"] = f"{e}, timing again"
            log.info("fastbert: %s", _state["note"])
        except Exception as e:  # noqa: BLE001  (any bad file, deep nesting included, means: time again)
            _files[file] = {}
            _state["note"] = f"{file} unreadable, timing again ({type(e).__name__}: {str(e)[:200]})"
            log.info("fastbert: %s", _state["note"])
    return _files[file]


def lookup(store: str, key: tuple) -> tuple[bool, str] | None:
    """A verdict an earlier process settled for this key on this machine, or None."""
    if not enabled():
        return None
    file = path()
    if file is None:
        return None
    with _lock:
        entry = _entries(file).get(_key(store, key))
        if entry is None:
            return None
        _state["read"] += 1
    return entry[0], f"{entry[1]} (timed in an earlier run, kept in {file})"


def remember(store: str, key: tuple, wins: bool, why: str, evidence: dict | None = None) -> None:
    """Keep a settled verdict, with the `evidence` it rests on, for the next process (written at once: a server may
    never exit cleanly)."""
    if not enabled():
        return
    file = path()
    if file is None:
        return
    with _lock:
        entries = _entries(file)
        if file in _passed_over:  # not read, so not replaced either: what is there is not the store's to touch
            return
        name = _key(store, key)
        if name not in entries and len(entries) >= MAX_ENTRIES:
            _state["note"] = f"{file} holds {MAX_ENTRIES} verdicts, its most: new ones stay in this process"
            return
        entries[name] = [wins, why] if evidence is None else [wins, why, evidence]
        tmp = None
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(Exception):  # another process's verdicts since this one read the file
                theirs = [(k, v) for k, v in _read(file).items() if k not in entries]
                entries.update(theirs[: max(0, MAX_ENTRIES - len(entries))])
            with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False) as out:
                tmp = out.name
                json.dump({"fingerprint": fingerprint(), "verdicts": entries}, out, indent=1)
            os.chmod(tmp, 0o644)  # readable by the other users of a shared directory
            os.replace(tmp, file)  # whole files only: a reader never sees half a write
            tmp = None
            _state["written"] += 1
        except OSError as e:
            _state["note"] = f"cannot write {file} ({e.strerror or e}): timings stay in this process"
            log.info("fastbert: %s", _state["note"])
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def note(words: str) -> None:
    """Say something about the store in explain() (the last thing said is shown)."""
    _state["note"] = words


def unkept(share: float) -> None:
    """Count a verdict settled while other processes took `share` of the CPUs: kept in this process only."""
    with _lock:
        _state["unkept"] += 1
        _state["share"] = max(_state["share"], share)


def describe() -> str:
    """explain()'s line: where timings are kept and what this process read and wrote."""
    if not enabled():
        return f"GEMM timings: kept in this process only ({ENV_SWITCH}=0)"
    file = path()
    if file is None:
        return f"GEMM timings: kept in this process only: {_state['note']}"
    said = f"GEMM timings: kept in {file} ({_state['read']} read, {_state['written']} written by this process)"
    if _state["unkept"]:
        said += (f"; {_state['unkept']} timed while other processes took up to {_state['share']:.0%} of the CPUs kept "
                 "in this process only")  # fmt: skip
    return said + (f"; {_state['note']}" if _state["note"] else "")


def forget() -> None:
    """Drop what this process read (tests: a new fingerprint or directory takes effect)."""
    with _lock:
        _files.clear()
        _passed_over.clear()
        _state.update(read=0, written=0, note="", unkept=0, share=0.0)
