"""Dispatch rules for the Triton backend: CPU tensors only when forced (interpreter), limits that say why."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import requires_triton

from fastbert import ops

pytestmark = requires_triton


def _bias_act_args() -> tuple:
    return torch.randn(4, 8), torch.randn(8), "gelu"


def test_automatic_dispatch_keeps_cpu_tensors_off_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("FASTBERT_BACKEND", raising=False)
    _, name = ops.select("bias_act", _bias_act_args(), {})
    assert name != "triton"
    assert "triton: used for cpu tensors only when chosen by name" in ops.explain()


def test_forced_triton_takes_cpu_tensors_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with ops.use_backend("triton"):
        fn, name = ops.select("bias_act", _bias_act_args(), {})
    assert name == "triton" and fn.__module__.startswith("fastbert.kernels")
    monkeypatch.setenv("FASTBERT_BACKEND", "triton")
    assert ops.select("bias_act", _bias_act_args(), {})[1] == "triton"


def test_forced_triton_on_cpu_without_the_interpreter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with ops.use_backend("triton"), pytest.raises(ops.BackendUnavailable, match="TRITON_INTERPRET=1"):
        ops.bias_act(*_bias_act_args())


@pytest.mark.parametrize(
    ("op", "args", "reason"),
    [
        ("attention", (torch.randn(4, 3, 1, 160), torch.tensor([0, 4], dtype=torch.int32), 4), "head dim 160 > 128"),
        ("attention", (torch.randn(4, 3, 1, 64), torch.tensor([0, 4], dtype=torch.int32), 50000, 0.1, True),
         "max_seqlen 50000"),
        ("bias_residual_layernorm", (torch.randn(2, 20000), *[torch.randn(20000)] * 1, torch.randn(2, 20000),
                                     torch.ones(20000), torch.zeros(20000), 1e-12), "feature dim 20000 > 16384"),
    ],
)
def test_triton_limits_give_a_reason(monkeypatch: pytest.MonkeyPatch, op: str, args: tuple, reason: str) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with ops.use_backend("triton"), pytest.raises(ops.BackendUnavailable, match=reason):
        ops.select(op, args, {})
    assert ops.select(op, args, {})[1] != "triton"  # automatic dispatch falls back


def test_triton_limits_are_defined_once() -> None:
    import importlib

    attention = importlib.import_module("fastbert.kernels.attention")  # the package's `attention` is the function
    from fastbert.kernels import limits

    assert attention.MAX_HEAD_DIM is limits.MAX_HEAD_DIM  # one definition, read by kernel and dispatch
    assert attention.MAX_SEQLEN_DROPOUT is limits.MAX_SEQLEN_DROPOUT


def test_triton_takes_cuda_tensors_automatically() -> None:
    """As data: the Triton backend accepts a CUDA call in automatic mode (checked without a GPU)."""
    backend = ops.backends()["triton"]
    call = dict(zip(("x", "bias", "kind"), _bias_act_args(), strict=True))
    assert backend.refuses("bias_act", torch.device("cuda"), torch.float16, call) is None
    assert backend.refuses("bias_act", torch.device("cpu"), torch.float32, call) is not None


def test_fastbert_imports_and_runs_without_triton() -> None:
    """With triton unimportable, fastbert still imports, the Triton backend reports why, and ops fall back."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, fastbert\n"
        "from fastbert import kernels, ops\n"
        "assert 'triton' in kernels.unavailable_reason(), kernels.unavailable_reason()\n"
        "_, name = ops.select('bias_act', (torch.randn(2, 4), torch.randn(4), 'gelu'), {})\n"
        "assert name != 'triton', name\n"
        "print(ops.backends()['triton'].unavailable())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "triton" in done.stdout


def test_decisions_follow_every_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch rebuilds explain()'s words only when a decision changes: forcing a backend, going back to
    automatic, and a second dtype each show at once, and the per-dtype lines keep both dtypes."""
    monkeypatch.delenv("FASTBERT_BACKEND", raising=False)
    x, bias = torch.randn(4, 8), torch.randn(8)
    ops.bias_act(x, bias)
    automatic = ops.decisions()["bias_act"]
    with ops.use_backend("torch"):
        ops.bias_act(x, bias)
        assert ops.decisions()["bias_act"] == "torch (forced)"
    ops.bias_act(x, bias)
    assert ops.decisions()["bias_act"] == automatic
    ops.bias_act(x.double(), bias.double())
    assert ops.decisions()["bias_act"] != automatic and "(in float64)" in ops.explain()
    ops.bias_act(x, bias)
    assert ops.decisions()["bias_act"] == automatic and "(in float32)" in ops.explain()
