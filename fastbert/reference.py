"""Every fused op in plain torch: the specification, the portable (CPU) path and the test oracle.

Each function computes in its inputs' dtype, or in fp32 with `upcast=True` (cast back once on return), the way
FlashAttention's references do. Kernels in `fastbert.kernels` and `csrc/` must match these.

Packed layout: tokens of all sequences laid end to end, `[total_tokens, ...]`; sequence b owns rows
`cu_seqlens[b]:cu_seqlens[b + 1]` (int32, length batch + 1); `max_seqlen` is a Python int (no host sync).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from fastbert import relative_positions

ACT_GELU, ACT_GELU_TANH, ACT_RELU, ACT_SILU = "gelu", "gelu_tanh", "relu", "silu"
ACTIVATIONS = (ACT_GELU, ACT_GELU_TANH, ACT_RELU)  # the bias_act and linear ops' (every backend's)
GATE_ACTIVATIONS = (*ACTIVATIONS, ACT_SILU)  # the gated ops': silu too (NomicBERT's and EuroBERT's SwiGLU)


def _up(t: torch.Tensor | None, upcast: bool) -> torch.Tensor | None:
    if t is None or not upcast or t.dtype == torch.float64:
        return t
    return t.float()


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm with fp32 statistics whatever the input dtype (fp16 overflows in the variance otherwise); `bias`
    None for the norms that have none (ModernBERT's)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        bias = None if bias is None else bias.float()
        return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias, eps).to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], weight.to(x.dtype), None if bias is None else bias.to(x.dtype), eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama's (EuroBERT's): x / sqrt(mean(x^2) + eps) with fp32 statistics, cast back to x's dtype, then
    times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def embedding_layernorm(
    input_ids: torch.Tensor | None,  # [*] int
    token_type_ids: torch.Tensor,  # [*] int
    position_ids: torch.Tensor,  # [*] int
    word_weight: torch.Tensor,  # [V, E]
    position_weight: torch.Tensor,  # [P, E]
    type_weight: torch.Tensor,  # [Tt, E]
    ln_weight: torch.Tensor,  # [E]
    ln_bias: torch.Tensor,  # [E]
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
    inputs_embeds: torch.Tensor | None = None,  # [*, E], replaces the word lookup
    upcast: bool = False,
) -> torch.Tensor:  # [*, E]
    """LayerNorm(word[ids] + position[pos] + type[tt]), then dropout."""
    dtype = word_weight.dtype if inputs_embeds is None else inputs_embeds.dtype
    words = F.embedding(input_ids, word_weight) if inputs_embeds is None else inputs_embeds
    x = _up(words, upcast) + _up(F.embedding(token_type_ids, type_weight), upcast)
    x = x + _up(F.embedding(position_ids, position_weight), upcast)
    x = layer_norm(x, _up(ln_weight, upcast), _up(ln_bias, upcast), eps)
    return F.dropout(x, dropout_p, training).to(dtype)


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The pointwise activations encoder configs name: erf GELU, tanh GELU (`gelu_new`), ReLU, SiLU (NomicBERT)."""
    if kind == ACT_GELU:
        return F.gelu(x)
    if kind == ACT_GELU_TANH:
        return F.gelu(x, approximate="tanh")
    if kind == ACT_RELU:
        return F.relu(x)
    if kind == ACT_SILU:
        return F.silu(x)
    raise ValueError(f"unknown activation {kind!r}; expected one of {GATE_ACTIVATIONS}")


def linear(
    x: torch.Tensor,  # [*, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    act: str | None = None,
    upcast: bool = False,
) -> torch.Tensor:  # [*, N]
    """act(x @ weight^T + bias): every dense layer of the encoder (FFN-in with `act`).

    Under `torch.autocast` the GEMM runs in the autocast dtype, exactly as `F.linear` does; the activation follows.
    """
    out = F.linear(_up(x, upcast), _up(weight, upcast), _up(bias, upcast))
    out = activation(out, act) if act is not None else out
    return out.to(x.dtype) if upcast else out


