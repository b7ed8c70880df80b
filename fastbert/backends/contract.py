"""Each fused op declared once: its name, parameters (kinds, defaults, shapes), output and words. A leaf.

Everything else that states an op's signature derives from its `Op` here: fastbert.ops' public function (its
signature, its words, the by-name reading of a call), the torch.library schema and fake of every custom op that takes
the op's arguments (the native kernels' forward-only ops), and tests/test_contract.py, which checks every backend's
implementation (reference, Triton and its forward-only launcher, native, oneDNN, gemm, int8, torch) against it. Adding
an op means one declaration here plus its implementations.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

REQUIRED = inspect.Parameter.empty
# schema kind -> the Python annotation a signature shows
_ANNOTATIONS = {"Tensor": torch.Tensor, "Tensor?": torch.Tensor | None, "float": float, "float?": float | None,
                "SymInt": int, "SymInt?": int | None, "bool": bool, "str": str, "str?": str | None}  # fmt: skip


@dataclass(frozen=True)
class Param:
    """One parameter: its name, torch.library schema kind, default (REQUIRED for none) and shape in words."""

    name: str
    kind: str  # as torch.library schemas write it (SymInt for an int a compiled graph keeps symbolic)
    default: Any = REQUIRED
    shape: str = ""
    dropout: bool = False  # dropout_p / training: what a forward-only kernel leaves out

    def schema(self) -> str:
        default = "" if self.default is REQUIRED else f"={_schema_value(self.default)}"
        return f"{self.kind} {self.name}{default}"


@dataclass(frozen=True)
class Op:
    """A fused op's contract: what every implementation takes and gives."""

    name: str
    params: tuple[Param, ...]
    returns: str  # the output's shape in words
    doc: str
    output: Callable[[dict[str, Any]], torch.Tensor]  # an empty tensor shaped and typed as the output, from the call

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def forward_only(self) -> tuple[Param, ...]:
        """The parameters of a forward-only kernel: the op's without the dropout ones."""
        return tuple(p for p in self.params if not p.dropout)

    def signature(self, params: tuple[Param, ...] | None = None) -> inspect.Signature:
        """The op's Python signature (or that of `params`, a form of it)."""
        return inspect.Signature(
            [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=p.default,
                               annotation=_ANNOTATIONS[p.kind]) for p in (params or self.params)],
            return_annotation=torch.Tensor,
        )  # fmt: skip

    def schema(self, params: tuple[Param, ...] | None = None) -> str:
        """The torch.library schema of the op's arguments (or of `params`): "(Tensor x, ...) -> Tensor"."""
        return "(" + ", ".join(p.schema() for p in (params or self.params)) + ") -> Tensor"

    def fake(self, params: tuple[Param, ...] | None = None) -> Callable[..., torch.Tensor]:
        """The output's fake for torch.library (shape and dtype from the arguments), for the op's or `params`' form."""
        params = params or self.params
        names, defaults = tuple(p.name for p in params), tuple(p.default for p in params)

        def fake(*args: Any) -> torch.Tensor:  # torch may leave out trailing arguments equal to their defaults
            return self.output(dict(zip(names, (*args, *defaults[len(args) :]), strict=True)))

        return fake

    def by_name(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """A call's arguments by parameter name, as given (trailing defaults may be absent)."""
        return dict(zip(self.names, args, strict=False), **kwargs)

    def describe(self) -> str:
        """The op's docstring: its words, then each parameter's shape."""
        shapes = [f"{p.name}: {p.shape}" for p in self.params if p.shape]
        return f"{self.doc}\n\nShapes: {'; '.join(shapes)} -> {self.returns}."


def _schema_value(value: Any) -> str:
    return "None" if value is None else (str(value) if not isinstance(value, str) else f'"{value}"')


def _rows_like(name: str, width: Callable[[dict], int] | None = None) -> Callable[[dict[str, Any]], torch.Tensor]:
    """Output rule: shaped like argument `name` (its last dim replaced by `width(call)` when given)."""

    def output(call: dict[str, Any]) -> torch.Tensor:
        x = call[name]
        return x.new_empty(*x.shape[:-1], width(call)) if width is not None else x.new_empty(x.shape)

    return output


def _embedding_output(call: dict[str, Any]) -> torch.Tensor:
    embeds, word = call.get("inputs_embeds"), call["word_weight"]
    if embeds is not None:
        return embeds.new_empty(embeds.shape)
    return word.new_empty(*call["token_type_ids"].shape, word.shape[-1])


def _residual_output(call: dict[str, Any]) -> torch.Tensor:
    x, residual = call["x"], call["residual"]
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))


