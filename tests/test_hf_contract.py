"""The calling contract transformers users rely on beyond the numbers: every head takes transformers' inputs in
transformers' order (positional callers and Trainer's column filter, which keeps only the dataset columns the
forward names), and the output flags left None follow the config, as in transformers."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import torch

import fastbert
from fastbert.checkpoint import CheckpointError
from fastbert.heads import HEADS

transformers = pytest.importorskip("transformers")
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
ATOL = 1e-5  # DESIGN: fp32 against transformers, every valid row
INPUTS = 5  # input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds


def pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    hf = getattr(transformers, name)(transformers.BertConfig(**TINY, attn_implementation="eager")).eval()
    return hf, getattr(fastbert, name).from_hf(hf).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (3, 8), generator=gen)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0
    return ids, mask


def names(cls: type) -> list[str]:
    return [p for p in inspect.signature(cls.forward).parameters if p not in ("self", "kwargs")]


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_names_transformers_inputs_in_their_order(name: str) -> None:
    ours, theirs = names(HEADS[name]), names(getattr(transformers, name))
    assert ours[:INPUTS] == theirs[:INPUTS]
    labels = [p for p in theirs[INPUTS:] if "label" in p or p.endswith("_positions")]
    assert bool(labels) == (name != "BertModel")
    assert [p for p in ours if p in labels] == labels  # what Trainer keeps of a labelled dataset


@pytest.mark.parametrize("name", ["BertForMaskedLM", "BertForSequenceClassification", "BertForQuestionAnswering"])
def test_positional_inputs_mean_what_they_mean_in_transformers(name: str) -> None:
    hf, fb = pair(name)
    ids, mask = batch()
    types = torch.zeros_like(ids)
    with torch.no_grad():
        want, got = hf(ids, mask, types), fb(ids, mask, types)
    assert list(got.keys()) == [k for k in want.keys() if k != "loss"]  # no labels given: no loss
    valid = mask.bool()
    for key in got.keys():
        a, b = got[key], want[key]
        if a.dim() >= 2 and a.shape[:2] == ids.shape:  # per-token outputs: valid positions
            a, b = a[valid], b[valid]
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["BertModel", "BertForSequenceClassification"])
def test_output_flags_left_none_follow_the_config(name: str) -> None:
    hf, fb = pair(name)
    ids, mask = batch()
    with torch.no_grad():
        assert isinstance(fb(ids, attention_mask=mask, return_dict=None), fastbert.outputs.ModelOutput)
        for model in (hf, fb):
            model.config.output_hidden_states = True
            model.config.output_attentions = True
        want, got = hf(ids, attention_mask=mask), fb(ids, attention_mask=mask)
        assert len(got.hidden_states) == len(want.hidden_states) == TINY["num_hidden_layers"] + 1
        assert len(got.attentions) == len(want.attentions) == TINY["num_hidden_layers"]
        assert fb(ids, attention_mask=mask, output_hidden_states=False).hidden_states is None  # the argument wins
        for model in (hf, fb):
            model.config.return_dict = False
        want, got = hf(ids, attention_mask=mask), fb(ids, attention_mask=mask)
    want = [x for x in want if not (isinstance(x, tuple) and not x)]  # transformers 5's empty past_key_values
    assert type(got) is tuple and len(got) == len(want)
    first = (lambda t: t[mask.bool()]) if name == "BertModel" else (lambda t: t)  # last_hidden_state; logits
    torch.testing.assert_close(first(got[0]), first(want[0]), atol=ATOL, rtol=0)


def test_from_pretrained_keywords_go_where_transformers_sends_them(tmp_path) -> None:
    """A base checkpoint fine-tuned with num_labels=5 saves and reloads (in fastbert and transformers); the model's
    own argument reaches its constructor, a config flag the config, the dtype the weights."""
    hf, _ = pair("BertModel")
    hf.save_pretrained(tmp_path / "base")
    head = fastbert.BertForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=5)
    assert head.config.num_labels == 5 and list(head.config.id2label.values()) == [f"LABEL_{i}" for i in range(5)]
    head.save_pretrained(tmp_path / "tuned")
    for cls in (fastbert.BertForSequenceClassification, transformers.BertForSequenceClassification):
        assert cls.from_pretrained(tmp_path / "tuned").classifier.out_features == 5
    kwargs = dict(add_pooling_layer=False, output_hidden_states=True)
    ours = fastbert.BertModel.from_pretrained(tmp_path / "base", **kwargs)
    theirs = transformers.BertModel.from_pretrained(tmp_path / "base", **kwargs)
    assert ours.pooler is None and theirs.pooler is None
    ids, mask = batch()
    assert len(ours(ids, attention_mask=mask).hidden_states) == TINY["num_hidden_layers"] + 1
    assert fastbert.BertModel.from_pretrained(tmp_path / "base", torch_dtype=torch.bfloat16).dtype == torch.bfloat16
    ours.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert fastbert.BertModel.from_pretrained(tmp_path / "bf16", dtype="auto").dtype == torch.bfloat16
    load = fastbert.BertModel.from_pretrained
    assert load(tmp_path / "base", dtype=torch.float16, torch_dtype=torch.bfloat16).dtype == torch.float16  # dtype wins
    assert load(tmp_path / "base", dtype="bfloat16").dtype == torch.bfloat16
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    del config["dtype"]
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
    assert load(tmp_path / "bf16", dtype="auto").dtype == torch.bfloat16  # nothing recorded: the weights' dtype
    assert load(tmp_path, subfolder="base", trust_remote_code=True, local_files_only=True).dtype == torch.float32
    with pytest.raises(ValueError, match="cache_dir, token: fastbert reads a local directory"):
        load(tmp_path / "base", token="hf_x", cache_dir="/tmp")
    with pytest.raises(TypeError, match=r"keyword\(s\) \['hidden_sise'\]: neither the model's arguments"):
        load(tmp_path / "base", hidden_sise=64)


def test_a_family_name_given_is_named_in_the_size_check(tmp_path) -> None:
    torch.manual_seed(0)
    hf = transformers.DistilBertModel(transformers.DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4,
                                                                    hidden_dim=64))  # fmt: skip
    hf.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"config.json \(with num_hidden_layers given\): n_layers=3"):
        fastbert.DistilBertModel.from_pretrained(tmp_path, n_layers=3)


def test_a_save_that_fails_leaves_the_saved_checkpoint_whole(tmp_path, monkeypatch) -> None:
    _, model = pair("BertModel")
    model.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    model.config.note = object()  # a field JSON cannot write
    with pytest.raises(TypeError, match="not JSON serializable"):
        model.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    del model.config.note

    def disk_full(tensors: dict, path: str, metadata: dict) -> None:
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        model.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no partial file left behind


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("size", [131, 64])
def test_resize_token_embeddings_keeps_transformers_rows_and_logits(tied: bool, size: int, tmp_path) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(**TINY, tie_word_embeddings=tied)
    hf = transformers.BertForMaskedLM(config).eval()
    fb = fastbert.BertForMaskedLM.from_hf(hf).eval()
    kept = min(size, TINY["vocab_size"])
    for model in (hf, fb):
        assert model.resize_token_embeddings(size, pad_to_multiple_of=4).num_embeddings == -(-size // 4) * 4
    assert fb.config.vocab_size == hf.config.vocab_size == -(-size // 4) * 4
    decoder = fb.get_output_embeddings()
    assert (decoder.weight is fb.get_input_embeddings().weight) == tied and decoder.bias is fb.cls.predictions.bias
    torch.testing.assert_close(fb.get_input_embeddings().weight[:kept], hf.get_input_embeddings().weight[:kept])
    ids, mask = batch()
    ids = ids % kept
    with torch.no_grad():
        want, got = hf(ids, attention_mask=mask).logits, fb(ids, attention_mask=mask).logits
    assert got.shape == want.shape
    valid = mask.bool()
    torch.testing.assert_close(got[valid][:, :kept], want[valid][:, :kept], atol=ATOL, rtol=0)
    fb.save_pretrained(tmp_path)
    assert transformers.BertForMaskedLM.from_pretrained(tmp_path).config.vocab_size == fb.config.vocab_size
    if size > TINY["vocab_size"]:  # a new token runs, and trains
        fb.train()
        new = torch.full((1, 4), size - 1)
        fb(new, labels=new).loss.backward()
        assert fb.get_input_embeddings().weight.grad[size - 1].abs().sum() > 0


def test_resize_keeps_the_modules_and_parameters_and_refuses_cutting_the_padding_token() -> None:
    """As transformers: the same module and Parameter (hooks and optimizer references stay), no change at the same
    size, None with pad_to_multiple_of pads the current size; new rows by the initialiser without mean_resizing."""
    _, fb = pair("BertForMaskedLM")
    embeddings, weight = fb.get_input_embeddings(), fb.get_input_embeddings().weight
    optimizer = torch.optim.SGD(fb.parameters(), lr=0.1)
    assert fb.resize_token_embeddings(TINY["vocab_size"]) is embeddings and embeddings.weight is weight
    grown = fb.resize_token_embeddings(None, pad_to_multiple_of=64, mean_resizing=False)
    assert grown is embeddings and grown.weight is weight and weight.shape[0] == fb.config.vocab_size == 128
    assert any(p is weight for group in optimizer.param_groups for p in group["params"])
    new_rows = weight[TINY["vocab_size"] :]
    assert 0 < new_rows.std().item() < 3 * TINY.get("initializer_range", 0.02)
    fb.config.pad_token_id = 90
    with pytest.raises(ValueError, match=r"50 tokens would cut the padding token \(pad_token_id=90\)"):
        fb.resize_token_embeddings(50)
    assert fb.config.vocab_size == 128


def test_set_input_embeddings_refuses_another_width() -> None:
    _, fb = pair("BertModel")
    with pytest.raises(ValueError, match="16 wide; this model's are 32"):
        fb.set_input_embeddings(torch.nn.Embedding(10, 16))
    assert fb.base_model is fb and fb.main_input_name == "input_ids"


def test_a_decoders_arguments_are_taken_as_transformers_encoders_take_them() -> None:
    hf, fb = pair("BertForSequenceClassification")
    ids, mask = batch()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, use_cache=False, encoder_hidden_states=None).logits
        got = fb(ids, attention_mask=mask, use_cache=False, encoder_hidden_states=None).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="encoder_hidden_states: fastbert's encoders have no cross-attention"):
        fb(ids, encoder_hidden_states=torch.zeros(3, 8, TINY["hidden_size"]))


class Pairs(torch.utils.data.Dataset):
    """Ragged rows as a tokenizer's dataset gives them: ids, mask, token types, a label."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, TINY["vocab_size"], (10,), generator=torch.Generator().manual_seed(i))
        mask = (torch.arange(10) < 6 + i % 4).long()
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids), "labels": i % 2}


