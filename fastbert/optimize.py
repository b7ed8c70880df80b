"""`fastbert.optimize(model)`: one line from a live transformers encoder of a supported family (or a fastbert model),
or a sentence-transformers SentenceTransformer / CrossEncoder built on one, to the fast path."""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from fastbert.auto import BY_NAME
from fastbert.backends import native
from fastbert.checkpoint import PreTrainedModel
from fastbert.config import QUANTIZE_CHOICES
from fastbert.execution import graphs

CLASSES = tuple(BY_NAME)  # transformers class names, each with the fastbert class of the same contract


def optimize(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    cuda_graphs: bool | None = None,
    freeze: bool = True,
    quantize: str | None = None,
) -> nn.Module:
    """Convert (weights copied; the original is untouched) and set up for inference.

    - a transformers model (BERT, RoBERTa, XLM-RoBERTa, DistilBERT, ALBERT, ELECTRA, MPNet; the bare encoder or a head)
      becomes its fastbert class (`from_hf`); a fastbert model is used as is;
    - moved to `device` / cast to `dtype` (bf16 or fp16 runs every GEMM in that dtype; statistics stay fp32);
    - eval mode; `freeze` turns off requires_grad so the inference-only fast paths (oneDNN prepacked GEMMs) apply
      even outside `torch.no_grad()`;
    - CUDA graphs when the model ends up on a GPU (`cuda_graphs=None` means "if on CUDA", False turns them off);
    - a sentence-transformers SentenceTransformer or CrossEncoder keeps its pipeline (tokenizer, pooling, head) and
      gets fastbert's encoder swapped in, in place; it is returned too;
    - `quantize="int8"`: the encoder's GEMMs run as dynamic int8 on CPU wherever int8 is measured faster (explain()
      lists each); a fastbert model passed in is copied, so that it stays fp32 and trainable.
    """
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
    options = dict(dtype=dtype, device=device, cuda_graphs=cuda_graphs, freeze=freeze, quantize=quantize)
    if type(model).__module__.startswith("sentence_transformers"):
        return _swap_encoders(model, **options)
    if quantize is not None:
        _check_quantizable(model, dtype, device)
    if isinstance(model, PreTrainedModel) and quantize is not None:  # the caller's fp32 model stays as it was
        model = copy.deepcopy(model)
    if not isinstance(model, PreTrainedModel):
        name = type(model).__name__
        if name not in CLASSES or not hasattr(model, "config"):
            raise TypeError(
                f"optimize() takes a transformers model of a supported family ({', '.join(CLASSES)}) or a fastbert "
                f"one, got {name}"
            )
        model = BY_NAME[name].from_hf(model)
    model = model.to(device=device, dtype=dtype).eval()
    if quantize is not None:
        model.config.quantize = quantize
    if freeze:
        model.requires_grad_(False)
    on_cuda = next(model.parameters()).device.type == "cuda"
    if cuda_graphs or (cuda_graphs is None and on_cuda):
        if not on_cuda:
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        graphs.enable(model)
    elif cuda_graphs is False:
        graphs.disable(model)
    return model


def _check_quantizable(model: nn.Module, dtype: torch.dtype | None, device: torch.device | str | None) -> None:
    """int8 is for fp32 inference on CPU: say so before converting anything."""
    first = next(model.parameters(), None)
    where = torch.device(device) if device is not None else (first.device if first is not None else None)
    if where is not None and where.type != "cpu":
        raise ValueError(f"quantize='int8' runs on CPU (dynamic int8 GEMMs); the model would be on {where.type}")
    if (dtype or (first.dtype if first is not None else torch.float32)) != torch.float32:
        raise ValueError("quantize='int8' quantizes an fp32 model: leave dtype unset or float32")


def _swap_encoders(model: nn.Module, **options: object) -> nn.Module:
    """Replace the transformers model inside each sentence-transformers Transformer module with fastbert's, the way
    sentence-transformers 6 reads it (`module.model`; assigning `auto_model` would register a stray submodule and
    change nothing), and check that the module now runs fastbert's."""
    encoders = [m for m in model.modules() if type(m).__name__ == "Transformer" and hasattr(m, "model")]
    if not encoders:
        raise TypeError(f"optimize(): this {type(model).__name__} holds no transformers encoder module to swap")
    for module in encoders:
        fast = optimize(module.model, **options)  # TypeError naming what fastbert takes, for a non-BERT encoder
        module.model = fast
        if module.model is not fast:
            raise RuntimeError(f"{type(module).__name__}.model did not take fastbert's model: this version of "
                               "sentence-transformers reads its encoder elsewhere")  # fmt: skip
        params = inspect.signature(fast.forward).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        module.model_forward_params = None if takes_any else set(params)  # what its forward passes on to the model
    if native.enter_team_scope not in model._forward_pre_hooks.values():  # its pooling and head in the scope too
        model.register_forward_pre_hook(native.enter_team_scope)
        model.register_forward_hook(native.leave_team_scope, always_call=True)
    return model