def bias_act(
    x: torch.Tensor,  # [*, N]
    bias: torch.Tensor,  # [N]
    kind: str = ACT_GELU,
    upcast: bool = False,
) -> torch.Tensor:  # [*, N]
    """act(x + bias): the epilogue of the FFN's first GEMM."""
    return activation(_up(x, upcast) + _up(bias, upcast), kind).to(x.dtype)


def bias_residual_layernorm(
    x: torch.Tensor,  # [*, N], a GEMM output without its bias
    bias: torch.Tensor,  # [N]
    residual: torch.Tensor,  # [*, N]
    ln_weight: torch.Tensor,  # [N]
    ln_bias: torch.Tensor,  # [N]
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
    upcast: bool = False,
) -> torch.Tensor:  # [*, N]
    """LayerNorm(dropout(x + bias) + residual): the epilogue of every BERT sub-layer.

    Returns the wider of x's and residual's dtypes: under autocast x is the GEMM's bf16/fp16 output while the residual
    stream keeps the model's dtype, as transformers' fp32 LayerNorm does under autocast.
    """
    h = F.dropout(_up(x, upcast) + _up(bias, upcast), dropout_p, training) + _up(residual, upcast)
    out_dtype = torch.promote_types(x.dtype, residual.dtype)
    return layer_norm(h, _up(ln_weight, upcast), _up(ln_bias, upcast), eps).to(out_dtype)


def gated_act(
    x: torch.Tensor,  # [*, N]
    up: torch.Tensor,  # [*, N]
    kind: str = ACT_GELU,
    upcast: bool = False,
) -> torch.Tensor:  # [*, N]
    """act(x) * up: a gated feed-forward's activation (GeGLU with gelu, SwiGLU with silu)."""
    return (activation(_up(x, upcast), kind) * _up(up, upcast)).to(x.dtype)


def gated_linear(
    x: torch.Tensor,  # [*, K]
    weight: torch.Tensor,  # [N, K], or [2N, K] (activated rows over up rows) with no up_weight
    bias: torch.Tensor | None = None,  # [N] or [2N]
    up_weight: torch.Tensor | None = None,  # [N, K]
    up_bias: torch.Tensor | None = None,  # [N]
    act: str = ACT_GELU,
    upcast: bool = False,
) -> torch.Tensor:  # [*, N]
    """act(x @ weight^T + bias) * (x @ up_weight^T + up_bias); with no up_weight, act(first half) * second half of
    x @ weight^T + bias (ModernBERT's Wi)."""
    h, weight, bias, up_weight, up_bias = (_up(t, upcast) for t in (x, weight, bias, up_weight, up_bias))
    if up_weight is None:
        gate, up = F.linear(h, weight, bias).chunk(2, dim=-1)
    else:
        gate, up = F.linear(h, weight, bias), F.linear(h, up_weight, up_bias)
    return gated_act(gate, up, act).to(x.dtype)


def dense_residual_layernorm(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor,  # [N]
    residual: torch.Tensor,  # [T, N]
    ln_weight: torch.Tensor,  # [N]
    ln_bias: torch.Tensor,  # [N]
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
    upcast: bool = False,
) -> torch.Tensor:  # [T, N]
    """LayerNorm(dropout(x @ weight^T + bias) + residual): a sub-layer's output projection and its epilogue."""
    y = linear(x, weight, None, None, upcast)
    return bias_residual_layernorm(y, bias, residual, ln_weight, ln_bias, eps, dropout_p, training, upcast)


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear computes `x` in: autocast's for an fp32 x where autocast is on for x's device, else x's."""
    kind = x.device.type
    if x.dtype == torch.float32 and kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off: these ops pick their own precision (fp32 softmax); autocast must not recast their matmuls."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed token: (its sequence index, its position inside the sequence). No host sync."""
    token = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens[1:].contiguous(), token, right=True)
    return seq, token - cu_seqlens[seq]


