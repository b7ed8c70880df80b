"""LayerNorm(dropout(x + bias) + residual): the epilogue of every BERT sub-layer, forward and backward in one pass.

Limits: x, residual `[*, N]` fp32/fp16/bf16 (any strides; rows flattened), N <= 16384 (a whole row sits in
registers); bias, ln weight/bias `[N]` of any float dtype. Statistics in fp32, one cast to x's dtype on store.
Dropout: Philox keep-mask from (seed, row * N + col), regenerated in backward, so at most 2**31 elements per call.
Backward recomputes h = dropout(x + bias) + residual from the saved inputs and fp32 (mean, rstd) per row; weight and
bias grads are per-program fp32 partial rows summed afterwards (deterministic, no atomics).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _common as C
from . import tuning
from ._device import dropout_keep, layernorm_tile, layernorm_tile_bwd


@triton.jit
def _hidden(x_ptr, res_ptr, b, rows, cols, mask, N, stride_x, stride_r, p, scale, seed, DROPOUT: tl.constexpr):
    """h = dropout(x + bias) + residual on a [BLOCK_M, BLOCK_N] tile, fp32, 0 outside mask; and the keep-mask."""
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32) + b[None, :]
    keep = mask
    if DROPOUT:
        keep = mask & dropout_keep(seed, rows[:, None] * N + cols[None, :], p)
        x = tl.where(keep, x * scale, 0.0)
    res = tl.load(res_ptr + r64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, x + res, 0.0), keep


@triton.jit(do_not_specialize=["seed"])
def _brln_fwd(
    x_ptr,  # [M, N] rows at stride_x, unit feature stride
    bias_ptr,  # [N]
    res_ptr,  # [M, N] rows at stride_r
    w_ptr,  # [N] LayerNorm weight
    lnb_ptr,  # [N] LayerNorm bias
    y_ptr,  # [M, N] contiguous, x's dtype
    mean_ptr,  # [M] fp32
    rstd_ptr,  # [M] fp32
    M,
    N,
    stride_x,
    stride_r,
    eps,
    p,
    scale,
    seed,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STATS: tl.constexpr = True,  # store (mean, rstd) for a backward; inference leaves them out (pointers unused)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    mask = rmask[:, None] & cmask[None, :]
    b = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    lnb = tl.load(lnb_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    h, _ = _hidden(x_ptr, res_ptr, b, rows, cols, mask, N, stride_x, stride_r, p, scale, seed, DROPOUT)
    y, mean, rstd = layernorm_tile(h, mask, w, lnb, N, eps)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(mean_ptr + rows, mean, mask=rmask)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit(do_not_specialize=["seed"])
def _brln_bwd(
    dy_ptr,  # [M, N] rows at stride_dy
    x_ptr,  # [M, N] rows at stride_x
    bias_ptr,  # [N]
    res_ptr,  # [M, N] rows at stride_r
    w_ptr,  # [N]
    mean_ptr,  # [M] fp32
    rstd_ptr,  # [M] fp32
    dx_ptr,  # [M, N] contiguous, x's dtype
    dres_ptr,  # [M, N] contiguous, residual's dtype
    dparts_ptr,  # [3, G, N] fp32 partial rows per program: d(bias), d(ln weight), d(ln bias)
    M,
    N,
    stride_dy,
    stride_x,
    stride_r,
    p,
    scale,
    seed,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    b = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dbias = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dlnb = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, programs * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        h, keep = _hidden(x_ptr, res_ptr, b, rows, cols, mask, N, stride_x, stride_r, p, scale, seed, DROPOUT)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        g = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dh = layernorm_tile_bwd(g, xhat, rstd, w, N)
        dx = dh
        if DROPOUT:
            dx = tl.where(keep, dh * scale, 0.0)
        tl.store(dres_ptr + r64 * N + cols[None, :], dh.to(dres_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + r64 * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dbias += tl.where(mask, dx, 0.0)
        dw += g * xhat
        dlnb += g
    part = pid * N + cols
    tl.store(dparts_ptr + part, tl.sum(dbias, axis=0), mask=cmask)
    tl.store(dparts_ptr + programs * N + part, tl.sum(dw, axis=0), mask=cmask)
    tl.store(dparts_ptr + 2 * programs * N + part, tl.sum(dlnb, axis=0), mask=cmask)


@functools.cache
def _blocks(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): the whole row, as many rows as fill the tile."""
    block_n = C.feature_block(n)
    block_m = C.rows_per_program(block_n)
    return block_m, block_n, C.warps_for(block_m * block_n)


