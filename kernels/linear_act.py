"""act(x @ W^T + bias): a tiled Triton GEMM with the bias + activation epilogue (the FFN's first layer), and its
backward. Optional extra over the dispatch ops: `fastbert.ops` has no entry for it; call it directly.

Limits: x `[*, K]`, weight `[N, K]` (nn.Linear layout, any strides), bias `[N]`; fp32/fp16/bf16, x and weight of
one dtype; fp32 accumulation (fp32 inputs: TF32 dots where torch allows TF32, else IEEE), bias + activation in
fp32, one cast on store.
Forward also stores the pre-activation when a grad is needed; backward turns it into dL/d(pre) and the bias grad
with the bias_act backward kernel, then dX and dW with torch matmuls (cuBLAS on GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as C
from ._device import dot
from .bias_act import ACT_IDS, _act, _bias_act_bwd
from .bias_act import _blocks as _elementwise_blocks
from .limits import fp32_dot_precision


@triton.jit
def _linear_act_fwd(
    x_ptr,  # [M, K] at (stride_xm, stride_xk)
    w_ptr,  # [N, K] at (stride_wn, stride_wk)
    bias_ptr,  # [N]
    y_ptr,  # [M, N] contiguous: act(x @ W^T + bias)
    pre_ptr,  # [M, N] contiguous: x @ W^T + bias (written only with SAVE_PRE)
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    ACT: tl.constexpr,
    SAVE_PRE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # grouped program order: GROUP_M row blocks share each column block of W while it is in L2
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * blocks_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * blocks_n)) % group_size
    pid_n = (pid % (GROUP_M * blocks_n)) // group_size
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask, cmask = rows < M, cols < N
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :] * stride_xk
    w_tile = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None] * stride_wk  # [BLOCK_K, BLOCK_N] of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + ks) < K
        a = tl.load(x_tile, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_tile, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc += dot(a, b, PRECISION, UPCAST)
        x_tile += BLOCK_K * stride_xk
        w_tile += BLOCK_K * stride_wk
    pre = acc + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out = rows.to(tl.int64)[:, None] * N + cols[None, :]
    mask = rmask[:, None] & cmask[None, :]
    if SAVE_PRE:
        tl.store(pre_ptr + out, pre.to(pre_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + out, _act(pre, ACT).to(y_ptr.dtype.element_ty), mask=mask)


def _blocks(m: int, n: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): 128x128 output tiles (64x64 in fp32, which needs twice the
    registers per element), shrunk to the problem for tiny shapes; K steps of 32; 8 warps for 128x128, else 4."""
    big = 64 if dtype == torch.float32 else 128
    block_m = min(big, max(16, triton.next_power_of_2(m)))
    block_n = min(big, max(16, triton.next_power_of_2(n)))
    return block_m, block_n, 32, 8 if block_m * block_n >= 128 * 128 else 4


class LinearAct(torch.autograd.Function):
    """Saves x, the weight and (when a grad is needed) the pre-activation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, kind: str) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.reshape(-1, k)
        m, n = rows.shape[0], weight.shape[0]
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        save = ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        pre = torch.empty_like(y) if save else y  # pre_ptr is unused without SAVE_PRE
        block_m, block_n, block_k, warps = _blocks(m, n, x.dtype)
        if m and n:
            grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
            _linear_act_fwd[grid](
                rows, weight, bias, y, pre, m, n, k, rows.stride(0), rows.stride(1), weight.stride(0),
                weight.stride(1), ACT=ACT_IDS[kind], SAVE_PRE=save, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_K=block_k, GROUP_M=8, PRECISION=fp32_dot_precision() if x.dtype == torch.float32 else "tf32",
                UPCAST=C.interpreter_bf16(x), num_warps=warps,
            )
        if save:
            ctx.save_for_backward(rows, weight, pre)
        ctx.kind, ctx.shape, ctx.bias_dtype = kind, x.shape, bias.dtype
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, weight, pre = ctx.saved_tensors
        m, n = pre.shape
        dy_rows = C.as_rows(dy, n)
        dpre = torch.empty_like(pre)
        block_m, block_n, warps = _elementwise_blocks(n)
        programs = C.reduction_programs(triton.cdiv(m, block_m), pre.device)
        partial = torch.zeros(programs, n, dtype=torch.float32, device=pre.device)
        if m:
            zero_bias = torch.zeros(n, dtype=pre.dtype, device=pre.device)  # pre already holds the bias
            _bias_act_bwd[(programs, triton.cdiv(n, block_n))](
                dy_rows, pre, zero_bias, dpre, partial, m, n, dy_rows.stride(0), pre.stride(0),
                ACT=ACT_IDS[ctx.kind], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
            )
        dx = (dpre @ weight).view(ctx.shape)
        dw = dpre.t() @ rows
        return dx, dw, partial.sum(0).to(ctx.bias_dtype), None


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, kind: str = "gelu") -> torch.Tensor:
    """act(x @ weight^T + bias) in one kernel (`weight` in nn.Linear's [out, in] layout); differentiable."""
    if kind not in ACT_IDS:
        raise ValueError(f"unknown activation {kind!r}; expected one of {tuple(ACT_IDS)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or bias.shape != weight.shape[:1]:
        raise ValueError(f"need x [*, K], weight [N, K], bias [N]; got {tuple(x.shape)}, {tuple(weight.shape)}, "
                         f"{tuple(bias.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    return LinearAct.apply(x, weight, bias, kind)
