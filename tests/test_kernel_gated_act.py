"""Triton gated activation act(x) * up (erf GELU, tanh GELU, ReLU, SiLU), forward and backward, vs the fp64
reference; x and up as the two halves of one GEMM output (row-strided views), as a gated feed-forward passes them."""

from __future__ import annotations

import functools

import pytest
import torch
from kernel_checks import DEVICE, DTYPES, check_inference, check_op, gpu, requires_triton, row_strided

from fastbert import reference

pytestmark = requires_triton
KINDS = reference.GATE_ACTIVATIONS


def _inputs(shape: tuple[int, ...], device: torch.device) -> list[torch.Tensor]:
    x = torch.randn(*shape, dtype=torch.float64, device=device) * 3  # wide enough to reach the activations' tails
    return [x, torch.randn(*shape, dtype=torch.float64, device=device)]


def _check(kind: str, dtype: torch.dtype, shape: tuple[int, ...], view=None, device=DEVICE) -> None:
    from fastbert import kernels

    check_op(f"gated_act[{kind}]", functools.partial(kernels.gated_act, kind=kind),
             functools.partial(reference.gated_act, kind=kind), _inputs(shape, device), dtype, view)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_gated_act_matches_reference(kind: str, dtype: torch.dtype) -> None:
    # 2 x 19 = 38 rows (not a multiple of the row block), 100 columns (not a power of two), row-strided views
    _check(kind, dtype, (2, 19, 100), view=row_strided)


def test_gated_act_on_the_halves_of_one_gemm_output() -> None:
    """x and up as ModernBERT's Wi output chunked: views sharing one buffer, rows 2N apart."""
    from fastbert import kernels

    wide = torch.randn(37, 2 * 1152, device=DEVICE, dtype=torch.float64) * 3
    x, up = wide.float().chunk(2, dim=-1)
    out = kernels.gated_act(x, up, "gelu")
    expected = reference.gated_act(*wide.chunk(2, dim=-1), "gelu")
    assert (out.double() - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())


def test_gated_act_rejects_bad_input() -> None:
    from fastbert import kernels

    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="unknown activation"):
        kernels.gated_act(x, x, "swish")
    with pytest.raises(ValueError, match="up must match x"):
        kernels.gated_act(x, torch.randn(3, 7, device=DEVICE))
    with pytest.raises(ValueError, match="up must match x"):
        kernels.gated_act(x, x.double())


def test_gated_act_empty_input() -> None:
    from fastbert import kernels

    x = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    up = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    kernels.gated_act(x, up, "silu").sum().backward()
    assert x.grad.shape == (0, 8) and up.grad.shape == (0, 8)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ("gelu", "silu"))
def test_gated_act_gpu_encoder_shapes(kind: str, dtype: torch.dtype) -> None:
    _check(kind, dtype, (4093, 1152), view=row_strided, device=torch.device("cuda"))  # ModernBERT-base's width


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_gated_act_inference_launcher(kind: str, dtype: torch.dtype) -> None:
    from fastbert import kernels

    check_inference(f"gated_act[{kind}]", functools.partial(kernels.INFERENCE["gated_act"], kind=kind),
                    functools.partial(reference.gated_act, kind=kind), _inputs((2, 19, 100), DEVICE), dtype,
                    row_strided)  # fmt: skip
