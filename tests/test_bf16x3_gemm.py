"""fp32 GEMMs on AMX bf16 tiles (bf16x3: the `gemm` backend's fp32 calls where K is a multiple of 32 and the kernels
have AMX tiles, csrc/cpu/amx_bf16x3_linear.inc): the kernel against an fp64 reference with every epilogue, awkward
shapes, several chunks of K, strided rows and non-finite input; the weight's three parts; which calls take it and the
switch that keeps vector FMA; an fp32 model on it against transformers, stacked and per op bitwise alike.

Tolerance: bf16x3 stands in for an fp32 GEMM, so its error against the fp64 reference must be that of an fp32 GEMM:
at most 2x that of plain torch fp32 or of fastbert's FMA kernel (the same epilogue: its GELU is not torch's), whichever
is larger, on the same operands, plus one fp32 rounding of the largest value (DESIGN.md's low-precision rule, applied
at fp32), on top of kernel_checks.assert_close's fp32 bound.
"""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from fastbert.backends import gemm, native
from fastbert.execution import stack as layer_stack
from tests.conftest import loop_and_stack, tiny_bert
from tests.kernel_checks import assert_close, gemm_layer

EXT, EXT_REASON = native.load("_native_cpu")
AMX = EXT is not None and hasattr(EXT, "bf16x3_linear") and "avx512amx" in EXT.runnable_isas()
pytestmark = pytest.mark.skipif(not AMX, reason=f"needs AMX tiles and the native extension ({EXT_REASON or 'no AMX'})")
ACTS = (None, "gelu", "gelu_tanh", "relu")  # silu is a gate activation only
# (M, K, N): one row, rows short of a block (M % 32), columns short of a tile (N % 32, N < 16), the encoder's, and K
# over one chunk of 768: two chunks, the last one step (800), three (1600), four whole ones (3072);
SHAPES = [(1, 32, 1), (7, 64, 50), (33, 96, 97), (130, 768, 2304), (37, 800, 48), (64, 1600, 33), (203, 3072, 40),
          (300, 1600, 97)]  # the last: several row groups (a group's x fits half the L2) and several chunks


def operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 1000 + k)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)


def assert_fp32_accuracy(name: str, out: torch.Tensor, ref64: torch.Tensor, *fp32: torch.Tensor) -> None:
    """The module's rule: fp32's bound (assert_close), and at most 2x the larger error of the `fp32` GEMMs' results +
    one rounding."""
    assert_close(name, out, ref64)
    scale = ref64.abs().max().item()
    err, *errs = ((t.double() - ref64).abs().max().item() for t in (out, *fp32))
    fp32_err = max(errs)
    bound = 2 * fp32_err + torch.finfo(torch.float32).eps * scale
    assert err <= bound, f"{name}: max error {err:.3g} > 2x fp32's {fp32_err:.3g} + one rounding"


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_has_fp32_accuracy(amx, shape: tuple[int, int, int], act: str | None) -> None:
    x, w, b = operands(*shape)
    out = torch.full((shape[0], shape[2]), float("nan"))  # poisoned: every element written
    amx.bf16x3_linear(x, gemm.pack_bf16x3(w), w.shape[0], b, act, out=out)
    fma = amx.fp32_linear(x, gemm.pack_panels(w, 1), w.shape[0], b, act)
    ref = gemm_layer(x.double(), w, b, act)
    assert_fp32_accuracy(f"bf16x3_linear {shape} {act}", out, ref, gemm_layer(x, w, b, act), fma)


@pytest.mark.parametrize("shape", SHAPES)
def test_residual_layernorm_epilogue_has_fp32_accuracy(amx, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    x, w, b = operands(m, k, n)
    g = torch.Generator().manual_seed(n)
    ln = (torch.randn(m, n, generator=g), torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g), 1e-12)
    out = torch.full((m, n), float("nan"))  # poisoned: every element written, LayerNorm in place
    amx.bf16x3_linear(x, gemm.pack_bf16x3(w), n, b, None, *ln, out=out)
    fma = amx.fp32_linear(x, gemm.pack_panels(w, 1), n, b, None, *ln)
    assert_fp32_accuracy(f"bf16x3_linear {shape} + LayerNorm", out, gemm_layer(x.double(), w, b, ln=ln),
                         gemm_layer(x, w, b, ln=ln), fma)  # fmt: skip