def _to_padded(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """[T, 3, nH, D] packed -> ([3, B, nH, S, D], key mask [B, 1, 1, S] or None, flat index [T] or None)."""
    batch = cu_seqlens.numel() - 1
    total, _, heads, dim = qkv.shape
    if total == batch * max_seqlen:  # no padding anywhere: a view, no mask
        return qkv.view(batch, max_seqlen, 3, heads, dim).permute(2, 0, 3, 1, 4), None, None
    seq, pos = packed_positions(cu_seqlens, total)
    flat = seq.long() * max_seqlen + pos.long()
    padded = qkv.new_zeros(batch * max_seqlen, 3, heads, dim).index_copy(0, flat, qkv)
    padded = padded.view(batch, max_seqlen, 3, heads, dim).permute(2, 0, 3, 1, 4)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).view(batch, 1, 1, 1)
    keys = torch.arange(max_seqlen, device=qkv.device).view(1, 1, 1, max_seqlen)
    # An empty sequence attends to every (zero) key so no softmax row is all -inf; its rows are never read back.
    mask = (keys < lengths) | (lengths == 0)
    return padded, mask, flat


def _position_terms(
    qkv: torch.Tensor,  # [T, 3, nH, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    max_seqlen: int,
    flat: torch.Tensor | None,  # [T] padded slot of each token, or None
    table: torch.Tensor | None,  # [nH, 2R + 1] fp32
    scores: torch.Tensor | None,  # [2, nH, T, W]
    columns: torch.Tensor | None,  # [2R + 1] int32
) -> torch.Tensor | None:  # [B or 1, nH, S, S] fp32
    """The relative-position terms every score gains (MPNet's table, DeBERTa's disentangled scores), spelled out."""
    total, _, heads, _ = qkv.shape
    bias = None
    if table is not None:
        relative_positions.table_radius(table, heads)
        bias = relative_positions.dense_bias(table, max_seqlen).unsqueeze(0)
    if (scores is None) != (columns is None):
        raise ValueError("position_scores and position_columns come together")
    if scores is not None:
        relative_positions.check_scores(scores, columns, heads, total)
        batch = cu_seqlens.numel() - 1
        wide = scores.to(torch.promote_types(scores.dtype, torch.float32))
        terms = relative_positions.dense_scores(wide, columns, flat, batch, max_seqlen)
        bias = terms if bias is None else bias + terms
    return bias


