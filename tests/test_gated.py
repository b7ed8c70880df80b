"""The gated feed-forward's ops on CPU (GeGLU, SwiGLU): the native `gated_act` kernel and the gated GEMM epilogue
(fp32 and int8; the activated and up rows interleaved in groups of half a tile) against fp64 references, once per ISA
the CPU runs; the `gated_linear` op's dispatch, refusals and torch composition; bad arguments.

Tolerances (DESIGN.md): fp32 within 1e-5 of fp64 relative to max(1, max|ref|); bf16 within 2x plain torch's own bf16
error plus 1e-3; int8 against the same quantised arithmetic in fp64 (exact integers: rtol and atol 1e-5 x scale).
"""

from __future__ import annotations

import pytest
import torch

from fastbert import ops, reference
from fastbert.backends import gemm, int8, native, onednn
from tests.kernel_checks import assert_close
from tests.test_native import check, poisoned, strided

EXT, EXT_REASON = native.load("_native_cpu")
pytestmark = pytest.mark.skipif(
    EXT is None or not hasattr(EXT, "gate_group"), reason=f"needs the native CPU extension: {EXT_REASON}"
)
KINDS = reference.GATE_ACTIVATIONS
# (M, K, N per half): one row, ragged row tiles (M % 6), one group (N = 16: one AVX-512 tile, two AVX2 tiles), the
# widths of ModernBERT-base (1152) and a longer K than a row panel holds
SHAPES = [(1, 5, 16), (13, 26, 48), (130, 100, 32), (64, 384, 1152), (203, 2048, 16)]


def operands(m: int, k: int, n: int, biases: bool = True) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g) * 2
    w, u = (torch.randn(n, k, generator=g) / max(k, 1) ** 0.5 * 2 for _ in range(2))
    b, c = (torch.randn(n, generator=g) if biases else None for _ in range(2))
    return x, w, b, u, c


def fp64(x, w, b, u, c, act):
    return reference.gated_linear(*(t.double() if t is not None else None for t in (x, w, b, u, c)), act=act)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 7), (37, 312), (2, 5, 384)])
def test_gated_act_kernel(ext, dtype: torch.dtype, kind: str, shape: tuple[int, ...]) -> None:
    x, up = (torch.randn(shape) * 3).to(dtype), torch.randn(shape).to(dtype)
    x[..., 0], x[..., -1] = -12.0, -90.0  # deep in the tails; past exp's clamp for SiLU
    out = ext.gated_act(strided(x), strided(up), kind, out=poisoned(shape, dtype))
    check(out, reference.gated_act(x.double(), up.double(), kind), reference.gated_act(x, up, kind))