def test_the_sums_are_kept_apart_over_chunks(amx) -> None:
    """Four chunks of K with x's rows all of one sign: the sums grow with k, and the small products summed into x0.W0's
    running total would round at its size (2.4x torch's error at K = 3072); kept apart they stay within the rule."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.rand(96, 3072, generator=g), torch.rand(64, 3072, generator=g) / 3072
    out = amx.bf16x3_linear(x, gemm.pack_bf16x3(w), 64)
    assert_fp32_accuracy("bf16x3_linear, growing sums", out, gemm_layer(x.double(), w, None), gemm_layer(x, w, None))


def test_strided_rows_and_no_bias(amx) -> None:
    g = torch.Generator().manual_seed(1)
    wide, w = torch.randn(40, 160, generator=g), torch.randn(48, 64, generator=g)
    x = wide[:, 32:96]  # a row stride of 160
    out = amx.bf16x3_linear(x, gemm.pack_bf16x3(w), 48)
    assert_fp32_accuracy("bf16x3_linear strided", out, gemm_layer(x.double(), w, None), gemm_layer(x, w, None))
    assert torch.equal(out, amx.bf16x3_linear(x.contiguous(), gemm.pack_bf16x3(w), 48))


def test_a_non_finite_weight_stays_in_its_column(amx) -> None:
    """An infinite or NaN weight gives non-finite outputs in its own column only."""
    x, w, b = operands(40, 64, 48)
    clean = amx.bf16x3_linear(x, gemm.pack_bf16x3(w), 48, b)
    w[7, 3], w[30, 60] = float("-inf"), float("nan")
    out = amx.bf16x3_linear(x, gemm.pack_bf16x3(w), 48, b)
    cols = torch.tensor([7, 30])
    assert not out[:, cols].isfinite().any()
    keep = torch.ones(48, dtype=torch.bool)
    keep[cols] = False
    assert torch.equal(out[:, keep], clean[:, keep])


def test_a_non_finite_row_stays_in_its_row(amx) -> None:
    """An infinite or NaN x gives non-finite outputs in its own row (its lower parts are zero, not NaN) and leaves
    every other row bitwise as it was."""
    x, w, b = operands(40, 64, 48)
    clean = amx.bf16x3_linear(x, gemm.pack_bf16x3(w), 48, b)
    x[3, 5], x[17, 0] = float("inf"), float("nan")
    out = amx.bf16x3_linear(x, gemm.pack_bf16x3(w), 48, b)
    rows = torch.tensor([3, 17])
    assert not out[rows].isfinite().any()
    keep = torch.ones(40, dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(out[keep], clean[keep])


def test_the_weight_parts_add_up_to_it() -> None:
    g = torch.Generator().manual_seed(3)
    v = torch.randn(4096, generator=g) * torch.exp(4 * torch.randn(4096, generator=g))
    parts = gemm.bf16_parts(v)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    assert torch.equal(sum(p.double() for p in parts), v.double())  # 3 x 8 significant bits: fp32's 24, exactly
    v0, v1, v2 = gemm.bf16_parts(torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0]))
    assert v0[:2].isinf().all() and v0[2].isnan() and (v1 == 0).all() and (v2 == 0).all()


def test_bad_kernel_arguments_raise(amx) -> None:
    p = gemm.pack_bf16x3(torch.randn(8, 64))
    with pytest.raises(TypeError, match="float32"):
        amx.bf16x3_linear(torch.randn(4, 64).bfloat16(), p, 8)
    with pytest.raises(ValueError, match="32"):
        amx.bf16x3_linear(torch.randn(4, 48), gemm.pack_bf16x3(torch.randn(8, 48)), 8)
    with pytest.raises(ValueError, match="at least one"):  # K = 0: no chunk to cut (it divided by zero)
        amx.bf16x3_linear(torch.randn(4, 0), gemm.pack_bf16x3(torch.randn(8, 0)), 8)
    with pytest.raises(ValueError, match="pack"):
        amx.bf16x3_linear(torch.randn(4, 64), gemm.pack_panels(torch.randn(8, 64).bfloat16(), 2), 8)  # one part
    with pytest.raises(ValueError, match="pack"):
        amx.bf16x3_linear(torch.randn(4, 64), gemm.pack_panels(torch.randn(8, 64), 1), 8)  # an fp32 pack
    assert amx.set_isa("avx512bf16")
    with pytest.raises(ValueError, match="AMX"):
        amx.bf16x3_linear(torch.randn(4, 64), p, 8)


def test_which_fp32_calls_take_it(amx, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiles above FMA_ROWS rows where K is whole tile steps; vector FMA at fewer rows (its own pack) and at any
    other K; FASTBERT_CPU_FP32=bf16x3 asks for the tiles at any row count, =fma for vector FMA throughout."""
    (x, w, b), few = operands(gemm.FMA_ROWS + 1, 64, 40), torch.randn(gemm.FMA_ROWS, 64)
    assert gemm.fp32_mode() == "auto"
    kernels = (gemm.fp32_kernel(64, gemm.FMA_ROWS + 1), gemm.fp32_kernel(64, gemm.FMA_ROWS), gemm.fp32_kernel(78, 99))
    assert kernels == ("bf16x3", "fma", "fma")
    assert gemm.fp32_pack(w, len(x)).dtype == torch.bfloat16 and gemm.fp32_pack(w, len(few)).dtype == torch.float32
    assert torch.equal(gemm.linear(x, w, b, "gelu"), amx.bf16x3_linear(x, gemm.pack_bf16x3(w), 40, b, "gelu"))
    assert torch.equal(gemm.linear(few, w, b, "gelu"), amx.fp32_linear(few, gemm.pack_panels(w, 1), 40, b, "gelu"))
    assert "bf16x3" in gemm.describe() and f"above {gemm.FMA_ROWS} rows" in gemm.describe()
    monkeypatch.setenv(gemm.FP32_ENV, "bf16x3")
    assert gemm.fp32_kernel(64, 1) == "bf16x3" and "above" not in gemm.describe()
    assert torch.equal(gemm.linear(few, w, b, "gelu"), amx.bf16x3_linear(few, gemm.pack_bf16x3(w), 40, b, "gelu"))
    monkeypatch.setenv(gemm.FP32_ENV, "fma")
    assert gemm.fp32_kernel(64, 99) == "fma" and gemm.fp32_pack(w, 99).dtype == torch.float32
    assert torch.equal(gemm.linear(x, w, b, "gelu"), amx.fp32_linear(x, gemm.pack_panels(w, 1), 40, b, "gelu"))
    assert "FMA" in gemm.describe() and "bf16x3" not in gemm.describe().split(";")[0]
    monkeypatch.setenv(gemm.FP32_ENV, "fast")
    with pytest.raises(ValueError, match="bf16x3, fma"):
        gemm.fp32_mode()
    monkeypatch.delenv(gemm.FP32_ENV)
    assert amx.set_isa("avx512bf16")
    assert gemm.fp32_mode() == "fma" and "no AMX bf16 tiles" in gemm.describe()