def test_trainer_trains_evaluates_and_predicts_a_fastbert_head(tmp_path) -> None:
    """transformers' Trainer with activation checkpointing, bf16 autocast and gradient accumulation: the forward gets
    the mask and no loss keywords it cannot take, the weights move, evaluation and prediction run."""
    pytest.importorskip("accelerate")
    _, model = pair("BertForSequenceClassification")
    before = [p.detach().clone() for p in model.parameters()]
    calls = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(sorted(kwargs)), with_kwargs=True)
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                          gradient_accumulation_steps=2, bf16=True, use_cpu=True, report_to=[],
                                          save_strategy="no", **{checkpointing: True})  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Pairs(), eval_dataset=Pairs())
    trainer.train()
    assert model.is_gradient_checkpointing
    assert calls and all("attention_mask" in c and "num_items_in_batch" not in c for c in calls)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))
    assert trainer.predict(Pairs()).predictions.shape == (len(Pairs()), 2)


def test_from_hf_keeps_the_output_flags_the_forward_follows() -> None:
    hf, _ = pair("BertModel")
    hf.config.output_hidden_states = True
    ids, mask = batch()
    with torch.no_grad():
        assert len(fastbert.BertModel.from_hf(hf)(ids, attention_mask=mask).hidden_states) == len(
            hf(ids, attention_mask=mask).hidden_states
        )


def test_a_transformers_config_is_refused_with_the_conversion_and_converts() -> None:
    hf_config = transformers.BertConfig(**TINY)
    with pytest.raises(TypeError, match=r"takes a fastbert.BertConfig, .*BertConfig.from_hf\(config\)"):
        fastbert.BertModel(hf_config)
    config = fastbert.BertConfig.from_hf(hf_config)
    assert config.hidden_size == TINY["hidden_size"] and fastbert.BertModel(config).config is config
