"""pytest-benchmark, CPU: bias + residual + LayerNorm, transformers-style eager modules vs fastbert's dispatched op.

No GPU claims: on CPU `fastbert.ops` picks the native or torch path (Triton only on CUDA).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastbert import ops, reference

TOKENS = 256


@pytest.mark.parametrize("path", ["eager", "fastbert"])
@pytest.mark.parametrize("hidden", [384, 768])
def test_bias_residual_layernorm(benchmark, hidden: int, path: str) -> None:
    x, residual, bias = torch.randn(TOKENS, hidden), torch.randn(TOKENS, hidden), torch.randn(hidden)
    ln = nn.LayerNorm(hidden, eps=1e-12)
    args = (x, bias, residual, ln.weight, ln.bias, 1e-12)
    with torch.no_grad():
        fn = (lambda: ln(x + bias + residual)) if path == "eager" else (lambda: ops.bias_residual_layernorm(*args))
        benchmark.group = f"bias_residual_layernorm {TOKENS}x{hidden}"
        out = benchmark(fn)
        torch.testing.assert_close(out, reference.bias_residual_layernorm(*args))
