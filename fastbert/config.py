"""BertConfig: transformers' field names, plus fastbert's own (ALBERT factorisation, layer sharing, backend).

Reads and writes the same `config.json` transformers does. Fields fastbert does not use are kept as they were read,
so a checkpoint round-trips without losing anything.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable
from typing import Any

from fastbert import ops
from fastbert.families import Family, UnsupportedModelError, family_of
from fastbert.relative_positions import RELATIVE_BUCKETS

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
GATE_ACTIVATIONS = (*ACTIVATIONS, "silu")  # a gated family's (NomicBERT: SwiGLU)
ACT_KINDS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
             "silu": "silu"}  # fmt: skip  (config's name -> ops')
LAYER_KINDS = ("full_attention", "sliding_attention")  # transformers' layer_types of the rotary families
ROPE_FIELDS = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}  # older configs' names
SHARING = ("none", "all", "attention", "ffn")
OUTPUT_FLAGS = ("output_hidden_states", "output_attentions", "return_dict")  # read by forward where left None

_DEFAULTS: dict[str, Any] = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
    "classifier_dropout": None,
    "num_labels": 2,
    "problem_type": None,
    "id2label": None,
    "label2id": None,
    "tie_word_embeddings": True,
    # fastbert's own
    "embedding_size": None,  # ALBERT: embeddings of size E projected to hidden_size; None means E == H
    "layer_sharing": "none",  # none | all | attention | ffn
    "num_hidden_groups": 1,  # ALBERT groups: layer i uses group i * groups // layers
    "backend": None,  # None/auto or a name in fastbert.ops.backends(); use_backend() and FASTBERT_BACKEND override
    "quantize": None,  # None | "int8": dynamic int8 GEMMs on CPU where measured faster (inference only)
}

_FASTBERT_FIELDS = ("embedding_size", "layer_sharing", "num_hidden_groups", "backend", "quantize")
QUANTIZE_CHOICES = (None, "int8")
_SIZES = (  # positive integers
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "num_hidden_groups",
)
MAX_LABELS = 1 << 20  # num_labels builds a label map entry per label at once: more is a typo or a hostile file
LAYER_BYTES = 1 << 14  # a generous bound on a layer's Python objects (modules, parameter wrappers), shared or not
_PROBABILITIES = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")  # None: not set
PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")
# transformers fields that change what the model computes, which fastbert does not implement: each runs here only
# switched off (false, 0, null or empty). Ignoring one would silently give other numbers (is_decoder: a causal mask,
# 1.5 off), so it is refused. Not here: chunk_size_feed_forward, which splits the per-token FFN along the sequence to
# save memory and computes the same numbers.
OFF_ONLY_FIELDS = (
    ("is_decoder", "a decoder (causal attention mask)"),
    ("add_cross_attention", "cross-attention layers"),
    ("is_encoder_decoder", "an encoder-decoder model"),
    ("pruned_heads", "pruned attention heads"),
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _label_map(id2label: Any) -> dict[int, Any]:
    """id2label with integer keys (JSON writes them as strings); anything else is a ValueError naming the field."""
    if not isinstance(id2label, dict):
        raise ValueError(f"id2label must be a mapping of label ids to names, got {id2label!r:.60}")
    try:
        return {int(k): v for k, v in id2label.items()}
    except (TypeError, ValueError):
        raise ValueError(f"id2label keys must be integers, got {list(id2label)[:10]}") from None


def _not_implemented(name: str, value: Any, what: str, runs: str) -> ValueError:
    """The error for a config field asking for what fastbert does not compute: the field, its value, what runs."""
    return ValueError(
        f"{name}={value!r} is not supported: it asks for {what}, which fastbert does not implement; fastbert runs "
        f"{name} {runs} only. Load this model with transformers instead"
    )


class BertConfig:
    """Model hyper-parameters; attribute names are transformers' so existing code and checkpoints carry over.

    `model_type` picks the family (bert, roberta, xlm-roberta, distilbert, albert, electra): its defaults here, its
    behaviour in the model. RobertaConfig and the others below are this class with their model_type preset.
    """

    model_type = "bert"

    def __init__(self, **kwargs: Any) -> None:
        model_type = kwargs.pop("model_type", type(self).model_type)
        family = family_of(model_type)
        self.model_type = family.model_type
        values = copy.deepcopy({**_DEFAULTS, **family.config_defaults})
        for hf_name, name in family.config_names:  # DistilBertConfig(dim=..., n_layers=...) as in transformers
            if hf_name in kwargs:  # fastbert's name wins where both are given (a config dict edited by name)
                kwargs.setdefault(name, kwargs.pop(hf_name))
        values.update(kwargs)
        if values.get("id2label") is None:
            if not _is_int(values["num_labels"]) or values["num_labels"] < 0:
                raise ValueError(f"num_labels must be a non-negative integer, got {values['num_labels']!r}")
            if values["num_labels"] > MAX_LABELS:
                raise ValueError(f"num_labels must be at most {MAX_LABELS}, got {values['num_labels']!r}")
            values["id2label"] = {i: f"LABEL_{i}" for i in range(values["num_labels"])}
        values["id2label"] = _label_map(values["id2label"])
        values["num_labels"] = len(values["id2label"])
        if values.get("label2id") is None:
            values["label2id"] = {v: k for k, v in values["id2label"].items()}
        for key, value in values.items():
            setattr(self, key, value)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError, naming the field, for any value or combination no model can be built from or run."""
        for name in _SIZES:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        least = 0 if self.family.disentangled or self.family.rotary else 1  # 0: no token-type table (gte-base-en)
        if not _is_int(self.type_vocab_size) or self.type_vocab_size < least:
            raise ValueError(f"type_vocab_size must be a positive integer, got {self.type_vocab_size!r}")
        if self.embedding_size is not None and (not _is_int(self.embedding_size) or self.embedding_size < 1):
            raise ValueError(f"embedding_size must be a positive integer or null, got {self.embedding_size!r}")
        for name in _PROBABILITIES:
            value = getattr(self, name)
            if not (value is None and name == "classifier_dropout") and not (_is_number(value) and 0 <= value <= 1):
                raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
        if not _is_number(self.layer_norm_eps) or self.layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}")
        if not _is_number(self.initializer_range) or self.initializer_range < 0:
            raise ValueError(f"initializer_range must be a number >= 0, got {self.initializer_range!r}")
        if self.pad_token_id is not None and not (
            _is_int(self.pad_token_id) and 0 <= self.pad_token_id < self.vocab_size
        ):
            raise ValueError(
                f"pad_token_id must be null or in [0, vocab_size={self.vocab_size}), got {self.pad_token_id!r}"
            )
        if self.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"problem_type must be one of {PROBLEM_TYPES}, got {self.problem_type!r}")
        _label_map(self.id2label)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        allowed = GATE_ACTIVATIONS if self.family.gated else ACTIVATIONS
        if self.hidden_act not in allowed:
            raise ValueError(f"hidden_act must be one of {allowed}, got {self.hidden_act!r}")
        if self.layer_sharing not in SHARING:
            raise ValueError(f"layer_sharing must be one of {SHARING}, got {self.layer_sharing!r}")
        if self.num_hidden_groups > self.num_hidden_layers:
            raise ValueError(
                f"num_hidden_groups ({self.num_hidden_groups}) must be in "
                f"[1, num_hidden_layers={self.num_hidden_layers}]"
            )
        if self.backend not in (None, "auto", *ops.backends()):
            # the registry's names: a backend added with ops.register_backend is valid here too
            raise ValueError(f"backend must be None, 'auto' or one of {sorted(ops.backends())}, got {self.backend!r}")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(
                f"quantize must be None or 'int8' (dynamic int8 GEMMs on CPU, inference), got {self.quantize!r}"
            )
        if self.family.grouped_layers:  # ALBERT checkpoints number groups of whole shared layers
            if getattr(self, "inner_group_num", 1) != 1:
                raise ValueError("inner_group_num must be 1: ALBERT groups of several layers are not supported")
            if self.layer_sharing != "all":
                raise ValueError(f"layer_sharing must be 'all' for {self.model_type}, got {self.layer_sharing!r}")
        if self.family.relative_attention:
            buckets = getattr(self, "relative_attention_num_buckets", None)
            if not _is_int(buckets) or buckets < RELATIVE_BUCKETS:
                raise ValueError(
                    f"relative_attention_num_buckets must be an integer >= {RELATIVE_BUCKETS} (MPNet buckets distances "
                    f"{RELATIVE_BUCKETS} ways whatever the table's size), got {buckets!r}"
                )
        if self.family.disentangled:
            self._validate_disentangled()
        if self.family.rotary:
            self._validate_rotary()
        for name, what in OFF_ONLY_FIELDS:
            if getattr(self, name, None):
                raise _not_implemented(name, getattr(self, name), what, "switched off (false, 0, null or empty)")
        if self.position_embedding_type != "absolute":
            raise _not_implemented("position_embedding_type", self.position_embedding_type, "other position "
                                   "embeddings than absolute ones", "'absolute'")  # fmt: skip

    def _validate_disentangled(self) -> None:
        """DeBERTa-v2/v3's fields: what fastbert computes of them, the rest refused by name."""
        if isinstance(self.pos_att_type, str):  # transformers' "p2c|c2p" spelling
            self.pos_att_type = [x.strip() for x in self.pos_att_type.lower().split("|")]
        kinds = self.pos_att_type or []
        if not isinstance(kinds, list) or any(k not in ("c2p", "p2c") for k in kinds):
            raise ValueError(f"pos_att_type must be a list of 'c2p' and 'p2c', got {self.pos_att_type!r}")
        for name in ("position_buckets", "max_relative_positions"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.position_buckets > 0 and self.position_buckets < 2:
            raise ValueError(f"position_buckets must be >= 2 or <= 0 (none), got {self.position_buckets}")
        if self.pooler_hidden_act not in ACTIVATIONS:
            raise ValueError(f"pooler_hidden_act must be one of {ACTIVATIONS}, got {self.pooler_hidden_act!r}")
        refused = (
            ("conv_kernel_size", getattr(self, "conv_kernel_size", 0) or 0, 0, "DeBERTa-v2's convolution layer", "0"),
            ("embedding_size", self.embedding_size, self.hidden_size, "an embedding projection before the LayerNorm "
             "(DeBERTa's embed_proj)", "equal to hidden_size"),
            ("attention_head_size", getattr(self, "attention_head_size", None), self.head_dim, "heads of another "
             "width than hidden_size / num_attention_heads", "equal to hidden_size / num_attention_heads"),
            ("pooler_hidden_size", getattr(self, "pooler_hidden_size", None), self.hidden_size, "a pooler of another "
             "width", "equal to hidden_size"),
        )  # fmt: skip
        for name, value, allowed, what, runs in refused:
            if value is not None and value != allowed:
                raise _not_implemented(name, value, what, runs)

    def _validate_rotary(self) -> None:
        """ModernBERT's fields: layer kinds, window, rotary bases; other rope types and head widths refused."""
        kinds = self.layer_kinds
        if len(kinds) != self.num_hidden_layers or any(k not in LAYER_KINDS for k in kinds):
            raise ValueError(f"layer_types must name {LAYER_KINDS} once per layer ({self.num_hidden_layers}), "
                             f"got {getattr(self, 'layer_types', None)!r}")  # fmt: skip
        if getattr(self, "head_dim_field", None) not in (None, self.head_dim):
            raise _not_implemented("head_dim", self.head_dim_field, "heads of another width than hidden_size / "
                                   "num_attention_heads", "equal to hidden_size / num_attention_heads")  # fmt: skip
        if self.head_dim % 2:
            raise ValueError(f"rotary positions rotate pairs of dims: hidden_size / num_attention_heads must be even, "
                             f"got {self.head_dim}")  # fmt: skip
        window = getattr(self, "local_attention", 0)
        if not _is_int(window) or window < 0:
            raise ValueError(f"local_attention must be an integer >= 0, got {window!r}")
        if getattr(self, "decoder_bias", True) is not True:
            raise _not_implemented("decoder_bias", self.decoder_bias, "an MLM decoder without a bias", "true")
        if getattr(self, "sparse_prediction", False):
            raise _not_implemented("sparse_prediction", self.sparse_prediction, "MLM logits of the labelled positions "
                                   "only", "false (the loss is the same)")  # fmt: skip
        poolings = self.family.classifier_poolings
        if getattr(self, "classifier_pooling", poolings[0]) not in poolings:
            raise ValueError(f"classifier_pooling must be one of {poolings}, got {self.classifier_pooling!r}")
        if self.family.llama_layers and not (
            _is_int(self.kv_heads) and self.kv_heads > 0 and self.num_attention_heads % self.kv_heads == 0
        ):
            raise ValueError(f"num_key_value_heads must divide num_attention_heads ({self.num_attention_heads}), got "
                             f"{getattr(self, 'num_key_value_heads', None)!r}")  # fmt: skip
        if getattr(self, "classifier_activation", "gelu") not in ACTIVATIONS:
            raise ValueError(f"classifier_activation must be one of {ACTIVATIONS}, got {self.classifier_activation!r}")
        for kind in set(kinds):
            rope = self.rope_parameters_of(kind)
            if rope.get("rope_type", "default") != "default":
                raise _not_implemented("rope_type", rope["rope_type"], "scaled rotary frequencies", "'default'")
            if not _is_number(rope.get("rope_theta")) or rope["rope_theta"] <= 0:
                raise ValueError(f"rope_theta of {kind} must be a positive number, got {rope.get('rope_theta')!r}")

    @property
    def layer_kinds(self) -> list[str]:
        """Per layer, "full_attention" or "sliding_attention": `layer_types`, or every `global_attn_every_n_layers`-th
        layer global from the first (older ModernBERT configs)."""
        kinds = getattr(self, "layer_types", None)
        if kinds is not None:
            return list(kinds)
        if not self.family.sliding_layers:  # GTE, EuroBERT: every layer global
            return [LAYER_KINDS[0]] * self.num_hidden_layers
        every = getattr(self, "global_attn_every_n_layers", 3)
        return [LAYER_KINDS[bool(i % every)] for i in range(self.num_hidden_layers)]

    @property
    def kv_heads(self) -> int:
        """The key and value heads (EuroBERT's num_key_value_heads, each serving a group of query heads): as many as
        query heads unless the config says fewer."""
        kv = getattr(self, "num_key_value_heads", None)
        return self.num_attention_heads if kv is None else kv

    @property
    def sliding_window(self) -> int:
        """The half window of sliding layers: keys within local_attention // 2 of the query."""
        return getattr(self, "local_attention", 0) // 2

    def rope_parameters_of(self, kind: str) -> dict[str, Any]:
        """The rotary parameters of a layer kind: `rope_parameters[kind]` (ModernBERT's, by layer kind) or
        `rope_parameters` itself (GTE's, one for all), else the older `global_rope_theta` / `local_rope_theta` fields,
        else the family's base (10k on sliding layers)."""
        given = getattr(self, "rope_parameters", None) or {}
        if not ("rope_theta" in given or "rope_type" in given):
            given = given.get(kind) or {}
        default = self.family.rope_theta if kind == LAYER_KINDS[0] else 10_000.0
        return {"rope_type": "default", "rope_theta": getattr(self, ROPE_FIELDS[kind], default), **given}

    @property
    def absolute_positions(self) -> bool:
        """Whether position embeddings are added to the words (not for DeBERTa-v3: position_biased_input false, nor
        for the rotary families)."""
        return not self.family.rotary and bool(getattr(self, "position_biased_input", True))

    @property
    def token_types(self) -> bool:
        """Whether the embeddings add a token-type row (the family has them and type_vocab_size > 0)."""
        return self.family.token_types and self.type_vocab_size > 0

    @property
    def disentangled_kinds(self) -> tuple[str, ...]:
        """DeBERTa's relative terms the attention adds ("c2p", "p2c"); empty without relative attention."""
        if not self.family.disentangled or not self.relative_attention:
            return ()
        return tuple(k for k in ("c2p", "p2c") if k in (self.pos_att_type or []))

    def parameter_count(self) -> int:
        """The parameters a model of this config holds (the bare encoder, a pooler, an MLM transform and a
        classifier: an upper bound for every head), counted from the sizes alone, nothing allocated."""
        e, h, i, v = self.embedding_dim, self.hidden_size, self.intermediate_size, self.vocab_size
        layers, groups = self.num_hidden_layers, self.num_hidden_groups
        project = e != h or self.family.always_project
        embeddings = (v + self.max_position_embeddings + self.type_vocab_size + 2) * e + (e * h + h) * project
        attention, ffn = 4 * h * h + 6 * h, 2 * h * i + i + 3 * h
        unique = {"none": (layers, layers), "all": (groups, groups), "attention": (groups, layers)}
        n_attention, n_ffn = unique.get(self.layer_sharing, (layers, groups))
        heads = 2 * (h * h + h) + 3 * h + v + (self.num_labels + 1) * h + v * e * (not self.tie_word_embeddings)
        return embeddings + n_attention * attention + n_ffn * ffn + heads

    def check_fits(self, source: str | Callable[[str], str], memory: int | None = None) -> None:
        """Raise ValueError, naming `source` (the file or options the sizes came from; a function of the field where
        they came from several) and the size most out of proportion, if a model of this config cannot be allocated
        on this machine (its fp32 parameters and per-layer objects exceed `memory`, default: `machine_memory()`):
        one line before a byte is allocated, not the allocator's error (or the OOM killer) after minutes of trying."""
        memory = machine_memory() if memory is None else memory
        if memory is None:
            return
        need = 4 * self.parameter_count() + LAYER_BYTES * self.num_hidden_layers
        if need <= memory:
            return
        names = (*_SIZES, "embedding_size", "num_labels")
        sizes = {n: getattr(self, n) for n in names if _is_int(getattr(self, n)) and getattr(self, n) > 0}
        defaults = {**_DEFAULTS, "embedding_size": _DEFAULTS["hidden_size"]}
        field = max(sizes, key=lambda n: sizes[n] / max(1, defaults[n] or 1))
        shown = dict((fb, hf) for hf, fb in self.family.config_names).get(field, field)
        where = source(field) if callable(source) else source
        raise ValueError(
            f"{where}: {shown}={sizes[field]} makes a model of {self.parameter_count():.3g} parameters "
            f"({need / 2**30:.3g} GiB in fp32), more than this machine's memory ({memory / 2**30:.3g} GiB)"
        )

    # ---------------------------------------------------------- derived values
    @property
    def family(self) -> Family:
        """What this model_type changes in the one model definition (fastbert.families)."""
        return family_of(self.model_type)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def embedding_dim(self) -> int:
        """Width of the embedding tables (E); equals hidden_size unless ALBERT factorisation is on."""
        return self.embedding_size or self.hidden_size

    def group_of_layer(self, layer: int) -> int:
        """ALBERT's group assignment: layer i of L uses group floor(i * G / L)."""
        return layer * self.num_hidden_groups // self.num_hidden_layers

    # -------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict[str, Any]:
        """transformers' field names for this family (AutoConfig reads them), plus fastbert's where not default."""
        family = self.family
        out = {k: copy.deepcopy(v) for k, v in self.__dict__.items() if not k.startswith("_")}
        out["id2label"] = {str(k): v for k, v in self.id2label.items()}
        defaults = {**_DEFAULTS, **family.config_defaults}
        for name in _FASTBERT_FIELDS:  # keep HF-only configs free of fastbert fields at their defaults
            if name not in family.native_fields and out.get(name) == defaults[name]:
                out.pop(name)
        for name in family.config_absent:
            out.pop(name, None)
        for name in family.native_fields:  # DeBERTa's embedding_size unset: transformers reads it as hidden_size
            if out.get(name) is None:
                out.pop(name, None)
        for hf_name, name in family.config_names:
            if name in out:  # NomicBERT's head_dim: only where the config gave one
                out[hf_name] = out.pop(name)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> BertConfig:
        """The config class of the dict's model_type (UnsupportedModelError for an architecture fastbert lacks)."""
        values = dict(values)
        family = family_of(values.pop("model_type", "bert"))
        return CONFIG_CLASSES[family.model_type](**values)

    @classmethod
    def from_hf(cls, hf_config: Any) -> BertConfig:
        """A transformers config object of a supported family, converted: the fields fastbert reads (its own names
        or the family's), those it refuses when switched on, none of transformers' runtime fields."""
        values = hf_config.to_dict()
        family = family_of(values.get("model_type", "bert"))
        keep = set(_DEFAULTS) | {"architectures", "model_type", *OUTPUT_FLAGS} | {hf for hf, _ in family.config_names}
        keep |= set(family.extra_fields) | set(family.config_defaults)
        keep |= {name for name, _ in OFF_ONLY_FIELDS if values.get(name)}  # switched on: refused by name
        return cls.from_dict({k: v for k, v in values.items() if k in keep})

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> BertConfig:
        """A config.json; a file that is not JSON or holds a bad field is a ValueError naming the file."""
        with open(path, encoding="utf-8") as f:
            try:
                values = json.load(f)
                if not isinstance(values, dict):
                    raise ValueError(f"a config.json must hold a JSON object of fields, got a {type(values).__name__}")
                return cls.from_dict(values)
            except UnsupportedModelError as exc:
                raise UnsupportedModelError(f"{os.fspath(path)}: {exc}") from None
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors too
                raise ValueError(f"{os.fspath(path)}: {exc}") from None

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> BertConfig:
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in {directory}")
        return cls.from_json_file(path)

    def field_names(self) -> set[str]:
        """Every field a caller may set: this config's, fastbert's and transformers' (the family's names too), and the
        output flags transformers' forward reads."""
        family = self.family
        names = set(vars(self)) | set(_DEFAULTS) | set(family.config_defaults) | set(family.extra_fields)
        names |= {name for pair in family.config_names for name in pair} | set(OUTPUT_FLAGS)
        return {name for name in names if not name.startswith("_")}

    def updated(self, **fields: Any) -> BertConfig:
        """A copy with `fields` set as construction would take them: `num_labels` alone labels LABEL_0..LABEL_{n-1}
        (a label map read from the file would otherwise win), `id2label` alone derives label2id; validated."""
        values = self.to_dict()
        if "num_labels" in fields and "id2label" not in fields:
            values.pop("id2label", None)
        if "num_labels" in fields or "id2label" in fields:
            values.pop("label2id", None)
        return BertConfig.from_dict({**values, **fields})

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BertConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"BertConfig {self.to_json_string()}"


def machine_memory() -> int | None:
    """Bytes of memory this process may use: the machine's physical memory, or its cgroup's limit where lower;
    None where neither can be read (no model is then refused for its size)."""
    try:
        limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    except (AttributeError, ValueError, OSError):
        limits = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read(64).strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits) if limits else None


