"""Checkpoint round trips with transformers, safetensors-only loading, and key errors that name names."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ragged_batch
from safetensors.torch import save_file

import fastbert
from fastbert.checkpoint import CheckpointError, sniff_format

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def _outputs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids, attention_mask=mask)[0]
    return out[mask.bool()] if out.dim() == 3 else out


@pytest.mark.parametrize(
    "head", ["BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification"]
)
def test_transformers_to_fastbert_to_transformers(tmp_path, head: str) -> None:
    hf = getattr(transformers, head)(transformers.BertConfig(**TINY)).eval()
    hf.save_pretrained(tmp_path / "hf")
    fb = getattr(fastbert, head).from_pretrained(tmp_path / "hf")
    fb.save_pretrained(tmp_path / "fb")
    back = getattr(transformers, head).from_pretrained(tmp_path / "fb").eval()
    ids, mask, _ = ragged_batch(TINY["vocab_size"], 3, 9)
    expected = _outputs(hf, ids, mask)
    assert torch.equal(_outputs(back, ids, mask), expected)
    assert (_outputs(fb, ids, mask) - expected).abs().max() <= 1e-5
    assert set(back.state_dict()) == set(hf.state_dict())


def test_saved_keys_are_transformers_keys(tmp_path) -> None:
    fb = fastbert.BertForMaskedLM(fastbert.BertConfig(**TINY))
    fb.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "bert.embeddings.word_embeddings.weight" in keys
    assert "bert.encoder.layer.0.attention.self.query.weight" in keys
    assert "cls.predictions.bias" in keys
    assert "cls.predictions.decoder.weight" not in keys  # tied to the word embeddings, saved once
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"] and config["model_type"] == "bert"


def test_fastbert_round_trip_keeps_weights_and_tying(tmp_path) -> None:
    fb = fastbert.BertForPreTraining(fastbert.BertConfig(**TINY)).eval()
    fb.save_pretrained(tmp_path)
    again = fastbert.BertForPreTraining.from_pretrained(tmp_path)
    for (k, a), (_, b) in zip(fb.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert again.cls.predictions.decoder.weight is again.bert.embeddings.word_embeddings.weight
    saved = fastbert.BertConfig.from_pretrained(tmp_path).to_dict()
    assert saved.pop("architectures") == ["BertForPreTraining"] and saved.pop("dtype") == "float32"
    assert saved == fb.config.to_dict()


def test_from_pretrained_casts_dtype(tmp_path) -> None:
    fastbert.BertModel(fastbert.BertConfig(**TINY)).save_pretrained(tmp_path)
    model = fastbert.BertModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_bare_encoder_loads_into_a_head_with_fresh_head(tmp_path) -> None:
    base = fastbert.BertModel(fastbert.BertConfig(**TINY))
    base.save_pretrained(tmp_path)
    clf = fastbert.BertForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    assert torch.equal(clf.bert.embeddings.word_embeddings.weight, base.embeddings.word_embeddings.weight)
    assert clf.classifier.weight.shape == (3, TINY["hidden_size"])
    with pytest.raises(CheckpointError, match="classifier.weight"):
        fastbert.BertForSequenceClassification.from_pretrained(tmp_path, strict_heads=True)


def test_head_checkpoint_loads_into_bare_model(tmp_path) -> None:
    mlm = fastbert.BertForMaskedLM(fastbert.BertConfig(**TINY))
    mlm.save_pretrained(tmp_path)
    base = fastbert.BertModel.from_pretrained(tmp_path)
    assert torch.equal(base.encoder.layer[1].output.dense.weight, mlm.bert.encoder.layer[1].output.dense.weight)


def test_missing_key_raises_with_its_name_and_shape(tmp_path) -> None:
    fb = fastbert.BertModel(fastbert.BertConfig(**TINY))
    fb.save_pretrained(tmp_path)
    state = {k: v for k, v in fb.unique_state_dict().items() if k != "encoder.layer.1.output.dense.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"encoder\.layer\.1\.output\.dense\.weight \(64, 128\)"):
        fastbert.BertModel.from_pretrained(tmp_path)


def test_mismatched_shape_raises_with_both_shapes(tmp_path) -> None:
    fastbert.BertModel(fastbert.BertConfig(**TINY)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    says = r"config.json: intermediate_size=96 but model.safetensors has 128 \(encoder.layer.0.intermediate.dense"
    with pytest.raises(CheckpointError, match=says + r".weight \[128, 64\]\)"):
        fastbert.BertModel.from_pretrained(tmp_path)


def test_unexpected_encoder_key_raises(tmp_path) -> None:
    fb = fastbert.BertModel(fastbert.BertConfig(**TINY))
    state = {k: v.contiguous() for k, v in fb.unique_state_dict().items()}
    state["encoder.layer.7.output.dense.weight"] = torch.zeros(2, 2)
    fb.config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected keys.*encoder\.layer\.7"):
        fastbert.BertModel.from_pretrained(tmp_path)


def test_pickle_refused_by_header_not_name(tmp_path) -> None:
    fb = fastbert.BertModel(fastbert.BertConfig(**TINY))
    fb.config.save_pretrained(tmp_path)
    # A torch pickle wearing a safetensors name: judged by its bytes, refused.
    torch.save(fb.unique_state_dict(), tmp_path / "model.safetensors")
    assert sniff_format(tmp_path / "model.safetensors") == "pickle"
    with pytest.raises(CheckpointError, match="pickle"):
        fastbert.BertModel.from_pretrained(tmp_path)
    loaded = fastbert.BertModel.from_pretrained(tmp_path, allow_pickle=True)
    assert torch.equal(loaded.pooler.dense.weight, fb.pooler.dense.weight)


def test_pytorch_model_bin_refused_unless_opted_in(tmp_path) -> None:
    hf = transformers.BertModel(transformers.BertConfig(**TINY))
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        fastbert.BertModel.from_pretrained(tmp_path)
    fb = fastbert.BertModel.from_pretrained(tmp_path, allow_pickle=True)
    assert torch.equal(fb.embeddings.word_embeddings.weight, hf.embeddings.word_embeddings.weight)


def test_garbage_file_and_missing_directory(tmp_path) -> None:
    fastbert.BertModel(fastbert.BertConfig(**TINY)).config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="unrecognised header"):
        fastbert.BertModel.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fastbert.BertModel.from_pretrained(tmp_path / "nope")


def test_legacy_gamma_beta_names_load(tmp_path) -> None:
    fb = fastbert.BertModel(fastbert.BertConfig(**TINY))
    state = {}
    for k, v in fb.unique_state_dict().items():
        if "LayerNorm" in k:
            k = k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        state[k] = v.contiguous()
    fb.config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = fastbert.BertModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.embeddings.LayerNorm.weight, fb.embeddings.LayerNorm.weight)
