"""Flash attention over packed varlen QKV: online softmax, no [S, S] matrix in memory, forward and backward.

Limits: qkv `[T, 3, nH, D]` fp32/fp16/bf16 with a unit stride on D (any other strides), D <= 128 (any D: the
block is the next power of two >= 16, masked); cu_seqlens `[B + 1]` int32 with cu_seqlens[-1] == T; max_seqlen a
Python int >= every length (only the grid and the RNG offsets use it; no host sync). Output `[T, nH, D]` in qkv's
dtype. Softmax and accumulation in fp32 (fp32 inputs: TF32 dots where torch allows TF32, else IEEE). A query
only sees keys of its own sequence (bidirectional); empty sequences launch programs that exit at once, and no row is
left unwritten.
Relative positions (MPNet's `position_bias` table by distance, DeBERTa's `position_scores` gathered by column):
added to the scores in the tile loop, never an [S, S] tensor; fastbert/kernels/attention_positions.py says how, and
how their gradients are summed deterministically. Rotary positions and sliding windows: applied as q and k are loaded,
and by skipping the blocks outside the window (fastbert/kernels/attention_rotary.py).
Dropout on the probabilities: Philox keep-mask from (seed + bh << 32, row * max_seqlen + col), regenerated in both
backward kernels, so max_seqlen <= 46340. Backward is deterministic: one kernel owns dK/dV per key block, another
dQ per query block (no atomics but the position scores' ordered adds); the log-sum-exp per query row is the only
softmax state saved.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import _common as C
from . import tuning
from ._device import dot, dropout_keep
from .attention_positions import LOG2E, add_by_column, bias_tile, distance_sums, scores_tile
from .attention_rotary import check_rotary, load_qk, load_rows, rotary_args, span, unrotate
from .limits import MAX_HEAD_DIM, MAX_POSITION_COLUMNS, MAX_SEQLEN_DROPOUT, fp32_dot_precision

_LOG2E = tl.constexpr(LOG2E)  # the kernels' copy (a jit function reads module globals only as constexprs)


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
    bias_ptr,  # [nH, 2R + 1] fp32 contiguous position bias (BIAS; else unused)
    radius,  # R
    scores_ptr,  # [2, nH, T, W] at (stride_side, stride_head, stride_tok, 1): position scores (SCORES; else unused)
    columns_ptr,  # [2R' + 1] int32 contiguous: the column of each clamped key - query distance (SCORES)
    score_radius,  # R'
    width,  # W
    stride_side,
    stride_head,
    stride_tok,
    rot_ptr,  # [2, T, R/2] fp32 at (rot_side, rot_tok, 1): cos and sin per token and rotated pair (ROTARY)
    half,  # R/2
    rot_side,
    rot_tok,
    window,  # keys within this distance of the query (WINDOW)
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    STATS: tl.constexpr = True,  # store the log-sum-exp for a backward; inference leaves it out (lse_ptr unused)
    BIAS: tl.constexpr = False,  # add position_bias[h, clamp(j - i, -R, R) + R] to the scores
    SCORES: tl.constexpr = False,  # add position_scores[0, h, i, c] + position_scores[1, h, j, c] to the scores
    ROTARY: tl.constexpr = False,  # rotate q and k as they are loaded
    WINDOW: tl.constexpr = False,  # only the key blocks within `window` of the query block, the others masked
):
    b, h, m0 = _program(max_seqlen, BLOCK_M)
    start, length = _seq_bounds(cu_ptr, b)
    if m0 >= length:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    rmask = rows < length
    d = tl.arange(0, BLOCK_D)
    base = qkv_ptr + h * stride_h
    tok = (start + rows).to(tl.int64)
    q = load_qk(base, tok, rmask, d, D, stride_t, rot_ptr, half, rot_side, rot_tok, ROTARY)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    key_seed = _rng_seed(seed, b, h, H)
    lo, hi = span(m0, BLOCK_M, length, window, BLOCK_N, WINDOW)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < length
        ctok = (start + cols).to(tl.int64)
        k = load_qk(base + stride_3, ctok, cmask, d, D, stride_t, rot_ptr, half, rot_side, rot_tok, ROTARY)
        v = load_rows(base + 2 * stride_3, ctok, cmask, d, D, stride_t)
        s = dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N] fp32, log2 units
        if BIAS:
            s += bias_tile(bias_ptr, h, radius, rows, cols)
        if SCORES:
            s += scores_tile(scores_ptr, columns_ptr, h, tok, ctok, rows, cols, rmask[:, None] & cmask[None, :],
                              score_radius, width, stride_side, stride_head, stride_tok)  # fmt: skip
        keys = cmask[None, :]
        if WINDOW:
            keys = keys & (tl.abs(cols[None, :] - rows[:, None]) <= window)
        s = tl.where(keys, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite without a window: key 0 is valid in every program
        if WINDOW:  # a row may see no key of a block yet: exponents against 0, not -inf - -inf
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if DROPOUT:
            keep = dropout_keep(key_seed, rows[:, None] * max_seqlen + cols[None, :], p)
            pr = tl.where(keep, pr * keep_scale, 0.0)
        acc = acc * alpha[:, None] + dot(pr.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptr = out_ptr + tok[:, None] * (H * D) + h * D + d[None, :]
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (d < D)[None, :])
    if STATS:
        tl.store(lse_ptr + tok * H + h, m_i + tl.log2(l_i), mask=rmask)


@triton.jit
def _probs_and_dscores(
    q, k, v, do, lse, delta, rmask, cmask, rows, cols, tok, ctok, key_seed, max_seqlen, qk_scale, p, keep_scale,
    bias_ptr, h, radius, scores_ptr, columns_ptr, score_radius, width, stride_side, stride_head, stride_tok, window,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BIAS: tl.constexpr, SCORES: tl.constexpr,
    WINDOW: tl.constexpr,
):  # fmt: skip
    """For one [BLOCK_M, BLOCK_N] block: (dropped probs P*Z/(1-p), dS = P * (dP - delta)), both fp32, 0 off mask. dS is
    the gradient of the score in natural units (q.k * scale + bias + position scores): dQ, dK take it times the scale,
    the bias and the position scores as is."""
    s = dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
    if BIAS:
        s += bias_tile(bias_ptr, h, radius, rows, cols)
    valid = rmask[:, None] & cmask[None, :]
    if SCORES:
        s += scores_tile(scores_ptr, columns_ptr, h, tok, ctok, rows, cols, valid, score_radius, width, stride_side,
                          stride_head, stride_tok)  # fmt: skip
    if WINDOW:
        valid = valid & (tl.abs(cols[None, :] - rows[:, None]) <= window)
    pr = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
    dp = dot(do, tl.trans(v), PRECISION, UPCAST)
    dropped = pr
    if DROPOUT:
        keep = dropout_keep(key_seed, rows[:, None] * max_seqlen + cols[None, :], p)
        dropped = tl.where(keep, pr * keep_scale, 0.0)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    return dropped, pr * (dp - delta[:, None])


@triton.jit(do_not_specialize=["seed", "max_seqlen", "total"])
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
    bias_ptr,  # [nH, 2R + 1] fp32 contiguous (BIAS; else unused)
    radius,  # R
    scores_ptr,  # [2, nH, T, W] at (stride_side, stride_head, stride_tok, 1) (SCORES; else unused)
    columns_ptr,  # [2R' + 1] int32 contiguous (SCORES)
    score_radius,  # R'
    width,  # W
    stride_side,
    stride_head,
    stride_tok,
    total,  # T
    dscores_ptr,  # [2, nH, T, W] fp32 contiguous zeros: this kernel adds its side's gradient (SCORES_GRAD)
    rot_ptr,  # [2, T, R/2] fp32 (ROTARY): as _attn_fwd's
    half,
    rot_side,
    rot_tok,
    window,  # (WINDOW)
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BIAS: tl.constexpr = False,
    SCORES: tl.constexpr = False,
    ROTARY: tl.constexpr = False,  # q and k rotated as loaded: dK is the rotated key's gradient (unrotated after)
    WINDOW: tl.constexpr = False,
    SCORES_GRAD: tl.constexpr = False,  # add the key side's gradient (side 1) to dscores_ptr
    BLOCK_T: tl.constexpr = 1,  # next_power_of_2(BLOCK_M + BLOCK_N - 1): the diagonals of a tile (SCORES_GRAD)
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
    k = load_qk(base + stride_3, ctok, cmask, d, D, stride_t, rot_ptr, half, rot_side, rot_tok, ROTARY)
    v = load_rows(base + 2 * stride_3, ctok, cmask, d, D, stride_t)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    key_seed = _rng_seed(seed, b, h, H)
    if SCORES_GRAD:
        key_rows = dscores_ptr + ((H + h).to(tl.int64) * total + ctok) * width  # [BLOCK_N]: side 1
    lo, hi = span(n0, BLOCK_N, length, window, BLOCK_M, WINDOW)
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < length
        tok = (start + rows).to(tl.int64)
        q = load_qk(base, tok, rmask, d, D, stride_t, rot_ptr, half, rot_side, rot_tok, ROTARY)
        do = load_rows(do_ptr + h * D, tok, rmask, d, D, H * D)
        lse = tl.load(lse_ptr + tok * H + h, mask=rmask, other=0.0)
        delta = tl.load(delta_ptr + tok * H + h, mask=rmask, other=0.0)
        dropped, ds = _probs_and_dscores(
            q, k, v, do, lse, delta, rmask, cmask, rows, cols, tok, ctok, key_seed, max_seqlen, qk_scale, p,
            keep_scale, bias_ptr, h, radius, scores_ptr, columns_ptr, score_radius, width, stride_side, stride_head,
            stride_tok, window, DROPOUT, PRECISION, UPCAST, BIAS, SCORES, WINDOW,
        )  # fmt: skip
        dv += dot(tl.trans(dropped.to(do.dtype)), do, PRECISION, UPCAST)
        dk += dot(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
        if SCORES_GRAD:  # key n0 + a, query m0 + b: diagonal t = b - a + BLOCK_N - 1 is at n0 - m0 + BLOCK_N - 1 - t
            add_by_column(tl.trans(ds), n0 - m0 + BLOCK_N - 1, key_rows, cmask, columns_ptr, score_radius, width, True,
                           BLOCK_N, BLOCK_M, BLOCK_T)  # fmt: skip
    out = dqkv_ptr + ctok[:, None] * (3 * H * D) + h * D + d[None, :]
    mask = cmask[:, None] & (d < D)[None, :]
    tl.store(out + H * D, (dk * sm_scale).to(dqkv_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 2 * H * D, dv.to(dqkv_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed", "max_seqlen", "total"])
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
    bias_ptr,  # [nH, 2R + 1] fp32 contiguous (BIAS; else unused)
    radius,  # R
    scores_ptr,  # [2, nH, T, W] at (stride_side, stride_head, stride_tok, 1) (SCORES; else unused)
    columns_ptr,  # [2R' + 1] int32 contiguous (SCORES)
    score_radius,  # R'
    width,  # W
    stride_side,
    stride_head,
    stride_tok,
    total,  # T
    dscores_ptr,  # [2, nH, T, W] fp32 contiguous zeros: this kernel adds its side's gradient (SCORES_GRAD)
    rot_ptr,  # [2, T, R/2] fp32 (ROTARY): as _attn_fwd's
    half,
    rot_side,
    rot_tok,
    window,  # (WINDOW)
    dbias_ptr,  # [grid x, nH, 2W + 1] fp32 zeros: this program's distance-bin sums of dS go to its row (BIAS_GRAD)
    grad_radius,  # W = min(R, max_seqlen - 1)
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BIAS: tl.constexpr = False,
    BIAS_GRAD: tl.constexpr = False,
    SCORES: tl.constexpr = False,
    ROTARY: tl.constexpr = False,  # q and k rotated as loaded: dQ is the rotated query's gradient (unrotated after)
    WINDOW: tl.constexpr = False,
    SCORES_GRAD: tl.constexpr = False,  # add the query side's gradient (side 0) to dscores_ptr
    BLOCK_T: tl.constexpr = 1,  # next_power_of_2(BLOCK_M + BLOCK_N - 1): a tile's diagonals (BIAS_GRAD, SCORES_GRAD)
    BLOCK_W: tl.constexpr = 1,  # next_power_of_2(2W + 1): the distance bins (BIAS_GRAD)
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
    q = load_qk(base, tok, rmask, d, D, stride_t, rot_ptr, half, rot_side, rot_tok, ROTARY)
    do = load_rows(do_ptr + h * D, tok, rmask, d, D, H * D)
    lse = tl.load(lse_ptr + tok * H + h, mask=rmask, other=0.0)
    delta = tl.load(delta_ptr + tok * H + h, mask=rmask, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if BIAS_GRAD:
        dbias = tl.zeros((BLOCK_W,), dtype=tl.float32)
    key_seed = _rng_seed(seed, b, h, H)
    if SCORES_GRAD:
        query_rows = dscores_ptr + (h.to(tl.int64) * total + tok) * width  # [BLOCK_M]: side 0
    lo, hi = span(m0, BLOCK_M, length, window, BLOCK_N, WINDOW)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < length
        ctok = (start + cols).to(tl.int64)
        k = load_qk(base + stride_3, ctok, cmask, d, D, stride_t, rot_ptr, half, rot_side, rot_tok, ROTARY)
        v = load_rows(base + 2 * stride_3, ctok, cmask, d, D, stride_t)
        _, ds = _probs_and_dscores(
            q, k, v, do, lse, delta, rmask, cmask, rows, cols, tok, ctok, key_seed, max_seqlen, qk_scale, p,
            keep_scale, bias_ptr, h, radius, scores_ptr, columns_ptr, score_radius, width, stride_side, stride_head,
            stride_tok, window, DROPOUT, PRECISION, UPCAST, BIAS, SCORES, WINDOW,
        )  # fmt: skip
        dq += dot(ds.to(k.dtype), k, PRECISION, UPCAST)
        if BIAS_GRAD:
            dbias += distance_sums(ds, m0, n0, grad_radius, BLOCK_M, BLOCK_N, BLOCK_T, BLOCK_W)
        if SCORES_GRAD:
            add_by_column(ds, n0 - m0 - (BLOCK_M - 1), query_rows, rmask, columns_ptr, score_radius, width, False,
                           BLOCK_M, BLOCK_N, BLOCK_T)  # fmt: skip
    out = dqkv_ptr + tok[:, None] * (3 * H * D) + h * D + d[None, :]
    tl.store(out, (dq * sm_scale).to(dqkv_ptr.dtype.element_ty), mask=rmask[:, None] & (d < D)[None, :])
    if BIAS_GRAD:
        w = tl.arange(0, BLOCK_W)
        row = dbias_ptr + (tl.program_id(0) * H + h).to(tl.int64) * (2 * grad_radius + 1)
        tl.store(row + w, dbias, mask=w <= 2 * grad_radius)


def _blocks(head_dim: int, max_seqlen: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps): 64x64 tiles up to D=64, 64x32 above; never past the longest
    sequence (rounded up to 16, the smallest dot); 4 warps up to D=64, 8 above."""
    return _tiles(head_dim, max(16, C.next_power_of_2(max(max_seqlen, 1))))


