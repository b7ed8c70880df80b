"""Embedding gather (word + position + token type) + sum + LayerNorm (+ dropout) in one pass, and its backward.

Limits: ids `[*]` int32/int64 (flattened), tables `[V, E]`, `[P, E]`, `[Tt, E]` fp32/fp16/bf16 with a unit
feature stride (any row stride), E <= 16384; `inputs_embeds` `[*, E]` replaces the word lookup. With ALBERT's
embedding_size < hidden the LayerNorm is over E and the projection follows in the model. Statistics in fp32, one
cast to the table's (or inputs_embeds') dtype on store. Ids are not bounds-checked here (the model validates them).
Backward: one kernel recomputes the row sum from the ids and writes dL/d(sum) in fp32 plus per-program partial
LayerNorm grads; each table grad is then a segmented reduction over the ids sorted (stable): per id, the fp32 sum of
its rows in one fixed order (token order within chunks of SEGMENT_CHUNK sorted positions, the chunk sums in order),
cast once to the table dtype. No atomics anywhere, so the backward is bitwise repeatable on a GPU always, which is
what torch.use_deterministic_algorithms(True) asks for; it is the only path because it costs about what
nn.Embedding's own sort-based backward does (one sort of the ids, two passes over [tokens, E] fp32, the table zeroed).
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
def _row_sum(
    ids_ptr, emb_ptr, tt_ptr, pos_ptr, word_ptr, posw_ptr, typew_ptr, rows, cols, rmask, mask,
    stride_word, stride_pos, stride_type, stride_emb, HAS_EMBEDS: tl.constexpr,
):
    """word[ids] (or inputs_embeds) + position[pos] + type[tt] for a [BLOCK_M, BLOCK_N] tile, fp32, 0 off mask."""
    c = cols[None, :]
    if HAS_EMBEDS:
        x = tl.load(emb_ptr + rows.to(tl.int64)[:, None] * stride_emb + c, mask=mask, other=0.0).to(tl.float32)
    else:
        ids = tl.load(ids_ptr + rows, mask=rmask, other=0).to(tl.int64)
        x = tl.load(word_ptr + ids[:, None] * stride_word + c, mask=mask, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0).to(tl.int64)
    tt = tl.load(tt_ptr + rows, mask=rmask, other=0).to(tl.int64)
    x += tl.load(posw_ptr + pos[:, None] * stride_pos + c, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(typew_ptr + tt[:, None] * stride_type + c, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit(do_not_specialize=["seed"])
def _embedding_ln_fwd(
    ids_ptr,  # [M] int (unused with HAS_EMBEDS)
    emb_ptr,  # [M, E] rows at stride_emb (inputs_embeds; used with HAS_EMBEDS)
    tt_ptr,  # [M] int token-type ids
    pos_ptr,  # [M] int position ids
    word_ptr,  # [V, E] rows at stride_word
    posw_ptr,  # [P, E] rows at stride_pos
    typew_ptr,  # [Tt, E] rows at stride_type
    w_ptr,  # [E] LayerNorm weight
    b_ptr,  # [E] LayerNorm bias
    y_ptr,  # [M, E] contiguous
    mean_ptr,  # [M] fp32
    rstd_ptr,  # [M] fp32
    M,
    E,
    stride_word,
    stride_pos,
    stride_type,
    stride_emb,
    eps,
    p,
    scale,
    seed,
    HAS_EMBEDS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STATS: tl.constexpr = True,  # store (mean, rstd) for a backward; inference leaves them out (pointers unused)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < E
    mask = rmask[:, None] & cmask[None, :]
    x = _row_sum(
        ids_ptr, emb_ptr, tt_ptr, pos_ptr, word_ptr, posw_ptr, typew_ptr, rows, cols, rmask, mask,
        stride_word, stride_pos, stride_type, stride_emb, HAS_EMBEDS,
    )
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y, mean, rstd = layernorm_tile(x, mask, w, b, E, eps)
    if DROPOUT:
        y = tl.where(dropout_keep(seed, rows[:, None] * E + cols[None, :], p), y * scale, 0.0)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(mean_ptr + rows, mean, mask=rmask)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit(do_not_specialize=["seed"])
def _embedding_ln_bwd(
    dy_ptr,  # [M, E] rows at stride_dy
    ids_ptr,  # [M] int
    emb_ptr,  # [M, E] rows at stride_emb
    tt_ptr,  # [M] int
    pos_ptr,  # [M] int
    word_ptr,  # [V, E]
    posw_ptr,  # [P, E]
    typew_ptr,  # [Tt, E]
    w_ptr,  # [E]
    mean_ptr,  # [M] fp32
    rstd_ptr,  # [M] fp32
    dx_ptr,  # [M, E] fp32 contiguous: dL/d(word + position + type)
    dparts_ptr,  # [2, G, E] fp32 partial rows per program: d(ln weight), d(ln bias)
    M,
    E,
    stride_dy,
    stride_word,
    stride_pos,
    stride_type,
    stride_emb,
    p,
    scale,
    seed,
    HAS_EMBEDS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < E
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, programs * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = _row_sum(
            ids_ptr, emb_ptr, tt_ptr, pos_ptr, word_ptr, posw_ptr, typew_ptr, rows, cols, rmask, mask,
            stride_word, stride_pos, stride_type, stride_emb, HAS_EMBEDS,
        )
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            g = tl.where(dropout_keep(seed, rows[:, None] * E + cols[None, :], p), g * scale, 0.0)
        tl.store(dx_ptr + r64 * E + cols[None, :], layernorm_tile_bwd(g, xhat, rstd, w, E), mask=mask)
        dw += g * xhat
        db += g
    part = pid * E + cols
    tl.store(dparts_ptr + part, tl.sum(dw, axis=0), mask=cmask)
    tl.store(dparts_ptr + programs * E + part, tl.sum(db, axis=0), mask=cmask)


@functools.cache
def _blocks(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): the whole row, as many rows as fill the tile."""
    block_n = C.feature_block(n)
    block_m = C.rows_per_program(block_n)
    return block_m, block_n, C.warps_for(block_m * block_n)


