"""fastbert: a drop-in, faster BertModel for transformers checkpoints, and the fused kernels under it."""

from fastbert import capabilities
from fastbert.config import BertConfig
from fastbert.heads import (
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)
from fastbert.modeling import BertModel
from fastbert.ops import BackendUnavailable, explain, use_backend
from fastbert.optimize import optimize

capabilities.bound_onednn_caches()  # before any oneDNN GEMM of this process: oneDNN reads the capacities once

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "BertConfig",
    "BertForMaskedLM",
    "BertForMultipleChoice",
    "BertForNextSentencePrediction",
    "BertForPreTraining",
    "BertForQuestionAnswering",
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "BertModel",
    "explain",
    "optimize",
    "use_backend",
]
