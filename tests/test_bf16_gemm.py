"""fastbert's bf16 GEMM on AMX tiles (the `gemm` backend's bf16 calls, csrc/cpu/amx_bf16_linear.inc): the kernel
against an fp64 reference with every epilogue, awkward shapes and strided rows; the backend's limits (no AMX, K not a
whole tile step, a gate, mixed dtypes); a bf16 model on it, stacked and per op, bitwise alike.

Tolerance (DESIGN.md): bf16 error against the fp64 reference on the same bf16 operands at most 2x plain torch's bf16
error plus one rounding of the largest value (kernel_checks.assert_close).
"""

from __future__ import annotations

import pytest
import torch

import fastbert
from fastbert import ops
from fastbert.backends import gemm, native
from fastbert.execution import stack as layer_stack
from tests.conftest import loop_and_stack, tiny_bert
from tests.kernel_checks import assert_close, gemm_layer

EXT, EXT_REASON = native.load("_native_cpu")
AMX = EXT is not None and hasattr(EXT, "bf16_linear") and "avx512amx" in EXT.runnable_isas()
pytestmark = pytest.mark.skipif(not AMX, reason=f"needs AMX tiles and the native extension ({EXT_REASON or 'no AMX'})")
ACTS = (None, "gelu", "gelu_tanh", "relu")
# (M, K, N): one row, rows short of a block (M % 32), columns short of a tile (N % 32, N < 16), whole blocks, the
# encoder's, and rows long enough (K = 3072) that the rows split into several groups
SHAPES = [(1, 32, 1), (7, 64, 50), (33, 96, 97), (64, 384, 96), (130, 768, 2304), (203, 3072, 40)]


def operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 1000 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    return x.bfloat16(), w.bfloat16(), torch.randn(n, generator=g).bfloat16()


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_meets_the_bf16_rule(amx, shape: tuple[int, int, int], act: str | None) -> None:
    x, w, b = operands(*shape)
    out = torch.full((shape[0], shape[2]), float("nan"), dtype=torch.bfloat16)  # poisoned: every element written
    amx.bf16_linear(x, gemm.pack_panels(w, 2), w.shape[0], b, act, out=out)
    assert_close(f"bf16_linear {shape} {act}", out, gemm_layer(x.double(), w, b, act), gemm_layer(x, w, b, act))


@pytest.mark.parametrize("shape", SHAPES)
def test_residual_layernorm_epilogue_meets_the_bf16_rule(amx, shape: tuple[int, int, int]) -> None:
    m, k, n = shape
    x, w, b = operands(m, k, n)
    g = torch.Generator().manual_seed(n)
    ln = ((torch.randn(m, n, generator=g)).bfloat16(), (torch.rand(n, generator=g) + 0.5).bfloat16(),
          torch.randn(n, generator=g).bfloat16(), 1e-12)  # fmt: skip
    out = amx.bf16_linear(x, gemm.pack_panels(w, 2), n, b, None, *ln)
    assert out.dtype == torch.bfloat16
    assert_close(f"bf16_linear {shape} + LayerNorm", out, gemm_layer(x.double(), w, b, ln=ln),
                 gemm_layer(x, w, b, ln=ln))  # fmt: skip


@pytest.mark.parametrize("rows", [40, 64])  # the last block read in place (64) or copied from strided rows (40)
def test_strided_rows_and_no_bias(amx, rows: int) -> None:
    g = torch.Generator().manual_seed(1)
    wide, w = torch.randn(rows, 160, generator=g).bfloat16(), torch.randn(48, 64, generator=g).bfloat16()
    x = wide[:, 32:96]  # a row stride of 160: read in place
    out = amx.bf16_linear(x, gemm.pack_panels(w, 2), 48)
    assert_close("bf16_linear strided", out, gemm_layer(x.double(), w, None), gemm_layer(x, w, None))
    assert torch.equal(out, amx.bf16_linear(x.contiguous(), gemm.pack_panels(w, 2), 48))


