"""Triton bias + dropout + residual + LayerNorm, forward and backward, vs the fp64 reference; dropout statistics."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import (
    DEVICE,
    DTYPES,
    check_inference,
    check_op,
    gpu,
    nan_poisoned_empty,
    requires_triton,
    row_strided,
)

from fastbert import reference

pytestmark = requires_triton
EPS = 1e-12


def _inputs(rows: int, n: int, device: torch.device = DEVICE) -> list[torch.Tensor]:
    """x, bias, residual, LN weight, LN bias in fp64 (x offset so the LN mean is far from 0, as in BERT)."""
    x = torch.randn(rows, n, dtype=torch.float64, device=device) + 2.0
    r = torch.randn(rows, n, dtype=torch.float64, device=device)
    b, w, lb = (torch.randn(n, dtype=torch.float64, device=device) for _ in range(3))
    return [x, b, r, w, lb]


def _check(dtype: torch.dtype, rows: int, n: int, view=None, device: torch.device = DEVICE) -> None:
    from fastbert import kernels

    check_op(
        f"bias_residual_layernorm[{n}]", functools.partial(kernels.bias_residual_layernorm, eps=EPS),
        functools.partial(reference.bias_residual_layernorm, eps=EPS), _inputs(rows, n, device), dtype, view,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [100, 384])
def test_bias_residual_layernorm_matches_reference(dtype: torch.dtype, n: int) -> None:
    _check(dtype, 37, n, view=row_strided)  # 37 rows: not a multiple of the row block


def test_bias_residual_layernorm_hidden_768_one_row() -> None:
    _check(torch.float32, 1, 768)


def test_bias_residual_layernorm_dropout_mask_is_shared_by_forward_and_backward() -> None:
    """The keep-mask shows in d(x) = d(residual) * keep / (1 - p); the forward must have used that same mask."""
    from fastbert import kernels

    p, rows, n = 0.3, 64, 96
    x, b, r, w, lb = (t.float().requires_grad_() for t in _inputs(rows, n))
    with nan_poisoned_empty():
        y = kernels.bias_residual_layernorm(x, b, r, w, lb, EPS, dropout_p=p, training=True)
        gout = torch.randn_like(y)
        dx, dr = torch.autograd.grad(y, (x, r), gout)
    keep = dx != 0
    frac = keep.double().mean().item()
    assert abs(frac - (1 - p)) < 5 * ((p * (1 - p)) / keep.numel()) ** 0.5, f"kept fraction {frac:.3f}, p={p}"
    torch.testing.assert_close(dx[keep], dr[keep] / (1 - p), rtol=1e-6, atol=1e-6)
    h = torch.where(keep, (x + b) / (1 - p), 0.0) + r  # the reference forward with the mask read from backward
    expect = F.layer_norm(h.double(), (n,), w.double(), lb.double(), EPS)
    torch.testing.assert_close(y.double(), expect, rtol=0, atol=1e-5)
    eval_y = kernels.bias_residual_layernorm(x, b, r, w, lb, EPS, dropout_p=p, training=False)
    torch.testing.assert_close(eval_y, reference.bias_residual_layernorm(x, b, r, w, lb, EPS), rtol=0, atol=1e-5)


def test_bias_residual_layernorm_same_seed_same_mask() -> None:
    from fastbert import kernels

    x, b, r, w, lb = (t.float() for t in _inputs(16, 64))
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(kernels.bias_residual_layernorm(x, b, r, w, lb, EPS, dropout_p=0.5, training=True))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], kernels.bias_residual_layernorm(x, b, r, w, lb, EPS, dropout_p=0.5, training=True))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [384, 768, 1024])
def test_bias_residual_layernorm_gpu_bert_shapes(dtype: torch.dtype, n: int) -> None:
    _check(dtype, 8191, n, view=row_strided, device=torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_bias_residual_layernorm_autocast_mix(dtype: torch.dtype) -> None:
    """Under autocast the GEMM output and residual are 16-bit while the parameters stay fp32."""
    from fastbert import kernels

    x, b, r, w, lb = _inputs(29, 96)
    args = [x.to(dtype), b.float(), r.to(dtype), w.float(), lb.float()]
    leaves = [t.clone().requires_grad_() for t in args]
    out = kernels.bias_residual_layernorm(*leaves, EPS)
    gout = torch.randn(out.shape, dtype=torch.float64, device=out.device)
    grads = torch.autograd.grad(out, leaves, gout.to(dtype))
    assert out.dtype == dtype and [g.dtype for g in grads] == [t.dtype for t in args]
    assert [g.device for g in grads] == [t.device for t in args]
    ref_leaves = [t.double().requires_grad_() for t in args]
    ref = reference.bias_residual_layernorm(*ref_leaves, EPS)
    ref_grads = torch.autograd.grad(ref, ref_leaves, gout.to(dtype).double())
    tol = 2 * torch.finfo(dtype).eps
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()
    for g, rg in zip(grads, ref_grads, strict=True):
        assert (g.double() - rg).abs().max() <= tol * max(1.0, rg.abs().max().item())


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_bias_residual_layernorm_inference_launcher(dtype: torch.dtype) -> None:
    from fastbert import kernels

    # 37 rows (not a block multiple), 384 columns; dropout arguments are ignored (inference)
    check_inference(
        "bias_residual_layernorm", functools.partial(kernels.INFERENCE["bias_residual_layernorm"], eps=EPS,
                                                     dropout_p=0.1, training=True),
        functools.partial(reference.bias_residual_layernorm, eps=EPS), _inputs(37, 384), dtype, row_strided,
    )
