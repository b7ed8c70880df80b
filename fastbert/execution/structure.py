"""A model as the fused executors read it: each layer's parts found once by transformers' names, the one check that
they still compute what fastbert's modules compute, and the one rule for when the model changed shape.

The fused executors read the modules' tensors and never call their `forward`, so whatever would make a module compute
something else (a forward or backward hook, a forward set on the instance, a class swapped, a module wrapped or
swapped in, a submodule in another train/eval mode) must send the forward module by module. That check runs every
forward, so it is made of C-level scans over lists found once (`refusal`: the modules' types, hook tables, instance
dictionaries, training flags), never a walk of the module tree; the parameters are read from the leaves' own tables
every forward (functional_call and direct writes register nothing). What registers a parameter, buffer or submodule
anywhere (`setattr`, `load_state_dict(assign=True)`, a parametrization, a LoRA wrapper) bumps a process-wide count
through torch's registration hooks; a structure found under an older count is compared with the model again, and so is
the layer list every forward (a ModuleList edit registers nothing). A structure found anew binds the plans anew, and
the executors that keep state across forwards (CUDA graphs) start over.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from fastbert.relative_positions import DisentangledRows

_registrations = itertools.count()
_epoch = [0]  # parameters, buffers and submodules registered so far, process-wide


def _registered(*_: object) -> None:
    _epoch[0] = next(_registrations) + 1


nn.modules.module.register_module_parameter_registration_hook(_registered)
nn.modules.module.register_module_buffer_registration_hook(_registered)
nn.modules.module.register_module_module_registration_hook(_registered)


def epoch() -> int:
    """How many parameters, buffers and submodules were registered so far in this process (any module's)."""
    return _epoch[0]


def plain(module: nn.Module | None, kind: type[nn.Module]) -> bool:
    """Whether a leaf computes exactly what a fused op reading its tensors computes: of type `kind` itself (not a
    parametrized or adapter-wrapped one), without forward hooks (its own or global ones) or a forward set on it. A
    module's forward calls a leaf that is not plain, so what is hooked or wrapped runs (fastbert.modeling)."""
    if module is None:
        return True
    return (
        type(module) is kind
        and not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)
        and not (module._backward_hooks or module._backward_pre_hooks)
        and not global_hooks()
    )


def global_hooks() -> bool:
    """Whether hooks are registered for every module's forward or backward (torch's module-level registries)."""
    hooks = nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
                or hooks._global_backward_pre_hooks)  # fmt: skip


class Forwards(NamedTuple):
    """The forwards the fused executors reproduce (fastbert.modeling's), so a module running another is caught."""

    embeddings: Callable
    encoder: Callable
    # a layer, its attention, self-attention, attention output, intermediate, output; a tuple: any of those forwards
    layer: tuple[Callable | tuple[Callable, ...], ...]


class LayerParts(NamedTuple):
    """One BERT layer's modules, found once by transformers' names, in the order its forward runs them."""

    modules: tuple[nn.Module, ...]  # layer, attention, self-attention, attention output, intermediate, output
    query: nn.Module
    key: nn.Module
    value: nn.Module
    out_dense: nn.Module
    out_norm: nn.Module
    inter_dense: nn.Module
    ffn_dense: nn.Module
    ffn_norm: nn.Module
    pos_key: nn.Module | None = None  # DeBERTa's projection of the relative rows for c2p (its key's when shared)
    pos_query: nn.Module | None = None  # and for p2c
    gate: nn.Module | None = None  # a gated family's intermediate.gate (GTE, NomicBERT)

    @property
    def self_attention(self) -> nn.Module:
        return self.modules[2]

    @property
    def act(self) -> str:
        return self.modules[4].act

    @property
    def leaves(self) -> tuple[nn.Module, ...]:
        """The Linear and LayerNorm modules whose tensors the executors read, in forward order."""
        return tuple(m for m in self[1:] if m is not None)

    def signature(self) -> tuple | None:
        """What a layer computes with besides its inputs: heads, activation, and each weight's and bias's shape,
        dtype and device; None when a leaf lacks a weight or a bias (what the native layer stack needs of layers it
        runs alike)."""
        described = []
        for leaf in self.leaves:
            weight, bias = leaf._parameters.get("weight"), leaf._parameters.get("bias")
            if weight is None or bias is None:
                return None
            described += [(t.shape, t.dtype, t.device) for t in (weight, bias)]
        return self.self_attention.num_heads, self.act, *described


