"""Timing a fast path against the path it would replace, on the call's own input, for the backends that choose by
measurement (oneDNN's GEMMs, fastbert's fp32 and int8 GEMMs)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

SMALL_M = 128  # calibration size classes: latency-sized (M < 128 rows) and throughput-sized inputs


CPU_GEMM_MODES = ("auto", "gemm", "onednn", "torch")


def cpu_gemm_mode() -> str:
    """FASTBERT_CPU_GEMM (default auto: timed at first use); a value that is not a mode is a ValueError listing the
    accepted ones, not a silent auto."""
    mode = os.environ.get("FASTBERT_CPU_GEMM", "auto")
    if mode not in CPU_GEMM_MODES:
        raise ValueError(f"FASTBERT_CPU_GEMM={mode!r} is not one of {', '.join(CPU_GEMM_MODES)}")
    return mode


def size_class(rows: int) -> str:
    """The size class a GEMM of `rows` rows is judged in: one verdict per class and weight shape."""
    return "small" if rows < SMALL_M else "large"


def best_times(*fns: Callable[[], object], repeats: int = 9) -> list[float]:
    """Best-of-`repeats` wall seconds per function, interleaved so cache noise hits both alike; the minimum drops the
    runs a shared machine descheduled. Not process CPU time: Linux adds the worker threads' CPU time at scheduler ticks
    (4 ms), so a 2 ms multi-threaded GEMM reads 2 or 6 ms, and with two functions interleaved the tick can land on the
    same one every time (seen: fastbert's GEMM judged 3x slower than torch's, and the slow path chosen)."""
    for fn in fns:
        fn()  # warm-up: packing, oneDNN primitive creation, page faults
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def judge(
    verdicts: dict[tuple, tuple[bool, str]],
    key: tuple,
    mine: Callable[[], object],
    other: Callable[[], object],
    names: tuple[str, str],
    what: str,
    margin: float = 1.0,
) -> tuple[bool, str]:
    """The verdict for `key`, timed once: whether `mine` beats `other` (the path that runs without it) on the call's
    own input by `margin` (1.1: by 10%; 1 / 1.1: unless `other` is 10% faster), and why in explain()'s words.
    `names`: (mine, other) in words; `what`: the work timed, e.g. "[T, K] x [K, N] + gelu". Threads that time the
    same key at once all take the first verdict stored, so every call of a key runs the same path (same output)."""
    if key not in verdicts:
        with torch.no_grad():
            fast, plain = best_times(mine, other)
        wins = fast * margin < plain
        return verdicts.setdefault(key, (
            wins,
            f"{names[0] if wins else names[1]} for {what}: {names[0]} {fast * 1e3:.2f} ms vs {names[1]} "
            f"{plain * 1e3:.2f} ms{' (within the tie margin)' if wins and fast > plain else ''}",
        ))  # fmt: skip
    return verdicts[key]


def gemm_words(rows: int, weight: torch.Tensor, epilogue: str = "") -> str:
    """A GEMM as explain() names it: "[rows, K] x [K, N]" and its fused epilogue."""
    return f"[{rows}, {weight.shape[1]}] x [{weight.shape[1]}, {weight.shape[0]}]{epilogue}"
