"""The export graph: a padded forward over a fastbert model's own parameters, in transformers' classic BERT layout.

fastbert's forward unpads with a data-dependent host sync, which does not trace into a static graph. This module
computes the same function on the padded batch, written op for op the way onnxruntime's transformers optimizer
recognises (separate Q/K/V MatMul+Add, additive mask `(1 - mask) * min`, Softmax, erf GELU, LayerNorm after the
residual Add), so the optimizer can fuse EmbedLayerNormalization, Attention, SkipLayerNormalization and BiasGelu.
Padded positions of every per-token output are zeroed, as fastbert's repad does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastbert import outputs, reference, relative_positions
from fastbert.auto import BY_NAME
from fastbert.checkpoint import PreTrainedModel
from fastbert.heads import HEADS, ClassificationHead, pool
from fastbert.modeling import ACT_OF_CONFIG, BertLayer, BertModel, DisentangledSelfAttention, position_pad
from fastbert.prenorm import LlamaLayer, PreNormLayer
from fastbert.rotary import GLOBAL, rotary_rows


@dataclass(frozen=True)
class HeadSpec:
    """How one model class maps to graph outputs: names, per-token or per-sequence, and the output class."""

    outputs: tuple[str, ...]
    per_token: tuple[bool, ...]  # True: [B, S, ...] (axis 1 is the sequence), False: [B, ...]
    output_class: type[outputs.ModelOutput]


SPECS: dict[str, HeadSpec] = {
    "BertModel": HeadSpec(("last_hidden_state", "pooler_output"), (True, False), outputs.BaseModelOutputWithPooling),
    "BertForMaskedLM": HeadSpec(("logits",), (True,), outputs.MaskedLMOutput),
    "BertForPreTraining": HeadSpec(
        ("prediction_logits", "seq_relationship_logits"), (True, False), outputs.PreTrainingOutput
    ),
    "BertForNextSentencePrediction": HeadSpec(("logits",), (False,), outputs.NextSentencePredictorOutput),
    "BertForSequenceClassification": HeadSpec(("logits",), (False,), outputs.SequenceClassifierOutput),
    "BertForTokenClassification": HeadSpec(("logits",), (True,), outputs.TokenClassifierOutput),
    "BertForQuestionAnswering": HeadSpec(
        ("start_logits", "end_logits"), (True, True), outputs.QuestionAnsweringModelOutput
    ),
    "BertForMultipleChoice": HeadSpec(("logits",), (False,), outputs.MultipleChoiceModelOutput),
}
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def head_name(model: nn.Module) -> str:
    """The Bert class a fastbert model is (RobertaForMaskedLM -> BertForMaskedLM); TypeError for anything else."""
    known = BY_NAME.get(type(model).__name__) is type(model)  # fastbert's own classes: a subclass may compute more
    bases = [c.__name__ for c in type(model).__mro__ if HEADS.get(c.__name__) is c and c.__name__ in SPECS]
    if not isinstance(model, PreTrainedModel) or not known or not bases:
        raise TypeError(
            f"cannot export {type(model).__module__}.{type(model).__name__}: expected fastbert.BertModel or a head "
            f"from fastbert.heads ({', '.join(sorted(SPECS))}), or a family class built on one (RobertaModel, ...)"
        )
    return bases[0]


def spec_of(model: nn.Module) -> HeadSpec:
    """The HeadSpec of a fastbert model; TypeError for anything else (a transformers model included)."""
    return SPECS[head_name(model)]


def output_names(model: nn.Module) -> tuple[str, ...]:
    """Graph output names; a BertModel built without its pooler has only last_hidden_state."""
    names = spec_of(model).outputs
    if isinstance(model, BertModel) and model.pooler is None:
        return names[:1]
    return names


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _norm(x: torch.Tensor, norm: nn.LayerNorm | nn.RMSNorm) -> torch.Tensor:
    """A LayerNorm, or an RMSNorm with Llama's fp32 statistics (EuroBERT's)."""
    if isinstance(norm, nn.RMSNorm):
        return reference.rms_norm(x, norm.weight, norm.eps)
    return _layer_norm(x, norm)


class ReferenceGraph(nn.Module):
    """`forward(input_ids, attention_mask, token_type_ids)` -> the model's outputs as a tuple, padded layout."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        spec_of(model)  # TypeError for anything but fastbert.BertModel or one of its heads
        self.model = model
        self.bert: BertModel = model if isinstance(model, BertModel) else model.bert
        config = model.config
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.act = ACT_OF_CONFIG[config.hidden_act]
        # transformers' position_ids buffer: sliced to the input length, the pattern EmbedLayerNormalization matches
        positions = torch.arange(config.max_position_embeddings).unsqueeze(0)
        self.register_buffer("position_ids", positions, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S] int64 ([B, C, S] for multiple choice)
        attention_mask: torch.Tensor,  # same shape, int64 0/1
        token_type_ids: torch.Tensor,  # same shape, int64
    ) -> tuple[torch.Tensor, ...]:
        name = head_name(self.model)
        if name == "BertForMultipleChoice":
            choices = input_ids.size(1)
            input_ids, attention_mask, token_type_ids = (
                t.reshape(-1, t.size(-1)) for t in (input_ids, attention_mask, token_type_ids)
            )
        hidden, pooled = self.encode(input_ids, attention_mask, token_type_ids)
        m = self.model
        if name == "BertModel":
            return (hidden,) if pooled is None else (hidden, pooled)
        if name == "BertForMaskedLM":
            return (self._mlm(m.cls.predictions, hidden),)
        if name == "BertForPreTraining":
            return self._mlm(m.cls.predictions, hidden), _linear(pooled, m.cls.seq_relationship)
        if name == "BertForNextSentencePrediction":
            return (_linear(pooled, m.cls.seq_relationship),)
        head = m._modules.get("head")  # ModernBERT's transform before its classifiers
        if name == "BertForSequenceClassification":
            if m.config.family.llama_layers:  # EuroBERT: bos, mean or late pooling around dense -> GELU
                return (m._llama_logits(hidden, attention_mask),)
            if isinstance(m.classifier, ClassificationHead):  # RoBERTa, ELECTRA, DistilBERT: on the first token
                return (m.classifier(hidden[:, 0]),)
            if head is not None:
                return (_linear(_transform(head, pool(m.config, hidden, attention_mask, False)), m.classifier),)
            return (_linear(pooled, m.classifier),)
        if name == "BertForTokenClassification":
            return (_linear(hidden if head is None else _transform(head, hidden), m.classifier),)
        if name == "BertForQuestionAnswering":
            logits = _linear(hidden if head is None else _transform(head, hidden), m.qa_outputs)
            return logits[..., 0], logits[..., 1]
        if head is not None:
            pooled = _transform(head, pool(m.config, hidden, attention_mask, True))
        return (_linear(pooled, m.classifier).reshape(-1, choices),)  # BertForMultipleChoice

    def encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [B, S, H] (zero at padding), [B, H] or None
        emb = self.bert.embeddings
        dtype = emb.word_embeddings.weight.dtype
        if self.bert.config.family.padded_positions:  # RoBERTa: counted over non-pad ids, from pad_token_id + 1
            pad = position_pad(self.bert.config)
            real = input_ids.ne(pad).long()
            positions = torch.cumsum(real, dim=1) * real + pad
        else:
            positions = self.position_ids[:, : input_ids.size(1)]
        x = F.embedding(input_ids, emb.word_embeddings.weight) + F.embedding(token_type_ids, emb.type_table())
        if self.bert.config.absolute_positions:
            x = x + F.embedding(positions, emb.position_embeddings.weight)
        if emb.LayerNorm is not None:  # EuroBERT: the word rows (plus the zero type row: one signature for all)
            x = _layer_norm(x, emb.LayerNorm)
        if emb.projection is not None:
            x = _linear(x, emb.projection)
        mask = attention_mask.unsqueeze(1).unsqueeze(2).to(dtype)  # [B, 1, 1, S]
        additive = (1.0 - mask) * torch.finfo(dtype).min
        table = self.bert.encoder.position_bias()  # MPNet: [nH, 2R + 1] by distance -> [1, nH, S, S]
        if table is not None:
            additive = additive + relative_positions.dense_bias(table, input_ids.size(1)).unsqueeze(0).to(dtype)
        rows, index = self._disentangled(input_ids.size(1))
        encoder = self.bert.encoder
        rotary = _rotary_tables(encoder, input_ids.size(1), dtype)  # layer kind -> (cos, sin) [S, R/2], or {}
        for layer in encoder.layer:
            if isinstance(layer, PreNormLayer):
                x = self._pre_norm_layer(layer, x, attention_mask, rotary)
            elif isinstance(layer, LlamaLayer):
                x = self._llama_layer(layer, x, attention_mask, rotary[GLOBAL])
            else:
                x = self._layer(layer, x, additive, rows, index, rotary.get(GLOBAL))
        final = encoder._modules.get("final_norm")
        if final is not None:
            x = _norm(x, final)
        x = x * attention_mask.unsqueeze(-1).to(dtype)  # fastbert's repad: zeros at padded positions
        pooler = self.bert.pooler
        if pooler is None:
            return x, None
        first = _linear(x[:, 0], pooler.dense)
        return x, torch.tanh(first) if pooler.act is None else reference.activation(first, pooler.act)

    def _disentangled(self, seqlen: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """DeBERTa: the whole relative embedding (normalised) and the [S, S] row of each (query, key), read from a
        constant by distance (the sequence length is a dynamic axis); (None, None) for other families."""
        encoder = self.bert.encoder
        table = encoder._modules.get("rel_embeddings")
        if table is None:
            return None, None
        norm = encoder._modules.get("LayerNorm")
        rows = _layer_norm(table.weight, norm) if norm is not None else table.weight
        radius, by_distance = relative_positions.deberta_row_table(encoder.position_buckets,
                                                                   encoder.max_relative_positions)  # fmt: skip
        pos = torch.arange(seqlen, device=rows.device)
        distance = (pos[None, :] - pos[:, None]).clamp(-radius, radius) + radius  # key - query
        return rows, by_distance.to(rows.device)[distance]

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H] -> [B, nH, S, D]
        return x.view(x.size()[:-1] + (self.num_heads, self.head_dim)).permute(0, 2, 1, 3)

    def _layer(
        self,
        layer: BertLayer,
        x: torch.Tensor,  # [B, S, H]
        additive: torch.Tensor,  # [B, 1 or nH, S, S]
        rows: torch.Tensor | None = None,  # [2 span, H] DeBERTa's relative embedding
        index: torch.Tensor | None = None,  # [S, S] its row of each (query, key)
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin) [S, R/2]: GTE, NomicBERT, Jina-v3
    ) -> torch.Tensor:  # [B, S, H]
        attn = layer.attention.self
        q = self._split_heads(_linear(x, attn.query))
        k = self._split_heads(_linear(x, attn.key))
        v = self._split_heads(_linear(x, attn.value))
        if rotary is not None:
            q, k = (reference.rotate_half(t, *rotary) for t in (q, k))
        if isinstance(attn, DisentangledSelfAttention):
            scores = torch.matmul(q, k.transpose(-1, -2)) * attn.scale
            if rows is not None:
                position_keys, position_queries = attn.position_projections(rows)  # [nH, D, 2 span] each, scaled
                at = index.expand(q.size(0), self.num_heads, -1, -1)
                scores = scores + torch.matmul(q, position_keys).gather(-1, at)
                scores = scores + torch.matmul(k, position_queries).gather(-1, at.transpose(-1, -2)).transpose(-1, -2)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = torch.softmax(scores + additive, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        ctx = ctx.view(ctx.size()[:-2] + (self.num_heads * self.head_dim,))
        out = layer.attention.output
        h = _layer_norm(_linear(ctx, out.dense) + x, out.LayerNorm)
        gate = layer.intermediate._modules.get("gate")  # GTE, NomicBERT: act(gate(h)) * dense(h)
        if gate is not None:
            inner = reference.activation(_linear(h, gate), self.act) * _linear(h, layer.intermediate.dense)
        else:
            inner = reference.activation(_linear(h, layer.intermediate.dense), self.act)
        return _layer_norm(_linear(inner, layer.output.dense) + h, layer.output.LayerNorm)

    def _pre_norm_layer(
        self,
        layer: PreNormLayer,
        x: torch.Tensor,  # [B, S, H]
        attention_mask: torch.Tensor,  # [B, S]
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:  # [B, S, H]
        """ModernBERT's layer: x + attn(attn_norm(x)), then + mlp(mlp_norm(.)); its window as a mask."""
        attn, h = layer.attn, x
        if isinstance(layer.attn_norm, nn.LayerNorm):
            h = _layer_norm(x, layer.attn_norm)
        q, k, v = (self._split_heads(t) for t in _linear(h, attn.Wqkv).chunk(3, dim=-1))
        q, k = (reference.rotate_half(t, *rotary[attn.kind]) for t in (q, k))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = torch.softmax(scores + _window_mask(attention_mask, attn.window, scores.dtype), dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        x = x + _linear(ctx.view(ctx.size()[:-2] + (self.num_heads * self.head_dim,)), attn.Wo)
        up, gate = _linear(_layer_norm(x, layer.mlp_norm), layer.mlp.Wi).chunk(2, dim=-1)
        return x + _linear(reference.activation(up, layer.mlp.act) * gate, layer.mlp.Wo)

    def _mlm(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:  # [B, S, H] -> [B, S, V]
        if isinstance(head.transform, nn.Identity):  # EuroBERT's lm_head: the decoder alone
            return _linear(hidden, head.decoder)
        return _linear(_transform(head.transform, hidden), head.decoder)

    def _llama_layer(
        self,
        layer: LlamaLayer,
        x: torch.Tensor,  # [B, S, H]
        attention_mask: torch.Tensor,  # [B, S]
        rotary: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) [S, R/2]
    ) -> torch.Tensor:  # [B, S, H]
        """EuroBERT's layer: x + self_attn(RMSNorm(x)), then + SwiGLU(RMSNorm(.)); key and value heads repeated to
        their groups of query heads, as transformers' repeat_kv."""
        attn, mlp = layer.self_attn, layer.mlp
        h = _norm(x, layer.input_layernorm)
        batch, seqlen = h.shape[:2]
        q = self._split_heads(_linear(h, attn.q_proj))
        k, v = (_linear(h, p).view(batch, seqlen, attn.kv_heads, self.head_dim).permute(0, 2, 1, 3)
                for p in (attn.k_proj, attn.v_proj))  # fmt: skip
        group = self.num_heads // attn.kv_heads
        if group > 1:
            k, v = (t[:, :, None].expand(batch, attn.kv_heads, group, seqlen, self.head_dim).reshape(
                batch, self.num_heads, seqlen, self.head_dim) for t in (k, v))  # fmt: skip
        q, k = (reference.rotate_half(t, *rotary) for t in (q, k))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = torch.softmax(scores + _window_mask(attention_mask, None, scores.dtype), dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        x = x + _linear(ctx.view(ctx.size()[:-2] + (self.num_heads * self.head_dim,)), attn.o_proj)
        h = _norm(x, layer.post_attention_layernorm)
        return x + _linear(reference.activation(_linear(h, mlp.gate_proj), mlp.act) * _linear(h, mlp.up_proj),
                           mlp.down_proj)  # fmt: skip


def _transform(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A head's dense -> act -> LayerNorm (BertPredictionHeadTransform, ModernBERT's `head`)."""
    return _layer_norm(reference.activation(_linear(x, head.dense), head.act), head.LayerNorm)


def _rotary_tables(encoder: nn.Module, seqlen: int, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer kind, (cos, sin) [S, R/2] at positions 0..S-1 (a shift of every position leaves the scores as
    they are, so left padding needs no other positions); {} without rotary positions."""
    out = {}
    for name, frequencies in encoder._buffers.items():
        if name.endswith("_frequencies"):
            positions = torch.arange(seqlen, device=frequencies.device)
            cos, sin = rotary_rows(positions, frequencies).unbind(0)
            out[name.removesuffix("_frequencies")] = (cos.to(dtype), sin.to(dtype))
    return out


def _window_mask(attention_mask: torch.Tensor, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, S, S] additive: 0 where the key is real (and within `window` of the query), the dtype's min elsewhere;
    a padding query row with no key in reach keeps its sequence's keys (finite: no NaN before the repad)."""
    keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    if window is not None:
        keys = reference.windowed(keys, window, attention_mask.size(1), attention_mask.device)
    return torch.zeros(keys.shape, dtype=dtype, device=keys.device).masked_fill(~keys, torch.finfo(dtype).min)