def rotate(qkv: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:  # [T, 3, nH, D], [2, T, R/2] -> [T, 3, nH, D]
    """q and k rotated by each token's (cos, sin) row, rotate-half form over the first R dims, in fp32 (fp64 for fp64)
    and rounded to qkv's dtype (transformers' apply_rotary_pos_emb); v as it is."""
    total, _, _, dim = qkv.shape
    half = rotary.shape[-1] if rotary.dim() == 3 else 0
    if rotary.dim() != 3 or rotary.shape[:2] != (2, total) or not 0 < 2 * half <= dim:
        shape = tuple(rotary.shape)
        raise ValueError(f"rotary must be [2, T = {total}, R/2] with 0 < R <= head dim {dim}, got {shape}")
    wide = torch.promote_types(qkv.dtype, torch.float32)
    cos, sin = (t.to(wide)[:, None, None, :] for t in rotary.unbind(0))  # [T, 1, 1, R/2]
    rotated = rotate_half(qkv[:, :2].to(wide), cos, sin)
    return torch.cat((rotated.to(qkv.dtype), qkv[:, 2:]), dim=1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
    """x[d] cos - x[d + R/2] sin and x[d + R/2] cos + x[d] sin for d < R/2 (cos, sin [..., R/2] broadcast against x),
    the dims from R on as they are: the reference's rotation, and the export graph's."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :]), dim=-1)


def windowed(mask: torch.Tensor | None, window: int, max_seqlen: int, device: torch.device) -> torch.Tensor:
    """The key mask narrowed to keys within `window` of each query: [B or 1, 1, S, S]. A padding query row the
    window leaves no key keeps the sequence's keys, so no softmax row is all -inf (its row is never read back)."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (keys within that distance), got {window}")
    index = torch.arange(max_seqlen, device=device)
    near = ((index[None, :] - index[:, None]).abs() <= window).view(1, 1, max_seqlen, max_seqlen)
    if mask is None:
        return near
    both = mask & near
    return both | (mask & ~both.any(dim=-1, keepdim=True))


def _biased_mask(bias: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The position terms as an additive mask in `dtype`, -inf at the keys `mask` leaves out."""
    bias = bias.to(dtype)
    return bias if mask is None else bias.masked_fill(~mask, float("-inf"))


def attention(
    qkv: torch.Tensor,  # [T, 3, nH, D] packed tokens
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    max_seqlen: int,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
    position_bias: torch.Tensor | None = None,  # [nH, 2R + 1] fp32
    position_scores: torch.Tensor | None = None,  # [2, nH, T, W]
    position_columns: torch.Tensor | None = None,  # [2R + 1] int32
    rotary: torch.Tensor | None = None,  # [2, T, R/2] fp32
    window: int | None = None,
    upcast: bool = False,
) -> torch.Tensor:  # [T, nH, D]
    """softmax(q k^T * scale + bias) v within each sequence (bidirectional), fp32 softmax; the bias of query i and
    key j is position_bias[h, clamp(j - i, -R, R) + R] plus position_scores[0, h, i, c] + position_scores[1, h, j, c],
    c = position_columns[clamp(j - i, -R, R) + R] (spelled out as [B, nH, S, S] here, the reference's form); q and k
    rotated first by `rotary`, keys farther than `window` from the query masked out."""
    total, _, heads, dim = qkv.shape
    if total == 0:
        return qkv.new_zeros(0, heads, dim)
    qkv = rotate(qkv, rotary) if rotary is not None else qkv
    padded, mask, flat = _to_padded(_up(qkv, upcast), cu_seqlens, max_seqlen)
    if window is not None:
        mask = windowed(mask, window, max_seqlen, qkv.device)
    q, k, v = padded.unbind(0)
    p = dropout_p if training else 0.0
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    bias = _position_terms(qkv, cu_seqlens, max_seqlen, flat, position_bias, position_scores, position_columns)
    if bias is not None:
        mask = _biased_mask(bias, mask, q.dtype)
    with no_autocast(qkv.device):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)  # [B, nH, S, D]
    out = out.transpose(1, 2).reshape(-1, heads, dim)
    out = out if flat is None else out.index_select(0, flat)
    return out.to(qkv.dtype)


def attention_with_probs(
    qkv: torch.Tensor,  # [T, 3, nH, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    max_seqlen: int,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
    position_bias: torch.Tensor | None = None,  # [nH, 2R + 1] fp32
    position_scores: torch.Tensor | None = None,  # [2, nH, T, W]
    position_columns: torch.Tensor | None = None,  # [2R + 1] int32
    rotary: torch.Tensor | None = None,  # [2, T, R/2] fp32
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, nH, D], [B, nH, S, S]
    """The slow path that materialises the probabilities (`output_attentions`, attention distillation)."""
    total, _, heads, dim = qkv.shape
    batch = cu_seqlens.numel() - 1
    if total == 0:
        return qkv.new_zeros(0, heads, dim), qkv.new_zeros(batch, heads, max_seqlen, max_seqlen)
    qkv = rotate(qkv, rotary) if rotary is not None else qkv
    padded, mask, flat = _to_padded(qkv, cu_seqlens, max_seqlen)
    if window is not None:
        mask = windowed(mask, window, max_seqlen, qkv.device)
    q, k, v = padded.unbind(0)
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    with no_autocast(qkv.device):
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        bias = _position_terms(qkv, cu_seqlens, max_seqlen, flat, position_bias, position_scores, position_columns)
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        dropped = F.dropout(probs, dropout_p, training)
        out = torch.matmul(dropped.to(v.dtype), v).transpose(1, 2).reshape(-1, heads, dim)
    out = out if flat is None else out.index_select(0, flat)
    return out, probs.to(qkv.dtype)
