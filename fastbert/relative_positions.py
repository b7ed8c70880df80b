"""Relative-position biases as the attention kernels take them: one fp32 table [nH, 2R + 1] by key - query distance.

MPNet (like T5) adds to every score a learned bias per head and log-spaced distance bucket. Buckets stop changing
beyond `max_distance`, so the bucket of each distance in [-R, R] (R = max_distance) folded into the [buckets, nH]
embedding gives a table every kernel indexes with clamp(j - i, -R, R) + R: a gather of 2R + 1 rows per forward instead
of transformers' [B, nH, S, S] bias. The buckets are computed with transformers' own float ops, so the table is
bitwise what its model adds.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

RELATIVE_BUCKETS = 32  # transformers' MPNet buckets distances 32 ways whatever relative_attention_num_buckets says
MAX_DISTANCE = 128  # beyond which every distance shares its direction's last bucket


def relative_buckets(distance: torch.Tensor, num_buckets: int = RELATIVE_BUCKETS, max_distance: int = MAX_DISTANCE
                     ) -> torch.Tensor:  # fmt: skip
    """MPNet's bucket of each key - query distance: half the buckets per direction, exact up to a quarter of them,
    log-spaced up to `max_distance`, the last bucket beyond."""
    n = -distance
    half = num_buckets // 2
    ret = (n < 0).to(torch.long) * half
    n = torch.abs(n)
    max_exact = half // 2
    large = max_exact + (
        torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    ).to(torch.long)
    large = torch.minimum(large, torch.full_like(large, half - 1))
    return ret + torch.where(n < max_exact, n, large)


def distance_buckets(device: torch.device, num_buckets: int = RELATIVE_BUCKETS, max_distance: int = MAX_DISTANCE
                     ) -> torch.Tensor:  # fmt: skip
    """[2R + 1] bucket indices for the distances -R..R (R = max_distance): cached per device, computed in the graph
    while torch.compile traces (a cache is no guard)."""
    if torch.compiler.is_compiling():
        return _buckets(device, num_buckets, max_distance)
    return _cached_buckets(device, num_buckets, max_distance)


def _buckets(device: torch.device, num_buckets: int, max_distance: int) -> torch.Tensor:
    return relative_buckets(torch.arange(-max_distance, max_distance + 1, device=device), num_buckets, max_distance)


@functools.cache
def _cached_buckets(device: torch.device, num_buckets: int, max_distance: int) -> torch.Tensor:
    """A normal tensor even when first asked under inference_mode: a later training forward saves it for backward."""
    with torch.inference_mode(False), torch.no_grad():
        return _buckets(device, num_buckets, max_distance)


def bias_table(weight: torch.Tensor, num_buckets: int = RELATIVE_BUCKETS, max_distance: int = MAX_DISTANCE
               ) -> torch.Tensor:  # fmt: skip
    """[buckets, nH] embedding weight -> the [nH, 2R + 1] fp32 table (differentiable in `weight`)."""
    buckets = distance_buckets(weight.device, num_buckets, max_distance)
    return weight.float().index_select(0, buckets).t().contiguous()


def table_radius(table: torch.Tensor, heads: int) -> int:
    """R of a [nH, 2R + 1] table, after checking its shape against the heads."""
    if table.dim() != 2 or table.shape[0] != heads or table.shape[1] % 2 != 1:
        raise ValueError(f"position_bias must be [nH = {heads}, 2R + 1] (an odd width), got {tuple(table.shape)}")
    if table.dtype != torch.float32:
        raise ValueError(f"position_bias must be float32, got {table.dtype}")
    return (table.shape[1] - 1) // 2


def dense_bias(table: torch.Tensor, seqlen: int) -> torch.Tensor:
    """[nH, S, S] bias of a [nH, 2R + 1] table for positions 0..S-1: what the kernels add, spelled out (the
    reference's form; kernels never build it)."""
    radius = (table.shape[1] - 1) // 2
    pos = torch.arange(seqlen, device=table.device)
    index = (pos[None, :] - pos[:, None]).clamp(-radius, radius) + radius  # [S, S]: key - query
    return table[:, index]


# DeBERTa-v2/v3: disentangled attention. Query i and key j of one sequence add q_i . Kr[c] + k_j . Qr[c] (scaled),
# Kr and Qr the layer's projections of the relative embeddings, c = clamp(bucket(i - j) + span, 0, 2 span - 1). The
# model computes per token its scores against the rows it can reach ([2, nH, T, W]: `position_scores`), the kernels
# gather them by distance through `position_columns`.


def deberta_buckets(relative: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """DeBERTa's log bucket of each query - key distance (transformers' make_log_bucket_position, its float ops):
    exact below bucket_size / 2, log-spaced up to max_position, odd in the distance."""
    sign = torch.sign(relative)
    mid = bucket_size // 2
    abs_pos = torch.where((relative < mid) & (relative > -mid), torch.tensor(mid - 1).type_as(relative),
                          torch.abs(relative))  # fmt: skip
    log_pos = torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, relative.type_as(log_pos), log_pos * sign).to(torch.long)


def deberta_span(position_buckets: int, max_relative_positions: int) -> int:
    """Half the rows of the relative embedding a layer reads (transformers' att_span / pos_ebd_size)."""
    return position_buckets if position_buckets > 0 else max_relative_positions


def _rows_by_distance(seqlen: int, position_buckets: int, max_relative_positions: int, device: torch.device
                      ) -> torch.Tensor:  # fmt: skip
    """[2 seqlen - 1] int64: the relative-embedding row of each key - query distance -(seqlen - 1)..seqlen - 1."""
    span = deberta_span(position_buckets, max_relative_positions)
    query_minus_key = -torch.arange(-(seqlen - 1), seqlen, device=device)
    if position_buckets > 0:
        query_minus_key = deberta_buckets(query_minus_key, position_buckets, max_relative_positions)
    return (query_minus_key + span).clamp(0, 2 * span - 1)


@torch.compiler.assume_constant_result  # torch.compile takes the answer as a constant: no .item() in its graph
def _window(seqlen: int, position_buckets: int, max_relative_positions: int) -> tuple[int, int]:
    """(first row, row count W) that sequences up to `seqlen` long reach (the rows of a distance range are
    contiguous)."""
    first, _, columns = _deberta_rows(seqlen, position_buckets, max_relative_positions)
    return first, int(columns.max()) + 1


@functools.lru_cache(maxsize=1024)
def _deberta_rows(seqlen: int, position_buckets: int, max_relative_positions: int) -> tuple[int, int, torch.Tensor]:
    """(first row, W, [2 seqlen - 1] int32 CPU columns relative to the first row), cached per length."""
    rows = _rows_by_distance(seqlen, position_buckets, max_relative_positions, torch.device("cpu"))
    first, last = int(rows.min()), int(rows.max())
    return first, last - first + 1, (rows - first).to(torch.int32)


def deberta_rows(seqlen: int, position_buckets: int, max_relative_positions: int, device: torch.device
                 ) -> tuple[int, int, torch.Tensor]:  # fmt: skip
    """(first row, W, columns [2 seqlen - 1] int32 on `device`): the relative-embedding rows first..first + W - 1
    that sequences up to `seqlen` tokens reach, and each distance's column among them (R = seqlen - 1). Computed in
    the graph while torch.compile traces (a cache is no guard)."""
    seqlen = max(int(seqlen), 1)
    if torch.compiler.is_compiling():
        first, width = _window(seqlen, position_buckets, max_relative_positions)
        rows = _rows_by_distance(seqlen, position_buckets, max_relative_positions, device)
        return first, width, (rows - first).to(torch.int32)
    return _deberta_rows_on(seqlen, position_buckets, max_relative_positions, device)


@functools.lru_cache(maxsize=1024)
def _deberta_rows_on(seqlen: int, position_buckets: int, max_relative_positions: int, device: torch.device
                     ) -> tuple[int, int, torch.Tensor]:  # fmt: skip
    """`_deberta_rows` with the columns on `device`, kept there: a CUDA graph's capture finds them without a copy
    (its warm-up made them). A normal tensor even when first asked under inference_mode."""
    first, width, columns = _deberta_rows(seqlen, position_buckets, max_relative_positions)
    with torch.inference_mode(False):
        return first, width, columns.to(device)


def deberta_row_table(position_buckets: int, max_relative_positions: int) -> tuple[int, torch.Tensor]:
    """(R, [2R + 1] int64 CPU): the relative-embedding row of each key - query distance d at d + R, R the distance
    from which rows stop changing (a constant for graphs that must not recompute the float buckets: onnxruntime's
    log rounds otherwise at the bucket edges)."""
    radius = max(max_relative_positions, deberta_span(position_buckets, max_relative_positions))
    first, _, columns = _deberta_rows(radius + 1, position_buckets, max_relative_positions)
    return radius, columns.long() + first


class DisentangledRows(NamedTuple):
    """DeBERTa's relative embedding rows a batch reaches (normalised where the config says) and each distance's row."""

    rows: torch.Tensor  # [W, H]
    columns: torch.Tensor  # [2R + 1] int32: the row of key - query distance d at d + R (R = max_seqlen - 1)


def deberta_projections(
    key_side: torch.Tensor | None,  # [W, nH * D]: the rows through Kr's projection (c2p), or None
    query_side: torch.Tensor | None,  # [W, nH * D]: through Qr's (p2c), or None
    rows: torch.Tensor,  # [W, H]
    heads: int,
    dim: int,
    scale: float,
) -> torch.Tensor:  # [2, nH, D, W]
    """Kr and Qr per head, the softmax scale folded in; zeros for a term the config leaves out."""
    zeros = rows.new_zeros(rows.shape[0], heads * dim)
    both = torch.stack([key_side if key_side is not None else zeros, query_side if query_side is not None else zeros])
    return both.view(2, rows.shape[0], heads, dim).permute(0, 2, 3, 1) * scale


def deberta_scores(qkv: torch.Tensor, projections: torch.Tensor) -> torch.Tensor:  # -> [2, nH, T, W]
    """position_scores: each token's query against Kr, its key against Qr ([T, 3, nH, D] x [2, nH, D, W])."""
    return torch.matmul(qkv[:, :2].permute(1, 2, 0, 3), projections)


def check_scores(scores: torch.Tensor, columns: torch.Tensor, heads: int, tokens: int) -> int:
    """R of the columns, after checking `position_scores` [2, nH, T, W] and `position_columns` [2R + 1] int32."""
    if scores.dim() != 4 or scores.shape[0] != 2 or scores.shape[1] != heads or scores.shape[2] != tokens:
        raise ValueError(f"position_scores must be [2, nH = {heads}, T = {tokens}, W], got {tuple(scores.shape)}")
    if columns.dim() != 1 or columns.numel() % 2 != 1 or columns.dtype != torch.int32:
        raise ValueError(f"position_columns must be [2R + 1] int32, got {tuple(columns.shape)} {columns.dtype}")
    return (columns.numel() - 1) // 2


def dense_scores(scores: torch.Tensor, columns: torch.Tensor, flat: torch.Tensor | None, batch: int, seqlen: int
                 ) -> torch.Tensor:  # fmt: skip
    """[B, nH, S, S] bias of `position_scores` [2, nH, T, W] (token t at padded slot flat[t], or t itself when flat
    is None): what the kernels add, spelled out (the reference's form)."""
    _, heads, tokens, width = scores.shape
    if flat is not None:
        padded = scores.new_zeros(2, heads, batch * seqlen, width).index_copy(2, flat, scores)
    else:
        padded = scores
    padded = padded.view(2, heads, batch, seqlen, width).transpose(1, 2)  # [2, B, nH, S, W]
    radius = (columns.numel() - 1) // 2
    pos = torch.arange(seqlen, device=scores.device)
    index = columns.long()[(pos[None, :] - pos[:, None]).clamp(-radius, radius) + radius]  # [S (i), S (j)]
    index = index.expand(batch, heads, seqlen, seqlen)
    query_side = padded[0].gather(-1, index)  # [B, nH, i, j]: scores[0, h, i, c(i, j)]
    key_side = padded[1].gather(-1, index.transpose(-1, -2)).transpose(-1, -2)  # scores[1, h, j, c(i, j)]
    return query_side + key_side
