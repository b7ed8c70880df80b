"""The 'loop' executor: the embeddings and the encoder's layers as one loop over their tensors with a plan's bound
ops, no module calls and no dispatch. It computes what fastbert.modeling's forwards compute, op for op."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import checkpoint as activations

from fastbert import relative_positions
from fastbert.execution import rows
from fastbert.execution.plan import Call, FusedOp, Inputs, Plan
from fastbert.execution.structure import Structure
from fastbert.padding import Packing
from fastbert.rotary import GLOBAL


def embed(plan: Plan, structure: Structure, ids: torch.Tensor | None, types: torch.Tensor, positions: torch.Tensor,
          embeds: torch.Tensor | None, weights: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """Packed ids, types, positions [T] (or embeds [T, E]) -> [T, H] with the plan's embedding op (and projection);
    `weights`: Structure.embedding_weights() read earlier (a CUDA graph's), else read now."""
    word, position, kinds, norm_w, norm_b, eps, proj_w, proj_b = weights or structure.embedding_weights()
    mode, e = plan.mode, structure.embeddings
    x = plan.functions["embedding_layernorm"](ids, types, positions, word, position, kinds, norm_w, norm_b, eps,
                                              e.dropout_p, mode.training, embeds)  # fmt: skip
    return plan.functions["linear"](x, proj_w, proj_b, None) if proj_w is not None else x


def layers(
    plan: Plan,
    structure: Structure,
    weights: Sequence[tuple],
    x: torch.Tensor,  # [T, H]
    packing: Packing,
    hidden: list[torch.Tensor] | None = None,
    linear: FusedOp | None = None,
    dense_residual_layernorm: FusedOp | None = None,
) -> torch.Tensor:  # [T, H]
    """Each layer of `weights` (Structure.layer_weights) applied to x with the plan's ops (the GEMM ops may be given
    instead: the layer stack's first layer); each layer's output appended to `hidden` when given. Under gradient
    checkpointing (in training, recording) one layer at a time, the chosen ones recomputed in the backward with the
    same dropout masks (torch's RNG state, which seeds every dropout, is restored)."""
    terms = _terms(plan, structure, packing, x.shape[0], linear, dense_residual_layernorm)
    positions = terms.positions
    if positions is not None and len(positions) != len(weights):
        raise ValueError("DeBERTa's layers run all together: the position projections follow the layers' order")
    encoder, mode = structure.encoder, plan.mode
    checkpointing = encoder.gradient_checkpointing and mode.training and mode.grad
    if (checkpointing or encoder.inputs_require_grad) and mode.grad and not x.requires_grad:
        x.requires_grad_()  # frozen embeddings: a (reentrant) checkpoint still sees a graph from here on
    if not checkpointing:
        return _layers(terms, weights, x, hidden)
    options = {"use_reentrant": False, **encoder.checkpoint_kwargs}
    for k in range(len(weights)):
        args = (terms, weights[k : k + 1], x, None, k)
        x = activations.checkpoint(_layers, *args, **options) if k % encoder.checkpoint_every == 0 else _layers(*args)
        if hidden is not None:
            hidden.append(x)
    return x


class _Terms(NamedTuple):
    """What every layer of one forward reads, found once a forward."""

    linear: FusedOp
    drl: FusedOp  # dense_residual_layernorm
    attention: FusedOp
    gated_linear: FusedOp
    training: bool
    first: nn.Module  # the first layer's self-attention: heads, head size, scale, DeBERTa's kinds
    p_attn: float
    p_hidden: float
    p_gate: float  # a gated intermediate's dropout
    cu: torch.Tensor  # [B + 1] cu_seqlens
    max_seqlen: int
    qkv_shape: tuple[int, ...]  # (T, 3, nH, D)
    ctx_shape: tuple[int, ...]  # (T, nH * D)
    relative: object  # MPNet's [nH, 2R + 1] table or DeBERTa's rows, None without
    bias: torch.Tensor | None  # MPNet's table
    rotary: torch.Tensor | None  # [2, T, R/2]: GTE's, NomicBERT's, Jina's (every layer global)
    positions: list | None  # DeBERTa's per-layer position projections


def _terms(plan: Plan, structure: Structure, packing: Packing, tokens: int, linear: FusedOp | None,
           dense_residual_layernorm: FusedOp | None) -> _Terms:  # fmt: skip
    first = structure.layers[0].self_attention
    relative = structure.relative_terms(packing.max_seqlen)
    rotary = structure.rotary_terms(packing, tokens)
    return _Terms(
        linear or plan.functions["linear"],
        dense_residual_layernorm or plan.functions["dense_residual_layernorm"],
        plan.functions["attention"],
        plan.functions["gated_linear"],
        plan.mode.training,
        first,
        first.dropout_p,
        structure.layers[0].modules[3].dropout_p,
        getattr(structure.layers[0].modules[4], "dropout_p", 0.0),
        packing.cu_seqlens,
        packing.max_seqlen,
        (tokens, 3, first.num_heads, first.head_dim),
        (tokens, first.num_heads * first.head_dim),
        relative,
        relative if structure.relative is not None else None,
        rotary[GLOBAL] if rotary is not None else None,
        structure.position_weights() if first.kinds and relative is not None else None,
    )


def _layers(
    terms: _Terms, weights: Sequence[tuple], x: torch.Tensor, hidden: list[torch.Tensor] | None, start: int = 0
) -> torch.Tensor:  # [T, H] -> [T, H]
    """`layers` in one go, with the forward's `_terms`; the first of `weights` is layer `start`."""
    (linear, drl, attention, gated_linear, training, first, p_attn, p_hidden, p_gate, cu, max_seqlen, qkv_shape,
     ctx_shape, relative, bias, rotary, positions) = terms  # fmt: skip
    scale = first.scale
    for i, (qkv_w, qkv_b, o_w, o_b, n1_w, n1_b, eps1, i_w, i_b, act, f_w, f_b, n2_w, n2_b, eps2, gate_w) in enumerate(
            weights, start):  # fmt: skip
        qkv = linear(x, qkv_w, qkv_b, None).view(qkv_shape)
        if positions is not None:
            scores = _disentangled(qkv, relative.rows, positions[i], first, training)
            ctx = attention(qkv, cu, max_seqlen, p_attn, training, scale, None, scores, relative.columns)
        else:
            ctx = attention(qkv, cu, max_seqlen, p_attn, training, scale, bias, None, None, rotary)
        ctx = ctx.reshape(ctx_shape)
        h = drl(ctx, o_w, o_b, x, n1_w, n1_b, eps1, p_hidden, training)
        if gate_w is not None:  # act(gate(h)) * dense(h), as BertIntermediate's gated forward
            inner = F.dropout(gated_linear(h, gate_w, None, i_w, i_b, act), p_gate, training)
        else:
            inner = linear(h, i_w, i_b, act)
        x = drl(inner, f_w, f_b, h, n2_w, n2_b, eps2, p_hidden, training)
        if hidden is not None:
            hidden.append(x)
    return x


def _disentangled(qkv: torch.Tensor, rows: torch.Tensor, projections: tuple[torch.Tensor | None, ...],
                  attention: nn.Module, training: bool) -> torch.Tensor:  # fmt: skip
    """DeBERTa's position_scores [2, nH, T, W] of one layer: the rows (dropped out in training) through its Kr and Qr
    projections (weight, bias; None where a term is left out), against each token's query and key."""
    rows = F.dropout(rows, attention.pos_dropout_p, training) if training else rows
    key_w, key_b, query_w, query_b = projections
    sides = (F.linear(rows, key_w, key_b) if key_w is not None else None,
             F.linear(rows, query_w, query_b) if query_w is not None else None)  # fmt: skip
    heads, dim = attention.num_heads, attention.head_dim
    return relative_positions.deberta_scores(
        qkv, relative_positions.deberta_projections(*sides, rows, heads, dim, attention.scale)
    )


def packed(inputs: Inputs, packing: Packing) -> tuple[torch.Tensor | None, ...]:
    """The inputs packed to [T] (embeds [T, E]): ids, types, positions, embeds."""
    pack = packing.pack
    return tuple([pack(t) if t is not None else None for t in inputs])


class Loop:
    """Takes every mode (what would make a model compute something else fused is the structure's refusal)."""

    name = "loop"

    def takes(self, plan: Plan, model: nn.Module, structure: Structure) -> str | None:
        return None

    def declines(self, plan: Plan, call: Call) -> str | None:
        return None

    def run(self, plan: Plan, call: Call, packing: Packing) -> torch.Tensor:
        s, grad = call.structure, plan.mode.grad
        x = embed(plan, s, *packed(call.inputs, packing))
        total = x.shape[0]
        x, laid = rows.lay(plan, x, packing)
        if call.hidden is not None:
            call.hidden.append(x)
        return rows.cut(layers(plan, s, s.layer_weights(grad), x, laid, call.hidden), total, call.hidden)

    def note(self, plan: Plan) -> str:
        return "one loop over the layers' tensors with the bound ops"

    def __reduce__(self) -> str:
        return "LOOP"


LOOP = Loop()
