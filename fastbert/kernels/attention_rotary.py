"""Rotary positions and sliding windows in the attention kernels (fastbert/kernels/attention.py's kernels call these).

Rotary (`rotary` [2, T, R/2] fp32, unit stride on R/2, on qkv's device: each packed token's cos and sin per rotated
pair): q and k tiles are rotated as they are loaded (rotate-half over the first R dims: x[d] cos - x[d + R/2] sin and
x[d + R/2] cos + x[d] sin; the partner half is a second load of the same rows, from cache), in fp32 and rounded to the
tile's dtype, a ROTARY constexpr. Nothing rotated is written to memory; the backward kernels rotate what they load the
same way and give the gradients of the rotated q and k, which `unrotate` turns into the inputs' (one pass over dQ
and dK). Window (`window` >= 0: keys with |j - i| <= window): each program loops over the blocks its rows reach
(`span`) and masks the rest of those blocks, a WINDOW constexpr; a row may see no key in a block, so the online
softmax takes its exponents against 0 there instead of -inf.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def load_rows(ptr, tok, rmask, d, D, stride_t):
    """A [BLOCK, BLOCK_D] tile of rows `tok` (int64) from a [*, D] view, 0 outside the rows / D."""
    return tl.load(ptr + tok[:, None] * stride_t + d[None, :], mask=rmask[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def load_qk(ptr, tok, rmask, d, D, stride_t, rot_ptr, half, rot_side, rot_tok, ROTARY: tl.constexpr):
    """A q or k tile as _load_rows gives it, rotated by each token's (cos, sin) row where ROTARY (rotate-half over the
    first 2 * half dims, computed in fp32 and rounded to the tile's dtype, as the reference does)."""
    x = load_rows(ptr, tok, rmask, d, D, stride_t)
    if ROTARY:
        first, rotated = d < half, d < 2 * half
        partner = tl.where(first, d + half, tl.where(rotated, d - half, d))
        other = load_rows(ptr, tok, rmask, partner, D, stride_t)
        at = rot_ptr + tok[:, None] * rot_tok + tl.where(first, d, d - half)[None, :]
        inside = rmask[:, None] & rotated[None, :]
        cos = tl.load(at, mask=inside, other=1.0)
        sin = tl.load(at + rot_side, mask=inside, other=0.0)
        sign = tl.where(first, -1.0, 1.0)[None, :]
        x = (x.to(tl.float32) * cos + sign * other.to(tl.float32) * sin).to(x.dtype)
    return x


@triton.jit
def span(first, count, length, window, BLOCK: tl.constexpr, WINDOW: tl.constexpr):
    """The [lo, hi) of the other side's blocks that rows first .. first + count - 1 reach: all of [0, length), or
    with WINDOW those within `window` of them, lo on a block boundary."""
    lo = 0
    hi = length
    if WINDOW:
        lo = tl.maximum(first - window, 0) // BLOCK * BLOCK
        hi = tl.minimum(length, first + count + window)
    return lo, hi


def rotary_args(qkv: torch.Tensor, rotary: torch.Tensor | None, window: int | None) -> tuple:
    """The kernels' rotary and window arguments: (table, R/2, side and token strides, window), or stand-ins the
    kernels never read (ROTARY, WINDOW off)."""
    table = (rotary, rotary.shape[2], rotary.stride(0), rotary.stride(1)) if rotary is not None else (qkv, 0, 0, 0)
    return (*table, window or 0)


def unrotate(dqkv: torch.Tensor, rotary: torch.Tensor) -> None:
    """dQ and dK of the rotated q and k (what the backward kernels give) -> those of the inputs, in place: the inverse
    rotation, (g1, g2) -> (g1 cos + g2 sin, g2 cos - g1 sin) over the rotated pairs."""
    half = rotary.shape[2]
    cos, sin = (t.float()[:, None, None, :] for t in rotary.unbind(0))  # [T, 1, 1, R/2]
    g = dqkv[:, :2, :, : 2 * half].float()  # a view for fp32: both halves are computed before the one write
    g1, g2 = g[..., :half], g[..., half:]
    dqkv[:, :2, :, : 2 * half] = torch.cat((g1 * cos + g2 * sin, g2 * cos - g1 * sin), dim=-1).to(dqkv.dtype)


def check_rotary(rotary: torch.Tensor, qkv: torch.Tensor) -> None:
    """rotary: [2, T, R/2] fp32 with 0 < R <= D, a unit stride on R/2, on qkv's device."""
    total, dim = qkv.shape[0], qkv.shape[-1]
    if rotary.dim() != 3 or rotary.shape[:2] != (2, total) or not 0 < 2 * rotary.shape[2] <= dim:
        shape = tuple(rotary.shape)
        raise ValueError(f"rotary must be [2, T = {total}, R/2] with 0 < R <= head dim {dim}, got {shape}")
    if rotary.dtype != torch.float32:
        raise ValueError(f"rotary must be float32, got {rotary.dtype}")
    if rotary.device != qkv.device:
        raise ValueError(f"rotary is on {rotary.device}, qkv on {qkv.device}")
    if rotary.stride(2) != 1:
        raise ValueError("rotary needs a unit stride on R/2")
