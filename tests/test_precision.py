"""Mixed precision: bf16/fp16 weights and torch.autocast, judged against an fp64 transformers reference.

Rule (DESIGN.md): fastbert's error at a precision <= 2x transformers' error at that same precision + a small floor.
Also: fp16 stays finite where activations are large (LayerNorm statistics in fp32), and the reference ops keep their
own precision under autocast (fp32 softmax; autocast must not recast their matmuls).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import fastbert
from fastbert import ops, reference

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
FLOOR = {torch.bfloat16: 4e-3, torch.float16: 5e-4}


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([11, 4, 0, 8])  # ragged, with a fully padded row
    mask = (torch.arange(11)[None] < lengths[:, None]).long()
    ids = torch.randint(1, TINY["vocab_size"], mask.shape, generator=gen) * mask
    return ids, mask, (torch.arange(11)[None] >= 3).long() * mask


def hf_model(**overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(**{**TINY, **overrides})).eval()


def error(out: torch.Tensor, exact: torch.Tensor, mask: torch.Tensor) -> float:
    valid = mask.bool()
    return (out[valid].double() - exact[valid]).abs().max().item()


def run(model: torch.nn.Module, autocast: torch.dtype | None = None) -> torch.Tensor:
    ids, mask, types = batch()
    scope = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    with torch.no_grad(), scope:
        return model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state


@pytest.mark.parametrize("gemm", ["gemm", "onednn", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_error_within_twice_transformers(
    dtype: torch.dtype, gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", gemm)
    hf = hf_model()
    mask = batch()[1]
    reference_fp64 = run(hf_model().double())
    theirs = run(hf_model().to(dtype))
    ours = run(fastbert.optimize(hf, dtype=dtype))
    assert ours.dtype == dtype and torch.isfinite(ours).all()
    assert error(ours, reference_fp64, mask) <= 2 * error(theirs, reference_fp64, mask) + FLOOR[dtype]


@pytest.mark.parametrize("gemm", ["gemm", "onednn", "torch"])
def test_autocast_matches_transformers_autocast_and_keeps_fp32_residual_stream(
    gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", gemm)
    hf = hf_model()
    mask = batch()[1]
    exact = run(hf_model().double())
    theirs = run(hf, autocast=torch.bfloat16)
    ours = run(fastbert.optimize(hf), autocast=torch.bfloat16)
    assert ours.dtype == theirs.dtype == torch.float32  # LayerNorm outputs fp32 under autocast, as in transformers
    assert error(ours, exact, mask) <= 2 * error(theirs, exact, mask) + FLOOR[torch.bfloat16]


def test_fp16_stays_finite_with_large_activations() -> None:
    """LayerNorm gains of 300 give hidden states whose squares overflow fp16 (max 65504) unless statistics are fp32."""
    hf = hf_model()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "LayerNorm.weight" in name:
                param.fill_(300.0)
    mask = batch()[1]
    exact = run(hf.double())
    ours = run(fastbert.optimize(hf.float(), dtype=torch.float16))
    assert torch.isfinite(ours).all()
    assert error(ours, exact, mask) <= 4 * 2**-10 * exact.abs().max().item()  # 4 fp16 ulps at the largest value


def test_reference_attention_keeps_fp32_under_autocast() -> None:
    cu = torch.tensor([0, 5, 7, 13], dtype=torch.int32)
    qkv = torch.randn(13, 3, 2, 8)
    plain_out, plain_probs = reference.attention_with_probs(qkv, cu, 6)
    plain_attn = reference.attention(qkv, cu, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, probs = reference.attention_with_probs(qkv, cu, 6)
        attn = reference.attention(qkv, cu, 6)
    assert out.dtype == probs.dtype == attn.dtype == torch.float32
    assert torch.equal(out, plain_out) and torch.equal(probs, plain_probs) and torch.equal(attn, plain_attn)


def test_mixed_dtype_epilogues_under_autocast_promote() -> None:
    """A bf16 GEMM output meeting the fp32 residual stream gives fp32, as transformers' autocast LayerNorm does."""
    x, residual = torch.randn(6, 16).bfloat16(), torch.randn(6, 16)
    bias, weight, ln_bias = torch.randn(16), torch.rand(16) + 0.5, torch.randn(16)
    out = ops.bias_residual_layernorm(x, bias, residual, weight, ln_bias, 1e-12)
    expected = reference.bias_residual_layernorm(x.float(), bias, residual, weight, ln_bias, 1e-12)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    assert ops.bias_act(x, bias, "gelu").dtype == torch.bfloat16
