"""Defects from the bad-input sweep (issue 29): what users do with transformers idioms, damaged files and typos gets
either the transformers behaviour or one clear error naming what is wrong and what to do."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import fastbert
from fastbert.config import BertConfig
from tests.conftest import tiny_bert

TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def test_model_device_and_dtype_as_in_transformers() -> None:
    model = fastbert.BertForSequenceClassification(BertConfig(**TINY)).eval()
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    inputs = {"input_ids": torch.tensor([[2, 5, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    inputs = {k: v.to(model.device) for k, v in inputs.items()}  # the transformers idiom
    assert model(**inputs).logits.shape == (1, 2)
    assert tiny_bert().to(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "field,value",
    [
        ("is_decoder", True),  # transformers then runs a causal mask: 1.5 off when fastbert ignored it
        ("add_cross_attention", True),
        ("is_encoder_decoder", True),
        ("pruned_heads", {"0": [1]}),
        ("position_embedding_type", "relative_key"),
        ("position_embedding_type", None),  # transformers 4 then adds no position embeddings at all
    ],
)
def test_config_fields_fastbert_does_not_implement_are_refused_by_name(tmp_path: Path, field: str, value) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} is not supported")):
        BertConfig(**TINY, **{field: value})
    fastbert.BertModel(BertConfig(**TINY)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=rf"config.json: {field}=.* is not supported"):
        fastbert.BertModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["Bert", "Roberta", "XLMRoberta", "DistilBert", "Albert", "Electra"])
def test_transformers_default_configs_of_every_family_load(family: str) -> None:
    """The harmless values real checkpoints carry (is_decoder false, chunk_size_feed_forward 0, ...) are accepted."""
    transformers = pytest.importorskip("transformers")
    values = getattr(transformers, f"{family}Config")().to_dict()
    assert BertConfig.from_dict(values).model_type == values["model_type"]


def test_minilm_config_loads(minilm_dir: Path) -> None:
    assert BertConfig.from_pretrained(minilm_dir).hidden_size == 384


def test_chunked_feed_forward_is_accepted_as_it_computes_the_same(tmp_path: Path) -> None:
    """transformers' chunk_size_feed_forward splits the per-token FFN along the sequence: a memory saving with the
    same numbers, so fastbert runs such a checkpoint unchunked rather than refusing it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**TINY, chunk_size_feed_forward=3)).eval()
    hf.save_pretrained(tmp_path)
    model = fastbert.BertModel.from_pretrained(tmp_path)
    ids = torch.randint(1, 50, (2, 6))  # transformers wants the length a multiple of the chunk
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    with torch.no_grad():
        want, got = hf(ids, attention_mask=mask).last_hidden_state, model(ids, attention_mask=mask).last_hidden_state
    assert (want - got)[mask.bool()].abs().max().item() <= 1e-5


def test_optimize_refuses_a_live_transformers_decoder() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertModel(transformers.BertConfig(**TINY, is_decoder=True)).eval()
    with pytest.raises(ValueError, match="is_decoder=True is not supported"):
        fastbert.optimize(hf)
