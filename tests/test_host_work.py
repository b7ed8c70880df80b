"""The host-overhead guard: fastbert's own Python per BERT-base forward on the CUDA path, counted on CPU with the Triton
launches stubbed (benchmarks/host_work.py). Counts, never times: a regression in host work fails here on any machine."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import fastbert
from benchmarks.host_work import BERT_BASE, count, cuda_path, phases, stub_graphs, training_step

# the CUDA path's counts run its Triton kernels' launches stubbed under the interpreter; the CPU path's need no Triton
cuda_path_test = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
EAGER_CEILING, GRAPHED_CEILING = 1000, 300  # Python calls per forward (transformers makes ~2,000)
TRAINING_CEILING = 1000  # Python calls per training forward under bf16 autocast (4,571 when autocast was per call)
REPLAY_ATEN_CEILING = 12  # ATen ops between the host sync and a replay: all that serialises the GPU there
CPU_CEILING = 800  # Python calls per CPU inference forward, every layer in the native layer stack (712 measured)


def bert_base(training: bool = False) -> fastbert.BertModel:
    torch.manual_seed(0)
    return fastbert.BertModel(fastbert.BertConfig(**BERT_BASE)).train(training)


def ragged() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 1000, (2, 64))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    return ids, mask


@cuda_path_test
def test_eager_and_graphed_forwards_stay_under_their_python_call_ceilings() -> None:
    model, (ids, mask) = bert_base(), ragged()
    with torch.no_grad(), cuda_path() as launches:
        for _ in range(2):
            model(ids, attention_mask=mask)
        eager = count(lambda: model(ids, attention_mask=mask), launches)
        stub_graphs(model)
        for _ in range(2):
            model(ids, attention_mask=mask)
        graphed = count(lambda: model(ids, attention_mask=mask), launches)
    layers = BERT_BASE["num_hidden_layers"]
    assert eager.launches == 4 * layers + 1  # embedding + 4 fused ops a layer: every op reached its kernel
    assert eager.dispatches <= 1 and graphed.dispatches <= 1  # the pooler's GEMM; the encoder's ops are bound
    assert eager.python_calls < EAGER_CEILING, eager
    assert graphed.launches == 0 and graphed.python_calls < GRAPHED_CEILING, graphed


def test_a_cpu_inference_forward_stays_under_its_python_call_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path's Python around the native layer stack: input checks and packing (read in the extension), the
    dispatch's four questions about the first layer's GEMMs, the packed weights of every layer."""
    from fastbert.backends import native
    from fastbert.execution import stack

    if native.load("_native_cpu")[0] is None:
        pytest.skip(f"native CPU extension unavailable: {native.load('_native_cpu')[1]}")
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")  # fastbert's GEMMs without first-use timing: one path throughout
    model, (ids, mask) = bert_base(), ragged()
    with torch.inference_mode():
        for _ in range(2):
            model(ids, attention_mask=mask)
        work = count(lambda: model(ids, attention_mask=mask))
    assert "layers 1-12 in one native call" in stack.describe()
    assert work.dispatches == 5, work  # the first layer's four GEMMs and the pooler's
    assert work.python_calls < CPU_CEILING, work


@cuda_path_test
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "ragged"])
def test_nothing_between_the_sync_and_a_replay_but_the_inputs(padded: bool) -> None:
    """Between the one host sync and the replay: at most REPLAY_ATEN_CEILING ATen ops (packing the inputs into the
    graph's buffers) and no read of any weight; the weights' check runs before the sync."""
    model, (ids, mask) = bert_base(), ragged()
    if not padded:
        mask = torch.ones_like(ids)
    with torch.no_grad(), cuda_path():
        stub_graphs(model)
        for _ in range(2):
            model(ids, attention_mask=mask)
        work = phases(lambda: model(ids, attention_mask=mask), {id(p) for p in model.parameters()})
    between = work["sync to replay"]
    assert between.aten_ops <= REPLAY_ATEN_CEILING and between.parameter_reads == 0, work
    assert work["before the sync"].parameter_reads > 0  # the address check is there (and counted)


@cuda_path_test
def test_a_bf16_autocast_training_forward_runs_the_bound_ops() -> None:
    model, (ids, mask) = bert_base(training=True), ragged()
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_path() as launches:
        for _ in range(2):
            model(ids, attention_mask=mask)
        work = count(lambda: model(ids, attention_mask=mask), launches)
    assert work.dispatches <= 1 and work.launches == 4 * BERT_BASE["num_hidden_layers"] + 1, work
    assert work.python_calls <= TRAINING_CEILING, work


@cuda_path_test
def test_a_training_step_costs_less_host_work_than_transformers() -> None:
    """Forward under bf16 autocast, backward, fused AdamW: fewer Python calls than transformers' sdpa BertModel."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(**BERT_BASE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.BertModel(config).train()
    model, (ids, mask) = fastbert.BertModel.from_hf(hf).train(), ragged()
    theirs = training_step(hf, ids, mask)
    for _ in range(2):
        theirs()
    with cuda_path() as launches:
        ours = training_step(model, ids, mask)
        for _ in range(2):
            ours()
        work = count(ours, launches)
    assert work.python_calls < count(theirs).python_calls, work
