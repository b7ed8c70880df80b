"""The fast path: unpadded vs padded vs transformers, the onednn backend (oneDNN GEMMs, per-sequence attention) vs the
plain torch path, the prepacked-weight cache, `fastbert.optimize`, and the CUDA-graph bucket layout (run on CPU)."""

from __future__ import annotations

import functools

import pytest
import torch

import fastbert
from fastbert import ops, reference
from fastbert.backends import onednn, timing, timing_store
from fastbert.execution.graphs import _Graph, bucket_key
from fastbert.padding import unpad, unpad_and_read
from tests.kernel_checks import assert_close

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
TINY = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
ACTS = (None, "gelu", "gelu_tanh", "relu")


def ragged(batch: int, seqlen: int, vocab: int, seed: int = 0, empty_last: bool = True) -> tuple[torch.Tensor, ...]:
    """ids, right-padded mask (lengths in [1, S], first row full, last row fully padded), token types."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seqlen + 1, (batch,), generator=gen)
    lengths[0] = seqlen
    if empty_last:
        lengths[-1] = 0
    mask = (torch.arange(seqlen)[None] < lengths[:, None]).long()
    ids = torch.randint(1, vocab, (batch, seqlen), generator=gen) * mask
    return ids, mask, (torch.arange(seqlen)[None] >= lengths[:, None] // 2).long() * mask


def pair(config: dict, hf_cls: str = "BertModel") -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    hf = getattr(transformers, hf_cls)(transformers.BertConfig(**config)).eval()
    return hf, getattr(fastbert, hf_cls).from_hf(hf).eval()


def max_err(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    if mask is not None:
        a, b = a[mask.bool()], b[mask.bool()]
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("gemm", ["gemm", "onednn", "torch"])
def test_unpadded_padded_and_transformers_agree(gemm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed output == padded output at valid rows == transformers; padded rows are zeros; the padded row is finite."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", gemm)
    hf, fb = pair(TINY)
    ids, mask, types = ragged(5, 13, TINY["vocab_size"])
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, token_type_ids=types)
        padded = fb(ids, attention_mask=mask, token_type_ids=types)
        packed = fb(ids, attention_mask=mask, token_type_ids=types, packed_output=True).last_hidden_state
        dense = fb(ids[:1], token_type_ids=types[:1]).last_hidden_state  # the full row alone, no mask at all
    assert packed.shape == (int(mask.sum()), TINY["hidden_size"])
    assert torch.equal(packed, padded.last_hidden_state[mask.bool()])
    assert max_err(padded.last_hidden_state, theirs.last_hidden_state, mask) <= ATOL
    assert max_err(dense[0], theirs.last_hidden_state[0]) <= ATOL
    assert (padded.last_hidden_state[~mask.bool()] == 0).all()
    assert max_err(padded.pooler_output[:-1], theirs.pooler_output[:-1]) <= ATOL
    assert torch.isfinite(padded.pooler_output).all()


def test_fast_cpu_path_equals_plain_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole model on the onednn backend (FASTBERT_CPU_GEMM=onednn) vs FASTBERT_BACKEND=torch: fp32 tolerance."""
    _, fb = pair({**TINY, "hidden_act": "gelu_new"})
    ids, mask, types = ragged(4, 17, TINY["vocab_size"], seed=1)
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "onednn")
    with torch.no_grad():
        fast = fb(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        fp32 = [line for line in fastbert.explain().splitlines() if line.endswith("(in float32)")]
        # attention goes to the native extension where it is built, else to onednn; never to the reference
        assert any(line.startswith("linear: onednn") for line in fp32)
        assert not any(line.startswith("attention: torch") for line in fp32)
        with fastbert.use_backend("torch"):
            plain = fb(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        assert "linear: torch (forced)" in fastbert.explain()
    assert max_err(fast, plain, mask) <= ATOL


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows", [0, 1, 37])
def test_onednn_linear_matches_reference(act: str | None, rows: int) -> None:
    x, w, b = torch.randn(rows, 48), torch.randn(80, 48) / 7, torch.randn(80)
    with torch.no_grad():
        out = onednn.linear(x, w, b, act)
    assert out.shape == (rows, 80)
    if rows:
        assert max_err(out, reference.linear(x, w, b, act)) <= ATOL


def test_onednn_bf16_within_twice_torch_bf16_error() -> None:
    """On every CPU: bf16 instructions where it has them, fp32 GEMMs on the upcast operands where not."""
    x, w, b = torch.randn(64, 96), torch.randn(128, 96) / 10, torch.randn(128)
    exact = reference.linear(x.double(), w.double(), b.double(), "gelu")
    low = [t.bfloat16() for t in (x, w, b)]
    with torch.no_grad():
        ours = max_err(onednn.linear(*low, "gelu"), exact)
    plain = max_err(reference.linear(*low, "gelu"), exact)
    assert ours <= 2 * plain + 1e-3


def test_prepacked_weight_follows_in_place_updates() -> None:
    lin = torch.nn.Linear(32, 24).requires_grad_(False)
    x = torch.randn(9, 32)
    before = onednn.linear(x, lin.weight, lin.bias)
    lin.weight.mul_(-2)  # in place: same tensor, new version
    lin.bias.add_(1)
    after = onednn.linear(x, lin.weight, lin.bias)
    assert max_err(after, torch.nn.functional.linear(x, lin.weight, lin.bias)) <= ATOL
    assert not torch.allclose(before, after)


def test_autocast_linear_runs_in_bf16_on_a_cached_bf16_weight() -> None:
    w, b, x = torch.randn(40, 16), torch.randn(40), torch.randn(6, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours = onednn.linear(x, w, b, "gelu")
        theirs = reference.linear(x, w, b, "gelu")
    assert ours.dtype == theirs.dtype == torch.bfloat16
    exact = reference.linear(x.double(), w.double(), b.double(), "gelu")
    assert max_err(ours, exact) <= 2 * max_err(theirs, exact) + 1e-3


def test_gemm_calibration_is_reported_in_explain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "auto")
    monkeypatch.setattr(ops, "_decisions_by_dtype", {})  # this call's decisions only
    monkeypatch.setattr(ops, "_last_facts", {})
    x, w = torch.randn(5, 24), torch.randn(12, 24)
    with torch.no_grad(), ops.exclude_backends("gemm"):  # oneDNN's own verdict decides (gemm may beat both here)
        ops.linear(x, w)
    verdict = onednn.verdicts()[(torch.float32, 12, 24, False, False, "few")]
    assert "for [5, 24] x [24, 12] float32: oneDNN " in verdict[1] and " ms vs F.linear " in verdict[1]
    assert fastbert.explain().count("linear: ") == 1
    assert ("linear: onednn" in fastbert.explain()) == verdict[0]


def test_gemm_calibration_times_the_path_it_would_replace(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a bias and an activation the fallback is F.linear then the bias_act op, so that is what oneDNN is timed
    against (timing F.linear with its bias plus a bare activation would flatter the fallback)."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "auto")
    calls = []
    bias_act = ops.bias_act
    assert onednn.fallback_bias_act is bias_act  # the dispatcher hands its op to the calibration

    @functools.wraps(bias_act)  # the dispatch reads op signatures
    def counted(*args: object) -> torch.Tensor:
        calls.append(args)
        return bias_act(*args)

    monkeypatch.setattr(onednn, "fallback_bias_act", counted)
    x, w, b = torch.randn(7, 40), torch.randn(20, 40), torch.randn(20)
    with torch.no_grad():
        ops.linear(x, w, b, "gelu")
    verdict = onednn.verdicts()[(torch.float32, 20, 40, True, True, "few")]
    assert " ms vs F.linear + bias_act " in verdict[1]
    assert calls and torch.equal(calls[0][1], b) and calls[0][2] == "gelu"


def test_residual_calibration_times_whole_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """dense_residual_layernorm is timed as a whole against the op without oneDNN (a GEMM, then bias + residual +
    LayerNorm in one pass): the bare GEMMs would leave out the epilogues, where the two paths differ. The verdict
    follows the timings either way."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "auto")
    x, w, b, res = torch.randn(7, 40), torch.randn(20, 40), torch.randn(20), torch.randn(7, 20)
    lw, lb = torch.rand(20) + 0.5, torch.randn(20)
    for onednn_faster in (True, False):
        monkeypatch.setattr(onednn, "_verdicts", {})
        ran = []

        def timed(*fns, repeats: int = 9, faster: bool = onednn_faster, ran: list = ran) -> list[list[float]]:
            with ops.watching() as seen:
                for fn in fns:
                    fn()
            ran.extend(seen)
            return [[1.0], [2.0]] if faster else [[2.0], [1.0]]

        monkeypatch.setattr(timing, "samples", timed)
        monkeypatch.setattr(timing_store, "lookup", lambda *a: None)  # no verdict kept from an earlier run
        with torch.no_grad(), ops.exclude_backends("gemm"), ops.watching() as chosen:
            out = ops.dense_residual_layernorm(x, w, b, res, lw, lb, 1e-12)
        key = (torch.float32, torch.float32, 20, 40, "residual", "few")
        assert onednn.verdicts()[key][0] == onednn_faster and "the op without it" in onednn.verdicts()[key][1]
        assert chosen[0] == ("dense_residual_layernorm", "onednn" if onednn_faster else "torch")
        assert "bias_residual_layernorm" in {op for op, _ in ran}  # the rival: a GEMM, then the epilogue op
        assert not any(name == "onednn" for _, name in ran)  # oneDNN's side is its own op, called directly
        wide = (t.double() for t in (x, w, b, res, lw, lb))
        assert_close("dense_residual_layernorm", out, reference.dense_residual_layernorm(*wide, 1e-12))
    with torch.no_grad(), ops.exclude_backends("gemm"):  # a bf16 call is timed apart from the fp32 one
        ops.dense_residual_layernorm(*(t.bfloat16() for t in (x, w, b, res, lw, lb)), 1e-12)
    assert (torch.bfloat16, onednn.gemm_dtype(torch.bfloat16), 20, 40, "residual", "few") in onednn.verdicts()


def test_training_uses_autograd_path_and_gets_gradients() -> None:
    _, fb = pair(TINY)
    fb.train()
    ids, mask, types = ragged(3, 9, TINY["vocab_size"], empty_last=False)
    fb(ids, attention_mask=mask, token_type_ids=types).last_hidden_state.sum().backward()
    assert "linear: torch" in fastbert.explain()
    grad = fb.encoder.layer[0].intermediate.dense.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("lengths", [[5, 0, 9, 1], [7, 7, 7], [0, 0]])
def test_per_sequence_attention_matches_reference(lengths: list[int]) -> None:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    qkv = torch.randn(int(cu[-1]), 3, 4, 16)
    with torch.no_grad():
        ours = onednn.attention(qkv, cu, max(lengths))
    assert ours.shape == (int(cu[-1]), 4, 16)
    if qkv.shape[0]:
        assert max_err(ours, reference.attention(qkv, cu, max(lengths))) <= ATOL


def test_optimize_converts_a_transformers_head() -> None:
    hf, _ = pair(TINY, "BertForSequenceClassification")
    ids, mask, types = ragged(3, 10, TINY["vocab_size"], empty_last=False)
    fast = fastbert.optimize(hf)
    assert isinstance(fast, fastbert.BertForSequenceClassification) and not fast.training
    assert not any(p.requires_grad for p in fast.parameters()) and all(p.requires_grad for p in hf.parameters())
    with torch.no_grad():
        ours = fast(ids, attention_mask=mask, token_type_ids=types).logits
        assert max_err(ours, hf(ids, attention_mask=mask, token_type_ids=types).logits) <= ATOL
    assert fast.bert.cuda_graphs is None  # CPU: no graphs
    with pytest.raises(TypeError, match="optimize"):
        fastbert.optimize(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="CUDA"):
        fastbert.optimize(hf, cuda_graphs=True)


@pytest.mark.parametrize("layout", ["right", "left", "holes", "full", "none"])
def test_packing_reads_extra_values_in_its_one_sync(layout: str) -> None:
    """`unpad_and_read` packs exactly the mask's ones, in order, with the right cu_seqlens, whatever their layout,
    and hands back the caller's values read in the same sync."""
    gen = torch.Generator().manual_seed(1)
    mask = {
        "right": (torch.arange(6)[None] < torch.tensor([6, 2, 0, 4])[:, None]),
        "left": (torch.arange(6)[None] >= torch.tensor([0, 4, 6, 1])[:, None]),
        "holes": torch.rand(4, 6, generator=gen) < 0.5,
        "full": torch.ones(4, 6, dtype=torch.bool),
        "none": None,
    }[layout]
    extra = torch.tensor([-3, 7, 1 << 40])
    packing, values = unpad_and_read(None if mask is None else mask.long(), 4, 6, torch.device("cpu"), extra)
    assert values == [-3, 7, 1 << 40]
    expected = torch.ones(4, 6, dtype=torch.bool) if mask is None else mask
    flat = expected.reshape(-1).nonzero().squeeze(1)
    assert packing.total == flat.numel() and packing.max_seqlen == int(expected.sum(1).max())
    assert packing.lengths.tolist() == expected.sum(1).tolist()
    x = torch.arange(24.0).view(4, 6, 1)
    assert torch.equal(packing.pack(x).view(-1), x.view(-1)[flat])
    assert torch.equal(packing.repad(packing.pack(x)), x * expected[..., None])


@pytest.mark.parametrize("lengths", [[3], [16, 1, 9], [5, 0, 12, 2, 7]])
def test_cuda_graph_bucket_layout_computes_the_same_encoder(lengths: list[int]) -> None:
    """The static varlen layout a CUDA graph replays (real, empty, filler sequences), checked on CPU without a graph."""
    _, fb = pair(TINY)
    seqlen = max(lengths)
    mask = (torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, TINY["vocab_size"], mask.shape) * mask
    packing = unpad(mask, len(lengths), seqlen, torch.device("cpu"))
    positions = torch.arange(seqlen).expand(len(lengths), seqlen)
    key = bucket_key(len(lengths), packing.total, seqlen)
    graph = _Graph(*key, device=torch.device("cpu"))
    graph.load((ids, torch.zeros_like(ids), positions), packing, slice(None), packing.total)
    cu = graph.cu_seqlens
    assert cu[0] == 0 and cu[-1] == key[1] and (cu[1:] >= cu[:-1]).all() and (cu[1:] - cu[:-1]).max() <= key[2]
    with torch.no_grad():
        static = fb.encoder(fb.embeddings(graph.ids, graph.types, graph.positions), graph.packing)[0]
        direct = fb(ids, attention_mask=mask, packed_output=True).last_hidden_state
    assert max_err(static[: packing.total], direct) <= ATOL


@pytest.mark.parametrize("gemm", ["gemm", "onednn", "torch"])
def test_every_row_padded(gemm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Zero real tokens: zeros at every position, a finite pooler output, and transformers' pooler on those zeros."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", gemm)
    _, fb = pair(TINY)
    ids, mask = torch.randint(1, TINY["vocab_size"], (3, 7)), torch.zeros(3, 7, dtype=torch.long)
    with torch.no_grad():
        out = fb(ids, attention_mask=mask)
        packed = fb(ids, attention_mask=mask, packed_output=True).last_hidden_state
    assert (out.last_hidden_state == 0).all() and packed.shape == (0, TINY["hidden_size"])
    expected = torch.tanh(fb.pooler.dense.bias).expand(3, -1)
    assert max_err(out.pooler_output, expected) <= ATOL