def _attention_output(call: dict[str, Any]) -> torch.Tensor:
    qkv = call["qkv"]
    return qkv.new_empty(qkv.shape[0], qkv.shape[2], qkv.shape[3])


DROPOUT = (Param("dropout_p", "float", 0.0, dropout=True), Param("training", "bool", False, dropout=True))
GELU = "gelu"

EMBEDDING_LAYERNORM = Op(
    "embedding_layernorm",
    (Param("input_ids", "Tensor?", shape="[*] int"), Param("token_type_ids", "Tensor", shape="[*] int"),
     Param("position_ids", "Tensor", shape="[*] int"), Param("word_weight", "Tensor", shape="[V, E]"),
     Param("position_weight", "Tensor", shape="[P, E]"), Param("type_weight", "Tensor", shape="[Tt, E]"),
     Param("ln_weight", "Tensor", shape="[E]"), Param("ln_bias", "Tensor", shape="[E]"), Param("eps", "float"),
     *DROPOUT, Param("inputs_embeds", "Tensor?", None, shape="[*, E] (instead of the word rows)")),
    "[*, E]",
    "LayerNorm(word[ids] + position[pos] + type[tt]) then dropout, in one pass where a kernel exists.",
    _embedding_output,
)  # fmt: skip
BIAS_ACT = Op(
    "bias_act",
    (Param("x", "Tensor", shape="[*, N]"), Param("bias", "Tensor", shape="[N]"), Param("kind", "str", GELU)),
    "[*, N]",
    "act(x + bias) for act in gelu (erf), gelu_tanh, relu.",
    _rows_like("x"),
)
BIAS_RESIDUAL_LAYERNORM = Op(
    "bias_residual_layernorm",
    (Param("x", "Tensor", shape="[*, N]"), Param("bias", "Tensor", shape="[N]"),
     Param("residual", "Tensor", shape="[*, N]"), Param("ln_weight", "Tensor", shape="[N]"),
     Param("ln_bias", "Tensor", shape="[N]"), Param("eps", "float"), *DROPOUT),
    "[*, N] in the wider of x's and residual's dtypes",
    "LayerNorm(dropout(x + bias) + residual): the epilogue of every BERT sub-layer.",
    _residual_output,
)  # fmt: skip
ATTENTION = Op(
    "attention",
    (Param("qkv", "Tensor", shape="[T, 3, nH, D] packed tokens"),
     Param("cu_seqlens", "Tensor", shape="[B + 1] int32"), Param("max_seqlen", "SymInt"), *DROPOUT,
     Param("scale", "float?", None),
     Param("position_bias", "Tensor?", None, shape="[nH, 2R + 1] fp32, by key - query distance clamped to [-R, R]"),
     Param("position_scores", "Tensor?", None, shape="[2, nH, T, W] (qkv's dtype or fp32): per token, its scaled "
           "query-side and key-side scores against W relative-position rows"),
     Param("position_columns", "Tensor?", None, shape="[2R + 1] int32: the row of position_scores of each key - query "
           "distance clamped to [-R, R]"),
     Param("rotary", "Tensor?", None, shape="[2, T, R/2] fp32: cos and sin of each packed token's angle per rotated "
           "pair (d, d + R/2), d < R/2, R <= D even"),
     Param("window", "SymInt?", None, shape="keys within this distance of the query only (|j - i| <= window)")),
    "[T, nH, D]",
    "Varlen bidirectional attention over packed QKV: softmax(q k^T * scale + bias) v within each sequence, fp32 "
    "softmax; a fully masked (empty) sequence gives no rows, never NaN. `position_bias` adds, for query i and key j "
    "of one sequence, position_bias[h, clamp(j - i, -R, R) + R] (MPNet's and T5's relative buckets, folded into a "
    "table by distance). `position_scores` with `position_columns` adds position_scores[0, h, i, c] + "
    "position_scores[1, h, j, c], c = position_columns[clamp(j - i, -R, R) + R] (DeBERTa's disentangled "
    "content-to-position and position-to-content terms; i, j packed token indices). Kernels read both in the tile "
    "loop, never as an [S, S] tensor. `rotary` rotates q and k as they are loaded (rotary position embeddings, "
    "rotate-half form: x[d] cos - x[d + R/2] sin and x[d + R/2] cos + x[d] sin for d < R/2; dims from R on are "
    "kept), each token by its own row, so a sequence's positions are whatever its rows say. `window` keeps the keys "
    "within that distance of each query (sliding-window layers), and kernels skip the key blocks outside it.",
    _attention_output,
)  # fmt: skip
LINEAR = Op(
    "linear",
    (Param("x", "Tensor", shape="[*, K]"), Param("weight", "Tensor", shape="[N, K]"),
     Param("bias", "Tensor?", None, shape="[N]"), Param("act", "str?", None)),
    "[*, N]",
    "act(x @ weight^T + bias). A backend that fuses the whole layer (oneDNN, fastbert's GEMMs) takes it in one call; "
    "on the torch backend the GEMM is F.linear and the bias + activation epilogue goes to the `bias_act` op.",
    _rows_like("x", lambda call: call["weight"].shape[0]),
)  # fmt: skip
GATED_ACT = Op(
    "gated_act",
    (Param("x", "Tensor", shape="[*, N]"), Param("up", "Tensor", shape="[*, N]"), Param("kind", "str", GELU)),
    "[*, N]",
    "act(x) * up for act in gelu (erf), gelu_tanh, relu, silu: a gated feed-forward's (GeGLU, SwiGLU) activation "
    "after its GEMMs; x and up may be the two halves of one GEMM's output (any row strides).",
    _rows_like("x"),
)
GATED_LINEAR = Op(
    "gated_linear",
    (
        Param("x", "Tensor", shape="[*, K]"),
        Param("weight", "Tensor", shape="[N, K], or [2N, K] with no up_weight"),
        Param("bias", "Tensor?", None, shape="[N] ([2N] with no up_weight)"),
        Param("up_weight", "Tensor?", None, shape="[N, K]"),
        Param("up_bias", "Tensor?", None, shape="[N]"),
        Param("act", "str", GELU),
    ),
    "[*, N]",
    "act(x @ weight^T + bias) * (x @ up_weight^T + up_bias): a gated feed-forward's first layer (GeGLU, SwiGLU). "
    "With no up_weight, weight stacks the activated rows over the up rows ([2N, K], ModernBERT's Wi: act(first "
    "half) * second half). A backend that fuses it (fastbert's GEMMs) computes both products on one tile and writes "
    "only the gated [*, N]; otherwise it is the `linear` op, then the `gated_act` op.",
    lambda call: call["x"].new_empty(
        *call["x"].shape[:-1], call["weight"].shape[0] // (1 if call.get("up_weight") is not None else 2)
    ),
)
DENSE_RESIDUAL_LAYERNORM = Op(
    "dense_residual_layernorm",
    (Param("x", "Tensor", shape="[T, K]"), Param("weight", "Tensor", shape="[N, K]"),
     Param("bias", "Tensor", shape="[N]"), Param("residual", "Tensor", shape="[T, N]"),
     Param("ln_weight", "Tensor", shape="[N]"), Param("ln_bias", "Tensor", shape="[N]"), Param("eps", "float"),
     *DROPOUT),
    "[T, N]",
    "LayerNorm(dropout(x @ weight^T + bias) + residual): a sub-layer's output projection and its epilogue. A backend "
    "that fuses it takes it whole (bias and residual in the GEMM's epilogue); otherwise the GEMM is the `linear` op "
    "and the epilogue the `bias_residual_layernorm` op.",
    _rows_like("residual"),
)  # fmt: skip

KERNELS = (EMBEDDING_LAYERNORM, BIAS_ACT, BIAS_RESIDUAL_LAYERNORM, ATTENTION, GATED_ACT)
COMPOUNDS = (LINEAR, DENSE_RESIDUAL_LAYERNORM, GATED_LINEAR)  # GEMMs with their epilogues
OPS: dict[str, Op] = {op.name: op for op in KERNELS + COMPOUNDS}
