"""One BERT definition for every backend: embeddings -> encoder -> pooler, on packed (unpadded) tokens.

Module and parameter names are transformers' (`embeddings.word_embeddings`, `encoder.layer.0.attention.self.query`,
...), so state dicts load unchanged. The modules' forwards are the definition, run through `fastbert.ops`' dispatch;
how a forward actually runs (the ops bound once per mode, CUDA graphs, the CPU layer stack, one loop over the layers'
tensors) is fastbert.execution's choice, one call from `BertModel.forward`. The batch is unpadded once before the
embedding and repadded once at the output.
"""

from __future__ import annotations

import contextlib
import math
import operator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import checkpoint as activations

from fastbert import execution, ops, prenorm, reference, relative_positions, weight_stamp
from fastbert.checkpoint import PreTrainedModel
from fastbert.config import ACT_KINDS, BertConfig
from fastbert.execution import CudaGraphs, Inputs
from fastbert.execution.structure import plain
from fastbert.outputs import BaseModelOutputWithPooling, output_flags, return_dict_of
from fastbert.padding import Packing, rows_with_gaps, unpad_and_read
from fastbert.prenorm import LlamaLayer, PreNormLayer
from fastbert.relative_positions import DisentangledRows, bias_table, distance_buckets
from fastbert.rotary import GLOBAL, inverse_frequencies, rotary_rows
from fastbert.validation import check_inputs
from fastbert.weight_stamp import stamp

_requires_grad = operator.attrgetter("requires_grad")
ACT_OF_CONFIG = ACT_KINDS


class BertEmbeddings(nn.Module):
    """word + position + token-type, LayerNorm, dropout; with `embedding_size` < hidden, then a projection E -> H.

    A family without token types (DistilBERT) adds a zero row instead, so every backend's fused op serves it as is.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        dim, family = config.embedding_dim, config.family
        self.sinusoidal = bool(getattr(config, "sinusoidal_pos_embds", False))
        self.word_embeddings = nn.Embedding(config.vocab_size, dim, padding_idx=config.pad_token_id)
        # RoBERTa's row pad_token_id (MPNet's row 1) is never read for a real token; transformers starts it at zero
        pad_position = position_pad(config) if family.padded_positions else None
        if config.absolute_positions:
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, dim, padding_idx=pad_position)
        else:  # DeBERTa-v3: relative positions only; every token reads this zero row (position id 0)
            self.register_buffer("no_positions", torch.zeros(1, dim), persistent=False)
        if config.token_types:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, dim)
        else:
            self.register_buffer("no_token_types", torch.zeros(1, dim), persistent=False)
        if not family.embedding_norm:  # EuroBERT: the word rows as they are (no positions, types or norm either)
            self.register_module("LayerNorm", None)
        else:
            self.LayerNorm = nn.LayerNorm(dim, eps=config.layer_norm_eps, bias=bool(getattr(config, "norm_bias", True)))
        if self.LayerNorm is not None and self.LayerNorm.bias is None:  # ModernBERT: the fused op adds this zero row
            self.register_buffer("no_norm_bias", torch.zeros(dim), persistent=False)
        self.dropout_p = getattr(config, "embedding_dropout", config.hidden_dropout_prob)
        project = dim != config.hidden_size or family.always_project
        self.projection = nn.Linear(dim, config.hidden_size) if project else None

    def fused(self) -> bool:
        """Whether every table, the LayerNorm and the projection are plain (fastbert.execution.structure.plain), so
        the fused op reading their tensors computes what they would."""
        m = self._modules
        return (plain(m["word_embeddings"], nn.Embedding) and plain(m.get("position_embeddings"), nn.Embedding)
                and plain(m.get("token_type_embeddings"), nn.Embedding) and plain(m["LayerNorm"], nn.LayerNorm)
                and plain(m.get("projection"), nn.Linear))  # fmt: skip

    def position_table(self) -> torch.Tensor:
        """[max_position_embeddings, E], or one zero row where positions are relative only (DeBERTa-v3)."""
        return self.position_embeddings.weight if hasattr(self, "position_embeddings") else self.no_positions

    def type_table(self) -> torch.Tensor:
        """[type_vocab_size, E], or one zero row where the family has no token types."""
        return self.token_type_embeddings.weight if hasattr(self, "token_type_embeddings") else self.no_token_types

    def init_family_weights(self) -> None:
        """DistilBERT's `sinusoidal_pos_embds`: fixed sin/cos position table, as transformers initialises it."""
        if self.sinusoidal:
            with torch.no_grad():
                self.position_embeddings.weight.copy_(sinusoidal_table(*self.position_embeddings.weight.shape))

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [T] packed
        token_type_ids: torch.Tensor,  # [T]
        position_ids: torch.Tensor,  # [T]
        inputs_embeds: torch.Tensor | None = None,  # [T, E]
    ) -> torch.Tensor:  # [T, H]
        """Packed tokens, or any leading shape: transformers' [B, S] when a leaf is hooked or wrapped (`fused`)."""
        if self.LayerNorm is None:  # EuroBERT: a lookup, no sum to fuse
            return inputs_embeds if inputs_embeds is not None else self.word_embeddings(input_ids)
        if not self.fused():
            words = inputs_embeds if inputs_embeds is not None else self.word_embeddings(input_ids)
            types = self.token_type_embeddings(token_type_ids) if hasattr(self, "token_type_embeddings") else 0
            positions = self.position_embeddings(position_ids) if hasattr(self, "position_embeddings") else 0
            x = self.LayerNorm(words + positions + types)
            x = F.dropout(x, self.dropout_p, self.training)
            return self.projection(x) if self.projection is not None else x
        x = ops.embedding_layernorm(
            input_ids,
            token_type_ids,
            position_ids,
            self.word_embeddings.weight,
            self.position_table(),
            self.type_table(),
            self.LayerNorm.weight,
            self.LayerNorm.bias if self.LayerNorm.bias is not None else self.no_norm_bias,
            self.LayerNorm.eps,
            dropout_p=self.dropout_p,
            training=self.training,
            inputs_embeds=inputs_embeds,
        )
        return ops.linear(x, self.projection.weight, self.projection.bias) if self.projection is not None else x


