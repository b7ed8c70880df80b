"""The pre-norm encoder layers of the rotary families: norm -> attention -> residual, norm -> gated feed-forward ->
residual, with transformers' module names, so their checkpoints load unchanged inside fastbert's one model
(BertModel's embeddings and encoder). ModernBERT's (`PreNormLayer`: `attn_norm`, `attn.Wqkv`, `attn.Wo`, `mlp_norm`,
`mlp.Wi`, `mlp.Wo`; LayerNorm, GeGLU, global and sliding-window layers) and EuroBERT's (`LlamaLayer`, Llama's:
`input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`; RMSNorm, SwiGLU,
key and value heads shared by groups of query heads).

Every GEMM goes through `fastbert.ops.linear` (its fastest backend: oneDNN, fastbert's GEMMs, int8), the gated
feed-forward's first through `fastbert.ops.gated_linear` (on CPU one GEMM whose tiles write act(x W^T) * (x V^T)),
attention through `fastbert.ops.attention` with the layer's rotary table and window (global layers: none), so the
native CPU kernel rotates q and k as it loads them and skips the key chunks a window does not reach. Grouped key and
value heads are repeated to the query heads before the attention op (a copy of k and v per layer; the kernels read
one head per query head). These layers run module by module: the fused executors (the layer stack, the loop, CUDA
graphs) take post-norm BERT layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastbert import ops, reference
from fastbert.config import ACT_KINDS, BertConfig
from fastbert.execution.structure import plain
from fastbert.padding import Packing
from fastbert.rotary import SLIDING


def through(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x through the module: the dispatched GEMM, or its own forward where it is hooked or wrapped (LoRA)."""
    if plain(module, nn.Linear):
        return ops.linear(x, module.weight, module.bias)
    return module(x)


def norm(config: BertConfig) -> nn.LayerNorm | nn.RMSNorm:
    """A norm of the family's: RMSNorm for Llama's layers, else a LayerNorm with or without a bias (`norm_bias`); eps
    `layer_norm_eps`."""
    if config.family.llama_layers:
        return nn.RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=bool(getattr(config, "norm_bias", True)))


def normed(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x through a norm: an RMSNorm with Llama's fp32 statistics (reference.rms_norm), anything else its own way."""
    if plain(module, nn.RMSNorm):
        return reference.rms_norm(x, module.weight, module.eps)
    return module(x)


def attend(
    qkv: torch.Tensor,  # [T, 3, nH, D]
    packing: Packing,
    dropout_p: float,
    training: bool,
    output_attentions: bool,
    rotary: torch.Tensor,  # [2, T, R/2] fp32
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, nH, D], probs [B, nH, S, S] or None
    """The attention op with rotary positions (and a window), or the reference where probabilities are wanted."""
    cu, longest = packing.cu_seqlens, packing.max_seqlen
    if output_attentions:
        return reference.attention_with_probs(qkv, cu, longest, dropout_p, training, None, None, None, None, rotary,
                                              window)  # fmt: skip
    return ops.attention(qkv, cu, longest, dropout_p, training, None, None, None, None, rotary, window), None


class RotaryAttention(nn.Module):
    """Fused QKV projection, attention with rotary positions (and a window on sliding layers), output projection."""

    def __init__(self, config: BertConfig, layer: int) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.Wo = nn.Linear(hidden, hidden, bias=bias)
        self.kind = config.layer_kinds[layer]
        self.window = config.sliding_window if self.kind == SLIDING else None
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        packing: Packing,
        output_attentions: bool,
        rotary: torch.Tensor,  # [2, T, R/2] fp32, this layer kind's
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, H], probs [B, nH, S, S] or None
        total = x.shape[0]
        qkv = through(self.Wqkv, x).view(total, 3, self.num_heads, self.head_dim)
        ctx, probs = attend(qkv, packing, self.dropout_p, self.training, output_attentions, rotary, self.window)
        out = through(self.Wo, ctx.reshape(total, self.num_heads * self.head_dim))
        return F.dropout(out, self.dropout_p, self.training), probs


