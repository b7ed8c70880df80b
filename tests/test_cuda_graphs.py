"""CUDA graphs and the GPU fast path (skipped without CUDA): graph replay == eager forward, one graph per bucket,
recapture after a weight change, and no host sync inside the encoder or a replay."""

from __future__ import annotations

import warnings

import pytest
import torch

import fastbert
from fastbert.padding import unpad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=500, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def batch(lengths: list[int], seqlen: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, SMALL["vocab_size"], mask.shape, generator=gen) * mask
    return ids.cuda(), mask.cuda()


def models(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval()
    eager = fastbert.optimize(hf, dtype=dtype, device="cuda", cuda_graphs=False)
    graphed = fastbert.optimize(hf, dtype=dtype, device="cuda", cuda_graphs=True)
    return eager, graphed


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_graph_replay_matches_eager(dtype: torch.dtype) -> None:
    eager, graphed = models(dtype)
    cases = [([128], 128), ([37, 5, 100], 100), ([90, 12, 64], 100), ([1], 8), ([33, 0, 7, 16], 40)]
    for lengths, seqlen in cases:
        ids, mask = batch(lengths, seqlen)
        with torch.inference_mode():
            a = eager(ids, attention_mask=mask)
            b = graphed(ids, attention_mask=mask)
        valid = mask.bool()
        err = (a.last_hidden_state[valid].float() - b.last_hidden_state[valid].float()).abs().max().item()
        assert err <= TOL[dtype], f"{lengths}: {err}"
        assert (b.last_hidden_state[~valid] == 0).all()
    assert 1 <= len(graphed.cuda_graphs.graphs) < len(cases)  # [37, 5, 100] and [90, 12, 64] share a bucket


def test_replayed_output_is_not_overwritten_by_the_next_call() -> None:
    _, graphed = models(torch.float16)
    ids, mask = batch([64], 64)
    with torch.inference_mode():
        first = graphed(ids, attention_mask=mask).last_hidden_state
        kept = first.clone()
        graphed(batch([64], 64, seed=1)[0], attention_mask=mask)
    assert torch.equal(first, kept)


def test_weight_change_recaptures() -> None:
    eager, graphed = models(torch.float32)
    ids, mask = batch([20, 9], 20)
    with torch.inference_mode():
        graphed(ids, attention_mask=mask)
    with torch.no_grad():
        for model in (eager, graphed):
            model.encoder.layer[0].intermediate.dense.weight.mul_(-1.5)
    with torch.inference_mode():
        a, b = eager(ids, attention_mask=mask), graphed(ids, attention_mask=mask)
    assert (a.last_hidden_state - b.last_hidden_state).abs().max().item() <= TOL[torch.float32]


def test_no_host_sync_inside_the_encoder_or_a_replay() -> None:
    eager, graphed = models(torch.float16)
    ids, mask = batch([50, 17, 3], 50)
    packing = unpad(mask, 3, 50, ids.device)  # the forward's one host sync happens here
    packed = packing.pack(ids)
    types = torch.zeros_like(packed)
    positions = packing.pack(torch.arange(50, device="cuda").expand(3, 50))
    with torch.inference_mode():
        graphed.cuda_graphs.run(packed, types, positions, packing)  # capture outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            x = eager.embeddings(packed, types, positions)
            eager.encoder(x, packing)
            graphed.cuda_graphs.run(packed, types, positions, packing)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_a_whole_forward_reads_the_device_once() -> None:
    """Input range checks and unpadding share one device-to-host read (no second one for the packed size either),
    with and without CUDA graphs."""
    eager, graphed = models(torch.float16)
    ids, mask = batch([50, 17, 3], 50)
    types = (torch.arange(50, device="cuda")[None] >= 10).long() * mask
    for model in (eager, graphed):
        with torch.inference_mode():
            model(ids, attention_mask=mask, token_type_ids=types)  # warm-up: capture, first-use setup
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    model(ids, attention_mask=mask, token_type_ids=types)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) == 1, syncs


def test_gpu_fp32_matches_transformers() -> None:
    eager, _ = models(torch.float32)
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**SMALL)).eval().cuda()
    ids, mask = batch([30, 11, 0], 30)
    with torch.inference_mode():
        a = hf(ids, attention_mask=mask).last_hidden_state
        b = eager(ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    assert (a[valid] - b[valid]).abs().max().item() <= 1e-4


def test_the_drop_in_path_replays_graphs_by_default_and_splits_large_batches() -> None:
    """BertModel(...).cuda().half().eval() gets graphs with no call to optimize; a batch beyond the largest bucket is
    split into replays; warmup() captures ahead; every output equals the eager one (graphs off)."""
    torch.manual_seed(0)
    config = fastbert.BertConfig(**SMALL)
    model = fastbert.BertModel(config).cuda().half().eval()
    eager = fastbert.cuda_graphs.disable(fastbert.BertModel(config).cuda().half().eval())
    eager.load_state_dict(model.state_dict())
    ids, mask = batch([37, 5, 100, 64, 1, 90, 12, 64, 33], 100)
    with torch.inference_mode():
        expected = eager(ids, attention_mask=mask).last_hidden_state
        for _ in range(3):
            out = model(ids, attention_mask=mask).last_hidden_state
        assert isinstance(model.cuda_graphs, fastbert.cuda_graphs.CudaGraphs) and model.cuda_graphs.graphs
        assert (out.float() - expected.float()).abs().max().item() <= TOL[torch.float16]
        fastbert.cuda_graphs.enable(model, max_tokens=512, max_batch=4)  # 9 sequences: three replays
        for _ in range(2):
            split = model(ids, attention_mask=mask).last_hidden_state
        assert (split.float() - expected.float()).abs().max().item() <= TOL[torch.float16]
        assert len(model.cuda_graphs.graphs) >= 2
    assert fastbert.cuda_graphs.warmup(model, [(1, 128), (8, 64)]) >= 2