_rule = tuning.row_rule(_blocks)  # where no measured table entry fits


def _forward(
    xr: torch.Tensor,  # [M, N] rows
    bias: torch.Tensor,  # [N]
    rr: torch.Tensor,  # [M, N] rows
    ln_weight: torch.Tensor,  # [N]
    ln_bias: torch.Tensor,  # [N]
    eps: float,
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,  # fp32 (mean, rstd) [M] to write, for the backward
    p: float = 0.0,
    seed: int = 0,
    keep: float = 1.0,  # the dropout keep scale (C.keep_scale(p))
) -> torch.Tensor:  # [M, N]
    """One launch of the forward kernel: the training forward (stats, dropout) and the inference launcher share it."""
    m, n = xr.shape
    y = torch.empty(xr.shape, dtype=xr.dtype, device=xr.device)
    if m:
        block_m, block_n, warps, stages = tuning.settings(
            "bias_residual_layernorm", xr.device, xr.dtype, n, 1 << (m - 1).bit_length(), _rule)
        mean, rstd = stats if stats is not None else (y, y)
        _brln_fwd[(-(-m // block_m),)](
            xr, bias, rr, ln_weight, ln_bias, y, mean, rstd, m, n, xr.stride(0), rr.stride(0), eps, p,
            keep, seed, DROPOUT=p > 0, BLOCK_M=block_m, BLOCK_N=block_n,
            STATS=stats is not None, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return y


class BiasResidualLayerNorm(torch.autograd.Function):
    """Saves x, residual, the parameters and fp32 (mean, rstd); h is recomputed in backward."""

    @staticmethod
    def forward(ctx, x, bias, residual, ln_weight, ln_bias, eps: float, p: float):
        n = x.shape[-1]
        xr, rr = C.as_rows(x, n), C.as_rows(residual, n)
        mean = torch.empty(xr.shape[0], dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        seed, keep = (C.dropout_seed(), C.keep_scale(p)) if p > 0 else (0, 1.0)
        y = _forward(xr, bias, rr, ln_weight, ln_bias, eps, (mean, rstd), p, seed, keep)
        ctx.save_for_backward(xr, bias, rr, ln_weight, ln_bias, mean, rstd)
        ctx.p, ctx.scale, ctx.seed, ctx.shape, ctx.res_dtype = p, keep, seed, x.shape, residual.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        xr, bias, rr, ln_weight, ln_bias, mean, rstd = ctx.saved_tensors
        m, n = xr.shape
        dyr = C.as_rows(dy, n)
        dx = torch.empty(xr.shape, dtype=xr.dtype, device=xr.device)
        dres = torch.empty(xr.shape, dtype=ctx.res_dtype, device=xr.device)
        block_m, block_n, warps = _blocks(n)
        programs = C.reduction_programs(C.cdiv(m, block_m), xr.device)
        parts = torch.zeros(3, programs, n, dtype=torch.float32, device=xr.device)
        if m:
            _brln_bwd[(programs,)](
                dyr, xr, bias, rr, ln_weight, mean, rstd, dx, dres, parts, m, n, dyr.stride(0), xr.stride(0),
                rr.stride(0), ctx.p, ctx.scale, ctx.seed, DROPOUT=ctx.p > 0, BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=warps,
            )
        dbias, dw, dlnb = parts.sum(1).unbind(0)
        shape = ctx.shape
        return (
            dx.view(shape), dbias.to(bias.dtype), dres.view(shape), dw.to(ln_weight.dtype), dlnb.to(ln_bias.dtype),
            None, None,
        )


def bias_residual_layernorm(
    x: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """LayerNorm(dropout(x + bias) + residual), fused; differentiable in every tensor argument."""
    _check(x, bias, residual, ln_weight, ln_bias, dropout_p)
    p = dropout_p if training else 0.0
    if torch.compiler.is_compiling():
        return _brln_op(x, bias, residual, ln_weight, ln_bias, eps, p)[0]
    return C.apply(BiasResidualLayerNorm, x, bias, residual, ln_weight, ln_bias, eps, p)


def _check(
    x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
    dropout_p: float,
) -> None:  # fmt: skip
    n = x.shape[-1]
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}")
    for name, t in (("bias", bias), ("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")
    C.check_dropout(dropout_p)


def bias_residual_layernorm_inference(
    x: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """LayerNorm(x + bias + residual), forward kernel only: no autograd Function, no (mean, rstd) written, dropout
    ignored (inference), launch blocks from the cached rule."""
    if torch.compiler.is_compiling():  # a Triton launch in a traced graph goes through the custom op
        return bias_residual_layernorm(x, bias, residual, ln_weight, ln_bias, eps)
    _check(x, bias, residual, ln_weight, ln_bias, dropout_p)
    n = x.shape[-1]
    return _forward(C.as_rows(x, n), bias, C.as_rows(residual, n), ln_weight, ln_bias, eps).view(x.shape)


# torch.compile: the kernels as custom ops. The forward op returns what the backward op needs besides the inputs
# (fp32 mean and rstd, the dropout seed); the backward op is registered as its gradient.
@torch.library.custom_op("fastbert::triton_bias_residual_layernorm", mutates_args=())
def _brln_op(
    x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
    eps: float, p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    ctx = C.Saved()
    y = BiasResidualLayerNorm.forward(ctx, x, bias, residual, ln_weight, ln_bias, eps, p)
    mean, rstd = ctx.saved_tensors[-2:]
    return y, mean, rstd, C.seed_tensor(ctx.seed)


@_brln_op.register_fake
def _(x, bias, residual, ln_weight, ln_bias, eps, p):
    rows = x.numel() // x.shape[-1]
    stats = x.new_empty(rows, dtype=torch.float32)
    return x.new_empty(x.shape), stats, torch.empty_like(stats), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("fastbert::triton_bias_residual_layernorm_backward", mutates_args=())
def _brln_backward_op(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, ln_weight: torch.Tensor,
    ln_bias: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, seed: torch.Tensor, p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    n = x.shape[-1]
    saved = (C.as_rows(x, n), bias, C.as_rows(residual, n), ln_weight, ln_bias, mean, rstd)
    ctx = C.Saved(saved, p=p, scale=C.keep_scale(p), seed=int(seed.item()), shape=x.shape, res_dtype=residual.dtype)
    dx, dbias, dres, dw, dlnb = BiasResidualLayerNorm.backward(ctx, dy)[:5]
    return dx, dbias.clone(), dres, dw.clone(), dlnb.clone()  # views of one buffer; an op's outputs may not alias


@_brln_backward_op.register_fake
def _(dy, x, bias, residual, ln_weight, ln_bias, mean, rstd, seed, p):
    return tuple(t.new_empty(t.shape) for t in (x, bias, residual, ln_weight, ln_bias))


def _brln_setup(ctx, inputs, output) -> None:
    x, bias, residual, ln_weight, ln_bias, _, ctx.p = inputs
    _, mean, rstd, seed = output
    ctx.save_for_backward(x, bias, residual, ln_weight, ln_bias, mean, rstd, seed)


def _brln_grad(ctx, dy, *_):
    return (*_brln_backward_op(dy, *ctx.saved_tensors, ctx.p), None, None)


_brln_op.register_autograd(_brln_grad, setup_context=_brln_setup)
