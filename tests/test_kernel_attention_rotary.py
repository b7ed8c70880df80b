"""The Triton attention kernels with rotary positions and a sliding window (forward, both backward kernels, the
forward-only launcher), against the fp64 reference under Triton's interpreter on CPU (every load and store bounds-
checked) and on a GPU: ragged batches with an empty and a 1-token sequence past one key block, rotation of every dim
and of part of them, windows of 0, inside a block, across blocks and wider than the sequences; fp16/bf16 against
plain torch's own error (tests/kernel_checks.py)."""

from __future__ import annotations

import pytest
import torch

from fastbert import reference
from fastbert.rotary import inverse_frequencies, rotary_rows
from tests.kernel_checks import DEVICE, LOW, assert_close, nan_poisoned_empty, requires_triton

pytestmark = requires_triton
LENGTHS = [70, 0, 1, 17]  # 70: two key blocks of 64


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _rotary(lengths: list[int], rotary_dim: int) -> torch.Tensor:
    positions = torch.cat([torch.arange(n) + 3 for n in lengths])
    return rotary_rows(positions, inverse_frequencies(rotary_dim, 1e4)).to(DEVICE)


@pytest.mark.parametrize("window", [None, 0, 9, 100])
@pytest.mark.parametrize("dim, rotary_dim", [(24, 24), (32, 16)])
def test_forward_and_backward_match_the_fp64_reference(window: int | None, dim: int, rotary_dim: int) -> None:
    from fastbert import kernels

    heads, cu, longest = 2, _cu(LENGTHS), max(LENGTHS)
    rotary = _rotary(LENGTHS, rotary_dim)
    x = torch.randn(sum(LENGTHS), 3, heads, dim, device=DEVICE, requires_grad=True)
    with nan_poisoned_empty():
        out = kernels.attention(x, cu, longest, rotary=rotary, window=window)
        gout = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, x, gout)
        inference = kernels.attention_inference(x.detach(), cu, longest, rotary=rotary, window=window)
    x64 = x.detach().double().requires_grad_()
    expect = reference.attention(x64, cu, longest, rotary=rotary.double(), window=window)
    (expect_grad,) = torch.autograd.grad(expect, x64, gout.double())
    assert_close("triton rotary/window forward", out, expect)
    assert_close("triton rotary/window inference", inference, expect)
    assert_close("triton rotary/window backward", grad, expect_grad)


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_within_torchs_own_error(dtype: torch.dtype) -> None:
    from fastbert import kernels

    heads, dim, cu, longest = 2, 32, _cu(LENGTHS), max(LENGTHS)
    rotary = _rotary(LENGTHS, dim)
    x = torch.randn(sum(LENGTHS), 3, heads, dim, device=DEVICE)
    out = kernels.attention_inference(x.to(dtype), cu, longest, rotary=rotary, window=9)
    expect = reference.attention(x.double(), cu, longest, rotary=rotary.double(), window=9)
    plain = reference.attention(x.to(dtype), cu, longest, rotary=rotary, window=9)
    assert_close(f"triton rotary/window {dtype}", out, expect, plain)


def test_bad_rotary_and_window_raise_clearly() -> None:
    from fastbert import kernels

    x, cu = torch.randn(5, 3, 2, 8, device=DEVICE), _cu([5])
    with pytest.raises(ValueError, match="rotary must be"):
        kernels.attention(x, cu, 5, rotary=torch.zeros(2, 4, 2, device=DEVICE))
    with pytest.raises(ValueError, match="rotary must be float32"):
        kernels.attention(x, cu, 5, rotary=torch.zeros(2, 5, 2, device=DEVICE, dtype=torch.float64))
    with pytest.raises(ValueError, match="window must be >= 0"):
        kernels.attention(x, cu, 5, window=-1)
