"""Native CPU kernels (csrc/cpu) against the fp64 reference, the dispatch's fallback and forcing, BertModel end to end.

Kernel tests run once per ISA the CPU can execute (avx512amx, avx512bf16, avx512vnni, avx512, avx2, generic) and skip,
with the reason, when the extension is not built. fp32: rtol/atol 1e-5 vs fp64. bf16: error vs fp64 at most 2x plain
torch's bf16 error + 1e-3.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import fastbert
from fastbert import ops, reference
from fastbert.backends import native

EXT, EXT_REASON = native.load("_native_cpu")
needs_ext = pytest.mark.skipif(EXT is None, reason=f"native CPU extension unavailable: {EXT_REASON}")
DTYPES = (torch.float32, torch.bfloat16)


def check(out: torch.Tensor, ref64: torch.Tensor, torch_out: torch.Tensor) -> None:
    """out (fp32/bf16) vs the fp64 reference; bf16 within 2x torch's own bf16 error plus a small floor."""
    assert out.dtype == torch_out.dtype and out.shape == ref64.shape
    assert torch.isfinite(out).all()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref64, rtol=1e-5, atol=1e-5)
    else:
        ours, theirs = max_error(out, ref64), max_error(torch_out, ref64)
        assert ours <= 2 * theirs + 1e-3, f"bf16 error {ours:.3g} > 2 x torch's {theirs:.3g} + 1e-3"


