"""act(x) * up for erf GELU, tanh GELU, ReLU and SiLU (GeGLU, SwiGLU), forward and backward, in one memory pass each:
the gated feed-forward's activation after its GEMM(s) on GPU.

Limits: x and up `[*, N]` of one shape and dtype, fp32/fp16/bf16, any row strides (the two halves of one GEMM's
output are views of it; a unit feature stride is made if missing); math in fp32, one cast on store. Backward writes
dx = dy * up * act'(x) and dup = dy * act(x) in x's dtype, the activation recomputed from x (saves x and up, not
act(x)).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _common as C
from . import tuning
from .bias_act import _act, _act_grad

ACT_IDS = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3}


@triton.jit
def _gated_act_fwd(
    x_ptr,  # [M, N] rows at stride_x, unit feature stride
    up_ptr,  # [M, N] rows at stride_up
    y_ptr,  # [M, N] contiguous, x's dtype
    M,
    N,
    stride_x,
    stride_up,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + r64 * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + r64 * N + cols[None, :], (_act(x, ACT) * up).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_act_bwd(
    dy_ptr,  # [M, N] rows at stride_dy, unit feature stride
    x_ptr,  # [M, N] rows at stride_x
    up_ptr,  # [M, N] rows at stride_up
    dx_ptr,  # [M, N] contiguous, x's dtype
    dup_ptr,  # [M, N] contiguous, up's dtype
    M,
    N,
    stride_dy,
    stride_x,
    stride_up,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + r64 * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + r64 * N + cols[None, :], (dy * up * _act_grad(x, ACT)).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + r64 * N + cols[None, :], (dy * _act(x, ACT)).to(dup_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _blocks(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): columns up to 1024 wide per program, rows to fill the tile."""
    block_n = min(C.feature_block(n), 1024)
    block_m = C.rows_per_program(block_n)
    return block_m, block_n, C.warps_for(block_m * block_n)


_rule = tuning.row_rule(_blocks)  # where no measured table entry fits


def _forward(x: torch.Tensor, up: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [*, N], x rows, up rows): the forward launch on [M, N] views of x and up."""
    n = x.shape[-1]
    rows, up_rows = C.as_rows(x, n), C.as_rows(up, n)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    m = rows.shape[0]
    if m:
        block_m, block_n, warps, stages = tuning.settings(
            "gated_act", x.device, x.dtype, n, 1 << (m - 1).bit_length(), _rule)
        _gated_act_fwd[(C.cdiv(m, block_m), C.cdiv(n, block_n))](
            rows, up_rows, y, m, n, rows.stride(0), up_rows.stride(0), ACT=ACT_IDS[kind], BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return y.view(x.shape), rows, up_rows


def _backward(
    dy: torch.Tensor, rows: torch.Tensor, up_rows: torch.Tensor, kind: str, shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = rows.shape
    dy_rows = C.as_rows(dy, n)
    dx = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    dup = torch.empty(up_rows.shape, dtype=up_rows.dtype, device=up_rows.device)
    if m:
        block_m, block_n, warps = _blocks(n)
        _gated_act_bwd[(C.cdiv(m, block_m), C.cdiv(n, block_n))](
            dy_rows, rows, up_rows, dx, dup, m, n, dy_rows.stride(0), rows.stride(0), up_rows.stride(0),
            ACT=ACT_IDS[kind], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        )  # fmt: skip
    return dx.view(shape), dup.view(shape)


class GatedAct(torch.autograd.Function):
    """act(x) * up with act(x) recomputed in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
        y, rows, up_rows = _forward(x, up, kind)
        ctx.save_for_backward(rows, up_rows)
        ctx.kind, ctx.shape = kind, x.shape
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, up_rows = ctx.saved_tensors
        return (*_backward(dy, rows, up_rows, ctx.kind, ctx.shape), None)


def _check(x: torch.Tensor, up: torch.Tensor, kind: str) -> None:
    if kind not in ACT_IDS:
        raise ValueError(f"unknown activation {kind!r}; expected one of {tuple(ACT_IDS)}")
    if up.shape != x.shape or up.dtype != x.dtype:
        raise ValueError(f"up must match x: {tuple(x.shape)} {x.dtype}, got {tuple(up.shape)} {up.dtype}")


def gated_act(x: torch.Tensor, up: torch.Tensor, kind: str = "gelu") -> torch.Tensor:
    """act(x) * up for kind in gelu (erf), gelu_tanh, relu, silu; differentiable in x and up."""
    _check(x, up, kind)
    if torch.compiler.is_compiling():
        return _gated_act_op(x, up, kind)
    return C.apply(GatedAct, x, up, kind)


def gated_act_inference(x: torch.Tensor, up: torch.Tensor, kind: str = "gelu") -> torch.Tensor:
    """act(x) * up, forward kernel only: no autograd Function (inference)."""
    if torch.compiler.is_compiling():  # a Triton launch in a traced graph goes through the custom op
        return gated_act(x, up, kind)
    _check(x, up, kind)
    return _forward(x, up, kind)[0]


# torch.compile: the kernels as custom ops (forward, and a backward op registered as its gradient), so the compiler
# keeps each launch whole in its graph instead of breaking at the Triton launch.
@torch.library.custom_op("fastbert::triton_gated_act", mutates_args=())
def _gated_act_op(x: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    return _forward(x, up, kind)[0]


@_gated_act_op.register_fake
def _(x, up, kind):
    return x.new_empty(x.shape)


@torch.library.custom_op("fastbert::triton_gated_act_backward", mutates_args=())
def _gated_act_backward_op(
    dy: torch.Tensor, x: torch.Tensor, up: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    return _backward(dy, C.as_rows(x, n), C.as_rows(up, n), kind, x.shape)


@_gated_act_backward_op.register_fake
def _(dy, x, up, kind):
    return x.new_empty(x.shape), up.new_empty(up.shape)


def _gated_act_setup(ctx, inputs, output) -> None:
    x, up, ctx.kind = inputs
    ctx.save_for_backward(x, up)


def _gated_act_grad(ctx, dy):
    x, up = ctx.saved_tensors
    dx, dup = _gated_act_backward_op(dy, x, up, ctx.kind)
    return dx, dup, None


_gated_act_op.register_autograd(_gated_act_grad, setup_context=_gated_act_setup)
