"""The CUDA-graph executor's logic on CPU: a capture that replays by running the captured function again stands in for
CUDA graphs, so buckets, the static varlen layout, splitting beyond the largest bucket, the memory bound, recapture
after a weight change and the lock are checked on any machine (tests/test_cuda_graphs.py replays real graphs)."""

from __future__ import annotations

import copy
import gc
import io
import threading
import weakref

import pytest
import torch

import fastbert
from fastbert import ops
from fastbert.execution import graphs as cuda_graphs
from fastbert.execution.graphs import CudaGraphs, bucket_key, bucket_tokens, split
from fastbert.padding import unpad
from tests.conftest import tiny_bert


class RerunGraphs(CudaGraphs):
    """CudaGraphs on CPU: 'replay' runs the captured function again into the same static output."""

    device_type = "cpu"
    captures = 0

    @staticmethod
    def capture(run, pool):  # noqa: ANN001, ANN205
        RerunGraphs.captures += 1
        out = run()
        return (lambda: out.copy_(run())), out


def batch(lengths: list[int], seqlen: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]).long()
    return torch.randint(1, 120, mask.shape, generator=gen) * mask, mask


def graphed(**limits: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    eager = tiny_bert(max_position_embeddings=64)
    model = tiny_bert(max_position_embeddings=64)
    model.cuda_graphs = RerunGraphs(model, **limits)
    return eager, model


def test_buckets() -> None:
    assert [bucket_tokens(n) for n in (1, 16, 17, 256, 257, 2048, 2049, 5000)] == [16, 16, 32, 256, 512, 2048, 3072,
                                                                                     5120]  # fmt: skip
    assert bucket_key(3, 100, 40) == (4, 128, 64)
    assert split([5, 5, 5, 5, 5], max_tokens=12, max_batch=8) == [(0, 2), (2, 4), (4, 5)]
    assert split([1] * 7, max_tokens=100, max_batch=3) == [(0, 3), (3, 6), (6, 7)]


@pytest.mark.parametrize(
    "lengths", [[3], [16, 1, 9], [5, 0, 12, 2, 7], [40, 33, 64, 1, 50, 17, 9, 64, 3]], ids=["1", "3", "5", "9"]
)
def test_replay_equals_eager_including_split_batches(lengths: list[int]) -> None:
    """max_tokens 64 / max_batch 4: the 9-sequence batch is split into replays; every output equals eager."""
    eager, model = graphed(max_tokens=64, max_batch=4)
    ids, mask = batch(lengths, max(lengths) or 1)
    with torch.inference_mode():
        expected = eager(ids, attention_mask=mask).last_hidden_state
        for _ in range(3):  # binds, captures, replays
            out = model(ids, attention_mask=mask).last_hidden_state
    assert torch.allclose(out, expected, rtol=0, atol=1e-5)
    assert "CUDA graph replay by token bucket" in model.plans.lookup(next(iter(model.plans.plans))).describe()


def test_memory_bound_runs_eagerly_and_says_why() -> None:
    eager, model = graphed(memory_limit=1)
    ids, mask = batch([7, 3], 7)
    with torch.inference_mode():
        for _ in range(2):
            out = model(ids, attention_mask=mask).last_hidden_state
        assert torch.allclose(out, eager(ids, attention_mask=mask).last_hidden_state, rtol=0, atol=1e-5)
    assert not model.cuda_graphs.graphs and "memory_limit" in model.cuda_graphs.describe()


def _in_place(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.encoder.layer[0].output.dense.weight.mul_(0.5)
        model.encoder.layer[1].attention.self.key.weight.data.mul_(1.5)  # bypasses the version counter


def _new_memory(model: torch.nn.Module) -> None:
    query = model.encoder.layer[0].attention.self.query
    query.weight.data = query.weight.data * 0.5  # registers nothing


@pytest.mark.parametrize("edit, recaptures", [(_in_place, 0), (_new_memory, 1)], ids=["in-place", "new-memory"])
def test_weight_edits_are_read_by_the_next_replay(edit, recaptures: int) -> None:  # noqa: ANN001
    """A replay reads the weights where they lie (the Q, K and V concatenation is inside the graph): a change in place,
    by any route, is seen without a recapture; a weight moved to new memory is caught by the address check before
    the sync, and recaptured."""
    eager, model = graphed()
    ids, mask = batch([9, 4], 9)
    with torch.inference_mode():
        for _ in range(2):
            model(ids, attention_mask=mask)
        captured = RerunGraphs.captures
    for m in (model, eager):
        edit(m)
    with torch.inference_mode():
        out = model(ids, attention_mask=mask).last_hidden_state
        assert torch.allclose(out, eager(ids, attention_mask=mask).last_hidden_state, rtol=0, atol=1e-5)
    assert RerunGraphs.captures == captured + recaptures


def test_two_threads_replaying_one_model_get_their_own_outputs() -> None:
    eager, model = graphed()
    inputs = [batch([9, 4], 9, seed=s) for s in (1, 2)]
    with torch.inference_mode():
        expected = [eager(i, attention_mask=m).last_hidden_state for i, m in inputs]
        for i, m in inputs:
            model(i, attention_mask=m)
    results: dict[int, list] = {0: [], 1: []}

    def work(k: int) -> None:
        with torch.inference_mode():
            for _ in range(20):
                results[k].append(model(inputs[k][0], attention_mask=inputs[k][1]).last_hidden_state)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for k in (0, 1):
        assert len(results[k]) == 20
        assert all(torch.allclose(r, expected[k], rtol=0, atol=1e-5) for r in results[k])


def test_limits_and_switches() -> None:
    model = tiny_bert(max_position_embeddings=64)
    with pytest.raises(ValueError, match="max_tokens"):
        cuda_graphs.enable(model, max_tokens=32)
    cuda_graphs.disable(model)
    assert model.cuda_graphs is False
    with pytest.raises(TypeError, match="not a fastbert"):
        cuda_graphs.enable(torch.nn.Linear(2, 2))


def test_another_mode_or_replaced_weights_recapture() -> None:
    """Graphs hold the kernels and tensors of their capture: a forced backend or a weight table assigned anew (not
    copied into) must not replay them."""
    eager, model = graphed()
    ids, mask = batch([9, 4], 9)
    with torch.inference_mode():
        for _ in range(3):
            model(ids, attention_mask=mask)
        captured = RerunGraphs.captures
        with ops.use_backend("torch"):
            for _ in range(3):
                model(ids, attention_mask=mask)
        assert RerunGraphs.captures == captured + 1
        assert "forced torch): CUDA graph replay" in fastbert.explain()
    state = {k: v * 0.5 if k.endswith("dense.weight") else v for k, v in eager.state_dict().items()}
    for m in (model, eager):
        m.load_state_dict(state, assign=True)  # new Parameter objects
    with torch.inference_mode():
        out = model(ids, attention_mask=mask).last_hidden_state
        assert torch.allclose(out, eager(ids, attention_mask=mask).last_hidden_state, rtol=0, atol=1e-5)


def test_a_model_with_graphs_copies_pickles_and_is_freed() -> None:
    _, model = graphed()
    ids, mask = batch([5, 3], 5)
    with torch.inference_mode():
        for _ in range(2):
            model(ids, attention_mask=mask)
    assert model.cuda_graphs.graphs
    assert copy.deepcopy(model).cuda_graphs is None  # a copy starts without graphs (the default on CUDA)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).cuda_graphs is None
    fastbert.explain()  # the plan keeps only a weak reference to the graphs
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_a_config_with_more_positions_than_the_largest_bucket_runs_without_graphs(monkeypatch) -> None:  # noqa: ANN001
    """The default graphs are made inside the first eval forward on CUDA (here: on CPU, with the rerun capture): a
    model with more positions than the largest bucket runs in the loop and says why, instead of raising there."""
    monkeypatch.setattr(CudaGraphs, "device_type", "cpu")
    monkeypatch.setattr(CudaGraphs, "capture", RerunGraphs.capture)
    model = tiny_bert(max_position_embeddings=cuda_graphs.MAX_TOKENS + 1)
    ids, mask = batch([9, 4], 9)
    with torch.inference_mode():
        for _ in range(3):
            out = model(ids, attention_mask=mask).last_hidden_state
        expected = copy.deepcopy(model)(ids, attention_mask=mask).last_hidden_state
    assert torch.equal(out, expected) and model.cuda_graphs is None
    assert f"positions > the largest default bucket ({cuda_graphs.MAX_TOKENS} tokens)" in fastbert.explain()


def test_a_capture_that_fails_with_any_error_runs_the_bucket_in_the_loop() -> None:
    """A Triton compile error is not a RuntimeError: any error from a capture sends that bucket to the loop, said."""

    class CompilationError(Exception):
        pass

    class FailingGraphs(RerunGraphs):
        @staticmethod
        def capture(run, pool):  # noqa: ANN001, ANN205
            raise CompilationError("at 12:4: unsupported")

    eager, model = graphed()
    model.cuda_graphs = FailingGraphs(model)
    ids, mask = batch([9, 4], 9)
    with torch.inference_mode():
        for _ in range(3):
            out = model(ids, attention_mask=mask).last_hidden_state
        assert torch.allclose(out, eager(ids, attention_mask=mask).last_hidden_state, rtol=0, atol=1e-5)
    assert "capture failed (CompilationError: at 12:4: unsupported)" in model.cuda_graphs.describe()


@pytest.mark.parametrize("key", [(128, 16384, 128), (16, 5120, 512), (1, 128, 128), (4, 32, 16)])
def test_a_bucket_pays_for_few_filler_slots(key: tuple[int, int, int]) -> None:
    """A kernel that pads (fp32 attention without TF32 runs SDPA over [sequences, Sb]) pays for every sequence slot:
    a bucket has only the fillers its smallest call needs (2x the rows at 128 x 128 with one filler per Sb tokens)."""
    from fastbert.execution.graphs import _Graph, bucket_floor

    graph = _Graph(*key, device=torch.device("cpu"))
    batch, tokens, seqlen = key
    assert graph.fillers == -(-(tokens - bucket_floor(tokens)) // seqlen)
    assert graph.packing.batch * seqlen <= batch * seqlen + tokens - bucket_floor(tokens) + seqlen
    for total in (bucket_floor(tokens) + 1, tokens):  # the smallest and largest calls the bucket takes
        lengths = [total // batch] * batch
        lengths[0] += total - sum(lengths)
        if max(lengths) > seqlen:
            continue
        mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
        packing = unpad(mask, batch, max(lengths), torch.device("cpu"))
        graph.load((mask, mask, mask), packing, slice(None), total)
        cu = graph.cu_seqlens
        assert cu[-1] == tokens and (cu[1:] - cu[:-1]).max() <= seqlen  # every row in a sequence of <= Sb
