"""Dynamic int8 inference: the kernel against an fp64 reference of the same quantised arithmetic (once per ISA the CPU
runs), the model against fp32 on real weights and real sentences (STS-B dev), the first-use verdict, bad requests.

Tolerances: the kernel's integers are exact, so kernel vs reference differs only by fp32 rounding of the
dequantisation and epilogue: rtol 1e-5 plus an atol of 1e-5 x the output's scale. Quality (the issue's line): on 300
STS-B dev pairs with the real MiniLM, int8 Spearman within 0.5 points of fp32, every embedding's cosine to its fp32
embedding >= 0.98 (0.9866 is the minimum over the whole dev split on the development machine).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import fastbert
from fastbert import BertConfig, BertModel, ops
from fastbert.backends import gemm, int8, native, timing
from tests.conftest import tiny_bert

EXT, EXT_REASON = native.load("_native_cpu")
pytestmark = pytest.mark.skipif(
    EXT is None or not hasattr(EXT, "int8_linear"), reason=f"int8 needs the native CPU extension: {EXT_REASON}"
)
ACTS = (None, "gelu", "gelu_tanh", "relu")
# (M, K, N): ragged tiles and panels; K = 4096 (8 KiB int16 rows) needs several L2 row panels
SHAPES = [(1, 1, 1), (7, 33, 50), (13, 26, 97), (64, 384, 96), (130, 100, 33), (203, 4096, 40)]


def reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str | None = None, ln: tuple | None = None
) -> torch.Tensor:
    """The quantised arithmetic in fp64: the same integers (quantize_rows, for activations and weight channels), exact
    products and sums, then dequantisation, bias and the epilogue (residual + LayerNorm when `ln` = (residual, weight,
    bias, eps))."""
    qw, sw = int8.quantize_rows(weight)
    qx, sx = int8.quantize_rows(x)
    out = (qx.double() @ qw.double().T) * sx.double() * sw.double().T
    if bias is not None:
        out = out + bias.double()
    if ln is not None:
        residual, w, b, eps = ln
        return torch.nn.functional.layer_norm(out + residual.double(), out.shape[-1:], w.double(), b.double(), eps)
    if act in ("gelu", "gelu_tanh"):
        return torch.nn.functional.gelu(out, approximate="tanh" if act == "gelu_tanh" else "none")
    return out.relu() if act == "relu" else out


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item() if ref.numel() else 1.0
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * max(scale, 1.0))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_quantised_reference(ext, shape: tuple[int, int, int], act: str | None) -> None:
    m, k, n = shape
    g = torch.Generator().manual_seed(m * 1000 + k)
    x, w, b = torch.randn(m, k, generator=g) * 3, torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    x[m // 2] = 0.0  # an all-zero row: scale 0, output = bias (no NaN from 127 / 0)
    q = int8.quantize_weight(w)
    out = torch.full((m, n), float("nan"))  # poisoned: every element must be written
    ext.int8_linear(x, q.packed, q.scale, b, act, out=out)
    close(out, reference(x, w, b, act))


@pytest.mark.parametrize("shape", SHAPES)
def test_residual_layernorm_epilogue_matches_reference(ext, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    g = torch.Generator().manual_seed(k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g)
    residual, lw, lb = torch.randn(m, n, generator=g), torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    q = int8.quantize_weight(w)
    out = ext.int8_linear(x, q.packed, q.scale, b, None, residual, lw, lb, 1e-12)
    close(out, reference(x, w, b, ln=(residual, lw, lb, 1e-12)))


def test_strided_rows_and_no_bias(ext) -> None:
    g = torch.Generator().manual_seed(1)
    wide, w = torch.randn(9, 80, generator=g), torch.randn(20, 40, generator=g)
    x = wide[:, 10:50]  # a row stride of 80: read in place
    q = int8.quantize_weight(w)
    close(ext.int8_linear(x, q.packed, q.scale), reference(x, w, None))


def test_weight_quantisation_is_per_channel_and_symmetric() -> None:
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -3.0]])
    values, _ = int8.quantize_rows(w)
    q = int8.quantize_weight(w)
    assert values.abs().max().item() == int8.LEVELS
    assert values[1].eq(0).all() and q.scale[1].item() == 0  # an all-zero channel stays zero
    torch.testing.assert_close(values * q.scale[:, None], w, atol=q.scale.max().item() / 2, rtol=0)
    panels, steps, _, per_step = q.packed.shape  # int16 pairs, or int8 quads on VNNI kernels
    unpacked = q.packed.permute(0, 2, 1, 3).reshape(-1, steps * per_step)[: w.shape[0], : w.shape[1]]
    assert torch.equal(unpacked.float(), values)  # the kernel's layout holds exactly these integers


def test_quad_and_pair_packs_give_the_same_numbers(ext) -> None:
    """VNNI kernels multiply u8 x s8 quads (x shifted by 128, the shift taken back per column): the int32 sums, hence
    the outputs, are exactly those of int16 pairs. Kernels without VNNI refuse a quad pack by name."""
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(37, 70, generator=g) * 2, torch.randn(45, 70, generator=g) * 0.1, torch.randn(45, generator=g)
    values, scale = int8.quantize_rows(w)
    quads, pairs = int8.pack_quads(values), gemm.pack_panels(values.to(torch.int16), 2)
    scale = scale[:, 0].contiguous()
    if ext.int8_k_per_step() != 4:
        with pytest.raises(ValueError, match="VNNI"):
            ext.int8_linear(x, quads, scale, b)
        return
    for act in ACTS:
        assert torch.equal(ext.int8_linear(x, quads, scale, b, act), ext.int8_linear(x, pairs, scale, b, act))
    with pytest.raises(ValueError, match="pack of an"):  # quad panels without their column sums
        ext.int8_linear(x, gemm.pack_panels(values.to(torch.int8), 4), scale, b)


def test_a_quad_pack_ends_each_panel_with_its_column_sums() -> None:
    """The step after each panel's k holds 128 * sum_k q[n, k] per column as int32 (the u8 shift's correction),
    zero for the padding columns; the kernels read it instead of summing the weight on every call."""
    values, _ = int8.quantize_rows(torch.randn(45, 70, generator=torch.Generator().manual_seed(5)))
    pack = int8.pack_quads(values)
    assert pack.shape == (4, 70 // 4 + 1 + 1, gemm.PANEL, 4)  # K = 70: 18 quad steps, then the sums
    sums = pack[:, -1].contiguous().view(torch.int32).reshape(-1)
    assert torch.equal(sums[:45], 128 * values.sum(1).to(torch.int32)) and not sums[45:].any()


@pytest.mark.parametrize(("k", "n"), [(64, 77), (384, 77), (768, 77), (3072, 77), (768, 333), (3072, 1100)])
@pytest.mark.parametrize("m", [1, 31, 33, 130])
def test_amx_tiles_give_the_vnni_tiles_numbers_bit_for_bit(m: int, k: int, n: int) -> None:
    """Both sum the same u8 x s8 quads in exact int32 and share the epilogue: every output (bias, activation, residual
    + LayerNorm, gated, a partial last column tile) equal, at row counts below, at and past a 32-row block, K of one
    tile step to BERT's FFN (3072), and columns enough (333) that a job holds several column tiles. Jobs are cut by
    rows where W fits in half the L2, by columns where it does not (3072 x 1100: 3.3 MB, past half of any L2 up to
    6 MB)."""
    if "avx512amx" not in EXT.runnable_isas():
        pytest.skip(f"no AMX tiles here (kernels for {', '.join(EXT.runnable_isas())})")
    default = EXT.isa()
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    gated, gated_scale = int8.pack_quads(int8.quantize_rows(torch.randn(64, k))[0]), torch.rand(64)
    residual, lw, lb = torch.randn(m, n), torch.randn(n), torch.randn(n)
    q = int8.quantize_weight(w)
    outs = {}
    try:
        for isa in ("avx512amx", "avx512bf16"):
            assert EXT.set_isa(isa)
            outs[isa] = [EXT.int8_linear(x, q.packed, q.scale, b, act) for act in ACTS]
            outs[isa].append(EXT.int8_linear(x, q.packed, q.scale, b, None, residual, lw, lb, 1e-12))
            outs[isa].append(EXT.int8_linear(x, gated, gated_scale, None, "gelu", gated=EXT.gate_group()))
    finally:
        EXT.set_isa(default)
    for amx, vnni in zip(outs["avx512amx"], outs["avx512bf16"], strict=True):
        assert torch.equal(amx, vnni)


def test_bad_kernel_arguments_raise() -> None:
    q = int8.quantize_weight(torch.randn(8, 16))
    with pytest.raises(TypeError, match="float32"):
        EXT.int8_linear(torch.randn(4, 16, dtype=torch.bfloat16), q.packed, q.scale)
    with pytest.raises(ValueError, match="pack"):
        EXT.int8_linear(torch.randn(4, 12), q.packed, q.scale)  # K does not match the pack
    k = int8.max_k() + 1  # past int32's room for the products of K int8 pairs (quads: u8 x s8)
    big = int8.quantize_weight(torch.randn(1, k))
    with pytest.raises(ValueError, match="K must be at most"):
        EXT.int8_linear(torch.randn(1, k), big.packed, big.scale)
    assert "overflow" in int8.SPEC.limits["linear"]({"x": torch.randn(1, k), "weight": torch.randn(1, k)}, True)
    with pytest.raises(ValueError, match="residual"):
        EXT.int8_linear(torch.randn(4, 16), q.packed, q.scale, None, None, torch.randn(4, 8))  # no LayerNorm params


def tiny_model() -> BertModel:
    return tiny_bert()


def ragged_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 120, (3, 21), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 1:] = 0
    return ids, mask


def test_quantized_model_runs_int8_and_stays_close_to_fp32() -> None:
    model = tiny_model()
    quantized = fastbert.optimize(model, quantize="int8")
    assert quantized is not model and model.config.quantize is None  # the fp32 model is not modified
    ids, mask = ragged_batch()
    with torch.no_grad(), ops.use_backend("int8"):  # forced: every GEMM int8, whatever this CPU's timings say
        out = quantized(ids, attention_mask=mask).last_hidden_state
    ref = model(ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    cos = torch.nn.functional.cosine_similarity(out[valid], ref[valid], dim=-1)
    assert cos.min().item() > 0.99 and not torch.equal(out[valid], ref[valid])  # int8 ran, and stayed close
    assert out[~valid].eq(0).all()


def test_only_models_that_ask_run_int8() -> None:
    model = tiny_model()
    ids, mask = ragged_batch()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert not ops.decisions()["linear"].startswith("int8")
    assert "quantize='int8'" in ops.decisions()["linear"]  # explain() says why int8 was not used


def test_int8_slower_here_stays_fp32_and_explain_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8, "_verdicts", {})
    monkeypatch.setattr(timing, "samples", lambda *fns, **kw: [[2.0], [1.0]])  # int8 measured 2x slower
    model = fastbert.optimize(tiny_model(), quantize="int8")
    ids, mask = ragged_batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask).last_hidden_state
        ref = tiny_model()(ids, attention_mask=mask).last_hidden_state
    assert torch.equal(out, ref)  # nothing ran int8
    assert not ops.decisions()["linear"].startswith("int8")
    assert int8.verdicts() and not any(wins for wins, _ in int8.verdicts().values())
    assert "0 of" in fastbert.explain() and "fp32 for [" in fastbert.explain()


@pytest.mark.parametrize("bad", ["int4", "INT8", 8])
def test_unknown_quantization_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="quantize must be None or 'int8'"):
        fastbert.optimize(tiny_model(), quantize=bad)
    with pytest.raises(ValueError, match="quantize must be None or 'int8'"):
        BertConfig(quantize=bad).validate()


def test_training_a_quantized_model_is_refused() -> None:
    model = fastbert.optimize(tiny_model(), quantize="int8", freeze=False).train()
    ids, mask = ragged_batch()
    with pytest.raises(RuntimeError, match="inference"):
        model(ids, attention_mask=mask)


@pytest.mark.parametrize("where", [dict(device="cuda"), dict(dtype=torch.bfloat16)])
def test_int8_off_cpu_or_fp32_is_refused(where: dict) -> None:
    with pytest.raises(ValueError, match="CPU|fp32"):
        fastbert.optimize(tiny_model(), quantize="int8", **where)


def test_from_pretrained_quantize(tmp_path: Path) -> None:
    tiny_model().save_pretrained(tmp_path)
    model = BertModel.from_pretrained(tmp_path, quantize="int8")
    assert model.config.quantize == "int8"


def test_minilm_int8_quality_on_stsb_sample(minilm_dir: Path, shared_data: Path) -> None:
    from scipy.stats import spearmanr

    from fastbert.distill.recipes.sts import embed, read_sts
    from fastbert.tokenization import WordPieceTokenizer

    a, b, gold = (column[:300] for column in read_sts(str(shared_data / "stsb" / "sts-dev.csv")))
    tokenizer = WordPieceTokenizer.from_pretrained(minilm_dir)
    fp32 = BertModel.from_pretrained(minilm_dir)
    quantized = fastbert.optimize(fp32, quantize="int8")
    with ops.use_backend("int8"):  # every GEMM int8, whatever the timings on this CPU
        ea, eb = embed(quantized, tokenizer, a, 32), embed(quantized, tokenizer, b, 32)
    ra, rb = embed(fp32, tokenizer, a, 32), embed(fp32, tokenizer, b, 32)
    spearman = {name: 100 * spearmanr(torch.cosine_similarity(x, y).numpy(), gold).statistic
                for name, (x, y) in {"int8": (ea, eb), "fp32": (ra, rb)}.items()}  # fmt: skip
    assert math.isfinite(spearman["int8"]) and abs(spearman["int8"] - spearman["fp32"]) <= 0.5, spearman
    cos = torch.cosine_similarity(torch.cat([ea, eb]), torch.cat([ra, rb]))
    assert cos.min().item() >= 0.98 and cos.max().item() < 1.0  # close, and int8 really ran
