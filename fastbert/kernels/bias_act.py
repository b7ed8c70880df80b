"""act(x + bias) for erf GELU, tanh GELU and ReLU, forward and backward, in one memory pass each.

Limits: x `[*, N]` fp32/fp16/bf16 (any strides; rows are flattened, a unit feature stride is made if missing),
bias `[N]` of any float dtype; math in fp32, one cast to x's dtype on store. Backward writes dx in x's dtype and
the bias grad as per-program fp32 partial rows summed afterwards (deterministic, no atomics).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _common as C
from . import tuning

ACT_IDS = {"gelu": 0, "gelu_tanh": 1, "relu": 2}
SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1/sqrt(2)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1/sqrt(2*pi)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_TANH_C = tl.constexpr(0.044715)


@triton.jit
def _tanh(x):
    # tl has no tanh common to triton 3.6..3.9; this form never overflows and keeps relative accuracy near 0.
    t = tl.exp(-2.0 * tl.abs(x))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0.0, -r, r)


@triton.jit
def _act(u, ACT: tl.constexpr):
    if ACT == 0:
        return 0.5 * u * (1.0 + tl.erf(u * SQRT1_2))
    elif ACT == 1:
        return 0.5 * u * (1.0 + _tanh((u + u * u * u * GELU_TANH_C) * SQRT_2_OVER_PI))
    elif ACT == 2:
        return tl.maximum(u, 0.0)
    else:  # silu: the gated ops' only (fastbert.kernels.gated_act)
        return u / (1.0 + tl.exp(-u))


@triton.jit
def _act_grad(u, ACT: tl.constexpr):
    if ACT == 0:
        return 0.5 * (1.0 + tl.erf(u * SQRT1_2)) + u * tl.exp(-0.5 * u * u) * INV_SQRT_2PI
    elif ACT == 1:
        t = _tanh((u + u * u * u * GELU_TANH_C) * SQRT_2_OVER_PI)
        return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * (1.0 + u * u * (3.0 * GELU_TANH_C)) * SQRT_2_OVER_PI
    elif ACT == 2:
        return tl.where(u > 0.0, 1.0, 0.0)
    else:
        s = 1.0 / (1.0 + tl.exp(-u))
        return s * (1.0 + u * (1.0 - s))


@triton.jit
def _bias_act_fwd(
    x_ptr,  # [M, N] rows at stride_x, unit feature stride
    bias_ptr,  # [N]
    y_ptr,  # [M, N] contiguous, x's dtype
    M,
    N,
    stride_x,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = _act(x + b[None, :], ACT)
    tl.store(y_ptr + r64 * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_bwd(
    dy_ptr,  # [M, N] rows at stride_dy, unit feature stride
    x_ptr,  # [M, N] rows at stride_x
    bias_ptr,  # [N]
    dx_ptr,  # [M, N] contiguous, x's dtype
    dbias_ptr,  # [G, N] fp32: one partial bias-grad row per program along axis 0
    M,
    N,
    stride_dy,
    stride_x,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    b = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, programs * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = dy * _act_grad(x + b[None, :], ACT)
        tl.store(dx_ptr + r64 * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        db += tl.where(mask, dx, 0.0)
    tl.store(dbias_ptr + pid * N + cols, tl.sum(db, axis=0), mask=cmask)


@functools.cache
def _blocks(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): columns up to 1024 wide per program, rows to fill the tile."""
    block_n = min(C.feature_block(n), 1024)
    block_m = C.rows_per_program(block_n)
    return block_m, block_n, C.warps_for(block_m * block_n)


_rule = tuning.row_rule(_blocks)  # where no measured table entry fits