def sinusoidal_table(positions: int, dim: int) -> torch.Tensor:
    """transformers' DistilBERT table: sin on even columns, cos on odd, angle pos / 10000^(2 * (j // 2) / dim)."""
    pos = torch.arange(positions, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(dim, dtype=torch.float64)
    angle = pos / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / dim)
    table = torch.where(j.remainder(2) == 0, torch.sin(angle), torch.cos(angle))
    return table.float()


def position_pad(config: BertConfig) -> int:
    """The id padded positions count from: the family's own (MPNet: 1, whatever the pad token) or the pad token's."""
    pad = config.family.position_pad
    return config.pad_token_id if pad is None else pad


def family_positions(
    config: BertConfig, input_ids: torch.Tensor | None, seqlen: int, device: torch.device
) -> torch.Tensor:
    """Default position ids [B or 1, S]: 0..S-1, or RoBERTa's (counted over non-pad ids, offset by the pad id); all 0
    (the zero row) without absolute positions."""
    if not config.absolute_positions:
        return torch.zeros(1, seqlen, dtype=torch.long, device=device)
    if not config.family.padded_positions:
        return torch.arange(seqlen, device=device).unsqueeze(0)
    pad = position_pad(config)
    if input_ids is None:  # nothing says which embeddings are padding: sequential, as transformers does
        return torch.arange(pad + 1, seqlen + pad + 1, device=device).unsqueeze(0)
    real = input_ids.ne(pad).long()
    return torch.cumsum(real, dim=1) * real + pad


def relative_bias(table: nn.Module) -> torch.Tensor:
    """MPNet's [buckets, nH] embedding as the attention's [nH, 2R + 1] table: buckets as transformers' MPNet computes
    them (32 whatever the table's size), the embedding's own forward where it is hooked or wrapped."""
    if plain(table, nn.Embedding):
        return bias_table(table.weight)
    return table(distance_buckets(table.weight.device)).float().t().contiguous()


