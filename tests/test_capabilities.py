"""What the CPU can do is probed once and reported; FASTBERT_CPU_ISA=avx2 makes any machine take the weaker CPU's
paths; bf16 without bf16 instructions runs as fp32 GEMMs on the upcast operands and keeps bf16 semantics.

Rule (DESIGN.md): a bf16 result's error vs fp64 is at most 2x plain torch's bf16 error + a small floor.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fastbert
from fastbert import capabilities, ops, reference, train
from fastbert.backends import onednn

FLOOR = 4e-3  # DESIGN.md's small floor for bf16 (as in test_precision.py)
ACTS = (None, "gelu", "gelu_tanh", "relu")


def err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return (out.double() - exact.double()).abs().max().item()


@pytest.fixture
def no_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behave as a CPU without bf16 instructions, whatever this one has."""
    monkeypatch.setenv(capabilities.FORCE_ENV, "avx2")


def operands(rows: int = 37) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 96), torch.randn(80, 96) / 10, torch.randn(80)


def test_forcing_avx2_reports_no_bf16_and_fp32_as_the_fast_precision(no_bf16: None) -> None:
    assert not capabilities.bf16_gemm().ok and not capabilities.onednn_bf16_prepack().ok
    assert capabilities.bf16_via_fp32(torch.device("cpu"))
    assert capabilities.fast_dtype(torch.device("cpu")) == torch.float32
    text = fastbert.explain()
    assert "FASTBERT_CPU_ISA=avx2" in text and "bf16 runs as fp32 GEMMs" in text
    assert "fast precision here: float32" in text


def test_an_unknown_forced_isa_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(capabilities.FORCE_ENV, "avx3")
    with pytest.raises(ValueError, match="FASTBERT_CPU_ISA='avx3'"):
        capabilities.bf16_gemm()


def test_the_unforced_probe_is_measured_once_and_says_what_it_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(capabilities.FORCE_ENV, raising=False)
    first = capabilities.bf16_gemm()
    assert capabilities.bf16_gemm() is first  # cached: the timing runs once per process
    assert "x fp32's speed on [256, 512] x [512, 512]" in first.why
    assert capabilities.fast_dtype(torch.device("cpu")) == (torch.bfloat16 if first.ok else torch.float32)


@pytest.mark.parametrize("act", ACTS)
def test_bf16_linear_without_bf16_instructions_keeps_bf16_semantics(act: str | None, no_bf16: None) -> None:
    """oneDNN on fp32 packs of the bf16 weights: bf16 output, error within the low-precision rule."""
    x, w, b = (t.bfloat16() for t in operands())
    exact = reference.linear(x.double(), w.double(), b.double(), act)
    with torch.no_grad():
        ours = onednn.linear(x, w, b, act)
    plain = reference.linear(x, w, b, act)  # torch's own bf16 GEMM (emulated here: slow, but the yardstick)
    assert ours.dtype == torch.bfloat16
    assert err(ours, exact) <= 2 * err(plain, exact) + FLOOR
    # the rule: the fp32 GEMM of the bf16 operands, rounded once: equal up to fp32 summation order (1 bf16 ulp)
    rule = reference.linear(x.float(), w.float(), b.float(), act).bfloat16()
    assert torch.allclose(ours.float(), rule.float(), rtol=2**-7, atol=1e-6)


def test_the_rule_equals_the_bf16_hardware_path_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(capabilities.FORCE_ENV, raising=False)
    if not capabilities.bf16_gemm().ok:
        pytest.skip(f"no bf16 instructions on this CPU ({capabilities.bf16_gemm().why})")
    x, w, b = (t.bfloat16() for t in operands())
    with torch.no_grad():
        hardware = onednn.linear(x, w, b, "gelu")
        monkeypatch.setenv(capabilities.FORCE_ENV, "avx2")
        rule = onednn.linear(x, w, b, "gelu")
    exact = reference.linear(x.double(), w.double(), b.double(), "gelu")
    assert err(rule, exact) <= 2 * err(hardware, exact) + FLOOR
    assert err(hardware, exact) <= 2 * err(rule, exact) + FLOOR


