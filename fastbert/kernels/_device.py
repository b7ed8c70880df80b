"""Triton device functions shared by the kernels: LayerNorm forward/backward on a [BLOCK_M, BLOCK_N] tile (fp32
statistics whatever the storage dtype), the dropout keep-mask, and a tl.dot wrapper for the CPU interpreter."""

import triton
import triton.language as tl


@triton.jit
def layernorm_tile(x, mask, w, b, n, eps):
    """x: [BLOCK_M, BLOCK_N] fp32 (0 outside mask); w, b: [BLOCK_N] fp32 -> (y, mean [BLOCK_M], rstd [BLOCK_M])."""
    mean = tl.sum(x, axis=1) / n
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / n
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    return y, mean, rstd


@triton.jit
def layernorm_tile_bwd(g, xhat, rstd, w, n):
    """dL/dx of LayerNorm from g = dL/dy (fp32, 0 outside mask), xhat (normalised input, 0 outside), rstd, w."""
    wg = g * w[None, :]
    c1 = tl.sum(xhat * wg, axis=1) / n
    c2 = tl.sum(wg, axis=1) / n
    return (wg - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]


@triton.jit
def dropout_keep(seed, offsets, p):
    """Keep-mask for inverted dropout: element kept with probability 1 - p; same (seed, offsets) -> same mask."""
    return tl.rand(seed, offsets) >= p


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation; UPCAST feeds the (already rounded) operands as fp32 instead: the same
    products, for triton's CPU interpreter, whose bf16 tl.dot returns garbage (3.9)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)
