"""Defects from the bad-input sweep (issue 29): what users do with transformers idioms, damaged files and typos gets
either the transformers behaviour or one clear error naming what is wrong and what to do."""

from __future__ import annotations

import pytest
import torch

import fastbert
from tests.conftest import tiny_bert


def test_model_device_and_dtype_as_in_transformers() -> None:
    model = fastbert.BertForSequenceClassification(
        fastbert.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            intermediate_size=64)
    ).eval()  # fmt: skip
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    inputs = {"input_ids": torch.tensor([[2, 5, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    inputs = {k: v.to(model.device) for k, v in inputs.items()}  # the transformers idiom
    assert model(**inputs).logits.shape == (1, 2)
    assert tiny_bert().to(torch.bfloat16).dtype == torch.bfloat16