def test_gated_act_kernel_on_the_halves_of_one_output(ext) -> None:
    wide = torch.randn(37, 2 * 96) * 3
    out = ext.gated_act(*wide.chunk(2, dim=-1), "silu")
    check(out, reference.gated_act(*wide.double().chunk(2, dim=-1), "silu"), reference.gated_act(*wide.chunk(2, -1)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_gemm_matches_fp64(ext, shape: tuple[int, int, int], kind: str) -> None:
    x, w, b, u, c = operands(*shape)
    group = ext.gate_group()
    pack = gemm.pack_panels(gemm.interleaved(w, u, group), 1)
    out = torch.full((shape[0], shape[2]), float("nan"))  # poisoned: every element must be written
    ext.fp32_linear(x, pack, 2 * shape[2], gemm.interleaved(b, c, group), kind, out=out, gated=group)
    assert_close(f"gated fp32_linear {shape} {kind} {ext.isa()}", out, fp64(x, w, b, u, c, kind))


def test_gated_gemm_activation_over_its_whole_range(ext) -> None:
    """Pre-activations from -40 to 40 in every activation, on full tiles: out[m, n] = act(x[m]) * 1."""
    group = ext.gate_group()
    x = torch.linspace(-40, 40, 97).unsqueeze(1)
    pack = gemm.pack_panels(gemm.interleaved(torch.ones(2 * group, 1), torch.zeros(2 * group, 1), group), 1)
    for kind in KINDS:
        out = ext.fp32_linear(x, pack, 4 * group, gemm.interleaved(torch.zeros(2 * group), torch.ones(2 * group),
                                                                    group), kind, gated=group)  # fmt: skip
        assert_close(f"gated {kind} range", out, reference.activation(x.double(), kind).expand(-1, 2 * group))


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_gated_int8_gemm_matches_the_quantised_reference(ext, shape: tuple[int, int, int]) -> None:
    x, w, b, u, c = operands(*shape)
    group = ext.gate_group()
    q = int8.quantize_weight(gemm.interleaved(w, u, group))
    out = ext.int8_linear(x, q.packed, q.scale, gemm.interleaved(b, c, group), "silu", gated=group)
    qx, sx = int8.quantize_rows(x)
    products = []
    for weight, bias in ((w, b), (u, c)):  # each weight quantised per channel, as inside the interleaved one
        qw, sw = int8.quantize_rows(weight)
        products.append((qx.double() @ qw.double().T) * sx.double() * sw.double().T + bias.double())
    expected = reference.gated_act(*products, "silu")
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * scale)


def test_op_stacked_and_separate_weights_agree_on_every_backend() -> None:
    """ModernBERT's stacked Wi and GTE's two weights through the op's CPU backends: one answer."""
    x, w, b, u, c = operands(70, 96, 64)
    expected = fp64(x, w, b, u, c, "gelu")
    stacked, stacked_bias = torch.cat((w, u)), torch.cat((b, c))
    for backend in ("gemm", "torch"):
        with torch.inference_mode(), ops.use_backend(backend):
            for args in ((w, b, u, c), (stacked, stacked_bias, None, None)):
                assert_close(f"gated_linear on {backend}", ops.gated_linear(x, *args, "gelu"), expected)
            assert ops.decisions()["gated_linear"].startswith(backend)
    no_bias = ops.gated_linear(x, w, None, u, None, "relu")
    assert_close("gated_linear without biases", no_bias, fp64(x, w, None, u, None, "relu"))
    with torch.inference_mode(), ops.use_backend("gemm"):
        one_bias = ops.gated_linear(x, w, None, u, c, "gelu")
    assert_close("gated_linear with only up's bias", one_bias, fp64(x, w, torch.zeros_like(c), u, c, "gelu"))


def test_op_refuses_widths_off_the_tile_and_falls_back() -> None:
    """A width that is not whole groups goes to the torch composition, and explain() says why."""
    group = gemm.gate_group()
    x, w, b, u, c = operands(9, 24, group + 4)
    with torch.inference_mode(), ops.use_backend("gemm"), pytest.raises(ops.BackendUnavailable, match="multiple"):
        ops.gated_linear(x, w, b, u, c)
    with torch.inference_mode():
        out = ops.gated_linear(x, w, b, u, c, "silu")
    assert_close("gated_linear fallback", out, fp64(x, w, b, u, c, "silu"))
    assert "multiple of the tile's group" in ops.decisions()["gated_linear"]
    assert "not shaped like weight" in gemm.gated_refusal({"weight": w, "up_weight": u[:-1], "act": "gelu"})
    assert "even number" in gemm.gated_refusal({"weight": w[:-1], "act": "gelu"})
    assert "swish" in gemm.gated_refusal({"weight": w, "up_weight": u, "act": "swish"})


def test_training_gets_the_composition_with_gradients() -> None:
    x, w, b, u, c = (t.requires_grad_() for t in operands(9, 24, 32))
    ops.gated_linear(x, w, b, u, c, "silu").sum().backward()
    assert not ops.decisions()["gated_linear"].startswith("gemm")
    expected = [t.double().detach().requires_grad_() for t in (x, w, b, u, c)]
    reference.gated_linear(*expected, act="silu").sum().backward()
    for ours, theirs in zip((x, w, b, u, c), expected, strict=True):
        assert_close("gated_linear grad", ours.grad, theirs.grad)


def test_bad_kernel_arguments_raise(ext) -> None:
    x, w, b, u, c = operands(4, 8, 32)
    group = ext.gate_group()
    pack = gemm.pack_panels(gemm.interleaved(w, u, group), 1)
    with pytest.raises(ValueError, match="groups of"):
        ext.fp32_linear(x, pack, 64, None, "gelu", gated=group * 2)
    with pytest.raises(ValueError, match="an activation and no residual"):
        ext.fp32_linear(x, pack, 64, None, None, gated=group)
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        ext.fp32_linear(x, pack, 64, None, "swish", gated=group)
    with pytest.raises(ValueError, match="one shape"):
        ext.gated_act(x, x[:, :-1], "gelu")
    with pytest.raises(TypeError, match="like x"):
        ext.gated_act(x, x.bfloat16(), "gelu")
    with pytest.raises(ValueError, match="expected one of gelu, gelu_tanh, relu$"):  # SiLU: the gated ops' only
        ext.bias_act(x, torch.zeros(8), "silu")


def test_a_bias_or_weight_changed_in_place_is_read_again() -> None:
    """The interleaved pack and biases are cached per weight: an in-place edit of any of the four tensors rebuilds
    them, so the next call computes with the new values."""
    x, w, b, u, c = operands(9, 24, 32)
    with torch.inference_mode(), ops.use_backend("gemm"):
        ops.gated_linear(x, w, b, u, c, "gelu")
        for tensor in (b, c, u):
            tensor.add_(0.5)
            assert_close("gated_linear after an edit", ops.gated_linear(x, w, b, u, c, "gelu"),
                         fp64(x, w, b, u, c, "gelu"))  # fmt: skip


def test_gated_linear_by_keyword_times_its_first_use_on_the_call_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """`act` by name with `bias` left out: the first-use timing's path without fastbert's GEMM got the call's values in
    the order given (act where bias goes) and raised; it runs the call by name."""
    monkeypatch.setenv("FASTBERT_TIMING_CACHE", "0")
    monkeypatch.setattr(gemm, "_verdicts", {})
    monkeypatch.setattr(onednn, "_verdicts", {})
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(13, 32, generator=g), torch.randn(128, 32, generator=g)
    with torch.no_grad():
        out = ops.gated_linear(x, w, act="relu")
    ref = reference.gated_linear(x.double(), w.double(), act="relu")
    assert_close("gated_linear, act by keyword", out, ref, reference.gated_linear(x, w, act="relu"))