def test_autocast_and_the_residual_layernorm_epilogue_follow_the_rule(no_bf16: None) -> None:
    x, w, b = operands()
    residual, g, beta = torch.randn(37, 80).bfloat16(), torch.rand(80) + 0.5, torch.randn(80)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        auto = onednn.linear(x, w, b, "gelu")
    assert auto.dtype == torch.bfloat16
    exact = reference.linear(x.bfloat16().double(), w.bfloat16().double(), b.bfloat16().double(), "gelu")
    assert err(auto, exact) <= 2 * err(reference.linear(*(t.bfloat16() for t in (x, w, b)), "gelu"), exact) + FLOOR
    x16, w16, b16 = (t.bfloat16() for t in (x, w, b))
    with torch.no_grad():
        fused = onednn.dense_residual_layernorm(x16, w16, b16, residual, g.bfloat16(), beta.bfloat16(), 1e-12)
    h = reference.linear(x16.double(), w16.double(), b16.double()) + residual.double()
    exact = reference.layer_norm(h, g.bfloat16().double(), beta.bfloat16().double(), 1e-12)
    plain = reference.bias_residual_layernorm(x16 @ w16.T, b16, residual, g.bfloat16(), beta.bfloat16(), 1e-12)
    assert fused.dtype == torch.bfloat16
    assert err(fused, exact) <= 2 * err(plain, exact) + FLOOR


def test_the_torch_backend_follows_the_rule_with_autograd(no_bf16: None) -> None:
    """Training takes the torch path (oneDNN is forward-only): bf16 output and fp32-arithmetic gradients."""
    x, w, b = (t.bfloat16().requires_grad_() for t in operands(9))
    out = ops.linear(x, w, b, "gelu")
    assert out.dtype == torch.bfloat16 and "linear: torch" in fastbert.explain()
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (x, w, b))
    exact = reference.linear(*(t.detach().double() for t in (x, w, b)), "gelu")
    assert err(out, exact) <= 2 * err(reference.linear(x, w, b, "gelu"), exact) + FLOOR


def test_training_precision_auto_follows_the_machine(no_bf16: None) -> None:
    cpu_device = torch.device("cpu")
    chosen, why = train.resolve_precision("auto", cpu_device)
    assert chosen == "fp32" and "auto -> fp32" in why
    chosen, why = train.resolve_precision("bf16", cpu_device)
    assert chosen == "bf16" and why.startswith("warning: bf16 is slow")
    assert train.resolve_precision("fp32", cpu_device)[0] == "fp32"
    with pytest.raises(ValueError, match="precision must be one of"):
        train.resolve_precision("int8", cpu_device)