_rule = tuning.row_rule(_blocks)  # where no measured table entry fits


@triton.jit
def _segment_pieces(
    key_ptr,  # [M] ids sorted (stable)
    order_ptr,  # [M] int64: the token each sorted position came from
    rows_ptr,  # [M, E] fp32 contiguous: dL/d(sum) per token
    piece_ptr,  # [M, E] fp32: a piece's sum lands on the row of its first sorted position
    M,
    E,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Phase 1: one program per CHUNK sorted positions (x BLOCK_N features) sums each run of equal ids inside its
    chunk, in sorted (= token) order, and stores each run's sum at the run's first position."""
    base = tl.program_id(0) * CHUNK
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < E
    end = tl.minimum(base + CHUNK, M)
    prev = tl.load(key_ptr + base)
    start = base
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(CHUNK):
        i = base + k
        live = i < end
        key = tl.load(key_ptr + i, mask=live, other=-1)
        row = tl.load(order_ptr + i, mask=live, other=0)
        lmask = cmask & (cols * 0 + i < end)  # a vector mask: the interpreter rejects a block & scalar one
        x = tl.load(rows_ptr + row * E + cols, mask=lmask, other=0.0)
        same = key == prev
        acc = tl.where(same, acc + x, x)
        start = tl.where(same, start, i)
        nxt = tl.load(key_ptr + i + 1, mask=i + 1 < end, other=-1)
        tl.store(piece_ptr + start.to(tl.int64) * E + cols, acc, mask=lmask & (cols * 0 + nxt != key))
        prev = key


@triton.jit
def _segment_sums(
    key_ptr,  # [M] ids sorted (stable)
    piece_ptr,  # [M, E] fp32 from _segment_pieces
    grad_ptr,  # [V, E] table grad (zeros), rows at stride_grad
    M,
    E,
    stride_grad,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Phase 2: for each id whose run starts in this chunk, add its pieces (one per chunk the run reaches) in order
    and store the table row, cast once to the table dtype."""
    base = tl.program_id(0) * CHUNK
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < E
    for k in range(CHUNK):
        i = base + k
        key = tl.load(key_ptr + i, mask=i < M, other=-1)
        before = tl.load(key_ptr + i - 1, mask=(i > 0) & (i < M), other=-1)
        if (i < M) & (key != before):
            acc = tl.load(piece_ptr + i.to(tl.int64) * E + cols, mask=cmask, other=0.0)
            b = base + CHUNK
            nb = tl.load(key_ptr + b, mask=b < M, other=-1)
            while nb == key:
                acc += tl.load(piece_ptr + b.to(tl.int64) * E + cols, mask=cmask, other=0.0)
                b += CHUNK
                nb = tl.load(key_ptr + b, mask=b < M, other=-1)
            grad = grad_ptr + key.to(tl.int64) * stride_grad + cols
            tl.store(grad, acc.to(grad_ptr.dtype.element_ty), mask=cmask)


SEGMENT_CHUNK = 32  # sorted positions per program in the table-grad reduction
SEGMENT_BLOCK_N = 256  # features per program there


def _table_grad(grad_rows: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Sum fp32 row grads [M, E] into a [rows(table), E] grad of the table's dtype, deterministically: a stable
    sort by id, then per id the fp32 sum of its rows in token order (chunked, the chunks added in order), rounded
    once. No atomics, so bitwise repeatable on a GPU whatever torch.are_deterministic_algorithms_enabled() says."""
    m, e = grad_rows.shape
    grad = torch.zeros(table.shape, dtype=table.dtype, device=table.device)
    if m == 0:
        return grad
    keys, order = torch.sort(ids, stable=True)
    pieces = torch.empty(m, e, dtype=torch.float32, device=grad_rows.device)
    block_n = min(SEGMENT_BLOCK_N, C.feature_block(e))
    grid = (C.cdiv(m, SEGMENT_CHUNK), C.cdiv(e, block_n))
    warps = C.warps_for(block_n)
    _segment_pieces[grid](keys, order, grad_rows, pieces, m, e, CHUNK=SEGMENT_CHUNK, BLOCK_N=block_n,
                          num_warps=warps)
    _segment_sums[grid](keys, pieces, grad, m, e, grad.stride(0), CHUNK=SEGMENT_CHUNK, BLOCK_N=block_n,
                        num_warps=warps)
    return grad


def _rows(
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor,
    position_ids: torch.Tensor,
    tables: tuple[torch.Tensor, ...],
    inputs_embeds: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The kernel's views: ids [M] (the type ids stand in with inputs_embeds: unused), inputs_embeds as rows [M, E]
    or None, type and position ids [M], the (word, position, type) tables with unit column stride."""
    e = tables[0].shape[-1]
    tt, pos = token_type_ids.reshape(-1).contiguous(), position_ids.reshape(-1).contiguous()
    emb = C.as_rows(inputs_embeds, e) if inputs_embeds is not None else None
    ids = tt if emb is not None else input_ids.reshape(-1).contiguous()
    return ids, emb, tt, pos, [t if t.stride(-1) == 1 else t.contiguous() for t in tables]


def _forward(
    ids: torch.Tensor,  # [M]
    emb: torch.Tensor | None,  # [M, E] rows, or None
    tt: torch.Tensor,  # [M]
    pos: torch.Tensor,  # [M]
    tables: list[torch.Tensor],  # word [V, E], position [P, E], type [Tt, E]
    ln_w: torch.Tensor,  # [E]
    ln_b: torch.Tensor,  # [E]
    eps: float,
    dtype: torch.dtype,
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,  # fp32 (mean, rstd) [M] to write, for the backward
    p: float = 0.0,
    seed: int = 0,
    keep: float = 1.0,  # the dropout keep scale (C.keep_scale(p))
) -> torch.Tensor:  # [M, E]
    """One launch of the forward kernel: the training forward (stats, dropout) and the inference launcher share it."""
    m, e = tt.numel(), tables[0].shape[-1]
    y = torch.empty(m, e, dtype=dtype, device=tables[0].device)
    if m:
        block_m, block_n, warps, stages = tuning.settings(
            "embedding_layernorm", y.device, dtype, e, 1 << (m - 1).bit_length(), _rule)
        mean, rstd = stats if stats is not None else (y, y)
        word, posw, typew = tables
        _embedding_ln_fwd[(-(-m // block_m),)](
            ids, emb if emb is not None else y, tt, pos, word, posw, typew, ln_w, ln_b, y, mean, rstd, m, e,
            word.stride(0), posw.stride(0), typew.stride(0), emb.stride(0) if emb is not None else 0, eps, p,
            keep, seed, HAS_EMBEDS=emb is not None, DROPOUT=p > 0, BLOCK_M=block_m,
            BLOCK_N=block_n, STATS=stats is not None, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return y


class EmbeddingLayerNorm(torch.autograd.Function):
    """Saves the ids, tables, LayerNorm weight and fp32 (mean, rstd); the row sum is re-gathered in backward."""

    @staticmethod
    def forward(ctx, input_ids, token_type_ids, position_ids, word, posw, typew, ln_w, ln_b, eps, p, inputs_embeds):
        has_embeds = inputs_embeds is not None
        ids, emb, tt, pos, tables = _rows(input_ids, token_type_ids, position_ids, (word, posw, typew), inputs_embeds)
        dtype = inputs_embeds.dtype if has_embeds else word.dtype
        mean = torch.empty(tt.numel(), dtype=torch.float32, device=word.device)
        rstd = torch.empty_like(mean)
        seed, keep = (C.dropout_seed(), C.keep_scale(p)) if p > 0 else (0, 1.0)
        y = _forward(ids, emb, tt, pos, tables, ln_w, ln_b, eps, dtype, (mean, rstd), p, seed, keep)
        ctx.save_for_backward(ids, emb, tt, pos, *tables, ln_w, mean, rstd)
        ctx.p, ctx.scale, ctx.seed, ctx.has_embeds = p, keep, seed, has_embeds
        ctx.emb_shape = inputs_embeds.shape if has_embeds else None
        ctx.emb_dtype = dtype
        return y.view(*(inputs_embeds.shape[:-1] if has_embeds else input_ids.shape), word.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        ids, emb, tt, pos, word, posw, typew, ln_w, mean, rstd = ctx.saved_tensors
        m, e = tt.numel(), word.shape[-1]
        dyr = C.as_rows(dy, e)
        dx = torch.empty(m, e, dtype=torch.float32, device=word.device)
        block_m, block_n, warps = _blocks(e)
        programs = C.reduction_programs(C.cdiv(m, block_m), word.device)
        parts = torch.zeros(2, programs, e, dtype=torch.float32, device=word.device)
        emb_arg, emb_stride = (emb, emb.stride(0)) if ctx.has_embeds else (dx, 0)
        if m:
            _embedding_ln_bwd[(programs,)](
                dyr, ids, emb_arg, tt, pos, word, posw, typew, ln_w, mean, rstd, dx, parts, m, e, dyr.stride(0),
                word.stride(0), posw.stride(0), typew.stride(0), emb_stride, ctx.p, ctx.scale, ctx.seed,
                HAS_EMBEDS=ctx.has_embeds, DROPOUT=ctx.p > 0, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
            )
        dw, db = parts.sum(1).unbind(0)
        d_word = None if ctx.has_embeds else _table_grad(dx, ids, word)
        d_embeds = dx.to(ctx.emb_dtype).view(ctx.emb_shape) if ctx.has_embeds else None
        return (
            None, None, None, d_word, _table_grad(dx, pos, posw), _table_grad(dx, tt, typew),
            dw.to(ln_w.dtype), db.to(ln_w.dtype), None, None, d_embeds,
        )


def embedding_layernorm(
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor,
    position_ids: torch.Tensor,
    word_weight: torch.Tensor,
    position_weight: torch.Tensor,
    type_weight: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm(word[ids] + position[pos] + type[tt]) then dropout, fused; differentiable in every float tensor."""
    _check(input_ids, token_type_ids, position_ids, word_weight, position_weight, type_weight, dropout_p, inputs_embeds)
    p = dropout_p if training else 0.0
    args = (input_ids, token_type_ids, position_ids, word_weight, position_weight, type_weight, ln_weight, ln_bias,
            eps, p, inputs_embeds)  # fmt: skip
    if torch.compiler.is_compiling():
        return _embedding_op(*args)[0]
    return C.apply(EmbeddingLayerNorm, *args)


def _check(
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor,
    position_ids: torch.Tensor,
    word_weight: torch.Tensor,
    position_weight: torch.Tensor,
    type_weight: torch.Tensor,
    dropout_p: float,
    inputs_embeds: torch.Tensor | None,
) -> None:
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    e = word_weight.shape[-1]
    lead = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
    if token_type_ids.shape != lead or position_ids.shape != lead:
        raise ValueError(f"token_type_ids {tuple(token_type_ids.shape)} and position_ids "
                         f"{tuple(position_ids.shape)} must match the ids' shape {tuple(lead)}")
    for name, t in (("position_weight", position_weight), ("type_weight", type_weight)):
        if t.dim() != 2 or t.shape[1] != e:
            raise ValueError(f"{name} must be [rows, {e}], got {tuple(t.shape)}")
    if inputs_embeds is not None and inputs_embeds.shape[-1] != e:
        raise ValueError(f"inputs_embeds must end in {e}, got {tuple(inputs_embeds.shape)}")
    C.check_dropout(dropout_p)


def embedding_layernorm_inference(
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor,
    position_ids: torch.Tensor,
    word_weight: torch.Tensor,
    position_weight: torch.Tensor,
    type_weight: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm(word[ids] + position[pos] + type[tt]), forward kernel only: no autograd Function, no (mean, rstd)
    written, dropout ignored (inference), launch blocks from the cached rule."""
    if torch.compiler.is_compiling():  # a Triton launch in a traced graph goes through the custom op
        return embedding_layernorm(input_ids, token_type_ids, position_ids, word_weight, position_weight, type_weight,
                                   ln_weight, ln_bias, eps, inputs_embeds=inputs_embeds)  # fmt: skip
    _check(input_ids, token_type_ids, position_ids, word_weight, position_weight, type_weight, dropout_p, inputs_embeds)
    tables = (word_weight, position_weight, type_weight)
    rows = _rows(input_ids, token_type_ids, position_ids, tables, inputs_embeds)
    has_embeds = inputs_embeds is not None
    y = _forward(*rows, ln_weight, ln_bias, eps, inputs_embeds.dtype if has_embeds else word_weight.dtype)
    return y.view(*(inputs_embeds.shape[:-1] if has_embeds else input_ids.shape), word_weight.shape[-1])


# torch.compile: the kernels as custom ops. The forward op returns what the backward op needs besides the inputs
# (fp32 mean and rstd, the dropout seed); the backward op is registered as its gradient.
@torch.library.custom_op("fastbert::triton_embedding_layernorm", mutates_args=())
def _embedding_op(
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor,
    position_ids: torch.Tensor,
    word_weight: torch.Tensor,
    position_weight: torch.Tensor,
    type_weight: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    p: float,
    inputs_embeds: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ctx = C.Saved()
    y = EmbeddingLayerNorm.forward(
        ctx, input_ids, token_type_ids, position_ids, word_weight, position_weight, type_weight, ln_weight, ln_bias,
        eps, p, inputs_embeds,
    )  # fmt: skip
    mean, rstd = ctx.saved_tensors[-2:]
    return y, mean, rstd, C.seed_tensor(ctx.seed)


@_embedding_op.register_fake
def _(input_ids, token_type_ids, position_ids, word_weight, position_weight, type_weight, ln_weight, ln_bias, eps, p,
      inputs_embeds):  # fmt: skip
    lead = inputs_embeds if inputs_embeds is not None else word_weight
    shape = (*(inputs_embeds.shape[:-1] if inputs_embeds is not None else input_ids.shape), word_weight.shape[-1])
    stats = lead.new_empty(token_type_ids.numel(), dtype=torch.float32)
    return lead.new_empty(shape), stats, torch.empty_like(stats), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("fastbert::triton_embedding_layernorm_backward", mutates_args=())
def _embedding_backward_op(
    dy: torch.Tensor,
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor,
    position_ids: torch.Tensor,
    word_weight: torch.Tensor,
    position_weight: torch.Tensor,
    type_weight: torch.Tensor,
    ln_weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    seed: torch.Tensor,
    p: float,
    inputs_embeds: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad of word_weight or, with inputs_embeds, of inputs_embeds; position; type; ln weight; ln bias)."""
    has_embeds = inputs_embeds is not None
    tables = (word_weight, position_weight, type_weight)
    ids, emb, tt, pos, tables = _rows(input_ids, token_type_ids, position_ids, tables, inputs_embeds)
    ctx = C.Saved(
        (ids, emb, tt, pos, *tables, ln_weight, mean, rstd), p=p, scale=C.keep_scale(p), seed=int(seed.item()),
        has_embeds=has_embeds, emb_shape=inputs_embeds.shape if has_embeds else None,
        emb_dtype=inputs_embeds.dtype if has_embeds else word_weight.dtype,
    )  # fmt: skip
    _, _, _, d_word, d_pos, d_type, dw, db, _, _, d_embeds = EmbeddingLayerNorm.backward(ctx, dy)
    return d_embeds if has_embeds else d_word, d_pos, d_type, dw.clone(), db.clone()  # dw, db: views of one buffer


@_embedding_backward_op.register_fake
def _(dy, input_ids, token_type_ids, position_ids, word_weight, position_weight, type_weight, ln_weight, mean, rstd,
      seed, p, inputs_embeds):  # fmt: skip
    first = inputs_embeds if inputs_embeds is not None else word_weight
    return tuple(t.new_empty(t.shape) for t in (first, position_weight, type_weight, ln_weight, ln_weight))


def _embedding_setup(ctx, inputs, output) -> None:
    ids, tt, pos, word, posw, typew, ln_w, _, _, ctx.p, embeds = inputs
    _, mean, rstd, seed = output
    ctx.save_for_backward(ids, tt, pos, word, posw, typew, ln_w, mean, rstd, seed, embeds)


def _embedding_grad(ctx, dy, *_):
    ids, tt, pos, word, posw, typew, ln_w, mean, rstd, seed, embeds = ctx.saved_tensors
    first, d_pos, d_type, dw, db = _embedding_backward_op(
        dy, ids, tt, pos, word, posw, typew, ln_w, mean, rstd, seed, ctx.p, embeds
    )
    d_embeds, d_word = (first, None) if embeds is not None else (None, first)
    return None, None, None, d_word, d_pos, d_type, dw, db, None, None, d_embeds


_embedding_op.register_autograd(_embedding_grad, setup_context=_embedding_setup)
