"""Triton bias + activation (erf GELU, tanh GELU, ReLU), forward and backward, vs the fp64 reference."""

from __future__ import annotations

import functools

import pytest
import torch
from kernel_checks import DEVICE, DTYPES, check_inference, check_op, gpu, requires_triton, row_strided

from fastbert import reference

pytestmark = requires_triton
KINDS = ("gelu", "gelu_tanh", "relu")


def _check(kind: str, dtype: torch.dtype, shape: tuple[int, ...], view=None, device=DEVICE) -> None:
    from fastbert import kernels

    x = torch.randn(*shape, dtype=torch.float64, device=device) * 3  # wide enough to reach both GELU tails
    bias = torch.randn(shape[-1], dtype=torch.float64, device=device)
    check_op(
        f"bias_act[{kind}]", functools.partial(kernels.bias_act, kind=kind),
        functools.partial(reference.bias_act, kind=kind), [x, bias], dtype, view,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_bias_act_matches_reference(kind: str, dtype: torch.dtype) -> None:
    # 2 x 19 = 38 rows (not a multiple of the 32-row block), 100 columns (not a power of two), row-strided view
    _check(kind, dtype, (2, 19, 100), view=row_strided)


def test_bias_act_intermediate_width_and_transposed_input() -> None:
    _check("gelu", torch.float32, (5, 3072))  # BERT-base intermediate: several column blocks
    _check("gelu_tanh", torch.float32, (24, 7), view=lambda t: t.t().contiguous().t() if t.dim() > 1 else t)


def test_bias_act_rejects_bad_input() -> None:
    from fastbert import kernels

    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="unknown activation"):
        kernels.bias_act(x, torch.zeros(8, device=DEVICE), "swish")
    with pytest.raises(ValueError, match="bias must have shape"):
        kernels.bias_act(x, torch.zeros(7, device=DEVICE))


def test_bias_act_empty_input() -> None:
    from fastbert import kernels

    x = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    b = torch.randn(8, device=DEVICE, requires_grad=True)
    kernels.bias_act(x, b).sum().backward()
    assert x.grad.shape == (0, 8) and (b.grad == 0).all()


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_bias_act_gpu_bert_shapes(kind: str, dtype: torch.dtype) -> None:
    _check(kind, dtype, (4093, 3072), view=row_strided, device=torch.device("cuda"))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_bias_act_inference_launcher(kind: str, dtype: torch.dtype) -> None:
    from fastbert import kernels

    x = torch.randn(2, 19, 100, dtype=torch.float64, device=DEVICE) * 3
    bias = torch.randn(100, dtype=torch.float64, device=DEVICE)
    check_inference(f"bias_act[{kind}]", functools.partial(kernels.INFERENCE["bias_act"], kind=kind),
                    functools.partial(reference.bias_act, kind=kind), [x, bias], dtype, row_strided)
