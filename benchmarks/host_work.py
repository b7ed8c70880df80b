"""fastbert's own host work per forward on the CUDA path, counted on any CPU: Python calls and dispatch decisions.

On a GPU a fused op's kernel takes 10-30 us, so the Python around it is the cost that decides small and medium
batches. That Python can be counted without a GPU: the model runs on CPU tensors with the CUDA path's backends (the
Triton kernels for the fused ops, torch's GEMMs; Triton under its interpreter) and every Triton launch replaced by a
stub, so what remains is fastbert's Python, torch's Python and the GEMMs in C. `sys.setprofile` counts each Python
function call (C calls are not counted); `fastbert.ops.select` calls are the per-call dispatch decisions. The counts
are deterministic, so a test can assert a ceiling (tests/test_host_work.py); `python -m benchmarks.bench_host` prints
them side by side with transformers' BertModel, and the host milliseconds as a figure only.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from fastbert import ops

# BERT-base's shape; the weights are random (counts do not depend on them)
BERT_BASE = dict(
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
)
CUDA_PATH_EXCLUDED = ("native", "gemm", "onednn", "int8")  # CPU-only backends: what remains is the CUDA path's choice


@dataclass(frozen=True)
class HostWork:
    """One forward's host work: Python function calls, dispatch decisions (`ops.select` calls), Triton launches."""

    python_calls: int
    dispatches: int
    launches: int


@contextlib.contextmanager
def cuda_path() -> Iterator[list[int]]:
    """Inside the block fastbert picks its CUDA-path backends for CPU tensors (Triton forced on, under its interpreter,
    the CPU-only backends left out) and every Triton launch is a stub that writes nothing; yields [launch count]."""
    import triton.runtime.interpreter as interpreter

    launches = [0]

    def stub(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - a launch: count it, run nothing
        launches[0] += 1

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    real_run = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = stub
    try:
        with ops.use_backend("triton"), ops.exclude_backends(*CUDA_PATH_EXCLUDED):
            yield launches
    finally:
        interpreter.InterpretedFunction.run = real_run
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def count(forward: Callable[[], object], launches: list[int] | None = None) -> HostWork:
    """Run `forward()` once, counting Python calls and fastbert dispatch decisions (and launches, if given)."""
    calls, decisions = [0], [0]
    select = ops.select

    def counted_select(*args, **kwargs):  # noqa: ANN002, ANN003
        decisions[0] += 1
        return select(*args, **kwargs)

    def profile(frame, event, arg) -> None:  # noqa: ANN001
        if event == "call":
            calls[0] += 1

    before = launches[0] if launches is not None else 0
    ops.select = counted_select
    sys.setprofile(profile)
    try:
        forward()
    finally:
        sys.setprofile(None)
        ops.select = select
    # the counted_select wrapper's own calls are not fastbert's work
    return HostWork(calls[0] - decisions[0], decisions[0], (launches[0] - before) if launches is not None else 0)


def host_ms(forward: Callable[[], object], repeats: int = 5) -> float:
    """Median wall milliseconds of `forward()` (a figure for benchmarks, never for a test)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


class StubGraphs:
    """Stand-ins for the CUDA-graph executor on CPU: `capture` runs the function once for its output and returns a
    replay that launches nothing (what a replay costs the host is one call), so the graphed path's Python is counted."""

    device_type = "cpu"

    @staticmethod
    def capture(run: Callable[[], torch.Tensor], pool: object) -> tuple[Callable[[], None], torch.Tensor]:
        return (lambda: None), run()


def stub_graphs(model: torch.nn.Module) -> None:
    """Give `model` (a fastbert BertModel) the graph executor with stubbed capture and replay, on CPU."""
    from fastbert.execution.graphs import CudaGraphs

    stubbed = type("StubbedCudaGraphs", (StubGraphs, CudaGraphs), {})
    model.cuda_graphs = stubbed(model)