def test_an_fp32_model_on_it_matches_transformers_and_stacks_bitwise(amx, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 model whose widths are whole tile steps (64, 128): every GEMM on bf16x3, within DESIGN's fp32 atol of
    transformers, and the stacked layers bitwise the per-op loop."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    fields = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=3)
    model = tiny_bert(**fields)
    reference = transformers.BertModel(transformers.BertConfig(vocab_size=120, **fields)).eval()
    reference.load_state_dict(model.state_dict(), strict=False)
    ids, mask, outs = loop_and_stack(model, monkeypatch)
    assert torch.equal(outs[0], outs[1])
    assert "every GEMM on gemm" in layer_stack.describe()
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).last_hidden_state
        chosen = ops.select("linear", (torch.randn(5, 64), model.encoder.layer[0].intermediate.dense.weight), {})[1]
    valid = mask.bool()
    assert (outs[0][valid] - expected[valid]).abs().max().item() <= 1e-5
    assert chosen == "gemm" and gemm.fp32_kernel(64, int(mask.sum())) == "bf16x3"
    monkeypatch.setenv(gemm.FP32_ENV, "fma")  # the same model on the FMA kernel: other roundings, so bf16x3 ran above
    with torch.inference_mode():
        fma = model(ids, attention_mask=mask).last_hidden_state
    assert not torch.equal(fma, outs[0]) and (fma[valid] - expected[valid]).abs().max().item() <= 1e-5


def test_a_bucketed_batch_takes_its_real_rows_kernel(amx) -> None:
    """Row buckets (fastbert.execution.rows) must not change a GEMM's kernel, or a forward's bits would depend on
    whether its rows were bucketed: FMA_ROWS is a bucket's bound."""
    from fastbert.execution.rows import bucket

    assert all(gemm.fp32_kernel(64, rows) == gemm.fp32_kernel(64, bucket(rows)) for rows in range(1, 300))


def test_a_short_query_runs_on_vector_fma_stacked_and_per_op(amx, monkeypatch: pytest.MonkeyPatch) -> None:
    """One sequence of FMA_ROWS tokens or fewer: every layer's GEMMs on the FMA kernel, stacked and per op alike
    (bitwise the output with FASTBERT_CPU_FP32=fma, not the tiles' with =bf16x3), within DESIGN's fp32 atol of each
    other."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    model = tiny_bert(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=3)
    ids = torch.randint(1, 120, (1, gemm.FMA_ROWS), generator=torch.Generator().manual_seed(4))
    outs = {}
    for mode, stacked in (("auto", "1"), ("auto", "0"), ("fma", "1"), ("bf16x3", "1")):
        monkeypatch.setenv(gemm.FP32_ENV, mode)
        monkeypatch.setenv("FASTBERT_LAYER_STACK", stacked)
        with torch.inference_mode():
            outs[mode, stacked] = model(ids).last_hidden_state
    assert "layers 1-3 in one native call" in layer_stack.describe()
    assert torch.equal(outs["auto", "1"], outs["auto", "0"]) and torch.equal(outs["auto", "1"], outs["fma", "1"])
    assert not torch.equal(outs["auto", "1"], outs["bf16x3", "1"])
    assert (outs["auto", "1"] - outs["bf16x3", "1"]).abs().max().item() <= 1e-5
