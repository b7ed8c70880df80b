"""BertConfig: transformers' field names, plus fastbert's own (ALBERT factorisation, layer sharing, backend).

Reads and writes the same `config.json` transformers does. Fields fastbert does not use are kept as they were read,
so a checkpoint round-trips without losing anything.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
SHARING = ("none", "all", "attention", "ffn")
BACKENDS = (None, "auto", "triton", "native", "cpu", "torch")

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
    "backend": None,  # None/auto | triton | native | cpu | torch (use_backend() and FASTBERT_BACKEND override)
}

_FASTBERT_FIELDS = ("embedding_size", "layer_sharing", "num_hidden_groups", "backend")


class BertConfig:
    """Model hyper-parameters; attribute names are transformers' so existing code and checkpoints carry over."""

    model_type = "bert"

    def __init__(self, **kwargs: Any) -> None:
        values = copy.deepcopy(_DEFAULTS)
        values.update(kwargs)
        if values.get("id2label") is None:
            values["id2label"] = {i: f"LABEL_{i}" for i in range(values["num_labels"])}
        values["id2label"] = {int(k): v for k, v in values["id2label"].items()}
        values["num_labels"] = len(values["id2label"])
        if values.get("label2id") is None:
            values["label2id"] = {v: k for k, v in values["id2label"].items()}
        for key, value in values.items():
            setattr(self, key, value)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError for combinations no model can be built from."""
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.layer_sharing not in SHARING:
            raise ValueError(f"layer_sharing must be one of {SHARING}, got {self.layer_sharing!r}")
        if not 1 <= self.num_hidden_groups <= max(1, self.num_hidden_layers):
            raise ValueError(
                f"num_hidden_groups ({self.num_hidden_groups}) must be in "
                f"[1, num_hidden_layers={self.num_hidden_layers}]"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.position_embedding_type != "absolute":
            raise ValueError(f"only absolute position embeddings are supported, got {self.position_embedding_type!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    # ---------------------------------------------------------- derived values
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def embedding_dim(self) -> int:
        """Width of the embedding tables (E); equals hidden_size unless ALBERT factorisation is on."""
        return self.embedding_size or self.hidden_size

    @property
    def is_albert_style(self) -> bool:
        return self.embedding_dim != self.hidden_size or self.layer_sharing != "none"

    def group_of_layer(self, layer: int) -> int:
        """ALBERT's group assignment: layer i of L uses group floor(i * G / L)."""
        return layer * self.num_hidden_groups // self.num_hidden_layers

    # -------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict[str, Any]:
        out = {k: copy.deepcopy(v) for k, v in self.__dict__.items() if not k.startswith("_")}
        out["model_type"] = self.model_type
        out["id2label"] = {str(k): v for k, v in self.id2label.items()}
        for name in _FASTBERT_FIELDS:  # keep HF-only configs free of fastbert fields at their defaults
            if out.get(name) == _DEFAULTS[name]:
                out.pop(name)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> BertConfig:
        values = dict(values)
        model_type = values.pop("model_type", "bert")
        if model_type not in ("bert", "fastbert"):
            raise ValueError(f"config.json describes a {model_type!r} model, not a BERT encoder")
        return cls(**values)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> BertConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> BertConfig:
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in {directory}")
        return cls.from_json_file(path)

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
