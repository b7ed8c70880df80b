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