def max_error(out: torch.Tensor, ref64: torch.Tensor) -> float:
    return (out.double() - ref64).abs().max().item() if out.numel() else 0.0


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values, non-contiguous: every row lives inside a wider buffer."""
    wide = torch.full((*x.shape[:-1], x.shape[-1] + 7), float("nan"), dtype=x.dtype)
    wide[..., 3 : 3 + x.shape[-1]] = x
    return wide[..., 3 : 3 + x.shape[-1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", reference.ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 7), (37, 312), (2, 5, 384)])
def test_bias_act(ext, dtype: torch.dtype, kind: str, shape: tuple[int, ...]) -> None:
    x, bias = (torch.randn(shape) * 3).to(dtype), torch.randn(shape[-1]).to(dtype)
    x[..., 0], x[..., -1] = -12.0, -30.0  # deep in GELU's tail, and past the cap where it would reach denormals
    out = ext.bias_act(strided(x), bias, kind, out=poisoned(shape, dtype))
    check(out, reference.bias_act(x.double(), bias.double(), kind), reference.bias_act(x, bias, kind))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 26), (37, 312), (3, 4, 768)])
def test_bias_residual_layernorm(ext, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    n = shape[-1]
    x, res = (torch.randn(shape) * 4 + 1).to(dtype), torch.randn(shape).to(dtype)
    bias, w, b = torch.randn(n).to(dtype), torch.rand(n).to(dtype) + 0.5, torch.randn(n).to(dtype)
    out = ext.bias_residual_layernorm(strided(x), bias, res.transpose(0, -1).contiguous().transpose(0, -1), w, b,
                                      1e-12, out=poisoned(shape, dtype))  # fmt: skip
    ref = reference.bias_residual_layernorm(*(t.double() for t in (x, bias, res, w, b)), 1e-12)
    check(out, ref, reference.bias_residual_layernorm(x, bias, res, w, b, 1e-12))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("embeds", [False, True])
def test_embedding_layernorm(ext, dtype: torch.dtype, index_dtype: torch.dtype, embeds: bool) -> None:
    vocab, dim, tokens = 100, 312, 45
    tables = [torch.randn(rows, dim).to(dtype) for rows in (vocab, 64, 3)]  # word, position, type
    w, b = torch.rand(dim) + 0.5, torch.randn(dim)
    ids = torch.randint(0, vocab, (tokens * 2,), dtype=index_dtype)[::2]  # non-contiguous ids
    pos = torch.randint(0, 64, (tokens,), dtype=index_dtype)
    tt = torch.randint(0, 3, (tokens,), dtype=index_dtype)
    words = torch.randn(tokens, dim).to(dtype) if embeds else None
    ids_in = None if embeds else ids
    out = ext.embedding_layernorm(ids_in, tt, pos, *tables, w, b, 1e-12, None if words is None else strided(words),
                                  out=poisoned((tokens, dim), dtype))  # fmt: skip
    as64 = [t.double() for t in tables]
    ref = reference.embedding_layernorm(ids_in, tt, pos, *as64, w.double(), b.double(), 1e-12,
                                        inputs_embeds=None if words is None else words.double())  # fmt: skip
    check(out, ref, reference.embedding_layernorm(ids_in, tt, pos, *tables, w, b, 1e-12, inputs_embeds=words))


def packed_qkv(lengths: list[int], heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-contiguous packed QKV [T, 3, nH, D] (a slice of a wider buffer) and its cu_seqlens."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    wide = torch.randn(int(cu[-1]), 3, heads, dim + 5).to(dtype)
    return wide[..., 2 : 2 + dim], cu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [26, 32, 48, 64, 80, 96, 128])
@pytest.mark.parametrize("lengths", [[9], [16, 0, 7], [5, 0, 17, 1, 33], [16, 8, 15, 31], [0, 0], [47, 0, 130, 1]])
def test_attention(ext, dtype: torch.dtype, dim: int, lengths: list[int]) -> None:
    qkv, cu = packed_qkv(lengths, 3, dim, dtype)
    max_seqlen = max(max(lengths), 1)
    out = ext.attention(qkv, cu, max_seqlen, 1 / math.sqrt(dim), out=poisoned((int(cu[-1]), 3, dim), dtype))
    check(out, reference.attention(qkv.double(), cu, max_seqlen), reference.attention(qkv, cu, max_seqlen))


@pytest.mark.parametrize("dim", [32, 64, 80])
@pytest.mark.parametrize("lengths", [[9], [5, 0, 17, 1, 33], [47, 0, 130, 1]])
def test_attention_bf16_products(ext, dim: int, lengths: list[int]) -> None:
    """fp32 qkv with bf16 products (an int8 model's attention): on AMX tiles, where the bf16 kernel would take the same
    shapes, the bf16 kernel's products on qkv rounded to bf16, its output one rounding short of that kernel's, within
    the bf16 rule of the fp64 reference; anywhere else, the exact fp32 kernel bit for bit."""
    qkv, cu = packed_qkv(lengths, 3, dim, torch.float32)
    max_seqlen, scale = max(lengths), 1 / math.sqrt(dim)
    out = ext.attention(qkv, cu, max_seqlen, scale, out=poisoned((int(cu[-1]), 3, dim), torch.float32),
                        bf16_products=True)  # fmt: skip
    exact = ext.attention(qkv, cu, max_seqlen, scale)
    if ext.isa() != "avx512amx" or dim % 32 or (dim < 64 and max_seqlen < 40):
        assert torch.equal(out, exact)
        return
    assert not torch.equal(out, exact)
    rounded = qkv.bfloat16()
    bf16 = ext.attention(rounded, cu, max_seqlen, scale)
    assert torch.equal(out.bfloat16(), bf16)  # the same fp32 results, rounded once more by the bf16 kernel
    ours, theirs = max_error(out, reference.attention(qkv.double(), cu, max_seqlen)), max_error(
        reference.attention(rounded, cu, max_seqlen), reference.attention(qkv.double(), cu, max_seqlen))
    assert ours <= 2 * theirs + 1e-3, f"error {ours:.3g} > 2 x torch's bf16 {theirs:.3g} + 1e-3"


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_weights_sum_to_one(ext, dtype: torch.dtype) -> None:
    """Every output row is a convex combination of V rows: a constant V comes back (in bf16 exactly: the kernel
    normalises by the sum of the bf16-rounded weights it multiplies V with; fp32 within its 1e-5)."""
    qkv, cu = packed_qkv([500, 3, 64], 2, 32, dtype)
    qkv[:, :2] = 0.0
    qkv[:, 0, :, 0] = 1.0  # every query e_0; key j scores -0.6875 except each sequence's first (0): exp(-0.6875)
    qkv[:, 1, :, 0] = -0.6875  # = 0.5028 becomes 0.5039 in bf16, so the rounded weights of a row sum to 1.002
    qkv[cu[:-1].long(), 1, :, 0] = 0.0
    qkv[:, 2] = 1.9921875  # the largest bf16 below 2: weights summing to 1.002 round it to 2.0
    out = ext.attention(qkv, cu, 500, 1.0)
    assert (out.double() - 1.9921875).abs().max().item() <= (0.0 if dtype == torch.bfloat16 else 1e-5)


def test_attention_custom_scale_matches_public_wrapper(ext) -> None:
    qkv, cu = packed_qkv([7, 12], 2, 32, torch.float32)
    out = native.attention(qkv, cu, 12, scale=0.3)
    check(out, reference.attention(qkv.double(), cu, 12, scale=0.3), reference.attention(qkv, cu, 12, scale=0.3))


@needs_ext
def test_bad_inputs_raise_clear_errors() -> None:
    qkv, cu = packed_qkv([4, 6], 2, 16, torch.float32)
    with pytest.raises(ValueError, match="max_seqlen"):
        EXT.attention(qkv, cu, 5, 0.25)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to T"):
        EXT.attention(qkv, cu[:-1], 6, 0.25)
    with pytest.raises(ValueError, match="unknown activation"):
        EXT.bias_act(torch.randn(2, 4), torch.randn(4), "swish")
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        EXT.bias_act(torch.randn(2, 4, dtype=torch.float16), torch.randn(4), "relu")
    table = torch.randn(10, 8)
    with pytest.raises(IndexError, match="input_ids out of range"):
        ids = torch.tensor([3, 10])
        EXT.embedding_layernorm(ids, ids * 0, ids * 0, table, table, table, torch.ones(8), torch.zeros(8), 1e-5, None)


@needs_ext
def test_dispatch_prefers_native_and_falls_back_with_reasons() -> None:
    x, bias = torch.randn(4, 32), torch.randn(32)
    res, w, b = torch.randn(4, 32), torch.ones(32), torch.zeros(32)
    ops.bias_act(x, bias)
    assert ops.select("bias_act", (x, bias), {})[1] == "native"
    ops.bias_residual_layernorm(x, bias, res, w, b, 1e-12, 0.1, True)  # training with dropout: torch's job
    assert "native: no dropout" in ops.explain()
    ops.bias_act(x.half(), bias.half())
    assert "CPU kernels take float32/bfloat16" in ops.explain()
    for op, dtype in native.CPU_SLOWER_THAN_TORCH:  # measured no faster: torch by default, native only when forced
        sample = {"bias_act": (x, bias), "bias_residual_layernorm": (x, bias, res, w, b, 1e-12)}[op]
        args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) else a for a in sample)
        assert ops.select(op, args, {})[1] == "torch" and "not faster than torch" in ops.explain()
        with ops.use_backend("native"):
            assert ops.select(op, args, {})[1] == "native"
    with ops.use_backend("native"), pytest.raises(fastbert.BackendUnavailable, match="no dropout"):
        ops.bias_residual_layernorm(x, bias, res, w, b, 1e-12, 0.1, True)
    with ops.use_backend("native"):  # dropout_p > 0 is fine outside training
        torch.testing.assert_close(
            ops.bias_residual_layernorm(x, bias, res, w, b, 1e-12, 0.1, False),
            reference.bias_residual_layernorm(x, bias, res, w, b, 1e-12), rtol=1e-5, atol=1e-5,
        )  # fmt: skip


@pytest.fixture
def fresh_native(monkeypatch: pytest.MonkeyPatch) -> ops.Backend:
    """The native backend with its load cache (and fastbert.backends.native's) emptied; restored afterwards."""
    backend = ops.backends()["native"]
    monkeypatch.setattr(backend, "_ready", None)
    monkeypatch.setattr(native, "_loaded", {})
    return backend


def _fallback_then_forced_raises(reason: str) -> None:
    x, bias = torch.randn(3, 16), torch.randn(16)
    torch.testing.assert_close(ops.bias_act(x, bias), reference.bias_act(x, bias))
    assert "torch" in ops.explain() and reason in ops.explain()
    with ops.use_backend("native"), pytest.raises(fastbert.BackendUnavailable, match=reason):
        ops.bias_act(x, bias)


def test_missing_extension_falls_back_with_reason(fresh_native, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = native.importlib.util.find_spec
    monkeypatch.setattr(
        native.importlib.util, "find_spec", lambda name: None if "_native" in name else real_find_spec(name)
    )
    assert "not built" in native.unavailable_reason() and "FASTBERT_BUILD_NATIVE=1" in native.unavailable_reason()
    _fallback_then_forced_raises("not built")


@needs_ext
def test_stale_extension_falls_back_with_reason(fresh_native, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    info = {**native.build_info(), "torch": "0.0.1"}
    (tmp_path / "_build_info.json").write_text(json.dumps(info))
    monkeypatch.setattr(native, "BUILD_INFO", tmp_path / "_build_info.json")
    assert "stale: fastbert._native_cpu was built for torch 0.0.1" in native.unavailable_reason()
    _fallback_then_forced_raises("stale")


def ragged(vocab: int, batch: int, seqlen: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask (right-padded, one full row, one empty row), token_type_ids."""
    lengths = torch.randint(1, seqlen + 1, (batch,))
    lengths[0], lengths[-1] = seqlen, 0
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    types = (torch.arange(seqlen)[None, :] >= (lengths[:, None] // 2)).long() * mask
    return torch.randint(1, vocab, (batch, seqlen)) * mask, mask, types


@needs_ext
@pytest.mark.parametrize(
    "config",
    [
        dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
        dict(vocab_size=120, hidden_size=312, num_hidden_layers=2, num_attention_heads=12, intermediate_size=1200),
        dict(vocab_size=99, hidden_size=96, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
             hidden_act="gelu_new"),
    ],
    ids=["tiny", "312-12heads", "gelu_new"],
)  # fmt: skip
def test_bert_model_native_matches_transformers(config: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    # GEMMs on F.linear: where oneDNN took the FFN GEMM it would fuse GELU itself and bias_act would not run
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertModel(transformers.BertConfig(**config)).eval()
    fb = fastbert.BertModel.from_hf(hf).eval()
    ids, mask, types = ragged(config["vocab_size"], 4, 13)
    with torch.no_grad(), ops.use_backend("native"):
        ours = fb(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    theirs = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state.detach()
    for op in set(ops.KERNEL_OPS) - {"gated_act"}:  # BERT has no gated feed-forward
        assert f"{op}: native (forced)" in ops.explain()
    valid = mask.bool()
    assert torch.isfinite(ours[valid]).all()
    assert (ours[valid] - theirs[valid]).abs().max().item() <= 1e-5


@needs_ext
def test_bert_model_native_bf16_within_twice_torch_error() -> None:
    transformers = pytest.importorskip("transformers")
    config = dict(vocab_size=99, hidden_size=96, num_hidden_layers=2, num_attention_heads=4, intermediate_size=192)
    hf = transformers.BertModel(transformers.BertConfig(**config)).eval()
    fb = fastbert.BertModel.from_hf(hf).eval().to(torch.bfloat16)
    ids, mask, types = ragged(config["vocab_size"], 4, 13)
    valid = mask.bool()
    exact = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state.detach().double()[valid]
    errors = {}
    with torch.no_grad():
        for backend in ("native", "torch"):
            with ops.use_backend(backend):
                out = fb(ids, attention_mask=mask, token_type_ids=types).last_hidden_state[valid]
            errors[backend] = (out.double() - exact).abs().max().item()
    assert errors["native"] <= 2 * errors["torch"] + 1e-3, errors
