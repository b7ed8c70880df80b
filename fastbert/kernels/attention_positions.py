"""Relative positions in the attention kernels' tile loop: the tiles they add to the scores and the deterministic
sums of their gradients (fastbert/kernels/attention.py's kernels call these).

Relative position bias (MPNet/T5 style, `position_bias` [nH, 2R + 1] fp32 contiguous on qkv's device, any R >= 0):
the score of query i and key j of one sequence gains position_bias[h, clamp(j - i, -R, R) + R] (in natural units,
times log2(e) in the kernels' log2 units), gathered from the table in the tile loop (never an [S, S] tensor; the
table stays in cache); a BIAS constexpr, so bias-free launches compile as without it. Table values must be finite (a
-inf everywhere in a row would leave it no key). The table's gradient, where it requires grad, is deterministic too
(no atomics): each dQ program sums its dS tiles (the gradient of the natural-units score) by distance into a
register row of bins, skewing a tile that straddles the band |j - i| < W with tl.gather (32 diagonals at a time) and
adding a tile wholly beyond it to an end bin, then writes the row to its own slot of an fp32 [programs, nH, 2W + 1]
buffer that torch sums over the programs afterwards (W = min(R, max_seqlen - 1): no pair is farther apart; the bins
past it get 0). Costs: that buffer (12.6 MB at B = 128, S = 512, nH = 12, R = 128), next_power_of_2(2W + 1) fp32
registers a program, and the dQ launch at 8 warps (the skew's registers).
Disentangled position scores (DeBERTa-v2/v3: `position_scores` [2, nH, T, W] in qkv's dtype or fp32, unit stride on W,
any other strides; `position_columns` [2R + 1] int32 contiguous; both on qkv's device): the score of query i and key
j of one sequence gains position_scores[0, h, i, c] + position_scores[1, h, j, c], c = position_columns[clamp(j - i,
-R, R) + R], gathered in the tile loop (a SCORES constexpr). Columns are clamped into [0, W - 1], so a bad column
never reads or writes outside position_scores (an out-of-range value is the caller's error; checking it would sync).
Their gradient (where position_scores requires grad) is deterministic though it uses atomic adds: the dQ program owns
its query rows (side 0), the dK/dV program its key rows (side 1), so no two programs add to one element; per tile a
program ranks the tile's diagonals by column (one column per diagonal; by counting, [BLOCK_T, BLOCK_T] compares),
sums each row's entries per column (_SKEW ranks at a time) and adds the sums to its rows of an fp32 [2, nH, T, W]
buffer, one address per row and column in an add and a barrier after each, so every element takes its adds in a fixed
order. Costs: that buffer (zeroed, then cast to position_scores' dtype), the ranking, gathers and atomic adds per
tile, and both backward kernels at 8 warps.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the kernels' copy (a jit function reads module globals only as constexprs)
_SKEW = tl.constexpr(32)  # diagonals skewed at once by the position gradients (a [BLOCK_M, 32] tile; BLOCK_T >= 32)


@triton.jit
def bias_tile(bias_ptr, h, radius, rows, cols):
    """position_bias[h, clamp(j - i, -R, R) + R] of rows i, cols j of one sequence, in log2 units: [BLOCK_M, BLOCK_N]
    fp32. Every index is inside the table (rows and cols past the sequence too), so no mask."""
    dist = tl.minimum(tl.maximum(cols[None, :] - rows[:, None], -radius), radius)
    return tl.load(bias_ptr + h * (2 * radius + 1) + radius + dist) * _LOG2E


@triton.jit
def distance_sums(ds, m0, n0, radius, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_W: tl.constexpr):  # fmt: skip
    """A [BLOCK_M, BLOCK_N] tile (rows m0.., cols n0..; 0 off the sequence) summed by distance bin: [BLOCK_W] fp32, bin
    w = clamp(j - i, -W, W) + W for W = `radius`, 0 past 2W. A tile wholly at or beyond -W or +W goes to an end bin
    whole; any other is skewed (tl.gather) so that its diagonal t (j - i = n0 - m0 - (BLOCK_M - 1) + t) is a column,
    summed over rows, _SKEW diagonals at a time (registers); each inner bin takes one diagonal, an end bin the sum of
    the diagonals at or beyond it. Deterministic: fixed-order sums, no atomics."""
    w = tl.arange(0, BLOCK_W)
    first = n0 - m0 - (BLOCK_M - 1)  # the distance of the tile's first diagonal
    if first + BLOCK_M + BLOCK_N - 2 <= -radius:
        sums = tl.where(w == 0, tl.sum(tl.sum(ds, axis=1), axis=0), 0.0)
    elif first >= radius:
        sums = tl.where(w == 2 * radius, tl.sum(tl.sum(ds, axis=1), axis=0), 0.0)
    else:
        r = tl.arange(0, BLOCK_M)
        sums = tl.zeros((BLOCK_W,), dtype=tl.float32)
        low = tl.zeros((), dtype=tl.float32)
        high = tl.zeros((), dtype=tl.float32)
        for k in tl.static_range(0, BLOCK_T, _SKEW):
            t = k + tl.arange(0, _SKEW)
            col = t[None, :] - (BLOCK_M - 1) + r[:, None]
            on = (col >= 0) & (col < BLOCK_N)
            diag = tl.sum(tl.where(on, tl.gather(ds, tl.where(on, col, 0), axis=1), 0.0), axis=0)  # [_SKEW]
            dist = first + t
            low += tl.sum(tl.where(dist <= -radius, diag, 0.0))
            high += tl.sum(tl.where((dist >= radius) & (dist > -radius), diag, 0.0))  # W = 0: `low` has bin 0
            src = w - radius - first - k  # the diagonal (in this chunk) whose distance is w - W
            inner = (w > 0) & (w < 2 * radius) & (src >= 0) & (src < _SKEW)
            sums += tl.where(inner, tl.gather(diag, tl.where(inner, src, 0), axis=0), 0.0)
        sums += tl.where(w == 0, low, 0.0) + tl.where(w == 2 * radius, high, 0.0)
    return sums


@triton.jit
def column(columns_ptr, radius, dist, width):
    """position_columns[clamp(dist, -R, R) + R], clamped into [0, W - 1] (int32, `dist`'s shape)."""
    dist = tl.minimum(tl.maximum(dist, -radius), radius)
    return tl.minimum(tl.maximum(tl.load(columns_ptr + radius + dist), 0), width - 1)


@triton.jit
def scores_tile(scores_ptr, columns_ptr, h, qtok, ktok, rows, cols, valid, radius, width, stride_side, stride_head,
                 stride_tok):  # fmt: skip
    """position_scores[0, h, i, c] + position_scores[1, h, j, c] (c = the column of j - i) of rows i (tokens `qtok`),
    cols j (tokens `ktok`) of one sequence, in log2 units: [BLOCK_M, BLOCK_N] fp32, 0 off `valid`."""
    c = column(columns_ptr, radius, cols[None, :] - rows[:, None], width)
    head = scores_ptr + h.to(tl.int64) * stride_head + c
    q_side = tl.load(head + qtok[:, None] * stride_tok, mask=valid, other=0.0)
    k_side = tl.load(head + stride_side + ktok[None, :] * stride_tok, mask=valid, other=0.0)
    return (q_side.to(tl.float32) + k_side.to(tl.float32)) * _LOG2E


@triton.jit
def add_by_column(x, first, out_rows, amask, columns_ptr, radius, width, DOWN: tl.constexpr, BLOCK_A: tl.constexpr,
                   BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """Adds x [BLOCK_A, BLOCK_B] fp32 (0 off the sequence) to fp32 rows `out_rows` [BLOCK_A] (pointers to W-wide
    rows; `amask` the live ones) by position column: entry (a, b) lies on diagonal t = b - a + BLOCK_A - 1, whose key -
    query distance is first + t (first - t when DOWN), so one column per diagonal. The diagonals are ranked by column
    (by counting, no sort); _SKEW ranks at a time, each row's entries on those diagonals are gathered in rank order and
    summed per column (a running sum's difference across each run of one column), then added with one atomic add per
    row and column and a barrier after each: an element's adds come in a fixed order (deterministic)."""
    t = tl.arange(0, BLOCK_T)
    col = column(columns_ptr, radius, first - t if DOWN else first + t, width)
    key = col * BLOCK_T + t  # distinct; W <= MAX_POSITION_COLUMNS: no overflow
    rank = tl.zeros((BLOCK_T,), dtype=tl.int32)  # each diagonal's place, counted _SKEW diagonals at a time
    for k in tl.static_range(0, BLOCK_T, _SKEW):
        tk = k + tl.arange(0, _SKEW)
        key_k = column(columns_ptr, radius, first - tk if DOWN else first + tk, width) * BLOCK_T + tk
        rank += tl.sum((key_k[None, :] < key[:, None]).to(tl.int32), axis=1)
    a = tl.arange(0, BLOCK_A)
    for k in tl.static_range(0, BLOCK_T, _SKEW):
        at = rank[None, :] == (k + tl.arange(0, _SKEW))[:, None]  # [_SKEW, BLOCK_T]: the diagonal of each rank
        diag = tl.sum(tl.where(at, t[None, :], 0), axis=1)
        c = tl.sum(tl.where(at, col[None, :], 0), axis=1)  # [_SKEW], non-decreasing
        run = tl.sum((c[None, :] < c[:, None]).to(tl.int32), axis=1)  # where c's run starts in the chunk
        last = tl.sum((c[None, :] <= c[:, None]).to(tl.int32), axis=1) == tl.arange(1, _SKEW + 1)  # ... and ends
        b = diag[None, :] - (BLOCK_A - 1) + a[:, None]  # [BLOCK_A, _SKEW]: each row's entry on those diagonals
        on = (b >= 0) & (b < BLOCK_B)
        running = tl.cumsum(tl.where(on, tl.gather(x, tl.where(on, b, 0), axis=1), 0.0), axis=1)
        before = tl.gather(running, tl.broadcast_to(tl.maximum(run - 1, 0)[None, :], (BLOCK_A, _SKEW)), axis=1)
        sums = running - tl.where((run > 0)[None, :], before, 0.0)
        live = last[None, :] & amask[:, None] & (sums != 0.0)  # a zero sum adds nothing
        tl.atomic_add(out_rows[:, None] + c[None, :], sums, mask=live, sem="relaxed")
        tl.debug_barrier()