def test_bad_kernel_arguments_raise(amx) -> None:
    p = gemm.pack_panels(torch.randn(8, 64).bfloat16(), 2)
    with pytest.raises(TypeError, match="bfloat16"):
        amx.bf16_linear(torch.randn(4, 64), p, 8)
    with pytest.raises(ValueError, match="32"):
        amx.bf16_linear(torch.randn(4, 48).bfloat16(), gemm.pack_panels(torch.randn(8, 48).bfloat16(), 2), 8)
    with pytest.raises(ValueError, match="at least one"):  # K = 0 divided by zero in the job plan
        amx.bf16_linear(torch.randn(4, 0).bfloat16(), gemm.pack_panels(torch.randn(8, 0).bfloat16(), 2), 8)
    with pytest.raises(ValueError, match="pack"):
        amx.bf16_linear(torch.randn(4, 64).bfloat16(), gemm.pack_panels(torch.randn(8, 64), 1), 8)  # an fp32 pack
    with pytest.raises(ValueError, match="residual"):
        amx.bf16_linear(torch.randn(4, 64).bfloat16(), p, 8, None, None, torch.randn(4, 8))  # fp32 residual
    assert amx.set_isa("avx512bf16")
    with pytest.raises(ValueError, match="AMX"):
        amx.bf16_linear(torch.randn(4, 64).bfloat16(), p, 8)


def call(k: int = 64, **extra: object) -> dict:
    x, w, b = operands(5, k, 32)
    return {"x": x, "weight": w, "bias": b, **extra}


def test_the_backend_says_why_it_refuses_a_bf16_call(amx) -> None:
    assert gemm.bf16_refusal("linear", call()) is None
    assert "multiple of 32" in gemm.bf16_refusal("linear", call(k=78))
    assert "gated" in gemm.bf16_refusal("gated_linear", call())
    mixed = call()
    mixed["bias"] = mixed["bias"].float()
    assert "one dtype" in gemm.refuses_call(mixed, True, "linear", lambda: (True, ""), gemm.bf16_refusal)
    assert gemm.refuses_call(call(), True, "linear", lambda: (True, ""), gemm.bf16_refusal) is None
    assert "fp32" in gemm.refuses_call(call(), True, "linear", lambda: (True, ""))  # the int8 backend's limits
    assert amx.set_isa("avx512bf16")
    assert "AMX" in gemm.bf16_refusal("linear", call())
    assert "no bf16" in gemm.describe()


def test_a_bf16_model_stacks_on_it_bitwise_like_the_loop(amx, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model whose widths are whole tile steps (64, 128): every GEMM on the AMX kernel, per op and stacked."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    model = tiny_bert(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=3,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).to(torch.bfloat16)  # fmt: skip
    ids, mask, outs = loop_and_stack(model, monkeypatch)
    assert torch.equal(outs[0], outs[1])
    assert "every GEMM on gemm" in layer_stack.describe()
    with torch.no_grad():  # a bf16 call of a K the kernel takes goes to it (forced: FASTBERT_CPU_GEMM=gemm)
        assert ops.select("linear", (torch.randn(5, 64).bfloat16(), model.encoder.layer[0].intermediate.dense.weight),
                          {})[1] == "gemm"  # fmt: skip
    assert "bf16 on AMX tiles" in fastbert.explain()


def test_benchmark_times_every_system_and_writes_its_tables(tmp_path) -> None:
    """bench_bf16_gemm at one small shape: each GEMM of a layer timed on every system, per-layer sums, JSON and
    Markdown written."""
    import json

    from benchmarks import bench_bf16_gemm

    argv = ["--hidden", "64", "--rows", "40", "--budget", "0", "--layers", "2", "--out", str(tmp_path)]
    assert bench_bf16_gemm.main(argv) == 0
    doc = json.loads(next(tmp_path.glob("bf16_gemm_cpu-*.json")).read_text())
    assert [r["layer"] for r in doc["results"]] == list(bench_bf16_gemm.GEMMS)
    assert all(set(r["us"]) == set(bench_bf16_gemm.SYSTEMS) and min(r["us"].values()) > 0 for r in doc["results"])
    ((hidden, rows, us),) = bench_bf16_gemm.layer_sums(doc)
    assert (hidden, rows) == (64, 40) and us["oneDNN"] == sum(r["us"]["oneDNN"] for r in doc["results"])
    assert "| 64 | 40 | QKV |" in next(tmp_path.glob("bf16_gemm_cpu-*.md")).read_text()