def test_native_kernels_run_their_avx2_build_when_forced() -> None:
    """The switch reaches the compiled kernels too (a fresh process: the ISA is chosen once, at load)."""
    from fastbert.backends import native

    ext, reason = native.load("_native_cpu")
    if ext is None:
        pytest.skip(f"native CPU kernels: {reason}")
    if "avx2" not in ext.runnable_isas():
        pytest.skip("this CPU cannot run AVX2 kernels")
    code = "from fastbert.backends import native; print(native.load('_native_cpu')[0].isa())"
    env = {**os.environ, capabilities.FORCE_ENV: "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "avx2"


@pytest.fixture
def fresh_probes() -> object:
    """Forget the probes' cached answers before and after (they run once per process)."""
    probes = (capabilities._try_onednn_bf16_prepack, capabilities._time_bf16_gemm)
    for probe in probes:
        probe.cache_clear()
    yield
    for probe in probes:
        probe.cache_clear()


def test_the_first_call_under_cpu_bf16_autocast_runs() -> None:
    """The probes run at the first bf16 GEMM: under the caller's bf16 autocast they once computed their fp32 check in
    bf16 and raised 'Float did not match BFloat16' on CPUs with bf16 instructions (a fresh process: probes run once)."""
    code = (
        "import torch, fastbert\n"
        "from fastbert import capabilities, ops\n"
        "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "    out = ops.linear(torch.randn(5, 32), torch.randn(16, 32), torch.randn(16))\n"
        "print(out.dtype, capabilities.onednn_bf16_prepack().ok, capabilities.bf16_gemm().ok)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != capabilities.FORCE_ENV}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "torch.bfloat16"


def test_the_prepack_probe_checks_in_fp32_under_the_callers_autocast(
    monkeypatch: pytest.MonkeyPatch, fresh_probes: None
) -> None:
    """The same on any CPU: oneDNN's bf16 calls replaced by what bf16 hardware computes (fp32 products, one round)."""
    import torch.nn.functional as F

    monkeypatch.delenv(capabilities.FORCE_ENV, raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w: w, raising=False)
    monkeypatch.setattr(
        torch.ops.mkldnn, "_linear_pointwise", lambda x, w, *_: F.linear(x.float(), w.float()).bfloat16(), raising=False
    )
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.enable_grad():
        found = capabilities.onednn_bf16_prepack()
    assert found.ok, found.why
    assert not torch.is_autocast_enabled("cpu")


@pytest.fixture
def bf16_logic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decide as a CPU with bf16 dot products does, whatever this one has."""
    monkeypatch.setenv(capabilities.FORCE_ENV, capabilities.BF16_LOGIC)


def test_forcing_bf16_logic_makes_bf16_the_fast_precision(bf16_logic: None) -> None:
    assert capabilities.bf16_gemm().ok and "bf16 dot products" in capabilities.bf16_gemm().why
    assert not capabilities.bf16_via_fp32(torch.device("cpu"))
    assert capabilities.fast_dtype(torch.device("cpu")) == torch.bfloat16
    assert capabilities.cpu_kind() != capabilities.BF16_LOGIC  # a label of what runs: the CPU is unchanged
    chosen, why = train.resolve_precision("auto", torch.device("cpu"))
    assert chosen == "bf16" and "auto -> bf16" in why
    text = fastbert.explain()
    assert f"FASTBERT_CPU_ISA={capabilities.BF16_LOGIC}" in text and "fast precision here: bfloat16" in text
    assert "bf16 runs as fp32 GEMMs" not in text


def test_forced_bf16_logic_runs_bf16_gemms_as_bf16_under_autocast(bf16_logic: None) -> None:
    """The bf16 machine's path on any CPU: bf16 GEMMs (oneDNN's where its prepack runs, else torch's), bf16 out,
    error within the low-precision rule, with autograd through the torch path."""
    x, w, b = operands()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        auto = onednn.linear(x, w, b, "gelu")
    assert auto.dtype == torch.bfloat16
    x16, w16, b16 = (t.bfloat16() for t in (x, w, b))
    exact = reference.linear(x16.double(), w16.double(), b16.double(), "gelu")
    assert err(auto, exact) <= 2 * err(reference.linear(x16, w16, b16, "gelu"), exact) + FLOOR
    leaves = [t.clone().requires_grad_() for t in (x16, w16, b16)]
    out = ops.linear(*leaves, "gelu")
    out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in leaves)


def test_probes_first_asked_inside_a_trace_run_on_real_tensors() -> None:
    """A probe first asked under a FakeTensorMode (what torch.compile traces with) finds what it finds outside one: it
    leaves the mode (fake tensors timed nothing, cached a wrong finding for good, and crashed oneDNN in a trace)."""
    code = (
        "import sys, torch\n"
        "from fastbert import capabilities as c\n"
        "if sys.argv[1] == 'fake':\n"
        "    from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "    with FakeTensorMode():\n"
        "        g, p = c.bf16_gemm(), c.onednn_bf16_prepack()\n"
        "else:\n"
        "    g, p = c.bf16_gemm(), c.onednn_bf16_prepack()\n"
        "print(g.ok, p.ok, p.why)\n"
    )
    run = [subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True).stdout
           for mode in ("fake", "real")]  # fmt: skip
    assert run[0] == run[1]
