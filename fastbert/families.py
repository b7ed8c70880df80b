"""The encoder families fastbert runs on its one model definition, and how each differs from BERT, as data.

A `Family` says how transformers names the family's config fields and checkpoint keys, how positions are counted
(absolute, relative, rotary), whether there are token types, a pooler and an embedding projection, gates and biases,
and how its heads are laid out. The model (modeling.py, prenorm.py, heads.py) reads these flags; checkpoint.py renames
keys with `to_fastbert_keys` / `to_hf_keys` (splitting fused tensors where transformers' files hold them). Inside
fastbert every family keeps BERT's module names (`bert.encoder.layer.N.attention.self.query`, ...); BERT has none for
pre-norm layers, so ModernBERT's and EuroBERT's keep transformers' (`bert.encoder.layer.N.attn.Wqkv`,
`bert.encoder.layer.N.self_attn.q_proj`, ...).
This module imports nothing of fastbert's, so config, checkpoint and model can all read it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Pairs = tuple[tuple[str, str], ...]  # (transformers' name, fastbert's name); `*` stands for a layer number
HEAD_KINDS = ("model", "sequence", "token", "qa", "mlm", "pretraining", "nsp", "choice")
FAMILY_HEADS = ("model", "sequence", "token", "qa", "mlm")


@dataclass(frozen=True)
class Family:
    """One architecture: everything fastbert needs to load, run and save its checkpoints."""

    model_type: str  # transformers' config.model_type
    name: str  # prefix of its class names: "Roberta" -> RobertaModel, RobertaForMaskedLM, RobertaConfig
    prefix: str  # transformers' base_model_prefix: the heads' `roberta.` in `roberta.encoder.layer.0...`
    config_names: Pairs = ()  # config fields transformers names differently (DistilBERT's dim, n_layers, ...)
    config_defaults: Mapping[str, Any] = field(default_factory=dict)  # transformers' defaults that differ from BERT's
    config_absent: tuple[str, ...] = ()  # fields fixed for this family, not written to its config.json
    native_fields: tuple[str, ...] = ()  # fastbert's own fields that are this family's transformers fields too
    extra_fields: tuple[str, ...] = ()  # transformers-only fields kept when converting a live model
    padded_positions: bool = False  # RoBERTa: position = cumsum(id != pad) * (id != pad) + pad
    position_pad: int | None = None  # the pad id positions count from where the family fixes it (MPNet: 1)
    relative_attention: bool = False  # MPNet: a learned bias per head and relative-distance bucket on every score
    disentangled: bool = False  # DeBERTa-v2/v3: content-to-position and position-to-content scores (config says which)
    rotary: bool = False  # ModernBERT, GTE: rotary positions in the attention, no position table
    pre_norm: bool = False  # ModernBERT, EuroBERT: pre-norm layers (fastbert.prenorm) and a final norm
    sliding_layers: bool = False  # ModernBERT: global and sliding-window layers (layer_types); others all global
    llama_layers: bool = False  # EuroBERT: Llama's layers (RMSNorm, q/k/v/o with grouped kv heads, SwiGLU)
    embedding_norm: bool = True  # False: the word rows go into the first layer as they are (EuroBERT)
    head_transform: bool = False  # ModernBERT: dense -> act -> norm (`head`) before every classifier
    classifier_poolings: tuple[str, ...] = ("cls", "mean")  # the sentence head's classifier_pooling choices
    gated: bool = False  # GTE: act(gate(x)) * up(x) in BERT's intermediate (`intermediate.gate`)
    rope_theta: float = 10_000.0  # the rotary base where a config names none (ModernBERT's global layers: 160k)
    head_pooler: bool = False  # GTE: no pooler in the bare model, BERT's dense + tanh in the sequence head
    linear_biases: bool = True  # False: Q, K, V, the attention output and the FFN output without biases (NomicBERT)
    gate_dropout: bool = True  # dropout on the gated activation (GTE's; NomicBERT has none)
    context_pooler: bool = False  # DeBERTa: no pooler in the bare model; the sentence heads pool through `pooler.dense`
    modern_mlm_keys: Pairs = ()  # DeBERTa-v2 with legacy=False: its lm_predictions head's names, in place of "mlm"'s
    ignored_keys: tuple[str, ...] = ()  # checkpoint key prefixes dropped where the model has no place for them
    token_types: bool = True  # False: no token_type_embeddings (DistilBERT)
    pooler: bool = True  # the bare model has a pooler
    always_project: bool = False  # an E -> H projection even when E == H (ALBERT's embedding_hidden_mapping_in)
    grouped_layers: bool = False  # checkpoint keys number ALBERT groups, not layers
    keys: Pairs = ()  # base-model key pieces
    load_keys: Pairs = ()  # pieces read but never written: another layout transformers itself writes (GTE's files)
    fused_keys: tuple[tuple[str, tuple[str, ...]], ...] = ()  # a piece whose tensor splits along dim 0 into these
    head_keys: Mapping[str, Pairs] = field(default_factory=dict)  # per head kind ("sequence", "mlm", ...)
    classifier_act: str | None = None  # None: BERT's pooler + classifier; else <s> -> dense -> act -> out_proj
    classifier_dropout_first: bool = True  # RoBERTa/ELECTRA drop out before the dense layer too, DistilBERT not
    mlm_act: str | None = None  # the MLM transform's activation when fixed; None: config.hidden_act
    dropouts: Mapping[str, str] = field(default_factory=dict)  # head kind -> config field of its dropout
    heads: tuple[str, ...] = FAMILY_HEADS  # the head kinds it has classes for (fastbert.auto)


_ROBERTA = dict(
    prefix="roberta",
    config_defaults={
        "vocab_size": 50265,
        "max_position_embeddings": 514,
        "type_vocab_size": 1,
        "layer_norm_eps": 1e-5,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
    },
    padded_positions=True,
    head_keys={
        "mlm": (
            ("lm_head.dense", "cls.predictions.transform.dense"),
            ("lm_head.layer_norm", "cls.predictions.transform.LayerNorm"),
            ("lm_head.decoder", "cls.predictions.decoder"),
            ("lm_head.bias", "cls.predictions.bias"),
        )
    },
    classifier_act="tanh",
    mlm_act="gelu",
)

# transformers' module names of the gated rotary families on BERT's layers (GTE, NomicBERT)
_GATED_ROTARY_KEYS = (
    ("layers", "encoder.layer"),
    ("self_attn.q_proj", "attention.self.query"),
    ("self_attn.k_proj", "attention.self.key"),
    ("self_attn.v_proj", "attention.self.value"),
    ("self_attn.o_proj", "attention.output.dense"),
    ("post_attention_layernorm", "attention.output.LayerNorm"),
    ("mlp.up_proj", "intermediate.dense"),
    ("mlp.gate_proj", "intermediate.gate"),
    ("mlp.down_proj", "output.dense"),
    ("post_mlp_layernorm", "output.LayerNorm"),
)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("bert", "Bert", "bert", heads=HEAD_KINDS),
        Family("roberta", "Roberta", **_ROBERTA),
        Family("xlm-roberta", "XLMRoberta", **_ROBERTA),
        Family(
            "distilbert",
            "DistilBert",
            "distilbert",
            config_names=(
                ("dim", "hidden_size"),
                ("n_layers", "num_hidden_layers"),
                ("n_heads", "num_attention_heads"),
                ("hidden_dim", "intermediate_size"),
                ("dropout", "hidden_dropout_prob"),
                ("attention_dropout", "attention_probs_dropout_prob"),
                ("activation", "hidden_act"),
            ),
            config_defaults={"num_hidden_layers": 6, "qa_dropout": 0.1, "seq_classif_dropout": 0.2},
            config_absent=("type_vocab_size", "layer_norm_eps", "position_embedding_type", "classifier_dropout"),
            extra_fields=("sinusoidal_pos_embds", "qa_dropout", "seq_classif_dropout"),
            token_types=False,
            pooler=False,
            keys=(
                ("transformer.layer", "encoder.layer"),
                ("attention.q_lin", "attention.self.query"),
                ("attention.k_lin", "attention.self.key"),
                ("attention.v_lin", "attention.self.value"),
                ("attention.out_lin", "attention.output.dense"),
                ("sa_layer_norm", "attention.output.LayerNorm"),
                ("ffn.lin1", "intermediate.dense"),
                ("ffn.lin2", "output.dense"),
                ("output_layer_norm", "output.LayerNorm"),
            ),
            head_keys={
                "sequence": (("pre_classifier", "classifier.dense"), ("classifier", "classifier.out_proj")),
                "mlm": (
                    ("vocab_transform", "cls.predictions.transform.dense"),
                    ("vocab_layer_norm", "cls.predictions.transform.LayerNorm"),
                    ("vocab_projector.bias", "cls.predictions.bias"),
                    ("vocab_projector", "cls.predictions.decoder"),
                ),
            },
            classifier_act="relu",
            classifier_dropout_first=False,
            dropouts={"sequence": "seq_classif_dropout", "qa": "qa_dropout"},
        ),
        Family(
            "albert",
            "Albert",
            "albert",
            config_names=(("classifier_dropout_prob", "classifier_dropout"),),
            config_defaults={
                "vocab_size": 30000,
                "embedding_size": 128,
                "hidden_act": "gelu_new",
                "hidden_dropout_prob": 0.0,
                "attention_probs_dropout_prob": 0.0,
                "classifier_dropout": 0.1,
                "layer_sharing": "all",
                "bos_token_id": 2,
                "eos_token_id": 3,
            },
            native_fields=("embedding_size", "num_hidden_groups"),
            extra_fields=("inner_group_num",),
            always_project=True,
            grouped_layers=True,
            keys=(
                ("encoder.embedding_hidden_mapping_in", "embeddings.projection"),
                ("encoder.albert_layer_groups.*.albert_layers.0", "encoder.layer.*"),
                ("attention.query", "attention.self.query"),
                ("attention.key", "attention.self.key"),
                ("attention.value", "attention.self.value"),
                ("attention.dense", "attention.output.dense"),
                ("attention.LayerNorm", "attention.output.LayerNorm"),
                ("ffn", "intermediate.dense"),
                ("ffn_output", "output.dense"),
                ("full_layer_layer_norm", "output.LayerNorm"),
                ("pooler", "pooler.dense"),
            ),
            head_keys={
                "mlm": (
                    ("predictions.dense", "cls.predictions.transform.dense"),
                    ("predictions.LayerNorm", "cls.predictions.transform.LayerNorm"),
                    ("predictions", "cls.predictions"),
                )
            },
        ),
        Family(
            "mpnet",
            "MPNet",
            "mpnet",
            config_defaults={
                **_ROBERTA["config_defaults"],
                "vocab_size": 30527,
                "max_position_embeddings": 512,
                "layer_norm_eps": 1e-12,
                "relative_attention_num_buckets": 32,
            },
            config_absent=("type_vocab_size", "position_embedding_type", "classifier_dropout"),
            padded_positions=True,
            position_pad=1,
            relative_attention=True,
            token_types=False,
            keys=(
                ("attention.attn.q", "attention.self.query"),
                ("attention.attn.k", "attention.self.key"),
                ("attention.attn.v", "attention.self.value"),
                ("attention.attn.o", "attention.output.dense"),
                ("attention.LayerNorm", "attention.output.LayerNorm"),
            ),
            head_keys={"mlm": _ROBERTA["head_keys"]["mlm"]},
            classifier_act="tanh",
            mlm_act="gelu",
            heads=(*FAMILY_HEADS, "choice"),
        ),
        Family(
            "deberta-v2",
            "DebertaV2",
            "deberta",
            config_defaults={
                "vocab_size": 128100,
                "hidden_size": 1536,
                "num_hidden_layers": 24,
                "num_attention_heads": 24,
                "intermediate_size": 6144,
                "type_vocab_size": 0,
                "layer_norm_eps": 1e-7,
                "relative_attention": False,
                "max_relative_positions": -1,
                "position_buckets": -1,
                "pos_att_type": None,
                "share_att_key": False,
                "norm_rel_ebd": "none",
                "position_biased_input": True,
                "pooler_dropout": 0,
                "pooler_hidden_act": "gelu",
                "legacy": True,
            },
            config_absent=("position_embedding_type", "classifier_dropout"),
            native_fields=("embedding_size",),
            extra_fields=("pooler_hidden_size", "cls_dropout", "conv_kernel_size", "attention_head_size"),
            disentangled=True,
            pooler=False,
            context_pooler=True,
            keys=(("query_proj", "query"), ("key_proj", "key"), ("value_proj", "value")),
            head_keys={
                "sequence": (("pooler", "bert.pooler"),),
                "choice": (("pooler", "bert.pooler"),),
            },
            modern_mlm_keys=(
                ("lm_predictions.lm_head.dense", "cls.predictions.transform.dense"),
                ("lm_predictions.lm_head.LayerNorm", "cls.predictions.transform.LayerNorm"),
                ("lm_predictions.lm_head.bias", "cls.predictions.bias"),
            ),
            ignored_keys=("embeddings.position_embeddings.", "mask_predictions."),
            dropouts={"sequence": "cls_dropout", "choice": "cls_dropout"},
            heads=(*FAMILY_HEADS, "choice"),
        ),
        Family(
            "modernbert",
            "ModernBert",
            "model",
            config_names=(
                ("norm_eps", "layer_norm_eps"),
                ("hidden_activation", "hidden_act"),
                ("attention_dropout", "attention_probs_dropout_prob"),
                ("mlp_dropout", "hidden_dropout_prob"),
            ),
            config_defaults={
                "vocab_size": 50368,
                "intermediate_size": 1152,
                "num_hidden_layers": 22,
                "max_position_embeddings": 8192,
                "layer_norm_eps": 1e-5,
                "pad_token_id": 50283,
                "hidden_dropout_prob": 0.0,
                "attention_probs_dropout_prob": 0.0,
                "classifier_dropout": 0.0,
                "type_vocab_size": 0,
                "norm_bias": False,
                "attention_bias": False,
                "mlp_bias": False,
                "embedding_dropout": 0.0,
                "local_attention": 128,
            },
            config_absent=("type_vocab_size", "position_embedding_type"),
            extra_fields=("layer_types", "rope_parameters", "global_attn_every_n_layers", "global_rope_theta",
                          "local_rope_theta", "classifier_pooling", "classifier_bias", "classifier_activation",
                          "decoder_bias", "sparse_prediction", "sparse_pred_ignore_index", "initializer_cutoff_factor",
                          "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id"),  # fmt: skip
            rotary=True,
            pre_norm=True,
            sliding_layers=True,
            head_transform=True,
            rope_theta=160_000.0,
            token_types=False,
            pooler=False,
            keys=(
                ("embeddings.tok_embeddings", "embeddings.word_embeddings"),
                ("embeddings.norm", "embeddings.LayerNorm"),
                ("layers", "encoder.layer"),
                ("final_norm", "encoder.final_norm"),
            ),
            head_keys={
                "mlm": (
                    ("head.dense", "cls.predictions.transform.dense"),
                    ("head.norm", "cls.predictions.transform.LayerNorm"),
                    ("decoder.bias", "cls.predictions.bias"),
                    ("decoder", "cls.predictions.decoder"),
                ),
                "sequence": (("head.norm", "head.LayerNorm"),),
                "token": (("head.norm", "head.LayerNorm"),),
                "qa": (("head.norm", "head.LayerNorm"), ("classifier", "qa_outputs")),
                "choice": (("head.norm", "head.LayerNorm"),),
            },
            heads=(*FAMILY_HEADS, "choice"),
        ),
        Family(
            "eurobert",
            "EuroBert",
            "model",
            config_names=(
                ("rms_norm_eps", "layer_norm_eps"),
                ("attention_dropout", "attention_probs_dropout_prob"),
                ("head_dim", "head_dim_field"),
            ),
            config_defaults={
                "vocab_size": 128256,
                "max_position_embeddings": 8192,
                "layer_norm_eps": 1e-5,
                "hidden_act": "silu",
                "pad_token_id": 128001,
                "hidden_dropout_prob": 0.0,
                "attention_probs_dropout_prob": 0.0,
                "type_vocab_size": 0,
                "attention_bias": False,
                "mlp_bias": False,
                "tie_word_embeddings": False,
                "classifier_pooling": "late",
            },
            config_absent=("type_vocab_size", "position_embedding_type", "hidden_dropout_prob", "classifier_dropout"),
            extra_fields=("num_key_value_heads", "rope_parameters", "bos_token_id", "eos_token_id", "mask_token_id",
                          "use_cache", "pretraining_tp", "head_dim"),  # fmt: skip
            rotary=True,
            pre_norm=True,
            llama_layers=True,
            gated=True,
            embedding_norm=False,
            token_types=False,
            pooler=False,
            keys=(
                ("embed_tokens", "embeddings.word_embeddings"),
                ("layers", "encoder.layer"),
                ("norm", "encoder.final_norm"),
            ),
            head_keys={"mlm": (("lm_head.bias", "cls.predictions.bias"), ("lm_head", "cls.predictions.decoder"))},
            classifier_poolings=("bos", "mean", "late"),
            heads=("model", "sequence", "token", "mlm"),
        ),
        Family(
            "gte",
            "Gte",
            "gte",
            config_defaults={
                "vocab_size": 250048,
                "max_position_embeddings": 8192,
                "type_vocab_size": 1,
                "pad_token_id": 1,
                "attention_probs_dropout_prob": 0.0,
            },
            config_absent=("position_embedding_type",),
            extra_fields=("rope_parameters", "bos_token_id", "eos_token_id"),
            rotary=True,
            gated=True,
            rope_theta=160_000.0,
            pooler=False,
            head_pooler=True,
            keys=_GATED_ROTARY_KEYS,
            # transformers writes GTE's files in Alibaba's original layout (fused qkv_proj and up_gate_proj, attn_ln,
            # mlp_ln, lm_head.norm) and converts on load: read both, write the model's own names (it reads those too)
            load_keys=(
                ("attention.o_proj", "attention.output.dense"),
                ("attn_ln", "attention.output.LayerNorm"),
                ("mlp_ln", "output.LayerNorm"),
                ("lm_head.norm", "cls.predictions.transform.LayerNorm"),
            ),
            fused_keys=(
                ("attention.qkv_proj", ("attention.self.query", "attention.self.key", "attention.self.value")),
                ("mlp.up_gate_proj", ("intermediate.dense", "intermediate.gate")),
            ),
            head_keys={
                "mlm": (
                    ("lm_head.dense", "cls.predictions.transform.dense"),
                    ("lm_head.layer_norm", "cls.predictions.transform.LayerNorm"),
                    ("lm_head.decoder.bias", "cls.predictions.bias"),
                    ("lm_head.decoder", "cls.predictions.decoder"),
                ),
            },
            mlm_act="gelu",
            heads=("model", "sequence", "token", "mlm"),
        ),
        Family(
            "nomic_bert",
            "NomicBert",
            "nomic_bert",
            config_names=(("head_dim", "head_dim_field"),),
            config_defaults={
                "vocab_size": 30528,
                "hidden_act": "silu",
                "hidden_dropout_prob": 0.0,
                "attention_probs_dropout_prob": 0.0,
                "max_position_embeddings": 2048,
            },
            config_absent=("position_embedding_type",),
            extra_fields=("rope_parameters", "bos_token_id", "eos_token_id", "head_dim"),
            rotary=True,
            gated=True,
            rope_theta=1000.0,
            pooler=False,
            head_pooler=True,
            linear_biases=False,
            gate_dropout=False,
            keys=_GATED_ROTARY_KEYS,
            # the layout transformers writes (nomic-embed's original names, converted on load)
            load_keys=(
                ("encoder.layers", "encoder.layer"),
                ("emb_ln", "embeddings.LayerNorm"),
                ("attn.out_proj", "attention.output.dense"),
                ("mlp.fc11", "intermediate.dense"),
                ("mlp.fc12", "intermediate.gate"),
                ("mlp.fc2", "output.dense"),
                ("norm1", "attention.output.LayerNorm"),
                ("norm2", "output.LayerNorm"),
            ),
            fused_keys=(("attn.Wqkv", ("attention.self.query", "attention.self.key", "attention.self.value")),),
            head_keys={"mlm": (("cls.predictions.transform.layer_norm", "cls.predictions.transform.LayerNorm"),)},
            heads=("model", "sequence", "token", "mlm"),
        ),
        Family(
            "jina_embeddings_v3",
            "JinaEmbeddingsV3",
            "roberta",
            config_defaults={
                **_ROBERTA["config_defaults"],
                "vocab_size": 250002,
                "hidden_size": 1024,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
                "intermediate_size": 4096,
                "max_position_embeddings": 8194,
            },
            config_absent=("position_embedding_type",),
            extra_fields=("rope_parameters", "bos_token_id", "eos_token_id", "use_cache"),
            rotary=True,
            rope_theta=20_000.0,
            keys=(
                ("layers", "encoder.layer"),
                *_GATED_ROTARY_KEYS[1:6],  # Q, K, V, the attention output and its norm: GTE's names
                ("mlp.fc1", "intermediate.dense"),
                ("mlp.fc2", "output.dense"),
                ("post_mlp_layernorm", "output.LayerNorm"),
            ),
            # the layout transformers writes (jina-embeddings-v3's original names, converted on load)
            load_keys=(
                ("emb_ln", "embeddings.LayerNorm"),
                ("encoder.layers", "encoder.layer"),
                ("mixer.out_proj", "attention.output.dense"),
                ("norm1", "attention.output.LayerNorm"),
                ("norm2", "output.LayerNorm"),
            ),
            fused_keys=(("mixer.Wqkv", ("attention.self.query", "attention.self.key", "attention.self.value")),),
            head_keys={"mlm": _ROBERTA["head_keys"]["mlm"]},
            classifier_act="tanh",
            mlm_act="gelu",
        ),
        Family(
            "electra",
            "Electra",
            "electra",
            config_defaults={"embedding_size": 128},
            native_fields=("embedding_size",),
            pooler=False,
            keys=(("embeddings_project", "embeddings.projection"),),
            head_keys={
                "mlm": (
                    ("generator_predictions.dense", "cls.predictions.transform.dense"),
                    ("generator_predictions.LayerNorm", "cls.predictions.transform.LayerNorm"),
                    ("generator_lm_head.bias", "cls.predictions.bias"),
                    ("generator_lm_head", "cls.predictions.decoder"),
                )
            },
            classifier_act="gelu",
            mlm_act="gelu",
        ),
    )
}


# Encoders people ask for that fastbert does not run yet, with what they need beyond the families above
NOT_YET = {
    "deberta": "DeBERTa: disentangled relative attention",
    "new": "GTE's remote-code checkpoints (Alibaba-NLP's `new`): their key names differ from transformers' `gte`, "
    "which is supported",
}


class UnsupportedModelError(ValueError):
    """A checkpoint or config of an architecture fastbert does not run."""


def family_of(model_type: str) -> Family:
    """The Family for a config's model_type; UnsupportedModelError naming what is supported otherwise."""
    family = FAMILIES.get("bert" if model_type == "fastbert" else model_type)
    if family is None:
        missing = f" ({NOT_YET[model_type]})" if model_type in NOT_YET else ""
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by fastbert{missing}; supported: {', '.join(FAMILIES)}; "
            f"not yet: {', '.join(NOT_YET)}"
        )
    return family