@functools.cache
def _tiles(head_dim: int, cap: int) -> tuple[int, int, int, int]:
    """_blocks for a shape class: the head dim and the longest sequence's power of two (`cap`)."""
    block_d = C.feature_block(head_dim)
    block_m, block_n = (64, 64) if block_d <= 64 else (64, 32)  # at most MAX_DIAGONALS diagonals (int32 ranks)
    return min(block_m, cap), min(block_n, cap), block_d, 4 if block_d <= 64 else 8


def _rule(head_dim: int, cap: int) -> tuning.Launch:
    """The fallback where no measured table entry fits: _tiles' blocks and warps, Triton's default pipelining."""
    block_m, block_n, _, warps = _tiles(head_dim, cap)
    return block_m, block_n, warps, None


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
    bias: torch.Tensor | None = None,  # [nH, 2R + 1] fp32 contiguous position bias (checked by _check)
    scores: torch.Tensor | None = None,  # [2, nH, T, W] position scores, unit stride on W (checked by _check)
    columns: torch.Tensor | None = None,  # [2R + 1] int32 contiguous (with scores)
    rotary: torch.Tensor | None = None,  # [2, T, R/2] fp32, unit stride on R/2 (checked by _check)
    window: int | None = None,
) -> torch.Tensor:  # [T, nH, D]
    """One launch of the forward kernel: the training forward (lse, dropout) and the inference launcher share it."""
    total, _, heads, dim = qkv.shape
    out = torch.empty(total, heads, dim, dtype=qkv.dtype, device=qkv.device)
    batch = cu_seqlens.numel() - 1
    if total and batch and max_seqlen:
        cap = max(16, 1 << (max_seqlen - 1).bit_length())  # the longest sequence's power of two: a shape class
        block_m, block_n, warps, stages = tuning.settings("attention", qkv.device, qkv.dtype, dim, cap, _rule)
        block_m, block_n, block_d = min(block_m, cap), min(block_n, cap), max(16, 1 << (dim - 1).bit_length())
        precision, upcast = modes or _dot_modes(qkv)
        # the tables and their R, or stand-ins the kernel never reads (BIAS, SCORES off); inline: this runs every launch
        bias_ptr, radius = (bias, (bias.shape[1] - 1) // 2) if bias is not None else (qkv, 0)
        score_args = _score_args(scores, columns) if scores is not None else (qkv, qkv, 0, 1, 0, 0, 0)
        _attn_fwd[_grid(batch, max_seqlen, block_m, heads)](
            qkv, cu_seqlens, out, lse if lse is not None else out, qkv.stride(0), qkv.stride(1), qkv.stride(2),
            heads, dim, max_seqlen, scale * LOG2E, p, keep, seed, bias_ptr, radius, *score_args,
            *rotary_args(qkv, rotary, window), DROPOUT=p > 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            PRECISION=precision, UPCAST=upcast, STATS=lse is not None, BIAS=bias is not None,
            SCORES=scores is not None, ROTARY=rotary is not None, WINDOW=window is not None, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    return out


def _score_args(scores: torch.Tensor, columns: torch.Tensor) -> tuple:
    """The kernels' position-score arguments: (scores, columns, R, W, the side, head and token strides)."""
    return (scores, columns, (columns.numel() - 1) // 2, scores.shape[3], *scores.stride()[:3])


def _backward(
    dout: torch.Tensor,
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    scores: torch.Tensor | None,
    columns: torch.Tensor | None,
    args: tuple,  # FlashAttention's ctx.args: (max_seqlen, p, keep, seed, scale, precision, upcast)
    bias_grad: bool,
    scores_grad: bool,
    rotary: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dqkv, d position_bias or None unless `bias_grad`, d position_scores or None unless `scores_grad`): the dK/dV
    kernel, then the dQ kernel. The dQ kernel writes the bias gradient's per-program partial rows, summed here; each
    kernel adds its side of the scores gradient to an fp32 buffer, cast to the scores' dtype here (deterministic)."""
    max_seqlen, p, keep, seed, scale, precision, upcast = args
    total, _, heads, dim = qkv.shape
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1)  # [T, nH] = rowsum(dO * O) = rowsum(P * dP)
    dqkv = torch.empty(total, 3, heads, dim, dtype=qkv.dtype, device=qkv.device)
    bias_grad = bias_grad and bias is not None
    dbias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias_grad else None
    scores_grad = scores_grad and scores is not None
    dscores = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device) if scores_grad else None
    batch = cu_seqlens.numel() - 1
    if not (total and batch and max_seqlen):
        return dqkv, dbias, dscores if dscores is None else dscores.to(scores.dtype)
    block_m, block_n, block_d, warps = _blocks(dim, max_seqlen)
    bias_ptr, radius = (bias, (bias.shape[1] - 1) // 2) if bias is not None else (qkv, 0)  # as in _forward
    score_args = _score_args(scores, columns) if scores is not None else (qkv, qkv, 0, 1, 0, 0, 0)
    args = (
        qkv, cu_seqlens, dout, lse, delta, dqkv, qkv.stride(0), qkv.stride(1), qkv.stride(2), heads, dim,
        max_seqlen, scale * LOG2E, scale, p, keep, seed, bias_ptr, radius, *score_args, total,
        dscores if scores_grad else qkv, *rotary_args(qkv, rotary, window),
    )  # fmt: skip
    meta = dict(DROPOUT=p > 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision, UPCAST=upcast)
    meta["BIAS"], meta["SCORES"] = bias is not None, scores is not None
    meta["ROTARY"], meta["WINDOW"] = rotary is not None, window is not None
    diagonals = C.next_power_of_2(block_m + block_n - 1)  # BLOCK_T of the position gradients
    if scores_grad:  # the column sums' registers: 8 warps whatever D
        meta.update(SCORES_GRAD=True, BLOCK_T=diagonals)
        warps = 8
    _attn_bwd_dkdv[_grid(batch, max_seqlen, block_n, heads)](*args, **meta, num_warps=warps)
    grid = _grid(batch, max_seqlen, block_m, heads)
    if bias_grad:  # no pair is farther apart than max_seqlen - 1: the bins past it get no gradient
        radius = (bias.shape[1] - 1) // 2
        width = min(radius, max_seqlen - 1)
        partial = torch.zeros(grid[0], heads, 2 * width + 1, dtype=torch.float32, device=qkv.device)
        # 8 warps whatever D: with the skew's registers 4 spill at D = 64 (ptxas for sm_90: 156 bytes a thread in fp16)
        meta.update(BIAS_GRAD=True, BLOCK_T=diagonals, BLOCK_W=C.next_power_of_2(2 * width + 1))
        _attn_bwd_dq[grid](*args, partial, width, **meta, num_warps=8)
        dbias[:, radius - width : radius + width + 1] = partial.sum(0)
    else:
        _attn_bwd_dq[grid](*args, dqkv, 0, **meta, num_warps=warps)
    if rotary is not None:
        unrotate(dqkv, rotary)
    return dqkv, dbias, dscores if dscores is None else dscores.to(scores.dtype)


class FlashAttention(torch.autograd.Function):
    """Saves qkv, the output, the fp32 log-sum-exp, the bias table and the position scores; probabilities are
    recomputed blockwise in backward."""

    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen: int, p: float, scale: float, position_bias=None,
                position_scores=None, position_columns=None, rotary=None, window=None):  # fmt: skip
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        lse = torch.empty(qkv.shape[0], qkv.shape[2], dtype=torch.float32, device=qkv.device)
        seed = C.dropout_seed() if p > 0 else 0
        modes, keep = _dot_modes(qkv), C.keep_scale(p)
        out = _forward(qkv, cu_seqlens, max_seqlen, scale, lse, p, seed, keep, modes, position_bias, position_scores,
                       position_columns, rotary, window)  # fmt: skip
        ctx.save_for_backward(qkv, cu_seqlens, out, lse, position_bias, position_scores, position_columns, rotary)
        ctx.args, ctx.window = (max_seqlen, p, keep, seed, scale, *modes), window
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, cu_seqlens, out, lse, bias, scores, columns, rotary = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dqkv, dbias, dscores = _backward(dout, qkv, cu_seqlens, out, lse, bias, scores, columns, ctx.args, needs[5],
                                         needs[6], rotary, ctx.window)  # fmt: skip
        return dqkv, None, None, None, None, dbias, dscores, None, None, None


def attention(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
    position_bias: torch.Tensor | None = None,
    position_scores: torch.Tensor | None = None,
    position_columns: torch.Tensor | None = None,
    rotary: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Varlen bidirectional attention over packed QKV `[T, 3, nH, D]` -> `[T, nH, D]`, plus a relative position bias
    `[nH, 2R + 1]` and disentangled position scores `[2, nH, T, W]` (by `position_columns`) when given;
    differentiable in qkv, the bias and the scores; q and k rotated by `rotary` [2, T, R/2] as they are loaded, keys
    beyond `window` of the query skipped block by block."""
    p, scale = _check(qkv, cu_seqlens, max_seqlen, dropout_p, training, scale, position_bias, position_scores,
                      position_columns, rotary, window)  # fmt: skip
    window = None if window is None else int(window)
    if torch.compiler.is_compiling():
        return _attention_op(qkv, cu_seqlens, int(max_seqlen), p, scale, position_bias, position_scores,
                             position_columns, rotary, window)[0]  # fmt: skip
    return C.apply(FlashAttention, qkv, cu_seqlens, int(max_seqlen), p, scale, position_bias, position_scores,
                   position_columns, rotary, window)  # fmt: skip


def _check(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float, training: bool,
    scale: float | None, position_bias: torch.Tensor | None = None, position_scores: torch.Tensor | None = None,
    position_columns: torch.Tensor | None = None, rotary: torch.Tensor | None = None, window: int | None = None,
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
    if position_bias is not None:
        _check_table(position_bias, qkv)
    if position_scores is not None or position_columns is not None:
        _check_scores(position_scores, position_columns, qkv)
    if rotary is not None:
        check_rotary(rotary, qkv)
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 (keys within that distance), got {window}")
    return p, float(scale if scale is not None else 1.0 / math.sqrt(qkv.shape[-1]))


def _check_table(table: torch.Tensor, qkv: torch.Tensor) -> None:
    """position_bias: [nH, 2R + 1] fp32, contiguous, on qkv's device (relative_positions.table_radius's rule; the
    kernels import nothing of the library)."""
    heads = qkv.shape[2]
    if table.dim() != 2 or table.shape[0] != heads or table.shape[1] % 2 != 1:
        raise ValueError(f"position_bias must be [nH = {heads}, 2R + 1] (an odd width), got {tuple(table.shape)}")
    if table.dtype != torch.float32:
        raise ValueError(f"position_bias must be float32, got {table.dtype}")
    if table.device != qkv.device:
        raise ValueError(f"position_bias is on {table.device}, qkv on {qkv.device}")
    if not table.is_contiguous():
        raise ValueError("position_bias must be contiguous")


def _check_scores(scores: torch.Tensor | None, columns: torch.Tensor | None, qkv: torch.Tensor) -> None:
    """position_scores: [2, nH, T, W] (0 < W <= MAX_POSITION_COLUMNS) in fp32 or qkv's dtype with a unit stride on W;
    position_columns: [2R + 1] int32 contiguous; both on qkv's device (relative_positions.check_scores' rule and the
    kernels' own)."""
    if scores is None or columns is None:
        raise ValueError("position_scores and position_columns come together")
    tokens, _, heads, _ = qkv.shape
    if scores.dim() != 4 or scores.shape[:3] != (2, heads, tokens) or scores.shape[3] < 1:
        raise ValueError(f"position_scores must be [2, nH = {heads}, T = {tokens}, W > 0], got {tuple(scores.shape)}")
    if scores.shape[3] > MAX_POSITION_COLUMNS:
        raise ValueError(f"position_scores has W = {scores.shape[3]} > {MAX_POSITION_COLUMNS} columns")
    if scores.dtype not in (qkv.dtype, torch.float32):
        raise ValueError(f"position_scores must be float32 or qkv's dtype ({qkv.dtype}), got {scores.dtype}")
    if columns.dim() != 1 or columns.numel() % 2 != 1 or columns.dtype != torch.int32:
        raise ValueError(f"position_columns must be [2R + 1] int32, got {tuple(columns.shape)} {columns.dtype}")
    for name, t in (("position_scores", scores), ("position_columns", columns)):
        if t.device != qkv.device:
            raise ValueError(f"{name} is on {t.device}, qkv on {qkv.device}")
    if scores.stride(3) != 1 and scores.shape[3] > 1:
        raise ValueError("position_scores needs a unit stride on W")
    if not columns.is_contiguous():
        raise ValueError("position_columns must be contiguous")


def attention_inference(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
    position_bias: torch.Tensor | None = None,
    position_scores: torch.Tensor | None = None,
    position_columns: torch.Tensor | None = None,
    rotary: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Varlen attention `[T, 3, nH, D]` -> `[T, nH, D]` (plus the position bias and scores when given), forward kernel
    only: no autograd Function, no log-sum-exp written, dropout ignored (inference), launch blocks from the cached
    rule."""
    if torch.compiler.is_compiling():  # a Triton launch in a traced graph goes through the custom op
        return attention(qkv, cu_seqlens, max_seqlen, scale=scale, position_bias=position_bias,
                         position_scores=position_scores, position_columns=position_columns, rotary=rotary,
                         window=window)  # fmt: skip
    _, scale = _check(qkv, cu_seqlens, max_seqlen, 0.0, False, scale, position_bias, position_scores, position_columns,
                      rotary, window)  # fmt: skip
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    window = None if window is None else int(window)
    return _forward(qkv, cu_seqlens, max_seqlen, scale, bias=position_bias, scores=position_scores,
                    columns=position_columns, rotary=rotary, window=window)  # fmt: skip


# torch.compile: the kernels as custom ops. The forward op returns what the backward op needs besides the inputs
# (the output, the fp32 log-sum-exp, the dropout seed); the backward op is registered as its gradient and returns the
# bias and scores gradients as well (an empty fp32 tensor where one is not asked for: an op's outputs are tensors).
@torch.library.custom_op("fastbert::triton_attention", mutates_args=())
def _attention_op(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, p: float, scale: float,
    position_bias: torch.Tensor | None = None, position_scores: torch.Tensor | None = None,
    position_columns: torch.Tensor | None = None, rotary: torch.Tensor | None = None, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    ctx = C.Saved()
    out = FlashAttention.forward(ctx, qkv, cu_seqlens, max_seqlen, p, scale, position_bias, position_scores,
                                 position_columns, rotary, window)  # fmt: skip
    return out, ctx.saved_tensors[3], C.seed_tensor(ctx.args[3])


@_attention_op.register_fake
def _(qkv, cu_seqlens, max_seqlen, p, scale, position_bias=None, position_scores=None, position_columns=None,
      rotary=None, window=None):  # fmt: skip
    total, _, heads, dim = qkv.shape
    return (qkv.new_empty(total, heads, dim), qkv.new_empty(total, heads, dtype=torch.float32),
            torch.empty(1, dtype=torch.int64))  # fmt: skip


@torch.library.custom_op("fastbert::triton_attention_backward", mutates_args=())
def _attention_backward_op(
    dout: torch.Tensor, qkv: torch.Tensor, cu_seqlens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    seed: torch.Tensor, position_bias: torch.Tensor | None, position_scores: torch.Tensor | None,
    position_columns: torch.Tensor | None, max_seqlen: int, p: float, scale: float, bias_grad: bool, scores_grad: bool,
    rotary: torch.Tensor | None = None, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    args = (max_seqlen, p, C.keep_scale(p), int(seed.item()), scale, *_dot_modes(qkv))
    dqkv, dbias, dscores = _backward(dout, qkv, cu_seqlens, out, lse, position_bias, position_scores,
                                     position_columns, args, bias_grad, scores_grad, rotary, window)  # fmt: skip
    dbias = dbias if dbias is not None else qkv.new_empty(0, dtype=torch.float32)
    return dqkv, dbias, dscores if dscores is not None else qkv.new_empty(0, dtype=torch.float32)


@_attention_backward_op.register_fake
def _(dout, qkv, cu_seqlens, out, lse, seed, position_bias, position_scores, position_columns, max_seqlen, p, scale,
      bias_grad, scores_grad, rotary=None, window=None):  # fmt: skip
    give_bias, give_scores = bias_grad and position_bias is not None, scores_grad and position_scores is not None
    dbias = position_bias.new_empty(position_bias.shape) if give_bias else qkv.new_empty(0, dtype=torch.float32)
    dscores = position_scores.new_empty(position_scores.shape) if give_scores else qkv.new_empty(0, dtype=torch.float32)
    return qkv.new_empty(qkv.shape), dbias, dscores


def _attention_setup(ctx, inputs, output) -> None:
    qkv, cu_seqlens, ctx.max_seqlen, ctx.p, ctx.scale, *positions = inputs
    bias, scores, columns, rotary, ctx.window = (*positions, None, None, None, None, None)[:5]  # trailing defaults
    out, lse, seed = output  # may be left out
    ctx.save_for_backward(qkv, cu_seqlens, out, lse, seed, bias, scores, columns, rotary)


def _attention_grad(ctx, dout, *_):
    qkv, cu_seqlens, out, lse, seed, bias, scores, columns, rotary = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[5]
    scores_grad = scores is not None and ctx.needs_input_grad[6]
    dqkv, dbias, dscores = _attention_backward_op(
        dout, qkv, cu_seqlens, out, lse, seed, bias, scores, columns, ctx.max_seqlen, ctx.p, ctx.scale, bias_grad,
        scores_grad, rotary, ctx.window,
    )  # fmt: skip
    dbias, dscores = dbias if bias_grad else None, dscores if scores_grad else None
    return dqkv, None, None, None, None, dbias, dscores, None, None, None


_attention_op.register_autograd(_attention_grad, setup_context=_attention_setup)
