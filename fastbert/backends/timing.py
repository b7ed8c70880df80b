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
    """Best-of-`repeats` process CPU seconds per function, interleaved: CPU time (not wall time) so that being
    descheduled on a shared machine does not decide the verdict, and interleaved so cache noise hits both alike."""
    for fn in fns:
        fn()  # warm-up: packing, oneDNN primitive creation, page faults
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.process_time()
            fn()
            best[i] = min(best[i], time.process_time() - start)
    return best
