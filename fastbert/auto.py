"""transformers' class names for every supported family, and AutoModel / AutoModelFor... choosing by model_type.

`RobertaForMaskedLM` is `BertForMaskedLM` with the RoBERTa family fixed: the model definition is the same one, the
differences are the data in fastbert.families. Each class takes only its family's configs and checkpoints, keeps
transformers' attribute for the encoder (`model.roberta`), and loads and saves transformers' key names.
"""

from __future__ import annotations

import os
from typing import Any

from fastbert.checkpoint import PreTrainedModel
from fastbert.config import BertConfig
from fastbert.families import FAMILIES, family_of
from fastbert.heads import HEADS

# head kind -> transformers' class-name suffix
SUFFIXES = {
    "model": "Model",
    "sequence": "ForSequenceClassification",
    "token": "ForTokenClassification",
    "qa": "ForQuestionAnswering",
    "mlm": "ForMaskedLM",
    "pretraining": "ForPreTraining",
    "nsp": "ForNextSentencePrediction",
    "choice": "ForMultipleChoice",
}


def _family_class(model_type: str, kind: str) -> type[PreTrainedModel]:
    """The Bert class of head `kind`, named and fixed for the family; `model.<prefix>` reads its encoder."""
    family = FAMILIES[model_type]
    base = HEADS["Bert" + SUFFIXES[kind]]
    if model_type == "bert":
        return base
    name = family.name + SUFFIXES[kind]
    doc = f"Drop-in for transformers' {name}: {base.__name__} with the {model_type} family's data."
    attrs: dict[str, Any] = {"model_type": model_type, "__doc__": doc, "__module__": __name__}
    if kind != "model":
        attrs[family.prefix] = property(lambda self: self.bert, doc="the encoder, under transformers' attribute name")
    return type(name, (base,), attrs)


CLASSES: dict[tuple[str, str], type[PreTrainedModel]] = {
    (model_type, kind): _family_class(model_type, kind) for model_type, f in FAMILIES.items() for kind in f.heads
}
BY_NAME: dict[str, type[PreTrainedModel]] = {cls.__name__: cls for cls in CLASSES.values()}


def model_class(model_type: str, kind: str) -> type[PreTrainedModel]:
    """The fastbert class for a model_type and head kind; UnsupportedModelError or ValueError naming what exists."""
    family = family_of(model_type)
    if (family.model_type, kind) not in CLASSES:
        has = ", ".join(family.name + SUFFIXES[k] for k in family.heads)
        raise ValueError(f"{family.name} has no {SUFFIXES[kind]} in fastbert; it has: {has}")
    return CLASSES[family.model_type, kind]


class _Auto:
    """Picks the class from config.json's model_type, as transformers' Auto classes do."""

    kind = "model"

    def __init__(self) -> None:
        raise TypeError(f"{type(self).__name__} is built with from_pretrained(dir) or from_config(config)")

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **kwargs: Any) -> PreTrainedModel:
        """Load a transformers- or fastbert-saved directory of any supported family."""
        config = BertConfig.from_pretrained(directory)
        return model_class(config.model_type, cls.kind).from_pretrained(directory, **kwargs)

    @classmethod
    def from_config(cls, config: BertConfig) -> PreTrainedModel:
        """A freshly initialised model of the config's family."""
        return model_class(config.model_type, cls.kind)(config)


class AutoModel(_Auto):
    kind = "model"


class AutoModelForSequenceClassification(_Auto):
    kind = "sequence"


class AutoModelForTokenClassification(_Auto):
    kind = "token"


class AutoModelForQuestionAnswering(_Auto):
    kind = "qa"


class AutoModelForMaskedLM(_Auto):
    kind = "mlm"


class AutoModelForMultipleChoice(_Auto):
    kind = "choice"


