"""`fastbert.optimize(model)`: one line from a live transformers BERT (or a fastbert model) to the fast path."""

from __future__ import annotations

import torch
from torch import nn

import fastbert
from fastbert import cuda_graphs as graphs
from fastbert.checkpoint import PreTrainedModel

# transformers class name -> the fastbert class with the same contract
CLASSES = (
    "BertModel",
    "BertForMaskedLM",
    "BertForPreTraining",
    "BertForNextSentencePrediction",
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "BertForQuestionAnswering",
    "BertForMultipleChoice",
)


def optimize(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    cuda_graphs: bool | None = None,
    freeze: bool = True,
) -> PreTrainedModel:
    """Convert (weights copied; the original is untouched) and set up for inference.

    - a transformers BertModel or Bert head becomes its fastbert class (`from_hf`); a fastbert model is used as is;
    - moved to `device` / cast to `dtype` (bf16 or fp16 runs every GEMM in that dtype; statistics stay fp32);
    - eval mode; `freeze` turns off requires_grad so the inference-only fast paths (oneDNN prepacked GEMMs) apply
      even outside `torch.no_grad()`;
    - CUDA graphs for small batches when the model ends up on a GPU (`cuda_graphs=None` means "if on CUDA").
    """
    if not isinstance(model, PreTrainedModel):
        name = type(model).__name__
        if name not in CLASSES or not hasattr(model, "config"):
            raise TypeError(
                f"optimize() takes a transformers BERT model ({', '.join(CLASSES)}) or a fastbert one, got {name}"
            )
        model = getattr(fastbert, name).from_hf(model)
    model = model.to(device=device, dtype=dtype).eval()
    if freeze:
        model.requires_grad_(False)
    on_cuda = next(model.parameters()).device.type == "cuda"
    if cuda_graphs or (cuda_graphs is None and on_cuda):
        if not on_cuda:
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        graphs.enable(model)
    return model
