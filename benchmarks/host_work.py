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
    the CPU-only backends left out, and the CPU-only rule that runs bf16 GEMMs as fp32 off, as on a GPU) and every
    Triton launch is a stub that writes nothing; yields [launch count]. The count is then the same on every CPU."""
    import triton.runtime.interpreter as interpreter

    from fastbert import capabilities

    launches = [0]

    def stub(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - a launch: count it, run nothing
        launches[0] += 1

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    real_run, via_fp32 = interpreter.InterpretedFunction.run, capabilities.bf16_via_fp32
    interpreter.InterpretedFunction.run = stub
    capabilities.bf16_via_fp32 = lambda device: False
    try:
        with ops.use_backend("triton"), ops.exclude_backends(*CUDA_PATH_EXCLUDED):
            yield launches
    finally:
        interpreter.InterpretedFunction.run, capabilities.bf16_via_fp32 = real_run, via_fp32
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


def training_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Callable[[], None]:
    """One training step of `model` (fastbert's or transformers' BertModel): zero_grad, a forward under bf16 autocast,
    a loss on the last hidden state, backward, fused AdamW: what a training loop runs per batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, attention_mask=mask).last_hidden_state
        out.float().square().mean().backward()
        optimizer.step()

    return step


def host_ms(forward: Callable[[], object], repeats: int = 5) -> float:
    """Median wall milliseconds of `forward()` (a figure for benchmarks, never for a test)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _replay() -> None:
    """A stubbed replay: launches nothing (what a replay costs the host is this one call); `phases` marks it."""


class StubGraphs:
    """Stand-ins for the CUDA-graph executor on CPU: `capture` runs the function once for its output and returns a
    replay that launches nothing, so the graphed path's Python is counted."""

    device_type = "cpu"

    @staticmethod
    def capture(run: Callable[[], torch.Tensor], pool: object) -> tuple[Callable[[], None], torch.Tensor]:
        return _replay, run()


PHASES = ("before the sync", "sync to replay", "after the replay")
WATCHED = ("data_ptr", "_version", "requires_grad", "is_inference")  # a tensor's attributes a weight check reads


@dataclass(frozen=True)
class Phase:
    """The host work of one phase of a graphed forward: Python calls, non-view ATen ops, weight attribute reads."""

    python_calls: int
    aten_ops: int
    parameter_reads: int


def phases(forward: Callable[[], object], params: set[int], names: list | None = None) -> dict[str, Phase]:
    """Run a graphed `forward()` twice (graphs stubbed, see StubGraphs), counting per phase: before the host sync
    (`Tensor.tolist`), from it to the replay, and after. The first run counts Python calls; the second counts ATen ops
    as dispatched (views left out: they launch nothing; their names appended to `names` as (phase, op) when given)
    and reads of `WATCHED` attributes of the tensors whose ids are in `params`, by any route (an attribute,
    `operator.attrgetter`, `map(torch.Tensor.data_ptr, ...)`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    phase = [0]
    calls, aten, reads = [0, 0, 0], [0, 0, 0], [0, 0, 0]
    tolist, replay_code = torch.Tensor.tolist, _replay.__code__

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            returns = func._schema.returns
            if not (returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write):
                aten[phase[0]] += 1
                if names is not None:
                    names.append((PHASES[phase[0]], func.__name__))
            return func(*args, **(kwargs or {}))

    def marked_tolist(self: torch.Tensor) -> list:
        phase[0] = 1
        return tolist(self)

    def profile(frame, event, arg) -> None:  # noqa: ANN001
        if event == "call" and frame.f_code is not marked_tolist.__code__:
            calls[phase[0]] += 1
            if frame.f_code is replay_code:
                phase[0] = 2

    def watched(name: str) -> object:
        real = getattr(torch._C.TensorBase, name)
        if callable(real):
            def read(self: torch.Tensor, *args: object) -> object:
                reads[phase[0]] += id(self) in params
                return real(self, *args)

            return read
        return property(lambda self: reads.__setitem__(phase[0], reads[phase[0]] + (id(self) in params))
                        or real.__get__(self))  # fmt: skip

    def replayed_marker(frame, event, arg) -> None:  # noqa: ANN001
        if event == "call" and frame.f_code is replay_code:
            phase[0] = 2

    torch.Tensor.tolist = marked_tolist
    try:
        sys.setprofile(profile)
        try:
            forward()
        finally:
            sys.setprofile(None)
        phase[0] = 0
        saved = {name: torch.Tensor.__dict__.get(name) for name in WATCHED}
        for name in WATCHED:
            setattr(torch.Tensor, name, watched(name))
        sys.setprofile(replayed_marker)
        try:
            with Ops():
                forward()
        finally:
            sys.setprofile(None)
            for name, value in saved.items():
                if value is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, value)
    finally:
        del torch.Tensor.tolist  # torch.Tensor inherits it from TensorBase: deleting the patch restores it
    return {name: Phase(calls[i], aten[i], reads[i]) for i, name in enumerate(PHASES)}


def stub_graphs(model: torch.nn.Module) -> None:
    """Give `model` (a fastbert BertModel) the graph executor with stubbed capture and replay, on CPU."""
    from fastbert.execution.graphs import CudaGraphs

    stubbed = type("StubbedCudaGraphs", (StubGraphs, CudaGraphs), {})
    model.cuda_graphs = stubbed(model)
