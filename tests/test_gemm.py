"""fastbert's fp32 GEMM (the `gemm` backend): the kernel against an fp64 reference once per ISA the CPU runs, with every
epilogue; the dispatch (first-use verdict both ways, FASTBERT_CPU_GEMM); bad arguments.

Tolerance (DESIGN.md): fp32 within 1e-5 of the fp64 reference, relative to max(1, max|ref|) (kernel_checks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastbert
from fastbert import BertConfig, BertModel, ops
from fastbert.backends import gemm, native, timing
from tests.kernel_checks import assert_close

EXT, EXT_REASON = native.load("_native_cpu")
pytestmark = pytest.mark.skipif(
    EXT is None or not hasattr(EXT, "fp32_linear"), reason=f"needs the native CPU extension: {EXT_REASON}"
)
ACTS = (None, "gelu", "gelu_tanh", "relu")
# (M, K, N): a single element, ragged row tiles (M % 6, M % 7: AVX2's and AVX-512's tile heights, x packed in groups
# of them), ragged column panels (N % 16, N % 32), K = 0 (within a group and over several), the encoder's, and rows
# long enough (K = 2048: 8 KiB) to need several L2 row panels
SHAPES = [(1, 1, 1), (7, 33, 50), (13, 26, 97), (64, 384, 96), (130, 100, 33), (5, 0, 20), (30, 0, 40),
          (203, 2048, 40)]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str | None = None,
              ln: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """The layer in fp64: GEMM, bias, then the activation or residual + LayerNorm (`ln` = (residual, w, b, eps))."""
    out = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    if ln is not None:
        residual, lw, lb, eps = ln
        return F.layer_norm(out + residual.double(), out.shape[-1:], lw.double(), lb.double(), eps)
    if act in ("gelu", "gelu_tanh"):
        return F.gelu(out, approximate="tanh" if act == "gelu_tanh" else "none")
    return out.relu() if act == "relu" else out


def operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 1000 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / max(k, 1) ** 0.5
    return x, w, torch.randn(n, generator=g)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_fp64_reference(ext, shape: tuple[int, int, int], act: str | None) -> None:
    x, w, b = operands(*shape)
    out = torch.full((shape[0], shape[2]), float("nan"))  # poisoned: every element must be written
    ext.fp32_linear(x, gemm.pack_panels(w, 1), w.shape[0], b, act, out=out)
    assert_close(f"fp32_linear {shape} {act}", out, reference(x, w, b, act))


@pytest.mark.parametrize("act", ACTS[1:])
def test_activation_over_its_whole_range(ext, act: str) -> None:
    """Pre-activations from -40 to 40 (past GELU's cap at |x| = 14: no denormal there, and the tail stays ~0), in
    full-width tiles (epilogue in registers) and a partial one (spilled)."""
    x, w = torch.linspace(-40, 40, 97).unsqueeze(1), torch.ones(40, 1)  # out[m, n] = x[m]; N = 40: 16 + 16 + 8
    out = ext.fp32_linear(x, gemm.pack_panels(w, 1), 40, None, act)
    assert_close(f"fp32_linear {act} on [-40, 40]", out, reference(x, w, None, act))
    assert out[x[:, 0] < -14].abs().max() < 1e-20


@pytest.mark.parametrize("shape", SHAPES)
def test_residual_layernorm_epilogue_matches_reference(ext, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    x, w, b = operands(m, k, n)
    g = torch.Generator().manual_seed(n)
    residual, lw, lb = torch.randn(m, n, generator=g), torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    out = ext.fp32_linear(x, gemm.pack_panels(w, 1), n, b, None, residual, lw, lb, 1e-12)
    assert_close(f"fp32_linear {shape} + LayerNorm", out, reference(x, w, b, ln=(residual, lw, lb, 1e-12)))


@pytest.mark.parametrize("m", [9, 130])
def test_strided_rows_and_no_bias(ext, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    wide, w = torch.randn(m, 80, generator=g), torch.randn(20, 40, generator=g)
    x = wide[:, 10:50]  # a row stride of 80, packed (vector kernels) or read in place, one group or many
    assert_close("fp32_linear strided", ext.fp32_linear(x, gemm.pack_panels(w, 1), 20), reference(x, w, None))


def test_pack_holds_the_weight_in_panels() -> None:
    w = torch.randn(40, 7)
    p = gemm.pack_panels(w, 1)
    assert p.shape == (4, 7, 16, 1)  # N padded to 64: four panels of 16 columns, one k per step
    assert torch.equal(p[..., 0].permute(0, 2, 1).reshape(64, 7)[:40], w) and p[2:, :, 8:].eq(0).all()


def test_bad_kernel_arguments_raise() -> None:
    p = gemm.pack_panels(torch.randn(8, 16), 1)
    with pytest.raises(TypeError, match="float32"):
        EXT.fp32_linear(torch.randn(4, 16, dtype=torch.bfloat16), p, 8)
    with pytest.raises(ValueError, match="pack"):
        EXT.fp32_linear(torch.randn(4, 12), p, 8)  # K does not match the pack
    with pytest.raises(ValueError, match="pack"):
        EXT.fp32_linear(torch.randn(4, 16), p, 40)  # N does not match the pack
    with pytest.raises(ValueError, match="residual"):
        EXT.fp32_linear(torch.randn(4, 16), p, 8, None, None, torch.randn(4, 8))  # no LayerNorm parameters


def tiny_model() -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=78, num_hidden_layers=2, num_attention_heads=3,
                        intermediate_size=160)  # fmt: skip
    return BertModel(config).eval()


def run_tiny(model: BertModel) -> torch.Tensor:
    ids = torch.randint(1, 120, (3, 21), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        return model(ids, attention_mask=mask).last_hidden_state[mask.bool()]


@pytest.mark.parametrize("faster", [True, False])
def test_first_use_verdict_decides_and_explain_says_why(faster: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured faster, the GEMMs run here; measured slower, they stay on the path that ran before, unchanged."""
    monkeypatch.delenv("FASTBERT_CPU_GEMM", raising=False)
    monkeypatch.setattr(gemm, "_verdicts", {})
    monkeypatch.setattr(timing, "samples", lambda *fns, **kw: [[1.0], [2.0]] if faster else [[2.0], [1.0]])
    model = tiny_model()
    out = run_tiny(model)
    assert ops.decisions()["linear"].startswith("gemm") == faster
    with ops.exclude_backends("gemm"):
        without = run_tiny(model)
    assert gemm.verdicts() and all(wins == faster for wins, _ in gemm.verdicts().values())
    assert ("gemm for [" if faster else "oneDNN/torch for [") in fastbert.explain()
    if faster:
        assert_close("tiny model, gemm vs without", out, without.double())
    else:
        assert torch.equal(out, without)  # nothing ran on the gemm kernel


@pytest.mark.parametrize("mode", ["gemm", "onednn", "torch"])
def test_cpu_gemm_switch_fixes_the_choice_without_timing(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", mode)
    monkeypatch.setattr(timing, "samples", lambda *fns, **kw: pytest.fail("timed a GEMM despite the switch"))
    run_tiny(tiny_model())
    assert ops.decisions()["linear"].split(" ")[0] == mode


def test_grad_autocast_and_bf16_go_elsewhere() -> None:
    x, w, b = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8), torch.randn(6)
    call = {"x": x, "weight": w, "bias": b}
    assert "grad" in gemm.refuses_call(call, True, "linear", lambda: (True, ""))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "autocast" in gemm.refuses_call({**call, "x": x.detach()}, True, "linear", lambda: (True, ""))
    assert "fp32" in gemm.refuses_call({**call, "x": x.detach().bfloat16()}, True, "linear", lambda: (True, ""))
    empty = {"x": torch.randn(4, 0), "weight": torch.randn(6, 0)}
    assert "K = 0" in gemm.refuses_call(empty, True, "linear", lambda: (True, ""))


def test_gemm_benchmark_writes_every_system(tmp_path) -> None:
    """benchmarks/bench_gemm.py on a tiny shape: every system timed, results written as JSON, Markdown (and a plot)."""
    import json

    from benchmarks import bench_gemm

    assert bench_gemm.main(["--hidden", "16", "--rows", "7", "--budget", "0.01", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("gemm_cpu-*.json")).read_text())
    assert [r["layer"] for r in doc["results"]] == ["QKV", "attention out", "FFN in", "FFN out", "gated FFN in"]
    assert all(set(r["gflops"]) == set(bench_gemm.systems()) for r in doc["results"])  # the pair column on VNNI
    assert all(v > 0 for r in doc["results"] for v in r["gflops"].values())
    assert all(s in next(tmp_path.glob("gemm_cpu-*.md")).read_text() for s in bench_gemm.systems())
