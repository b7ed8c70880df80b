"""Triton GEMM with bias + activation epilogue (optional extra), forward and backward, vs the fp64 reference."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, LOW, check_op, gpu, requires_triton, row_strided

from fastbert import reference

pytestmark = requires_triton


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, kind: str) -> torch.Tensor:
    return reference.bias_act(F.linear(x, weight), bias, kind)


def _check(kind: str, dtype: torch.dtype, m: int, k: int, n: int, view=None, device=DEVICE) -> None:
    from fastbert import kernels

    x = torch.randn(m, k, dtype=torch.float64, device=device)
    w = torch.randn(n, k, dtype=torch.float64, device=device) / k**0.5
    b = torch.randn(n, dtype=torch.float64, device=device)
    check_op(f"linear_act[{kind}]", functools.partial(kernels.linear_act, kind=kind),
             functools.partial(_reference, kind=kind), [x, w, b], dtype, view)


@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "relu"])
def test_linear_act_fp32(kind: str) -> None:
    _check(kind, torch.float32, 37, 80, 100, view=row_strided)  # K spans 3 K-steps; M, N off the block


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_linear_act_low_precision(dtype: torch.dtype) -> None:
    _check("gelu", dtype, 37, 48, 40)


def test_linear_act_transposed_weight_and_no_grad() -> None:
    from fastbert import kernels

    _check("gelu", torch.float32, 9, 24, 20, view=lambda t: t.t().contiguous().t() if t.dim() > 1 else t)
    x, w, b = torch.randn(5, 16, device=DEVICE), torch.randn(12, 16, device=DEVICE), torch.randn(12, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(kernels.linear_act(x, w, b), _reference(x, w, b, "gelu"), rtol=1e-5, atol=1e-5)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
def test_linear_act_gpu_bert_ffn(dtype: torch.dtype) -> None:
    _check("gelu", dtype, 4093, 768, 3072, view=row_strided, device=torch.device("cuda"))