RobertaModel = CLASSES["roberta", "model"]
RobertaForSequenceClassification = CLASSES["roberta", "sequence"]
RobertaForTokenClassification = CLASSES["roberta", "token"]
RobertaForQuestionAnswering = CLASSES["roberta", "qa"]
RobertaForMaskedLM = CLASSES["roberta", "mlm"]
XLMRobertaModel = CLASSES["xlm-roberta", "model"]
XLMRobertaForSequenceClassification = CLASSES["xlm-roberta", "sequence"]
XLMRobertaForTokenClassification = CLASSES["xlm-roberta", "token"]
XLMRobertaForQuestionAnswering = CLASSES["xlm-roberta", "qa"]
XLMRobertaForMaskedLM = CLASSES["xlm-roberta", "mlm"]
DistilBertModel = CLASSES["distilbert", "model"]
DistilBertForSequenceClassification = CLASSES["distilbert", "sequence"]
DistilBertForTokenClassification = CLASSES["distilbert", "token"]
DistilBertForQuestionAnswering = CLASSES["distilbert", "qa"]
DistilBertForMaskedLM = CLASSES["distilbert", "mlm"]
AlbertModel = CLASSES["albert", "model"]
AlbertForSequenceClassification = CLASSES["albert", "sequence"]
AlbertForTokenClassification = CLASSES["albert", "token"]
AlbertForQuestionAnswering = CLASSES["albert", "qa"]
AlbertForMaskedLM = CLASSES["albert", "mlm"]
ElectraModel = CLASSES["electra", "model"]
ElectraForSequenceClassification = CLASSES["electra", "sequence"]
ElectraForTokenClassification = CLASSES["electra", "token"]
ElectraForQuestionAnswering = CLASSES["electra", "qa"]
ElectraForMaskedLM = CLASSES["electra", "mlm"]
MPNetModel = CLASSES["mpnet", "model"]
MPNetForSequenceClassification = CLASSES["mpnet", "sequence"]
MPNetForTokenClassification = CLASSES["mpnet", "token"]
MPNetForQuestionAnswering = CLASSES["mpnet", "qa"]
MPNetForMaskedLM = CLASSES["mpnet", "mlm"]
MPNetForMultipleChoice = CLASSES["mpnet", "choice"]
DebertaV2Model = CLASSES["deberta-v2", "model"]
DebertaV2ForSequenceClassification = CLASSES["deberta-v2", "sequence"]
DebertaV2ForTokenClassification = CLASSES["deberta-v2", "token"]
DebertaV2ForQuestionAnswering = CLASSES["deberta-v2", "qa"]
DebertaV2ForMaskedLM = CLASSES["deberta-v2", "mlm"]
DebertaV2ForMultipleChoice = CLASSES["deberta-v2", "choice"]
ModernBertModel = CLASSES["modernbert", "model"]
ModernBertForSequenceClassification = CLASSES["modernbert", "sequence"]
ModernBertForTokenClassification = CLASSES["modernbert", "token"]
ModernBertForQuestionAnswering = CLASSES["modernbert", "qa"]
ModernBertForMaskedLM = CLASSES["modernbert", "mlm"]
ModernBertForMultipleChoice = CLASSES["modernbert", "choice"]
EuroBertModel = CLASSES["eurobert", "model"]
EuroBertForSequenceClassification = CLASSES["eurobert", "sequence"]
EuroBertForTokenClassification = CLASSES["eurobert", "token"]
EuroBertForMaskedLM = CLASSES["eurobert", "mlm"]
GteModel = CLASSES["gte", "model"]
GteForSequenceClassification = CLASSES["gte", "sequence"]
GteForTokenClassification = CLASSES["gte", "token"]
GteForMaskedLM = CLASSES["gte", "mlm"]
NomicBertModel = CLASSES["nomic_bert", "model"]
NomicBertForSequenceClassification = CLASSES["nomic_bert", "sequence"]
NomicBertForTokenClassification = CLASSES["nomic_bert", "token"]
NomicBertForMaskedLM = CLASSES["nomic_bert", "mlm"]
JinaEmbeddingsV3Model = CLASSES["jina_embeddings_v3", "model"]
JinaEmbeddingsV3ForSequenceClassification = CLASSES["jina_embeddings_v3", "sequence"]
JinaEmbeddingsV3ForTokenClassification = CLASSES["jina_embeddings_v3", "token"]
JinaEmbeddingsV3ForQuestionAnswering = CLASSES["jina_embeddings_v3", "qa"]
JinaEmbeddingsV3ForMaskedLM = CLASSES["jina_embeddings_v3", "mlm"]