class BertSelfAttention(nn.Module):
    scale: float | None = None  # the softmax scale; None: 1 / sqrt(head_dim)
    kinds: tuple[str, ...] = ()  # DeBERTa's relative terms ("c2p", "p2c")
    pos_dropout_p = 0.0  # dropout on DeBERTa's relative rows

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.family.linear_biases
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.query = nn.Linear(hidden, hidden, bias=bias)
        self.key = nn.Linear(hidden, hidden, bias=bias)
        self.value = nn.Linear(hidden, hidden, bias=bias)
        self.dropout_p = config.attention_probs_dropout_prob
        self._fused: tuple[tuple, torch.Tensor, torch.Tensor] | None = None

    def qkv_weight(self, concatenate: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Q, K and V projections as one [3H, H] GEMM: concatenated per call where asked (`concatenate`; None: under
        autograd) or while torch.compile traces, else the cached copy (`fused_qkv`). No bias where the family has
        none (NomicBERT)."""
        m = self._modules
        q, k, v = m["query"]._parameters, m["key"]._parameters, m["value"]._parameters
        tensors = (q["weight"], k["weight"], v["weight"], q["bias"], k["bias"], v["bias"])
        if torch.compiler.is_compiling() or (concatenate is None and torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in tensors)) or concatenate:  # fmt: skip
            return torch.cat(tensors[:3]), _cat_biases(tensors[3:])  # compiling: a cat in the graph (no stamps)
        return self.fused_qkv()

    def fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The [3H, H] weight and [3H] bias (or None) of Q, K and V, cached and rebuilt when any of the six tensors
        changes (fastbert.weight_stamp): the one fused copy per module, which the executors read outside autograd."""
        m = self._modules
        q, k, v = m["query"]._parameters, m["key"]._parameters, m["value"]._parameters
        key = stamp(q["weight"], k["weight"], v["weight"], q["bias"], k["bias"], v["bias"])
        if self._fused is None or self._fused[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor: a later forward may need its grad
                self._fused = (key, torch.cat((q["weight"], k["weight"], v["weight"])),
                               _cat_biases((q["bias"], k["bias"], v["bias"])))  # fmt: skip
        return self._fused[1], self._fused[2]

    def project(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, 3, nH, D]
        """Q, K and V of every token: one GEMM, or each projection's own forward where one is hooked or wrapped."""
        m = self._modules
        if plain(m["query"], nn.Linear) and plain(m["key"], nn.Linear) and plain(m["value"], nn.Linear):
            weight, bias = self.qkv_weight()
            qkv = ops.linear(x, weight, bias)
        else:  # a hooked or wrapped projection (LoRA) runs its own forward
            qkv = torch.stack([m["query"](x), m["key"](x), m["value"](x)], dim=1)
            self._fused = None  # a wrapper may edit the weights behind torch's back (peft's merge: .data +=)
        return qkv.view(x.shape[0], 3, self.num_heads, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        packing: Packing,
        output_attentions: bool = False,
        position_bias: torch.Tensor | dict[str, torch.Tensor] | None = None,  # BertEncoder.forward's terms
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, H] -> [T, H], probs [B, nH, S, S] or None
        """`position_bias`: MPNet's [nH, 2R + 1] fp32 table, or a rotary family's tables by layer kind (GTE's
        BERT-shaped layers are all global)."""
        qkv = self.project(x)
        rotary = None
        if isinstance(position_bias, dict):
            rotary, position_bias = position_bias[GLOBAL], None
        cu, longest = packing.cu_seqlens, packing.max_seqlen
        if output_attentions:
            ctx, probs = reference.attention_with_probs(qkv, cu, longest, self.dropout_p, self.training, None,
                                                        position_bias, None, None, rotary)  # fmt: skip
        else:
            p, probs = self.dropout_p, None
            ctx = ops.attention(qkv, cu, longest, p, self.training, None, position_bias, None, None, rotary)
        return ctx.reshape(x.shape[0], self.num_heads * self.head_dim), probs


def _cat_biases(biases: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
    """Q's, K's and V's biases as one, or None where the family has none."""
    return None if biases[0] is None else torch.cat(biases)


class DisentangledSelfAttention(BertSelfAttention):
    """DeBERTa-v2/v3's attention: score = (q_i . k_j + q_i . Kr[c] + k_j . Qr[c]) / sqrt(3 D), c the bucket of i - j.

    Kr and Qr are this layer's projections of the relative embedding rows (its own pos_key_proj / pos_query_proj, or
    the key / query projections with share_att_key). Per token, the scores against the W rows a batch reaches are two
    small batched GEMMs ([2, nH, T, W], the scale folded into Kr and Qr); the attention kernels gather them by
    distance inside their tile loops.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.kinds = config.disentangled_kinds
        self.scale = 1.0 / math.sqrt(self.head_dim * (1 + len(set(config.pos_att_type or []))))  # each kind once
        self.share_att_key = bool(config.share_att_key)
        self.pos_dropout_p = config.hidden_dropout_prob
        if not self.share_att_key:
            hidden = config.hidden_size
            if "c2p" in self.kinds:
                self.pos_key_proj = nn.Linear(hidden, hidden)
            if "p2c" in self.kinds:
                self.pos_query_proj = nn.Linear(hidden, hidden)

    def position_modules(self) -> tuple[nn.Linear | None, nn.Linear | None]:
        """The projections of the rows: Kr's (c2p) and Qr's (p2c), each None where the config leaves its term out."""
        m = self._modules
        key = (m["key"] if self.share_att_key else m["pos_key_proj"]) if "c2p" in self.kinds else None
        query = (m["query"] if self.share_att_key else m["pos_query_proj"]) if "p2c" in self.kinds else None
        return key, query

    def position_projections(self, rows: torch.Tensor) -> torch.Tensor:  # [W, H] -> [2, nH, D, W]
        """Kr and Qr of the rows through the modules' own forwards (what is hooked or wrapped runs), scaled."""
        key, query = self.position_modules()
        sides = (key(rows) if key is not None else None, query(rows) if query is not None else None)
        return relative_positions.deberta_projections(*sides, rows, self.num_heads, self.head_dim, self.scale)

    def forward(
        self,
        x: torch.Tensor,
        packing: Packing,
        output_attentions: bool = False,
        positions: DisentangledRows | None = None,  # BertEncoder.relative_terms; None without relative attention
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, H] -> [T, H], probs [B, nH, S, S] or None
        qkv = self.project(x)
        scores = columns = None
        if positions is not None and self.kinds:
            rows = F.dropout(positions.rows, self.pos_dropout_p, self.training)
            scores = relative_positions.deberta_scores(qkv, self.position_projections(rows))
            columns = positions.columns
        cu, longest = packing.cu_seqlens, packing.max_seqlen
        if output_attentions:
            ctx, probs = reference.attention_with_probs(
                qkv, cu, longest, self.dropout_p, self.training, self.scale, None, scores, columns
            )
        else:
            ctx = ops.attention(qkv, cu, longest, self.dropout_p, self.training, self.scale, None, scores, columns)
            probs = None
        return ctx.reshape(x.shape[0], self.num_heads * self.head_dim), probs


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig, width: int | None = None) -> None:
        """`width`: the input's (the intermediate size for BertOutput); hidden_size by default."""
        super().__init__()
        self.dense = nn.Linear(width or config.hidden_size, config.hidden_size, bias=config.family.linear_biases)
        if self.dense.bias is None:  # NomicBERT: the fused epilogue adds this zero row instead
            self.register_buffer("no_bias", torch.zeros(config.hidden_size), persistent=False)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout_p = config.hidden_dropout_prob

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if not (plain(self.dense, nn.Linear) and plain(self.LayerNorm, nn.LayerNorm)):
            return self.LayerNorm(F.dropout(self.dense(x), self.dropout_p, self.training) + residual)
        return ops.dense_residual_layernorm(
            x,
            self.dense.weight,
            self.dense.bias if self.dense.bias is not None else self._buffers.get("no_bias"),
            residual,
            self.LayerNorm.weight,
            self.LayerNorm.bias,
            self.LayerNorm.eps,
            self.dropout_p,
            self.training,
        )


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = (DisentangledSelfAttention if config.family.disentangled else BertSelfAttention)(config)
        self.output = BertSelfOutput(config)

    def forward(
        self,
        x: torch.Tensor,
        packing: Packing,
        output_attentions: bool = False,
        position_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx, probs = self.self(x, packing, output_attentions, position_bias)
        return self.output(ctx, x), probs


class BertIntermediate(nn.Module):
    """act(dense(x)); a gated family's (GTE's) act(gate(x)) * dense(x), then dropout, both without biases."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        gated = config.family.gated
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size, bias=not gated)
        if gated:
            self.gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.dropout_p = config.hidden_dropout_prob if config.family.gate_dropout else 0.0
        self.act = ACT_OF_CONFIG[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self._modules.get("gate")
        if gate is not None:
            if plain(gate, nn.Linear) and plain(self.dense, nn.Linear):  # both GEMMs and the gate: one fused op
                gated = ops.gated_linear(x, gate.weight, gate.bias, self.dense.weight, self.dense.bias, self.act)
            else:
                gated = reference.activation(prenorm.through(gate, x), self.act) * prenorm.through(self.dense, x)
            return F.dropout(gated, self.dropout_p, self.training)
        if not plain(self.dense, nn.Linear):
            return reference.activation(self.dense(x), self.act)
        return ops.linear(x, self.dense.weight, self.dense.bias, self.act)


class BertOutput(BertSelfOutput):
    def __init__(self, config: BertConfig) -> None:
        super().__init__(config, config.intermediate_size)


class BertFeedForward(nn.Module):
    """intermediate + output: a container only so ALBERT-style FFN sharing can share one object."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)


class BertLayer(nn.Module):
    def __init__(
        self, config: BertConfig, attention: BertAttention | None = None, ffn: BertFeedForward | None = None
    ) -> None:
        super().__init__()
        self.attention = attention or BertAttention(config)
        ffn = ffn or BertFeedForward(config)
        self.intermediate, self.output = ffn.intermediate, ffn.output

    def forward(
        self,
        x: torch.Tensor,
        packing: Packing,
        output_attentions: bool = False,
        position_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, probs = self.attention(x, packing, output_attentions, position_bias)
        return self.output(self.intermediate(h), h), probs


def build_layers(config: BertConfig) -> nn.ModuleList:
    """num_hidden_layers layers; with ALBERT sharing, layer i reuses group i * G // L's attention/FFN/whole layer;
    the rotary families' pre-norm layers (fastbert.prenorm)."""
    if config.family.pre_norm:
        kind = LlamaLayer if config.family.llama_layers else PreNormLayer
        return nn.ModuleList(kind(config, i) for i in range(config.num_hidden_layers))
    groups = config.num_hidden_groups if config.layer_sharing != "none" else config.num_hidden_layers
    attention = [BertAttention(config) for _ in range(groups)] if config.layer_sharing == "attention" else None
    ffn = [BertFeedForward(config) for _ in range(groups)] if config.layer_sharing == "ffn" else None
    whole = [BertLayer(config) for _ in range(groups)] if config.layer_sharing == "all" else None
    layers = []
    for i in range(config.num_hidden_layers):
        g = config.group_of_layer(i)
        if whole is not None:
            layers.append(whole[g])
        else:
            layers.append(BertLayer(config, attention[g] if attention else None, ffn[g] if ffn else None))
    return nn.ModuleList(layers)


class BertEncoder(nn.Module):
    """The layers; with MPNet's relative attention, the [buckets, nH] bias table every layer's attention adds; with
    DeBERTa's, the relative embedding (and its LayerNorm) every layer projects."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = build_layers(config)
        if config.family.relative_attention:
            buckets = config.relative_attention_num_buckets
            self.relative_attention_bias = nn.Embedding(buckets, config.num_attention_heads)
        if config.family.disentangled and config.relative_attention:
            self.position_buckets, self.max_relative_positions = config.position_buckets, config.max_relative_positions
            if self.max_relative_positions < 1:
                self.max_relative_positions = config.max_position_embeddings
            span = relative_positions.deberta_span(self.position_buckets, self.max_relative_positions)
            self.rel_embeddings = nn.Embedding(2 * span, config.hidden_size)
        norms = [x.strip() for x in str(getattr(config, "norm_rel_ebd", "none")).lower().split("|")]
        if config.family.disentangled and "layer_norm" in norms:  # transformers builds it without the rows too
            self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary = config.family.rotary
        if self.rotary:  # each layer kind's rotary frequencies
            for kind in sorted(set(config.layer_kinds)):
                theta = config.rope_parameters_of(kind)["rope_theta"]
                self.register_buffer(f"{kind}_frequencies", inverse_frequencies(config.head_dim, theta),
                                     persistent=False)  # fmt: skip
        if config.family.pre_norm:  # the norm after the last layer
            self.final_norm = prenorm.norm(config)
        # transformers' flag (model.gradient_checkpointing_enable sets it and the two below): recompute every
        # checkpoint_every-th layer in the backward, with torch.utils.checkpoint's checkpoint_kwargs
        self.gradient_checkpointing, self.checkpoint_every, self.checkpoint_kwargs = False, 1, {}
        self.inputs_require_grad = False  # the layers' input requires grad even under frozen embeddings (peft)

    def position_bias(self) -> torch.Tensor | None:
        """The [nH, 2R + 1] fp32 table by key - query distance the attention kernels read (None without one)."""
        table = self._modules.get("relative_attention_bias")
        return None if table is None else relative_bias(table)

    def relative_terms(self, max_seqlen: int) -> torch.Tensor | DisentangledRows | None:
        """What every layer's attention adds for relative positions: MPNet's table, DeBERTa's rows, or None."""
        table = self._modules.get("rel_embeddings")
        if table is None:
            return self.position_bias()
        first, width, columns = relative_positions.deberta_rows(
            max_seqlen, self.position_buckets, self.max_relative_positions, table.weight.device
        )
        rows = table(torch.arange(first, first + width, device=table.weight.device))
        norm = self._modules.get("LayerNorm")
        return DisentangledRows(norm(rows) if norm is not None else rows, columns)

    def rotary_terms(self, packing: Packing, total: int) -> dict[str, torch.Tensor]:
        """Per layer kind, the [2, T, R/2] rotary table of the packed tokens, positions counted within each
        sequence (rotation depends on position differences only, so left padding gives transformers' scores too)."""
        _, positions = reference.packed_positions(packing.cu_seqlens, total)
        return {name.removesuffix("_frequencies"): rotary_rows(positions, frequencies)
                for name, frequencies in self._buffers.items() if name.endswith("_frequencies")}  # fmt: skip

    def forward(
        self, x: torch.Tensor, packing: Packing, output_hidden_states: bool = False, output_attentions: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        hidden, attentions = [x] if output_hidden_states else [], []
        final = self._modules.get("final_norm")
        bias = self.rotary_terms(packing, x.shape[0]) if self.rotary else self.relative_terms(packing.max_seqlen)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        if (recompute or self.inputs_require_grad) and torch.is_grad_enabled() and not x.requires_grad:
            x.requires_grad_()  # frozen embeddings: a (reentrant) checkpoint still sees a graph from here on
        for i, layer in enumerate(self.layer):
            if recompute and i % self.checkpoint_every == 0:  # recomputed in the backward, same dropout masks
                x, probs = activations.checkpoint(layer, x, packing, output_attentions, bias,
                                                  **{"use_reentrant": False, **self.checkpoint_kwargs})  # fmt: skip
            else:
                x, probs = layer(x, packing, output_attentions, bias)
            if output_hidden_states:
                hidden.append(x)
            if output_attentions:
                attentions.append(probs)
        if final is not None:  # the last hidden state is the normed one, as transformers reports it
            x = prenorm.normed(final, x)
            if output_hidden_states:
                hidden[-1] = x
        return x, hidden, attentions


# What the fused executors compute: these forwards (the embeddings', the encoder's, then a layer's, its attention's,
# self-attention's, attention output's, intermediate's and output's); a model whose modules run any other runs module
# by module.
FORWARDS = execution.Forwards(
    BertEmbeddings.forward,
    BertEncoder.forward,
    (BertLayer.forward, BertAttention.forward, (BertSelfAttention.forward, DisentangledSelfAttention.forward),
     BertSelfOutput.forward, BertIntermediate.forward, BertOutput.forward),
)  # fmt: skip


class BertPooler(nn.Module):
    """The first token through dense -> tanh; DeBERTa's context pooler: dropout -> dense -> pooler_hidden_act."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        context = config.family.context_pooler
        self.act = ACT_OF_CONFIG[config.pooler_hidden_act] if context else None  # None: tanh
        self.dropout_p = config.pooler_dropout if context else 0.0

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [B, S, H] -> [B, H]
        first = F.dropout(hidden_states[:, 0], self.dropout_p, self.training) if self.dropout_p else hidden_states[:, 0]
        if not plain(self.dense, nn.Linear):
            x = self.dense(first)
        else:
            x = ops.linear(first, self.dense.weight, self.dense.bias)
        return torch.tanh(x) if self.act is None else reference.activation(x, self.act)


def _weights_loaded(model: BertModel, incompatible_keys: object) -> None:
    model.weights_changed()


def _pad_probs(probs: torch.Tensor, seqlen: int) -> torch.Tensor:
    """[B, nH, s, s] (s = longest real sequence) -> transformers' [B, nH, S, S]."""
    pad = seqlen - probs.shape[-1]
    return F.pad(probs, (0, pad, 0, pad)) if pad else probs


class BertModel(PreTrainedModel):
    """Drop-in for `transformers.BertModel`: same checkpoints, same forward contract, same outputs.

    Built from a RobertaConfig, DistilBertConfig, ... it is that family's model (fastbert.families says how).
    """

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True, context_pooler: bool = False) -> None:
        """`context_pooler`: the sentence heads' pooler of a family whose bare model has none (DeBERTa)."""
        super().__init__(config)
        self.plans = execution.Plans(type(self).__name__, FORWARDS, execution.EXECUTORS)  # how forwards run, per mode
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        family = config.family
        pools = family.pooler or (context_pooler and (family.context_pooler or family.head_pooler))
        self.pooler = BertPooler(config) if add_pooling_layer and pools else None
        self.cuda_graphs = None
        self.register_load_state_dict_post_hook(_weights_loaded)  # into inference tensors, no version is bumped
        self.post_init()

    @property
    def cuda_graphs(self) -> CudaGraphs | bool | None:
        """Replay on a GPU: None = on by default once on CUDA in eval, False = off, or the model's CudaGraphs
        (fastbert.execution.graphs' enable / disable). Setting it binds the plans anew."""
        return self.__dict__["_cuda_graphs"]

    @cuda_graphs.setter
    def cuda_graphs(self, graphs: CudaGraphs | bool | None) -> None:
        self.__dict__["_cuda_graphs"] = graphs
        self.plans.clear()

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - nn.Module's signature
        """.to() / .cuda() / .half() ...: plans, fused QKV copies and captured graphs belong to the old tensors; drop
        them so they free their memory now (the next forward binds and captures again)."""
        self.plans.clear()
        self.weights_changed()
        if isinstance(self.cuda_graphs, CudaGraphs):
            self.cuda_graphs.reset()
        return super()._apply(fn, *args, **kwargs)

    def weights_changed(self) -> None:
        """Say that weights were changed where torch cannot see it (`param.data` edited in place, a NumPy view of a
        parameter written): the copies kept of them (the fused QKV weight, the CPU kernels' packed and int8 weights)
        are built again at the next forward. Every other route is seen without it: in-place ops on a parameter, an
        optimizer step, `load_state_dict` (which calls this), `.to()`, a parameter or module assigned anew. A CUDA
        graph reads the weights where they lie and needs nothing."""
        for module in self.modules():
            if isinstance(module, BertSelfAttention):
                module._fused = None
        weight_stamp.forget(self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor | None = None,  # [B, S]
        attention_mask: torch.Tensor | None = None,  # [B, S] 0/1, bool or float; 1 = attend
        token_type_ids: torch.Tensor | None = None,  # [B, S]
        position_ids: torch.Tensor | None = None,  # [B, S] or [1, S] or [S]
        inputs_embeds: torch.Tensor | None = None,  # [B, S, E]
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        packed_output: bool = False,
        head_mask: torch.Tensor | None = None,  # transformers 4's argument (5 dropped it): None or all ones only
        encoder_hidden_states: torch.Tensor | None = None,  # a decoder's arguments, which transformers' encoders take
        encoder_attention_mask: torch.Tensor | None = None,  # too: None only (is_decoder configs are refused)
        past_key_values: object | None = None,
        use_cache: bool | None = None,  # ignored, as transformers ignores it outside a decoder
    ) -> BaseModelOutputWithPooling | tuple:
        """Encode a batch; `packed_output=True` gives `last_hidden_state` as `[total_tokens, H]` (valid tokens only).
        The output flags left None take the config's (`output_attentions`, `output_hidden_states`, `return_dict`)."""
        if encoder_hidden_states is not None or encoder_attention_mask is not None or past_key_values is not None:
            decoder = {"encoder_hidden_states": encoder_hidden_states, "encoder_attention_mask": encoder_attention_mask,
                       "past_key_values": past_key_values}  # fmt: skip
            given = ", ".join(name for name, value in decoder.items() if value is not None)
            raise ValueError(f"{given}: fastbert's encoders have no cross-attention and no key/value cache; pass None "
                             "(load a decoder with transformers)")  # fmt: skip
        output_attentions, output_hidden_states = output_flags(self.config, output_attentions, output_hidden_states)
        return_dict = return_dict_of(self.config, return_dict)
        if head_mask is not None and not bool((torch.as_tensor(head_mask) == 1).all()):
            raise ValueError(
                "head_mask: fastbert's fused attention has no per-head mask (transformers 5 dropped the argument "
                "too); pass None, or prune the heads from the weights"
            )
        lead = input_ids if input_ids is not None else inputs_embeds
        with self._backend_scope(), ops.team_scope(getattr(lead, "device", None)):
            return self._forward(
                input_ids,
                attention_mask,
                token_type_ids,
                position_ids,
                inputs_embeds,
                output_attentions,
                output_hidden_states,
                return_dict,
                packed_output,
            )

    def _backend_scope(self) -> contextlib.AbstractContextManager:
        """`config.backend` forces a backend for this model, unless `use_backend` / FASTBERT_BACKEND already do;
        `config.quantize="int8"` lets the int8 GEMMs run (inference only). Nothing to scope: a null context, which
        torch.compile can break a graph inside (the unpad host sync), where it cannot inside an ExitStack."""
        name = self.config.backend
        if self.config.quantize is None and (name in (None, "auto") or ops.forced_backend() is not None):
            return contextlib.nullcontext()
        scope = contextlib.ExitStack()
        if self.config.quantize is not None:
            if self.training and torch.is_grad_enabled():
                raise RuntimeError(
                    "this model is quantized to int8, which is for inference: call model.eval() (or run under "
                    "torch.no_grad()), and train the fp32 model"
                )
            scope.enter_context(ops.opt_in(self.config.quantize))
        if name not in (None, "auto") and ops.forced_backend() is None:
            scope.enter_context(ops.use_backend(name))
        return scope

    def _forward(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        output_attentions: bool,
        output_hidden_states: bool,
        return_dict: bool,
        packed_output: bool,
    ) -> BaseModelOutputWithPooling | tuple:
        if self.config.family.rotary and position_ids is not None:
            raise ValueError(
                f"position_ids: {type(self).__name__} counts rotary positions within each sequence (what transformers "
                "does without position_ids, and any shift of them gives the same scores); other positions are not "
                "supported"
            )
        if not self.config.absolute_positions:  # DeBERTa-v3 reads none, as transformers' model ignores them
            position_ids = None
        if not self.config.token_types and self.config.family.token_types:  # no table (type_vocab_size 0): unread
            token_type_ids = None
        batch, seqlen, ranges = check_inputs(
            self.config,
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            self.embeddings.word_embeddings.weight.dtype,
        )
        lead = input_ids if input_ids is not None else inputs_embeds
        device = lead.device
        if batch == 0:
            return self._empty_output(lead, seqlen, return_dict, output_hidden_states, output_attentions)
        run = self.plans.prepare(self, device, inputs_embeds, output_hidden_states, output_attentions)
        if position_ids is None:
            position_ids = family_positions(self.config, input_ids, seqlen, device)
        position_ids = position_ids.reshape(-1, seqlen).expand(batch, seqlen).contiguous()  # packed after the sync
        if token_type_ids is None:
            token_type_ids = torch.zeros(batch, seqlen, dtype=torch.long, device=device)
        read = ranges.values if ranges is not None else None
        # dict reads, no call: this runs every forward of every family
        encoder = self._modules["encoder"]._modules
        relative = self.config.family.rotary or "relative_attention_bias" in encoder or "rel_embeddings" in encoder
        gaps = attention_mask is not None and relative
        if gaps:  # read with the packing's sync
            read = rows_with_gaps(attention_mask) if read is None else torch.cat([read, rows_with_gaps(attention_mask)])
        packing, checked = unpad_and_read(attention_mask, batch, seqlen, device, read)
        if gaps and checked.pop():
            raise ValueError(
                f"attention_mask has zeros between the ones of a row: {type(self).__name__}'s relative positions "
                "would count the masked tokens between them, and fastbert packs the real tokens together; pass masks "
                "whose ones are one run per row (left or right padding)"
            )
        if ranges is not None:  # before any kernel gathers with these ids
            ranges.raise_if_bad(checked)
        x, hidden, attentions = run(Inputs(input_ids, token_type_ids, position_ids, inputs_embeds), packing)
        sequence_output = packing.repad(x)
        pooled = self.pooler(sequence_output) if self.pooler is not None else None
        out = BaseModelOutputWithPooling(
            last_hidden_state=x if packed_output else sequence_output,
            pooler_output=pooled,
            hidden_states=tuple(h if packed_output else packing.repad(h) for h in hidden) or None,
            attentions=tuple(_pad_probs(p, seqlen) for p in attentions) or None,
        )
        return out if return_dict else out.to_tuple()

    def _empty_output(
        self, lead: torch.Tensor, seqlen: int, return_dict: bool, output_hidden_states: bool, output_attentions: bool
    ) -> BaseModelOutputWithPooling | tuple:
        cfg, dtype = self.config, self.embeddings.word_embeddings.weight.dtype
        hidden = lead.new_zeros(0, seqlen, cfg.hidden_size, dtype=dtype)
        out = BaseModelOutputWithPooling(
            last_hidden_state=hidden,
            pooler_output=lead.new_zeros(0, cfg.hidden_size, dtype=dtype) if self.pooler is not None else None,
            hidden_states=(hidden,) * (cfg.num_hidden_layers + 1) if output_hidden_states else None,
            attentions=(lead.new_zeros(0, cfg.num_attention_heads, seqlen, seqlen, dtype=dtype),)
            * cfg.num_hidden_layers
            if output_attentions
            else None,
        )
        return out if return_dict else out.to_tuple()
