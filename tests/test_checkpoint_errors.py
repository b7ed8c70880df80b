"""Damaged checkpoints and bad config fields: an error naming the file and the field, before any model is built."""

from __future__ import annotations

import json
import re

import pytest
from memory_cap import run_capped

from fastbert import BertConfig, BertModel
from fastbert.checkpoint import WEIGHTS_NAME, CheckpointError, PreTrainedModel

TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@pytest.mark.parametrize("damage", ["truncated", "corrupted-header"])
def test_damaged_safetensors_is_a_checkpoint_error_naming_the_file(tmp_path, damage: str) -> None:
    BertModel(BertConfig(**TINY)).save_pretrained(tmp_path)
    path = tmp_path / WEIGHTS_NAME
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[12:24] = b"x" * 12
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{path}.*damaged safetensors"):
        BertModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_attention_heads", 0, "num_attention_heads must be a positive integer, got 0"),
        ("hidden_size", "32", "hidden_size must be a positive integer, got '32'"),
        ("hidden_size", None, "hidden_size must be a positive integer, got None"),
        ("max_position_embeddings", 32.5, "max_position_embeddings must be a positive integer, got 32.5"),
        ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer, got 0"),
        ("num_hidden_layers", -2, "num_hidden_layers must be a positive integer, got -2"),
        ("layer_norm_eps", -1, "layer_norm_eps must be a positive number, got -1"),
        ("hidden_dropout_prob", 1.5, r"hidden_dropout_prob must be a probability in \[0, 1\], got 1.5"),
        ("type_vocab_size", 0, "type_vocab_size must be a positive integer, got 0"),
        ("id2label", {"zero": "a", "1": "b"}, "id2label keys must be integers"),
        ("pad_token_id", 99, r"pad_token_id must be null or in \[0, vocab_size=50\), got 99"),
        ("vocab_size", True, "vocab_size must be a positive integer, got True"),
    ],
)
def test_every_config_field_is_checked_with_its_name(tmp_path, field: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BertConfig(**{**TINY, field: value})
    BertModel(BertConfig(**TINY)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=rf"config.json: {message}"):
        BertModel.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------- sizes before any allocation
def _refuse_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building any model fails the test: the sizes must be refused before a single tensor is allocated."""

    def build(self, *args, **kwargs) -> None:
        raise AssertionError("the model was built before its sizes were checked")

    monkeypatch.setattr(PreTrainedModel, "__init__", build)


@pytest.mark.parametrize(
    "field,value,has",
    [
        ("num_hidden_layers", 100000, r"2 layers \(encoder.layer.0..1\)"),
        ("hidden_size", 4096, r"32 \(encoder.layer.0.attention.self.query.weight \[32, 32\]\)"),
        ("intermediate_size", 1 << 20, r"64 \(encoder.layer.0.intermediate.dense.weight \[64, 32\]\)"),
        ("vocab_size", 1 << 24, r"50 \(embeddings.word_embeddings.weight \[50, 32\]\)"),
        ("max_position_embeddings", 1 << 22, r"512 \(embeddings.position_embeddings.weight \[512, 32\]\)"),
    ],
)
def test_config_sizes_are_checked_against_the_checkpoint_before_building(tmp_path, monkeypatch, field, value, has):
    BertModel(BertConfig(**TINY)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    _refuse_to_build(monkeypatch)
    says = rf"^{tmp_path / 'config.json'}: {field}={value} but model.safetensors has {has}$"
    with pytest.raises(CheckpointError, match=says):
        BertModel.from_pretrained(tmp_path)


def test_a_distilbert_config_names_its_own_field(tmp_path, monkeypatch):
    from fastbert import DistilBertConfig, DistilBertModel

    DistilBertModel(DistilBertConfig(**TINY)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layers": 100000}))
    _refuse_to_build(monkeypatch)
    with pytest.raises(CheckpointError, match=r"config.json: n_layers=100000 but model.safetensors has 2 layers"):
        DistilBertModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "options,says",
    [
        ({"hidden_size": 1 << 20, "num_attention_heads": 1}, "hidden_size=1048576"),
        ({"num_hidden_layers": 10**9, "layer_sharing": "all"}, "num_hidden_layers=1000000000"),
        ({"intermediate_size": 1 << 40}, "intermediate_size=1099511627776"),
    ],
)
def test_a_config_too_large_for_this_machine_names_the_file_and_the_field(tmp_path, monkeypatch, options, says):
    from fastbert.pretrain import build_model

    path = tmp_path / "big.json"
    path.write_text(json.dumps({**TINY, **options}))
    _refuse_to_build(monkeypatch)
    with pytest.raises(ValueError, match=rf"^{path}: {says} .*more than this machine's memory"):
        build_model(50, config=str(path))
    with pytest.raises(ValueError, match=rf"^model options: {says} .*more than this machine's memory"):
        build_model(50, **{**{k: v for k, v in TINY.items() if k != "vocab_size"}, **options})


def test_a_huge_num_labels_is_refused_not_allocated(tmp_path):
    BertModel(BertConfig(**TINY)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("id2label"), config.pop("label2id")
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_labels": 10**12}))
    imports = "from fastbert import BertForSequenceClassification\n"
    body = f"""
try:
    BertForSequenceClassification.from_pretrained({str(tmp_path)!r})
except ValueError as exc:
    print(exc)
"""
    done = run_capped(imports, body)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"config.json: num_labels must be at most \d+, got 1000000000000", done.stdout), done.stdout
