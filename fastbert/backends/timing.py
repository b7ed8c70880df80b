"""Timing a fast path against the path it would replace, on the call's own input, for the backends that choose by
measurement (oneDNN's GEMMs, fastbert's fp32 and int8 GEMMs)."""

from __future__ import annotations

import time
from collections.abc import Callable

SMALL_M = 128  # calibration size classes: latency-sized (M < 128 rows) and throughput-sized inputs


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