def _config_class(model_type: str, name: str) -> type[BertConfig]:
    return type(f"{name}Config", (BertConfig,), {"model_type": model_type, "__doc__": f"BertConfig for {model_type}."})


CONFIG_CLASSES: dict[str, type[BertConfig]] = {"bert": BertConfig}
RobertaConfig = CONFIG_CLASSES["roberta"] = _config_class("roberta", "Roberta")
XLMRobertaConfig = CONFIG_CLASSES["xlm-roberta"] = _config_class("xlm-roberta", "XLMRoberta")
DistilBertConfig = CONFIG_CLASSES["distilbert"] = _config_class("distilbert", "DistilBert")
AlbertConfig = CONFIG_CLASSES["albert"] = _config_class("albert", "Albert")
ElectraConfig = CONFIG_CLASSES["electra"] = _config_class("electra", "Electra")
MPNetConfig = CONFIG_CLASSES["mpnet"] = _config_class("mpnet", "MPNet")
DebertaV2Config = CONFIG_CLASSES["deberta-v2"] = _config_class("deberta-v2", "DebertaV2")
ModernBertConfig = CONFIG_CLASSES["modernbert"] = _config_class("modernbert", "ModernBert")
GteConfig = CONFIG_CLASSES["gte"] = _config_class("gte", "Gte")
NomicBertConfig = CONFIG_CLASSES["nomic_bert"] = _config_class("nomic_bert", "NomicBert")
EuroBertConfig = CONFIG_CLASSES["eurobert"] = _config_class("eurobert", "EuroBert")
JinaEmbeddingsV3Config = CONFIG_CLASSES["jina_embeddings_v3"] = _config_class("jina_embeddings_v3", "JinaEmbeddingsV3")
