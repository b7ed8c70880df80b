"""pytest-benchmark, CPU: bias + activation, transformers-style eager modules vs fastbert's dispatched op.

No GPU claims: on CPU `fastbert.ops` picks the native or torch path (Triton only on CUDA). Run with
`pytest benchmarks/bench_bias_act.py` (timed) or `--benchmark-disable` (each path once, as a check).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastbert import ops, reference

TOKENS, WIDTH = 256, 3072  # BERT-base intermediate width
ACTS = {"gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "relu": nn.ReLU()}


@pytest.mark.parametrize("path", ["eager", "fastbert"])
@pytest.mark.parametrize("kind", sorted(ACTS))
def test_bias_act(benchmark, kind: str, path: str) -> None:
    x, bias = torch.randn(TOKENS, WIDTH), torch.randn(WIDTH)
    fn = (lambda: ACTS[kind](x + bias)) if path == "eager" else (lambda: ops.bias_act(x, bias, kind))
    benchmark.group = f"bias_act[{kind}] {TOKENS}x{WIDTH}"
    out = benchmark(fn)
    torch.testing.assert_close(out, reference.bias_act(x, bias, kind))