def first_layer_of_group(group: int, layers: int, groups: int) -> int:
    """The first layer ALBERT's assignment (layer i uses group i * G // L) gives to `group`."""
    return -(-group * layers // groups)


def _renamer(pairs: Pairs, to_hf: bool, number: Callable[[int], int]) -> Callable[[str], str]:
    """Rename whole dot-separated pieces of a key, longest pattern first, in one left-to-right pass."""
    sources = sorted(((fb, hf) if to_hf else (hf, fb) for hf, fb in pairs), key=lambda p: -len(p[0]))
    alternatives = []
    for i, (src, _) in enumerate(sources):  # group p<i> is pattern i; n<i> its layer number, where it has one
        alternatives.append(f"(?P<p{i}>" + re.escape(src).replace(r"\*", f"(?P<n{i}>" + r"\d+)") + ")")
    pattern = re.compile(r"(?<![^.])(?:" + "|".join(alternatives) + r")(?![^.])")

    def replace(match: re.Match) -> str:
        i = int(match.lastgroup[1:])  # the enclosing p<i> closes last
        dst = sources[i][1]
        return dst.replace("*", str(number(int(match.group(f"n{i}"))))) if "*" in dst else dst

    return lambda key: pattern.sub(replace, key)


def _layer_number(config: Any, to_hf: bool) -> Callable[[int], int]:
    """Key layer numbers: kept, or ALBERT's layer i -> its group (saving) and group g -> its first layer (loading)."""
    if not family_of(config.model_type).grouped_layers:
        return int
    if to_hf:
        return config.group_of_layer
    return lambda g: first_layer_of_group(g, config.num_hidden_layers, config.num_hidden_groups)


def _rename_state(state: Mapping[str, Any], config: Any, head: str, to_hf: bool) -> dict[str, Any]:
    family = family_of(config.model_type)
    head_pairs = family.head_keys.get(head, ())
    if head in ("mlm", "pretraining") and family.modern_mlm_keys and getattr(config, "legacy", True) is False:
        head_pairs = family.modern_mlm_keys
    pairs = ((family.prefix, "bert"), *family.keys, *head_pairs, *(() if to_hf else family.load_keys))
    rename = _renamer(pairs, to_hf, _layer_number(config, to_hf))
    if not to_hf and family.fused_keys:
        state = _split_fused(state, family.fused_keys)
    return {rename(k): v for k, v in state.items()}


def _split_fused(state: Mapping[str, Any], fused: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, Any]:
    """Each value under a fused piece (GTE's `attention.qkv_proj`) split among the pieces it holds, in order: a tensor
    into equal chunks along dim 0, a shape with its first dim divided, anything else (a name) given to each; other
    keys as they are."""
    out = {}
    for key, value in state.items():
        for piece, parts in fused:
            if f".{piece}." in f".{key}":
                if hasattr(value, "chunk"):
                    chunks = value.chunk(len(parts), dim=0)
                elif isinstance(value, tuple):
                    chunks = [(value[0] // len(parts), *value[1:])] * len(parts)
                else:
                    chunks = [value] * len(parts)
                for part, chunk in zip(parts, chunks, strict=True):
                    out[f".{key}".replace(f".{piece}.", f".{part}.", 1)[1:]] = chunk
                break
        else:
            out[key] = value
    return out


def to_fastbert_keys(state: Mapping[str, Any], config: Any, head: str) -> dict[str, Any]:
    """A transformers state dict of `config`'s family, head kind `head`, under fastbert's (BERT's) key names."""
    return _rename_state(state, config, head, to_hf=False)


def to_hf_keys(state: Mapping[str, Any], config: Any, head: str) -> dict[str, Any]:
    """fastbert's keys back to the family's transformers names, for save_pretrained."""
    return _rename_state(state, config, head, to_hf=True)