def layer_parts(layer: nn.Module) -> LayerParts | None:
    """The layer's parts, None if it is not built as fastbert's BertLayer (children by name)."""
    try:
        attention, inter, ffn = (layer._modules[n] for n in ("attention", "intermediate", "output"))
        self_attention, out = attention._modules["self"], attention._modules["output"]
        q, k, v = (self_attention._modules[n] for n in ("query", "key", "value"))
        positions = self_attention.position_modules() if self_attention.kinds else (None, None)
        return LayerParts((layer, attention, self_attention, out, inter, ffn), q, k, v, out._modules["dense"],
                          out._modules["LayerNorm"], inter._modules["dense"], ffn._modules["dense"],
                          ffn._modules["LayerNorm"], *positions, inter._modules.get("gate"))  # fmt: skip
    except (KeyError, AttributeError):
        return None


PRE_NORM = ("its layers are pre-norm (ModernBERT's): the fused executors (layer stack, loop, CUDA graphs) take BERT's "
            "post-norm layers")
_DROPOUT_ROLES = (0, 2, 3, 5)  # in LayerParts.modules: the forwards that read `training` (dropout)
_training = operator.itemgetter("training")
_requires_grad = operator.attrgetter("requires_grad")


class Structure:
    """The embeddings and layers of one model as found at one registration count, with the checks made on them."""

    def __init__(self, model: nn.Module, forwards: Forwards) -> None:
        self.epoch = epoch()
        self.model, self.forwards = model, forwards
        self.embeddings: nn.Module = model._modules["embeddings"]
        self.encoder: nn.Module = model._modules["encoder"]
        layers = list(self.encoder._modules["layer"]._modules.values())
        self.layers: list[LayerParts] = [p for p in map(layer_parts, layers) if p is not None]
        self.found = [self.embeddings, self.encoder, *layers]  # what `stale` compares every forward, by identity
        e = self.embeddings
        self.tables = tuple(e._modules.get(n) for n in ("word_embeddings", "position_embeddings", "LayerNorm"))
        projection = e._modules.get("projection")
        self.relative = self.encoder._modules.get("relative_attention_bias")  # MPNet's [buckets, nH] table, or None
        self.rows = self.encoder._modules.get("rel_embeddings")  # DeBERTa's relative embedding, or None
        self.rotary = bool(getattr(self.encoder, "rotary", False))  # GTE, NomicBERT, Jina-v3: rotary positions
        rows_norm = self.encoder._modules.get("LayerNorm") if self.rows is not None else None
        leaves = {m: None for m in (*self.tables, e._modules.get("token_type_embeddings"), projection, self.relative,
                                    self.rows, rows_norm) if m is not None}  # fmt: skip
        for p in self.layers:
            leaves.update(dict.fromkeys(p.leaves))
        wholes = {m: None for p in self.layers for m in p.modules}
        self.modules = [e, self.encoder, *wholes, *leaves]  # shared layers (ALBERT) once
        self._types = list(map(type, self.modules))
        self._hooks = [t for m in self.modules
                       for t in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)]
        self._dicts = [m.__dict__ for m in self.modules]
        dropout = {e: None} | {p.modules[i]: None for p in self.layers for i in _DROPOUT_ROLES}
        self._dropout_dicts = [m.__dict__ for m in dropout]
        self._param_dicts = [m._parameters for m in leaves]  # read every forward: a parameter can be swapped in there
        self._layer_modules = [(p.self_attention, p.out_dense._parameters, p.out_norm, p.inter_dense._parameters,
                                p.modules[4], p.ffn_dense._parameters, p.ffn_norm, p.modules[3]._buffers,
                                p.modules[5]._buffers, p.gate._parameters if p.gate is not None else None)
                               for p in self.layers]  # fmt: skip
        self._layer_sources = [(p.query._parameters, p.key._parameters, p.value._parameters, *attention[1:])
                               for p, attention in zip(self.layers, self._layer_modules, strict=True)]  # fmt: skip
        self._leaves, self._layer_count = list(leaves), len(layers)
        self.static_refusal = self._static_refusal()

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype now (its word table's): a submodule cast on its own changes it."""
        table = self.tables[0]
        return next(self.model.parameters()).dtype if table is None else table.weight.dtype

    def params(self) -> list[torch.Tensor]:
        """The parameters the executors read, as the leaves hold them now."""
        return [t for d in self._param_dicts for t in d.values() if t is not None]

    def _static_refusal(self) -> str | None:
        """Why this structure cannot run fused whatever the call, from the modules' types (checked every forward)."""
        e, forwards = self.embeddings, self.forwards
        config = getattr(self.model, "config", None)
        if config is not None and config.family.pre_norm:
            return PRE_NORM
        word, position, norm = self.tables
        if word is None or norm is None or (position is None and "no_positions" not in e._buffers):
            return f"the embeddings ({type(e).__name__}) are not built as fastbert's BertEmbeddings"
        if type(e).forward is not forwards.embeddings:
            return f"the embeddings ({type(e).__name__}) run another forward than fastbert's"
        if type(self.encoder).forward is not forwards.encoder:
            return f"the encoder ({type(self.encoder).__name__}) runs another forward than fastbert's"
        if len(self.layers) != self._layer_count:
            return "a layer is not built as fastbert's BertLayer"
        for p in self.layers:
            for module, forward in zip(p.modules, forwards.layer, strict=True):
                if type(module).forward not in (forward if isinstance(forward, tuple) else (forward,)):
                    return f"a {type(module).__name__} runs another forward than fastbert's"
        for leaf in self._leaves:
            kind = nn.LayerNorm if isinstance(leaf, nn.LayerNorm) else nn.Embedding if isinstance(
                leaf, nn.Embedding) else nn.Linear  # fmt: skip
            if type(leaf) is not kind:  # a parametrization or an adapter (LoRA) wraps it: its forward differs
                return f"a {type(leaf).__name__} stands where fastbert's {kind.__name__} was"
        return None

    def stale(self, model: nn.Module) -> bool:
        """Whether the model may no longer be built as found: the embeddings, encoder or layer list hold other objects
        (compared every forward: a ModuleList edit registers nothing), or something was registered since (anywhere)
        and a module the executors read is another object now. When something was registered but this model reads the
        same modules, the structure takes the new count."""
        encoder = model._modules["encoder"]
        found = [model._modules["embeddings"], encoder, *encoder._modules["layer"]._modules.values()]
        if list(map(id, found)) != list(map(id, self.found)):
            return True
        if self.epoch == epoch():
            return False
        now = epoch()
        if Structure(model, self.forwards).signature() != self.signature():
            return True
        self.epoch = now
        return False

    def signature(self) -> tuple:
        """Every module the executors read and its type, by identity: two structures equal in this read the same."""
        return tuple(map(id, self.modules)), tuple(self._types), tuple(map(id, self._param_dicts))

    def refusal(self, training: bool) -> str | None:
        """Why this forward must run module by module (see the module's docstring), or None; every forward."""
        if list(map(type, self.modules)) != self._types:  # a class swapped on an instance registers nothing
            self._types, self.static_refusal = list(map(type, self.modules)), self._static_refusal()
        if self.static_refusal is not None:
            return self.static_refusal
        if global_hooks():
            return "global module hooks are registered"
        if any(self._hooks) or any(map(dict.__contains__, self._dicts, itertools.repeat("forward"))):
            for module in self.modules:
                if module._forward_hooks or module._forward_pre_hooks:
                    return f"a {type(module).__name__} has forward hooks"
                if module._backward_hooks or module._backward_pre_hooks:
                    return f"a {type(module).__name__} has backward hooks"
                if "forward" in module.__dict__:
                    return f"a {type(module).__name__} runs another forward than fastbert's"
        if (not training) in map(_training, self._dropout_dicts):
            module = next(m for m in self.modules if m.training != training)
            return f"a {type(module).__name__} is in {'training' if module.training else 'eval'} mode"
        return None

    def requires_grad(self) -> bool:
        """Whether a weight the executors read requires grad (stops at the first that does)."""
        return any(map(_requires_grad, self.params()))

    def embedding_weights(self) -> tuple:
        """(word, position, token-type tables, LayerNorm weight, bias, eps, projection weight, bias or None)."""
        word, position, norm = self.tables
        projection = self.embeddings._modules.get("projection")
        w = projection._parameters if projection is not None else {}
        positions = position._parameters["weight"] if position is not None else self.embeddings.no_positions
        tables = (word._parameters["weight"], positions, self.embeddings.type_table())
        return (*tables, norm._parameters["weight"], norm._parameters["bias"], norm.eps, w.get("weight"), w.get("bias"))

    def position_bias(self) -> torch.Tensor | None:
        """The attention's [nH, 2R + 1] relative position table, read from the encoder's bucket embedding now (MPNet),
        or None."""
        return None if self.relative is None else self.encoder.position_bias()

    def relative_terms(self, max_seqlen: int) -> torch.Tensor | DisentangledRows | None:
        """What every layer's attention adds for relative positions, read now: MPNet's table, DeBERTa's rows (the
        encoder's `relative_terms`), or None."""
        if self.relative is None and self.rows is None:
            return None
        return self.encoder.relative_terms(max_seqlen)

    def position_weights(self) -> list[tuple]:
        """Per layer, DeBERTa's projections of the relative rows: (Kr weight, bias, Qr weight, bias), None where a
        term is left out."""
        out = []
        for p in self.layers:
            key = p.pos_key._parameters if p.pos_key is not None else {}
            query = p.pos_query._parameters if p.pos_query is not None else {}
            out.append((key.get("weight"), key.get("bias"), query.get("weight"), query.get("bias")))
        return out

    def rotary_terms(self, packing: Any, tokens: int) -> dict[str, torch.Tensor] | None:
        """The encoder's rotary tables for this batch (layer kind -> [2, T, R/2]), or None without rotary positions."""
        return self.encoder.rotary_terms(packing, tokens) if self.rotary else None

    def layer_weights(self, concatenate: bool) -> list[tuple]:
        """Per layer, the tensors its fused ops read, in the loop's order: (QKV weight, bias, attention output weight,
        bias, LayerNorm weight, bias, eps, FFN in weight, bias, activation, FFN out weight, bias, LayerNorm weight,
        bias, eps, gate weight or None). A GEMM built without a bias (NomicBERT's) reads its module's zero row for the
        fused epilogue's. `concatenate`: the QKV weight concatenated now (autograd), not the cached copy."""
        if concatenate:
            return fused(self.layer_sources())
        return [(*attention.fused_qkv(), o["weight"], o["bias"] if o["bias"] is not None else ob.get("no_bias"),
                 n1._parameters["weight"], n1._parameters["bias"], n1.eps, i["weight"], i["bias"], inter.act,
                 f["weight"], f["bias"] if f["bias"] is not None else fb.get("no_bias"), n2._parameters["weight"],
                 n2._parameters["bias"], n2.eps, g["weight"] if g is not None else None)
                for attention, o, n1, i, inter, f, n2, ob, fb, g in self._layer_modules]  # fmt: skip

    def layer_sources(self) -> list[tuple]:
        """Per layer, what `layer_weights` reads, with Q, K and V as found: ((Q, K, V weights), (Q, K, V biases),
        attention output weight, ...). A CUDA graph holds these and concatenates Q, K and V at every replay."""
        return [((q["weight"], k["weight"], v["weight"]), (q["bias"], k["bias"], v["bias"]), o["weight"],
                 o["bias"] if o["bias"] is not None else ob.get("no_bias"), n1._parameters["weight"],
                 n1._parameters["bias"], n1.eps, i["weight"], i["bias"], inter.act, f["weight"],
                 f["bias"] if f["bias"] is not None else fb.get("no_bias"), n2._parameters["weight"],
                 n2._parameters["bias"], n2.eps, g["weight"] if g is not None else None)
                for q, k, v, o, n1, i, inter, f, n2, ob, fb, g in self._layer_sources]  # fmt: skip


def fused(sources: list[tuple]) -> list[tuple]:
    """`Structure.layer_sources` with Q, K and V concatenated now: `layer_weights`' form."""
    return [(torch.cat(weights), None if biases[0] is None else torch.cat(biases), *rest)
            for weights, biases, *rest in sources]  # fmt: skip


def same_layers(layers: Sequence[LayerParts]) -> int | None:
    """The index (from 1) of the first layer not built like the first one (`LayerParts.signature`), or None."""
    template = layers[0].signature() if layers else None
    for i, p in enumerate(layers[1:], start=2):
        if p.signature() != template:
            return i
    return None
