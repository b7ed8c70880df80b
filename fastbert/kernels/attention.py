"""Flash attention over packed varlen QKV: online softmax, no [S, S] matrix in memory, forward and backward.

Limits: qkv `[T, 3, nH, D]` fp32/fp16/bf16 with a unit stride on D (any other strides), D <= 128 (any D: the
block is the next power of two >= 16, masked); cu_seqlens `[B + 1]` int32 with cu_seqlens[-1] == T; max_seqlen a
Python int >= every length (only the grid and the RNG offsets use it; no host sync). Output `[T, nH, D]` in qkv's
dtype. Softmax and accumulation in fp32 (fp32 inputs: TF32 dots where torch allows TF32, else IEEE). A query
only sees keys of its own sequence (bidirectional); empty sequences launch programs that exit at once, and no row is
left unwritten.
Dropout on the probabilities: Philox keep-mask from (seed + bh << 32, row * max_seqlen + col), regenerated in both
backward kernels, so max_seqlen <= 46340. Backward is deterministic: one kernel owns dK/dV per key block, another
dQ per query block (no atomics); the log-sum-exp per query row is the only softmax state saved.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import _common as C
from ._device import dot, dropout_keep
from .limits import MAX_HEAD_DIM, MAX_SEQLEN_DROPOUT, fp32_dot_precision

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(ptr, tok, rmask, d, D, stride_t):
    """A [BLOCK, BLOCK_D] tile of rows `tok` (int64) from a [*, D] view, 0 outside the rows / D."""
    return tl.load(ptr + tok[:, None] * stride_t + d[None, :], mask=rmask[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _program(max_seqlen, BLOCK: tl.constexpr):
    """(sequence, head, first row of the program's block) from the grid (B * blocks per sequence, nH): a sequence's
    blocks are adjacent on grid x, which takes 2^31 - 1 programs where y and z take 65,535."""
    blocks = tl.cdiv(max_seqlen, BLOCK)
    pid = tl.program_id(0)
    return pid // blocks, tl.program_id(1), (pid % blocks) * BLOCK


@triton.jit
def _seq_bounds(cu_ptr, b):
    start = tl.load(cu_ptr + b)
    return start, tl.load(cu_ptr + b + 1) - start


@triton.jit
def _rng_seed(seed, b, h, H):
    """One Philox key per (sequence, head): the base seed in the low word, the program's bh in the high word."""
    return seed.to(tl.int64) + ((b.to(tl.int64) * H + h) << 32)


def _grid(batch: int, max_seqlen: int, block: int, heads: int) -> tuple[int, int]:
    """(B * query or key blocks per sequence, nH): see _program."""
    return batch * -(-max_seqlen // block), heads


@triton.jit(do_not_specialize=["seed", "max_seqlen"])
def _attn_fwd(
    qkv_ptr,  # [T, 3, nH, D] at (stride_t, stride_3, stride_h, 1)
    cu_ptr,  # [B + 1] int32
    out_ptr,  # [T, nH, D] contiguous, qkv's dtype
    lse_ptr,  # [T, nH] fp32: log2-sum-exp2 of the scaled scores per query row
    stride_t,
    stride_3,
    stride_h,
    H,
    D: tl.constexpr,  # the head dim: constant, so the d < D masks fold away when D is a power of two
    max_seqlen,
    qk_scale,  # softmax scale * log2(e)
    p,
    keep_scale,
    seed,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STATS: tl.constexpr = True,  # store the log-sum-exp for a backward; inference leaves it out (lse_ptr unused)
):
    b, h, m0 = _program(max_seqlen, BLOCK_M)
    start, length = _seq_bounds(cu_ptr, b)
    if m0 >= length:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    rmask = rows < length
    d = tl.arange(0, BLOCK_D)
    base = qkv_ptr + h * stride_h
    q = _load_rows(base, (start + rows).to(tl.int64), rmask, d, D, stride_t)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    key_seed = _rng_seed(seed, b, h, H)
    for n0 in range(0, length, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < length
        ctok = (start + cols).to(tl.int64)
        k = _load_rows(base + stride_3, ctok, cmask, d, D, stride_t)
        v = _load_rows(base + 2 * stride_3, ctok, cmask, d, D, stride_t)
        s = dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N] fp32, log2 units
        s = tl.where(cmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 is valid in every launched program
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if DROPOUT:
            keep = dropout_keep(key_seed, rows[:, None] * max_seqlen + cols[None, :], p)
            pr = tl.where(keep, pr * keep_scale, 0.0)
        acc = acc * alpha[:, None] + dot(pr.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    out = acc / l_i[:, None]
    tok = (start + rows).to(tl.int64)
    o_ptr = out_ptr + tok[:, None] * (H * D) + h * D + d[None, :]
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (d < D)[None, :])
    if STATS:
        tl.store(lse_ptr + tok * H + h, m_i + tl.log2(l_i), mask=rmask)


@triton.jit
def _probs_and_dscores(
    q, k, v, do, lse, delta, rmask, cmask, rows, cols, key_seed, max_seqlen, qk_scale, p, keep_scale,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """For one [BLOCK_M, BLOCK_N] block: (dropped probs P*Z/(1-p), dS = P * (dP - delta)), both fp32, 0 off mask."""
    s = dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
    valid = rmask[:, None] & cmask[None, :]
    pr = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
    dp = dot(do, tl.trans(v), PRECISION, UPCAST)
    dropped = pr
    if DROPOUT:
        keep = dropout_keep(key_seed, rows[:, None] * max_seqlen + cols[None, :], p)
        dropped = tl.where(keep, pr * keep_scale, 0.0)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    return dropped, pr * (dp - delta[:, None])


@triton.jit(do_not_specialize=["seed", "max_seqlen"])
def _attn_bwd_dkdv(
    qkv_ptr,  # [T, 3, nH, D] at (stride_t, stride_3, stride_h, 1)
    cu_ptr,  # [B + 1] int32
    do_ptr,  # [T, nH, D] contiguous
    lse_ptr,  # [T, nH] fp32
    delta_ptr,  # [T, nH] fp32: rowsum(dO * O)
    dqkv_ptr,  # [T, 3, nH, D] contiguous; this kernel writes slots 1 (dK) and 2 (dV)
    stride_t,
    stride_3,
    stride_h,
    H,
    D: tl.constexpr,  # the head dim: constant, so the d < D masks fold away when D is a power of two
    max_seqlen,
    qk_scale,
    sm_scale,
    p,
    keep_scale,
    seed,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b, h, n0 = _program(max_seqlen, BLOCK_N)
    start, length = _seq_bounds(cu_ptr, b)
    if n0 >= length:
        return
    d = tl.arange(0, BLOCK_D)
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < length
    ctok = (start + cols).to(tl.int64)
    base = qkv_ptr + h * stride_h
    k = _load_rows(base + stride_3, ctok, cmask, d, D, stride_t)
    v = _load_rows(base + 2 * stride_3, ctok, cmask, d, D, stride_t)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    key_seed = _rng_seed(seed, b, h, H)
    for m0 in range(0, length, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < length
        tok = (start + rows).to(tl.int64)
        q = _load_rows(base, tok, rmask, d, D, stride_t)
        do = _load_rows(do_ptr + h * D, tok, rmask, d, D, H * D)
        lse = tl.load(lse_ptr + tok * H + h, mask=rmask, other=0.0)
        delta = tl.load(delta_ptr + tok * H + h, mask=rmask, other=0.0)
        dropped, ds = _probs_and_dscores(
            q, k, v, do, lse, delta, rmask, cmask, rows, cols, key_seed, max_seqlen, qk_scale, p, keep_scale,
            DROPOUT, PRECISION, UPCAST,
        )
        dv += dot(tl.trans(dropped.to(do.dtype)), do, PRECISION, UPCAST)
        dk += dot(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
    out = dqkv_ptr + ctok[:, None] * (3 * H * D) + h * D + d[None, :]
    mask = cmask[:, None] & (d < D)[None, :]
    tl.store(out + H * D, (dk * sm_scale).to(dqkv_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 2 * H * D, dv.to(dqkv_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed", "max_seqlen"])
def _attn_bwd_dq(
    qkv_ptr,  # [T, 3, nH, D] at (stride_t, stride_3, stride_h, 1)
    cu_ptr,  # [B + 1] int32
    do_ptr,  # [T, nH, D] contiguous
    lse_ptr,  # [T, nH] fp32
    delta_ptr,  # [T, nH] fp32
    dqkv_ptr,  # [T, 3, nH, D] contiguous; this kernel writes slot 0 (dQ)
    stride_t,
    stride_3,
    stride_h,
    H,
    D: tl.constexpr,  # the head dim: constant, so the d < D masks fold away when D is a power of two
    max_seqlen,
    qk_scale,
    sm_scale,
    p,
    keep_scale,
    seed,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b, h, m0 = _program(max_seqlen, BLOCK_M)
    start, length = _seq_bounds(cu_ptr, b)
    if m0 >= length:
        return
    d = tl.arange(0, BLOCK_D)
    rows = m0 + tl.arange(0, BLOCK_M)
    rmask = rows < length
    tok = (start + rows).to(tl.int64)
    base = qkv_ptr + h * stride_h
    q = _load_rows(base, tok, rmask, d, D, stride_t)
    do = _load_rows(do_ptr + h * D, tok, rmask, d, D, H * D)
    lse = tl.load(lse_ptr + tok * H + h, mask=rmask, other=0.0)
    delta = tl.load(delta_ptr + tok * H + h, mask=rmask, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    key_seed = _rng_seed(seed, b, h, H)
    for n0 in range(0, length, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < length
        ctok = (start + cols).to(tl.int64)
        k = _load_rows(base + stride_3, ctok, cmask, d, D, stride_t)
        v = _load_rows(base + 2 * stride_3, ctok, cmask, d, D, stride_t)
        _, ds = _probs_and_dscores(
            q, k, v, do, lse, delta, rmask, cmask, rows, cols, key_seed, max_seqlen, qk_scale, p, keep_scale,
            DROPOUT, PRECISION, UPCAST,
        )
        dq += dot(ds.to(k.dtype), k, PRECISION, UPCAST)
    out = dqkv_ptr + tok[:, None] * (3 * H * D) + h * D + d[None, :]
    tl.store(out, (dq * sm_scale).to(dqkv_ptr.dtype.element_ty), mask=rmask[:, None] & (d < D)[None, :])


def _blocks(head_dim: int, max_seqlen: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps): 64x64 tiles up to D=64, 64x32 above; never past the longest
    sequence (rounded up to 16, the smallest dot); 4 warps up to D=64, 8 above."""
    return _tiles(head_dim, max(16, C.next_power_of_2(max(max_seqlen, 1))))


@functools.cache
def _tiles(head_dim: int, cap: int) -> tuple[int, int, int, int]:
    """_blocks for a shape class: the head dim and the longest sequence's power of two (`cap`)."""
    block_d = C.feature_block(head_dim)
    block_m, block_n = (64, 64) if block_d <= 64 else (64, 32)
    return min(block_m, cap), min(block_n, cap), block_d, 4 if block_d <= 64 else 8


def _dot_modes(qkv: torch.Tensor) -> tuple[str, bool]:
    """(PRECISION, UPCAST) of the dots: TF32 for fp32 where torch allows it (16-bit inputs ignore it); fp32 operands
    for bf16 on the interpreter (see _device.dot)."""
    return fp32_dot_precision() if qkv.dtype == torch.float32 else "tf32", C.interpreter_bf16(qkv)


def _forward(
    qkv: torch.Tensor,  # [T, 3, nH, D], unit stride in D
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    max_seqlen: int,
    scale: float,
    lse: torch.Tensor | None = None,  # [T, nH] fp32 log-sum-exp to write, for the backward
    p: float = 0.0,
    seed: int = 0,
    keep: float = 1.0,  # the dropout keep scale (C.keep_scale(p))
    modes: tuple[str, bool] | None = None,  # _dot_modes(qkv), when the caller has them
) -> torch.Tensor:  # [T, nH, D]
    """One launch of the forward kernel: the training forward (lse, dropout) and the inference launcher share it."""
    total, _, heads, dim = qkv.shape
    out = torch.empty(total, heads, dim, dtype=qkv.dtype, device=qkv.device)
    batch = cu_seqlens.numel() - 1
    if total and batch and max_seqlen:
        block_m, block_n, block_d, warps = _blocks(dim, max_seqlen)
        precision, upcast = modes or _dot_modes(qkv)
        _attn_fwd[_grid(batch, max_seqlen, block_m, heads)](
            qkv, cu_seqlens, out, lse if lse is not None else out, qkv.stride(0), qkv.stride(1), qkv.stride(2),
            heads, dim, max_seqlen, scale * LOG2E, p, keep, seed, DROPOUT=p > 0,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision, UPCAST=upcast,
            STATS=lse is not None, num_warps=warps,
        )  # fmt: skip
    return out


class FlashAttention(torch.autograd.Function):
    """Saves qkv, the output and the fp32 log-sum-exp; probabilities are recomputed blockwise in backward."""

    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen: int, p: float, scale: float):
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        lse = torch.empty(qkv.shape[0], qkv.shape[2], dtype=torch.float32, device=qkv.device)
        seed = C.dropout_seed() if p > 0 else 0
        modes, keep = _dot_modes(qkv), C.keep_scale(p)
        out = _forward(qkv, cu_seqlens, max_seqlen, scale, lse, p, seed, keep, modes)
        ctx.save_for_backward(qkv, cu_seqlens, out, lse)
        ctx.args = (max_seqlen, p, keep, seed, scale, *modes)
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, cu_seqlens, out, lse = ctx.saved_tensors
        max_seqlen, p, keep, seed, scale, precision, upcast = ctx.args
        total, _, heads, dim = qkv.shape
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # [T, nH] = rowsum(dO * O) = rowsum(P * dP)
        dqkv = torch.empty(total, 3, heads, dim, dtype=qkv.dtype, device=qkv.device)
        batch = cu_seqlens.numel() - 1
        block_m, block_n, block_d, warps = _blocks(dim, max_seqlen)
        args = (
            qkv, cu_seqlens, dout, lse, delta, dqkv, qkv.stride(0), qkv.stride(1), qkv.stride(2), heads, dim,
            max_seqlen, scale * LOG2E, scale, p, keep, seed,
        )
        meta = dict(
            DROPOUT=p > 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision, UPCAST=upcast
        )
        if total and batch and max_seqlen:
            _attn_bwd_dkdv[_grid(batch, max_seqlen, block_n, heads)](*args, **meta, num_warps=warps)
            _attn_bwd_dq[_grid(batch, max_seqlen, block_m, heads)](*args, **meta, num_warps=warps)
        return dqkv, None, None, None, None


def attention(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Varlen bidirectional attention over packed QKV `[T, 3, nH, D]` -> `[T, nH, D]`; differentiable in qkv."""
    p, scale = _check(qkv, cu_seqlens, max_seqlen, dropout_p, training, scale)
    if torch.compiler.is_compiling():
        return _attention_op(qkv, cu_seqlens, int(max_seqlen), p, scale)[0]
    return C.apply(FlashAttention, qkv, cu_seqlens, int(max_seqlen), p, scale)


def _check(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float, training: bool,
    scale: float | None,
) -> tuple[float, float]:  # fmt: skip
    """The call's limits; (dropout probability in effect, softmax scale)."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be [T, 3, nH, D], got {tuple(qkv.shape)}")
    if qkv.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {qkv.shape[-1]} > {MAX_HEAD_DIM} is not supported by the Triton kernel")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor [B + 1]")
    C.check_dropout(dropout_p)
    p = dropout_p if training else 0.0
    if p > 0 and max_seqlen > MAX_SEQLEN_DROPOUT:
        raise ValueError(f"attention dropout needs max_seqlen <= {MAX_SEQLEN_DROPOUT}, got {max_seqlen}")
    return p, float(scale if scale is not None else 1.0 / math.sqrt(qkv.shape[-1]))


def attention_inference(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Varlen attention `[T, 3, nH, D]` -> `[T, nH, D]`, forward kernel only: no autograd Function, no log-sum-exp
    written, dropout ignored (inference), launch blocks from the cached rule."""
    if torch.compiler.is_compiling():  # a Triton launch in a traced graph goes through the custom op
        return attention(qkv, cu_seqlens, max_seqlen, scale=scale)
    _, scale = _check(qkv, cu_seqlens, max_seqlen, 0.0, False, scale)
    return _forward(qkv if qkv.stride(-1) == 1 else qkv.contiguous(), cu_seqlens, max_seqlen, scale)


# torch.compile: the kernels as custom ops. The forward op returns what the backward op needs besides the inputs
# (the output, the fp32 log-sum-exp, the dropout seed); the backward op is registered as its gradient.
@torch.library.custom_op("fastbert::triton_attention", mutates_args=())
def _attention_op(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, p: float, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ctx = C.Saved()
    out = FlashAttention.forward(ctx, qkv, cu_seqlens, max_seqlen, p, scale)
    return out, ctx.saved_tensors[3], C.seed_tensor(ctx.args[3])


@_attention_op.register_fake
def _(qkv, cu_seqlens, max_seqlen, p, scale):
    total, _, heads, dim = qkv.shape
    return (qkv.new_empty(total, heads, dim), qkv.new_empty(total, heads, dtype=torch.float32),
            torch.empty(1, dtype=torch.int64))  # fmt: skip


@torch.library.custom_op("fastbert::triton_attention_backward", mutates_args=())
def _attention_backward_op(
    dout: torch.Tensor, qkv: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    seed: torch.Tensor, max_seqlen: int, p: float, scale: float,
) -> torch.Tensor:  # fmt: skip
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    args = (max_seqlen, p, C.keep_scale(p), int(seed.item()), scale, *_dot_modes(qkv))
    return FlashAttention.backward(C.Saved((qkv, cu_seqlens, out, lse), args=args), dout)[0]


@_attention_backward_op.register_fake
def _(dout, qkv, cu_seqlens, out, lse, seed, max_seqlen, p, scale):
    return qkv.new_empty(qkv.shape)


def _attention_setup(ctx, inputs, output) -> None:
    qkv, cu_seqlens, ctx.max_seqlen, ctx.p, ctx.scale = inputs
    out, lse, seed = output
    ctx.save_for_backward(qkv, cu_seqlens, out, lse, seed)


def _attention_grad(ctx, dout, *_):
    dqkv = _attention_backward_op(dout, *ctx.saved_tensors, ctx.max_seqlen, ctx.p, ctx.scale)
    return dqkv, None, None, None, None


_attention_op.register_autograd(_attention_grad, setup_context=_attention_setup)