class GatedMLP(nn.Module):
    """Wi to twice the intermediate width, act(first half) * second half (the gated_linear op), dropout, Wo (GeGLU
    with gelu)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = ACT_KINDS[config.hidden_act]
        self.dropout_p = config.hidden_dropout_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if plain(self.Wi, nn.Linear):  # Wi stacks the activated rows over the gate's: the gated_linear op's layout
            gated = ops.gated_linear(x, self.Wi.weight, self.Wi.bias, None, None, self.act)
        else:
            up, gate = self.Wi(x).chunk(2, dim=-1)
            gated = reference.activation(up, self.act) * gate
        return through(self.Wo, F.dropout(gated, self.dropout_p, self.training))


class PreNormBlock(nn.Module):
    """x + attention(norm(x)), then + feed-forward(norm(.)): the one forward of both pre-norm layers, whose modules
    carry each family's transformers names (`parts`)."""

    def parts(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """(first norm, attention, second norm, feed-forward)."""
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        packing: Packing,
        output_attentions: bool = False,
        rotary: dict[str, torch.Tensor] | None = None,  # layer kind -> [2, T, R/2] (BertEncoder.rotary_terms)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        first, attention, second, mlp = self.parts()
        attended, probs = attention(normed(first, x), packing, output_attentions, rotary[attention.kind])
        x = x + attended
        return x + mlp(normed(second, x)), probs


class PreNormLayer(PreNormBlock):
    """ModernBERT's layer: x + attn(attn_norm(x)), then + mlp(mlp_norm(.)); the first layer's attn_norm is the
    identity (the embeddings end in a norm)."""

    def __init__(self, config: BertConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if layer == 0 else norm(config)
        self.attn = RotaryAttention(config, layer)
        self.mlp_norm = norm(config)
        self.mlp = GatedMLP(config)

    def parts(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        return self.attn_norm, self.attn, self.mlp_norm, self.mlp


class GroupedQueryAttention(nn.Module):
    """Llama's attention (EuroBERT's `self_attn`): q, k and v projections, k and v with num_key_value_heads heads
    each serving num_attention_heads / num_key_value_heads query heads, rotary positions, the output projection."""

    def __init__(self, config: BertConfig, layer: int) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.num_heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.kind = config.layer_kinds[layer]
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        packing: Packing,
        output_attentions: bool,
        rotary: torch.Tensor,  # [2, T, R/2] fp32
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, H], probs [B, nH, S, S] or None
        total, heads, dim = x.shape[0], self.num_heads, self.head_dim
        q = through(self.q_proj, x).view(total, 1, heads, dim)
        k, v = (through(p, x).view(total, 1, self.kv_heads, dim) for p in (self.k_proj, self.v_proj))
        if self.kv_heads != heads:  # query head h reads key and value head h // group, as transformers' repeat_kv
            k, v = (t.repeat_interleave(heads // self.kv_heads, dim=2) for t in (k, v))
        qkv = torch.cat((q, k, v), dim=1)
        ctx, probs = attend(qkv, packing, self.dropout_p, self.training, output_attentions, rotary, None)
        return through(self.o_proj, ctx.reshape(total, heads * dim)), probs


class SwiGLU(nn.Module):
    """Llama's feed-forward (EuroBERT's `mlp`): down_proj(act(gate_proj(x)) * up_proj(x)), the first two as one
    gated_linear op."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act = ACT_KINDS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate, up = self.gate_proj, self.up_proj
        if plain(gate, nn.Linear) and plain(up, nn.Linear):
            gated = ops.gated_linear(x, gate.weight, gate.bias, up.weight, up.bias, self.act)
        else:
            gated = reference.activation(gate(x), self.act) * up(x)
        return through(self.down_proj, gated)


class LlamaLayer(PreNormBlock):
    """EuroBERT's layer (Llama's, attending both ways): x + self_attn(input_layernorm(x)), then
    + mlp(post_attention_layernorm(.)), both norms RMSNorm."""

    def __init__(self, config: BertConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = norm(config)
        self.self_attn = GroupedQueryAttention(config, layer)
        self.post_attention_layernorm = norm(config)
        self.mlp = SwiGLU(config)

    def parts(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        return self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp
