"""Measured launch settings per GPU model, as data: `configs/<device>.json`, written by `benchmarks/tune_kernels.py`.

A forward launch asks `settings(kernel, device, dtype, n, rows, rule)`: the table of the GPU it runs on gives the
entry for that kernel, feature (or head) dim and dtype whose row count is nearest in log scale; where there is no
table, no such entry, or the entry breaks the kernel's constraints, the kernel file's `rule` (always valid) decides.
Answers are cached per key, so a launch pays one C-level cache hit. explain() says which table loaded and what each
launch used. `FASTBERT_KERNEL_CONFIGS` names a folder of tables to read instead of the shipped ones.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .limits import MAX_DIAGONALS

Launch = tuple[int, int, int, int | None]  # (BLOCK_M, BLOCK_N, num_warps, num_stages): None stages = Triton's default
Rule = Callable[[int, int], Launch]  # (n, rows) -> the kernel file's own settings
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
ENV = "FASTBERT_KERNEL_CONFIGS"
KERNELS = ("embedding_layernorm", "bias_act", "bias_residual_layernorm", "gated_act", "attention")
WHOLE_ROW = ("embedding_layernorm", "bias_residual_layernorm")  # a LayerNorm needs the whole row in one program
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

_lock = threading.Lock()
_tables: dict[str, tuple[dict | None, str]] = {}  # device name -> (table or None, where it came from or why not)
_used: dict[tuple, str] = {}  # (kernel, device name, dtype, n, rows class) -> what the launch used
_trial: dict[str, Launch] = {}  # kernel -> settings every launch of it uses (the tuner's candidates)


def device_name(device: torch.device) -> str:
    """The name a table is filed under: the GPU's model name; "cpu" for Triton's interpreter."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def file_name(name: str) -> str:
    """The table's file name for a device name: "NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3.json"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") + ".json"


def table_path(name: str) -> Path:
    return Path(os.environ.get(ENV) or CONFIG_DIR) / file_name(name)


def _table(name: str) -> tuple[dict | None, str]:
    """(the table for this device name or None, where it came from or why there is none), loaded once."""
    with _lock:
        if name not in _tables:
            path = table_path(name)
            try:
                with open(path, encoding="utf-8") as fh:
                    table = json.load(fh)
                if not isinstance(table.get("kernels"), dict):
                    raise ValueError("no 'kernels' object")
                _tables[name] = (table, str(path))
            except FileNotFoundError:
                _tables[name] = (None, f"no table for {name} ({path.name} not in {path.parent})")
            except (OSError, ValueError) as exc:  # a broken file falls back to the rule, and explain() says why
                _tables[name] = (None, f"{path} unreadable ({type(exc).__name__}: {exc}); the rule decides")
        return _tables[name]


def row_rule(blocks: Callable[[int], tuple[int, int, int]]) -> Rule:
    """A row kernel's fallback from its `blocks(n) -> (BLOCK_M, BLOCK_N, num_warps)`, Triton's default pipelining."""
    return lambda n, rows: (*blocks(n), None)


def problem(kernel: str, n: int, launch: Launch) -> str | None:
    """Why these settings cannot run this kernel at feature (head) dim n, or None."""
    block_m, block_n, warps, stages = launch
    for what, value in (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("num_warps", warps)):
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            return f"{what}={value!r} is not a power of two"
    if warps > 32:
        return f"num_warps={warps} is over 32"
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        return f"num_stages={stages!r} is not a positive int"
    if kernel in WHOLE_ROW and block_n < n:
        return f"BLOCK_N={block_n} < {n}: the LayerNorm needs the whole row"
    if kernel == "attention" and (min(block_m, block_n) < 16 or block_m + block_n > MAX_DIAGONALS):
        return f"attention tiles {block_m}x{block_n}: each side >= 16, together <= {MAX_DIAGONALS}"
    return None


def _entry(table: dict, kernel: str, dtype: str, n: int, rows: int) -> tuple[dict | None, str]:
    """The entry for (kernel, dtype, n) with the row count nearest `rows` (log scale), or None and why."""
    entries = [e for e in table["kernels"].get(kernel, ()) if e.get("dtype") == dtype and e.get("n") == n]
    if not entries:
        return None, f"the table has no {kernel} entry for n={n} {dtype}"
    best = min(entries, key=lambda e: abs(math.log2(max(1, e.get("rows", 1))) - math.log2(max(1, rows))))
    return best, f"the table's entry for {best.get('rows')} rows"


@functools.cache
def settings(kernel: str, device: torch.device, dtype: torch.dtype, n: int, rows: int, rule: Rule) -> Launch:
    """Launch settings for one forward launch: the device's table entry where one fits, else `rule(n, rows)`.
    `rows`: the launch's row count (tokens; attention: its sequence-length cap); cached per argument tuple."""
    name, dtype_name = device_name(device), DTYPES.get(dtype, str(dtype))
    key = (kernel, name, dtype_name, n, rows)
    if kernel in _trial:
        launch, source = _trial[kernel], "a tuner's trial"
    else:
        launch = rule(n, rows)
        table, why = _table(name)
        entry, reason = _entry(table, kernel, dtype_name, n, rows) if table is not None else (None, why)
        if entry is not None:
            found = (entry.get("BLOCK_M"), entry.get("BLOCK_N"), entry.get("num_warps"), entry.get("num_stages"))
            bad = problem(kernel, n, found)
            launch, source = (found, reason) if bad is None else (launch, f"the rule ({reason} is refused: {bad})")
        else:
            source = f"the rule ({reason})"
    _used[key] = source
    return launch


def reset() -> None:
    """Forget loaded tables and cached answers (a table written or FASTBERT_KERNEL_CONFIGS changed)."""
    with _lock:
        _tables.clear()
    _used.clear()
    settings.cache_clear()


@contextlib.contextmanager
def trial(kernel: str, launch: Launch) -> Iterator[None]:
    """Every launch of `kernel` inside the block uses `launch` (the tuner times candidates with it)."""
    if (why := problem(kernel, 1, launch)) is not None:
        raise ValueError(f"{kernel}: {why}")
    _trial[kernel] = launch
    settings.cache_clear()
    try:
        yield
    finally:
        del _trial[kernel]
        settings.cache_clear()


def note(device: torch.device) -> str:
    """The plan's line on launch settings for a device, read at bind time."""
    name = device_name(device)
    table, where = _table(name)
    if table is None:
        return f"launch settings: the kernels' rules ({where})"
    count = sum(len(v) for v in table["kernels"].values())
    return f"launch settings: measured table {Path(where).name} ({count} entries), the kernels' rules elsewhere"


def describe() -> str | None:
    """explain()'s lines: what each (kernel, device, dtype, n, rows) launched so far used."""
    if not _used:
        return None
    lines = ["kernel launch settings:"]
    for (kernel, name, dtype, n, rows), source in sorted(_used.items()):
        lines.append(f"  {kernel} n={n} {dtype} rows~{rows} on {name}: {source}")
    return "\n".join(lines)
