"""A fixed, reproducible background load for the CPU suites: neighbour processes that run for a suite's duration.

Two kinds, the neighbours a server meets: `spin`, a single-threaded busy loop (a Python worker, a tokenizer), and
`torch`, a multi-threaded torch worker with as many intra-op threads as the machine has cores, multiplying 256 x 256
matrices back to back (a second model server, a test run). Every system of a suite runs interleaved under the same
neighbours, so they share the load alike.

    python -m benchmarks.bench_encode --neighbours spin=1 torch=1
    python -m benchmarks.run_model --models minilm --neighbours torch=2
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

KINDS = {
    "spin": "while True:\n    pass\n",
    "torch": (
        "import os, torch\n"
        "torch.set_num_threads(int(os.environ['FASTBERT_NEIGHBOUR_THREADS']))\n"
        "a = torch.randn(256, 256)\n"
        "while True:\n"
        "    a = torch.tanh(a @ a)\n"
    ),
}


def parse(specs: list[str] | None) -> dict[str, int]:
    """["spin=1", "torch=2"] -> {"spin": 1, "torch": 2}; a clear error for anything else."""
    counts: dict[str, int] = {}
    for spec in specs or ():
        kind, _, count = spec.partition("=")
        if kind not in KINDS or not count.isdigit():
            raise ValueError(f"--neighbours takes KIND=N with KIND one of {', '.join(KINDS)}: got {spec!r}")
        counts[kind] = counts.get(kind, 0) + int(count)
    return {k: n for k, n in counts.items() if n > 0}


def describe(counts: dict[str, int]) -> str:
    """What ran beside the suite, in words for a table's header ("quiet" where nothing did)."""
    if not counts:
        return "no neighbours started"
    words = {"spin": "single-threaded busy loop", "torch": f"torch worker with {os.cpu_count()} threads"}
    return ", ".join(f"{n} x {words[k]}" for k, n in counts.items())


@contextmanager
def running(counts: dict[str, int]) -> Iterator[list[subprocess.Popen]]:
    """Start the neighbours, wait until each is running its loop, stop them all on the way out (also on errors)."""
    env = {**os.environ, "FASTBERT_NEIGHBOUR_THREADS": str(os.cpu_count() or 1)}
    procs = [subprocess.Popen([sys.executable, "-c", KINDS[kind]], env=env, stdin=subprocess.DEVNULL)
             for kind, n in counts.items() for _ in range(n)]  # fmt: skip
    try:
        if procs:
            time.sleep(2.0)  # torch's import, so the first system timed meets the same load as the last
            dead = [p.args[-1][:40] for p in procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"a neighbour exited at start: {dead}")
        yield procs
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
