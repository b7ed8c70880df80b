"""The pre-norm encoder layer of the rotary families (ModernBERT): norm -> attention -> residual, norm -> gated
feed-forward -> residual, with transformers' module names (`attn_norm`, `attn.Wqkv`, `attn.Wo`, `mlp_norm`, `mlp.Wi`,
`mlp.Wo`), so its checkpoints load unchanged inside fastbert's one model (BertModel's embeddings and encoder).

Every GEMM goes through `fastbert.ops.linear` (its fastest backend: oneDNN, fastbert's GEMMs, int8), the gated
feed-forward's first through `fastbert.ops.gated_linear` (on CPU one GEMM whose tiles write act(x W^T) * (x V^T)),
attention through `fastbert.ops.attention` with the layer's rotary table and window (global layers: none), so the
native CPU kernel rotates q and k as it loads them and skips the key chunks a window does not reach. These layers run
module by module: the fused executors (the layer stack, the loop, CUDA graphs) take post-norm BERT layers.
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


def norm(config: BertConfig) -> nn.LayerNorm:
    """A LayerNorm of the family's: with or without a bias (`norm_bias`), eps `layer_norm_eps`."""
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=bool(getattr(config, "norm_bias", True)))


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
        cu, longest, p = packing.cu_seqlens, packing.max_seqlen, self.dropout_p
        if output_attentions:
            ctx, probs = reference.attention_with_probs(qkv, cu, longest, p, self.training, None, None, None, None,
                                                        rotary, self.window)  # fmt: skip
        else:
            ctx = ops.attention(qkv, cu, longest, p, self.training, None, None, None, None, rotary, self.window)
            probs = None
        out = through(self.Wo, ctx.reshape(total, self.num_heads * self.head_dim))
        return F.dropout(out, p, self.training), probs


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


class PreNormLayer(nn.Module):
    """x + attn(attn_norm(x)), then + mlp(mlp_norm(.)); the first layer's attn_norm is the identity (the embeddings
    end in a norm)."""

    def __init__(self, config: BertConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if layer == 0 else norm(config)
        self.attn = RotaryAttention(config, layer)
        self.mlp_norm = norm(config)
        self.mlp = GatedMLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        packing: Packing,
        output_attentions: bool = False,
        rotary: dict[str, torch.Tensor] | None = None,  # layer kind -> [2, T, R/2] (BertEncoder.relative_terms)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attended, probs = self.attn(self.attn_norm(x), packing, output_attentions, rotary[self.attn.kind])
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), probs
