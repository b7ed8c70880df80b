"""Where a benchmark writes when it is given no --out: a fresh folder of its own, benchmarks/results/runs/<cpu key>/<UTC
time>/ (ignored by git), as `make bench` does, so a direct run never overwrites the committed results in
benchmarks/results/; committing a run is a deliberate copy."""

from __future__ import annotations

import os
import time

from fastbert.capabilities import cpu_key

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run_folder() -> str:
    """benchmarks/results/runs/<cpu key>/<UTC time of this call>: this run's own folder (created by the writer)."""
    return os.path.join(RESULTS, "runs", cpu_key(), time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
