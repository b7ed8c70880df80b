"""Damaged checkpoints and bad config fields: an error naming the file and the field, before any model is built."""

from __future__ import annotations

import json

import pytest

from fastbert import BertConfig, BertModel
from fastbert.checkpoint import WEIGHTS_NAME, CheckpointError

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