class BiasAct(torch.autograd.Function):
    """act(x + bias) with the pre-activation recomputed in backward (saves x, not x + bias)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor, kind: str) -> torch.Tensor:
        n = x.shape[-1]
        rows = C.as_rows(x, n)
        y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        m = rows.shape[0]
        if m:
            block_m, block_n, warps, stages = tuning.settings(
                "bias_act", x.device, x.dtype, n, 1 << (m - 1).bit_length(), _rule)
            grid = (-(-m // block_m), -(-n // block_n))
            _bias_act_fwd[grid](
                rows, bias, y, m, n, rows.stride(0), ACT=ACT_IDS[kind], BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip
        ctx.save_for_backward(rows, bias)
        ctx.kind, ctx.shape = kind, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, bias = ctx.saved_tensors
        m, n = rows.shape
        dy_rows = C.as_rows(dy, n)
        dx = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        block_m, block_n, warps = _blocks(n)
        programs = C.reduction_programs(C.cdiv(m, block_m), rows.device)
        partial = torch.zeros(programs, n, dtype=torch.float32, device=rows.device)
        if m:
            grid = (programs, C.cdiv(n, block_n))
            _bias_act_bwd[grid](
                dy_rows, rows, bias, dx, partial, m, n, dy_rows.stride(0), rows.stride(0), ACT=ACT_IDS[ctx.kind],
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
            )
        return dx.view(ctx.shape), partial.sum(0).to(bias.dtype), None


def _check(x: torch.Tensor, bias: torch.Tensor, kind: str) -> None:
    if kind not in ACT_IDS:
        raise ValueError(f"unknown activation {kind!r}; expected one of {tuple(ACT_IDS)}")
    if bias.shape != x.shape[-1:]:
        raise ValueError(f"bias must have shape {tuple(x.shape[-1:])}, got {tuple(bias.shape)}")


def bias_act(x: torch.Tensor, bias: torch.Tensor, kind: str = "gelu") -> torch.Tensor:
    """act(x + bias) for kind in gelu (erf), gelu_tanh, relu; differentiable in x and bias."""
    _check(x, bias, kind)
    if torch.compiler.is_compiling():
        return _bias_act_op(x, bias, kind)
    return C.apply(BiasAct, x, bias, kind)


def bias_act_inference(x: torch.Tensor, bias: torch.Tensor, kind: str = "gelu") -> torch.Tensor:
    """act(x + bias), forward kernel only: no autograd Function, launch blocks from the cached rule (inference)."""
    if torch.compiler.is_compiling():  # a Triton launch in a traced graph goes through the custom op
        return bias_act(x, bias, kind)
    _check(x, bias, kind)
    n = x.shape[-1]
    rows = C.as_rows(x, n)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    m = rows.shape[0]
    if m:
        block_m, block_n, warps, stages = tuning.settings(
            "bias_act", x.device, x.dtype, n, 1 << (m - 1).bit_length(), _rule)
        _bias_act_fwd[(-(-m // block_m), -(-n // block_n))](
            rows, bias, y, m, n, rows.stride(0), ACT=ACT_IDS[kind], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    return y.view(x.shape)


# torch.compile: the kernels as custom ops (forward, and a backward op registered as its gradient), so the compiler
# keeps each launch whole in its graph instead of breaking at the Triton launch.
@torch.library.custom_op("fastbert::triton_bias_act", mutates_args=())
def _bias_act_op(x: torch.Tensor, bias: torch.Tensor, kind: str) -> torch.Tensor:
    return BiasAct.forward(C.Saved(), x, bias, kind)


@_bias_act_op.register_fake
def _(x, bias, kind):
    return x.new_empty(x.shape)


@torch.library.custom_op("fastbert::triton_bias_act_backward", mutates_args=())
def _bias_act_backward_op(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dbias, _ = BiasAct.backward(C.Saved((C.as_rows(x, x.shape[-1]), bias), kind=kind, shape=x.shape), dy)
    return dx, dbias


@_bias_act_backward_op.register_fake
def _(dy, x, bias, kind):
    return x.new_empty(x.shape), bias.new_empty(bias.shape)


def _bias_act_setup(ctx, inputs, output) -> None:
    x, bias, ctx.kind = inputs
    ctx.save_for_backward(x, bias)


def _bias_act_grad(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, dbias = _bias_act_backward_op(dy, x, bias, ctx.kind)
    return dx, dbias, None


_bias_act_op.register_autograd(_bias_act_grad, setup_context=_bias_act_setup)
