"""RoBERTa, XLM-RoBERTa, DistilBERT, ALBERT, ELECTRA, MPNet and DeBERTa-v2/v3 against transformers: random models of
awkward sizes (head dim 26, ragged batches with a fully padded row, batch of 1), every hidden state and every head at
valid positions (fp32, atol 1e-5), losses, and checkpoints both ways with transformers' key names."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import fastbert
from fastbert.families import UnsupportedModelError

ATOL = 1e-5
SIZE = dict(vocab_size=99, hidden_size=78, num_attention_heads=3, num_hidden_layers=2, intermediate_size=37)
DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
CONFIGS = {  # transformers config class, fields
    "roberta": ("RobertaConfig", {**SIZE, **DROPOUT, "max_position_embeddings": 40}),
    "xlm-roberta": ("XLMRobertaConfig", {**SIZE, **DROPOUT, "max_position_embeddings": 40, "pad_token_id": 3}),
    "distilbert": (
        "DistilBertConfig",
        dict(
            vocab_size=99,
            dim=78,
            n_heads=3,
            n_layers=2,
            hidden_dim=37,
            dropout=0.0,
            attention_dropout=0.0,
            max_position_embeddings=40,
            sinusoidal_pos_embds=True,
            activation="gelu",
        ),
    ),  # fmt: skip
    "albert": (
        "AlbertConfig",
        {
            **SIZE,
            **DROPOUT,
            "num_hidden_layers": 3,
            "num_hidden_groups": 2,
            "embedding_size": 20,
            "max_position_embeddings": 40,
            "type_vocab_size": 3,
        },
    ),  # fmt: skip
    "electra": ("ElectraConfig", {**SIZE, **DROPOUT, "embedding_size": 20, "max_position_embeddings": 40}),
    "mpnet": ("MPNetConfig", {**SIZE, **DROPOUT, "num_hidden_layers": 3, "max_position_embeddings": 40}),
    "deberta-v2": (  # DeBERTa-v3's layout; distances past its 4 buckets and 8 positions from 11 tokens on
        "DebertaV2Config",
        {**SIZE, **DROPOUT, "max_position_embeddings": 40, "relative_attention": True, "position_buckets": 4,
         "max_relative_positions": 8, "pos_att_type": "p2c|c2p", "norm_rel_ebd": "layer_norm",
         "position_biased_input": False, "type_vocab_size": 0},
    ),  # fmt: skip
}
HEADS = {  # fastbert suffix: transformers suffix
    "Model": "Model",
    "ForSequenceClassification": "ForSequenceClassification",
    "ForTokenClassification": "ForTokenClassification",
    "ForQuestionAnswering": "ForQuestionAnswering",
    "ForMaskedLM": "ForMaskedLM",
}
NAMES = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "distilbert": "DistilBert", "albert": "Albert",
         "electra": "Electra", "mpnet": "MPNet", "deberta-v2": "DebertaV2"}  # fmt: skip


def hf_model(model_type: str, suffix: str = "Model", **extra) -> torch.nn.Module:
    cls_name, fields = CONFIGS[model_type]
    labels = 2 if suffix == "ForQuestionAnswering" else 3
    config = getattr(transformers, cls_name)(**{**fields, "num_labels": labels, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, NAMES[model_type] + suffix)(config)
    return model.eval()


def batch(config, rows: int = 4, seqlen: int = 11, full_pad_row: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged ids (pad_token_id at padding) and mask; with `full_pad_row`, the last row is all padding."""
    g = torch.Generator().manual_seed(1)
    pad = config.pad_token_id
    ids = torch.randint(4, config.vocab_size, (rows, seqlen), generator=g)
    lengths = torch.randint(1, seqlen + 1, (rows,), generator=g)
    lengths[0] = seqlen
    if full_pad_row and rows > 1:
        lengths[-1] = 0
    mask = (torch.arange(seqlen) < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, pad), mask


def _fast_class(model_type: str, suffix: str) -> type:
    return getattr(fastbert, NAMES[model_type] + suffix)


@pytest.mark.parametrize("rows", [4, 1])
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_encoder_matches_transformers_every_hidden_state(model_type: str, rows: int, tmp_path) -> None:
    hf = hf_model(model_type)
    hf.save_pretrained(tmp_path)
    fast = fastbert.AutoModel.from_pretrained(tmp_path)
    assert type(fast) is _fast_class(model_type, "Model")
    ids, mask = batch(hf.config, rows)
    with torch.no_grad():
        a = fast(ids, attention_mask=mask, output_hidden_states=True)
        b = hf(ids, attention_mask=mask, output_hidden_states=True)
    valid = mask.bool()
    assert len(a.hidden_states) == len(b.hidden_states)
    for x, y in zip(a.hidden_states, b.hidden_states, strict=True):
        torch.testing.assert_close(x[valid], y[valid], atol=ATOL, rtol=0)
    torch.testing.assert_close(a.last_hidden_state[valid], b.last_hidden_state[valid], atol=ATOL, rtol=0)
    assert (a.last_hidden_state[~valid] == 0).all()
    if "pooler_output" in b and b.pooler_output is not None:
        full = valid[:, 0]  # the pooler reads position 0: valid on every row but the fully padded one
        torch.testing.assert_close(a.pooler_output[full], b.pooler_output[full], atol=ATOL, rtol=0)
    else:
        assert a.pooler_output is None
    assert a[0] is a["last_hidden_state"] is a.last_hidden_state


def _labels(suffix: str, config, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    if suffix == "ForSequenceClassification":
        return {"labels": torch.randint(0, 3, (ids.shape[0],), generator=g)}
    if suffix == "ForTokenClassification":
        return {"labels": torch.randint(0, 3, ids.shape, generator=g).masked_fill(mask == 0, -100)}
    if suffix == "ForMaskedLM":
        return {"labels": ids.masked_fill((mask == 0) | (torch.rand(ids.shape, generator=g) < 0.5), -100)}
    return {"start_positions": torch.tensor([1, 3, 0]), "end_positions": torch.tensor([2, 9, 4])}


@pytest.mark.parametrize("suffix", [s for s in HEADS if s != "Model"])
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_heads_match_transformers_outputs_and_losses(model_type: str, suffix: str, tmp_path) -> None:
    hf = hf_model(model_type, suffix)
    hf.save_pretrained(tmp_path)
    auto = getattr(fastbert, "AutoModel" + suffix)
    fast = auto.from_pretrained(tmp_path, strict_heads=True)
    assert type(fast).__name__ == NAMES[model_type] + suffix
    # QA's softmax runs over padded positions too (fastbert zeros them), so its loss is compared unpadded
    qa = suffix == "ForQuestionAnswering"
    ids, mask = batch(hf.config, rows=3, full_pad_row=not qa and suffix != "ForSequenceClassification")
    if qa:
        mask = torch.ones_like(mask)
    labels = _labels(suffix, hf.config, ids, mask)
    with torch.no_grad():
        a = fast(ids, attention_mask=mask, **labels)
        b = hf(ids, attention_mask=mask, **labels)
    assert abs(a.loss.item() - b.loss.item()) <= ATOL
    valid = mask.bool()
    for key in ("logits", "start_logits", "end_logits"):
        if key in b:
            x, y = a[key], b[key]
            if x.dim() > 2 or key != "logits" or suffix != "ForSequenceClassification":
                x, y = x[valid], y[valid]
            torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


@pytest.mark.parametrize("suffix", list(HEADS))
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_round_trip_into_transformers_is_exact(model_type: str, suffix: str, tmp_path) -> None:
    hf = hf_model(model_type, suffix)
    hf.save_pretrained(tmp_path / "hf")
    fast = _fast_class(model_type, suffix).from_pretrained(tmp_path / "hf")
    fast.save_pretrained(tmp_path / "fast")
    config = json.loads((tmp_path / "fast" / "config.json").read_text())
    assert config["model_type"] == model_type and config["architectures"] == [NAMES[model_type] + suffix]
    assert type(transformers.AutoConfig.from_pretrained(tmp_path / "fast")) is type(hf.config)
    back = getattr(transformers, NAMES[model_type] + suffix).from_pretrained(tmp_path / "fast").eval()
    original, loaded = hf.state_dict(), back.state_dict()
    assert original.keys() == loaded.keys()
    for key, value in original.items():
        assert torch.equal(value, loaded[key]), key
    again = type(fast).from_pretrained(tmp_path / "fast").state_dict()
    assert all(torch.equal(v, again[k]) for k, v in fast.state_dict().items())


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_a_fresh_fastbert_model_loads_in_transformers(model_type: str, tmp_path) -> None:
    """Built and saved by fastbert alone (its config class, its initialisation): transformers loads every weight."""
    fields = {k: v for k, v in CONFIGS[model_type][1].items() if k != "sinusoidal_pos_embds"}
    config = fastbert.BertConfig(model_type=model_type, **fields)
    fast = _fast_class(model_type, "ForMaskedLM")(config).eval()
    fast.save_pretrained(tmp_path)
    hf_class = getattr(transformers, NAMES[model_type] + "ForMaskedLM")
    hf, info = hf_class.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids, mask = batch(hf.config, rows=3)
    valid = mask.bool()
    with torch.no_grad():
        a, b = fast(ids, attention_mask=mask).logits, hf.eval()(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[valid], b[valid], atol=ATOL, rtol=0)


def test_roberta_positions_count_non_pad_tokens_from_the_pad_id() -> None:
    config = fastbert.RobertaConfig(**SIZE, max_position_embeddings=40)
    ids = torch.tensor([[0, 5, 6, 2, 1, 1], [1, 1, 0, 7, 2, 1]])  # left and right padding
    expected = torch.tensor([[2, 3, 4, 5, 1, 1], [1, 1, 2, 3, 4, 1]])
    assert torch.equal(fastbert.modeling.family_positions(config, ids, 6, ids.device), expected)
    with pytest.raises(ValueError, match="positions start at pad_token_id"):
        fastbert.RobertaModel(config)(torch.full((1, 39), 5))


def test_distilbert_takes_no_token_types_and_albert_shares_groups() -> None:
    distil = fastbert.DistilBertModel(fastbert.DistilBertConfig(dim=78, n_heads=3, n_layers=2, hidden_dim=37))
    assert not hasattr(distil.embeddings, "token_type_embeddings") and distil.pooler is None
    with pytest.raises(TypeError, match="no token types"):
        distil(torch.ones(1, 4, dtype=torch.long), token_type_ids=torch.zeros(1, 4, dtype=torch.long))
    albert = fastbert.AlbertModel(fastbert.AlbertConfig(**{**SIZE, "num_hidden_layers": 3}, num_hidden_groups=2))
    layers = albert.encoder.layer
    assert layers[0] is layers[1] and layers[2] is not layers[0]
    with pytest.raises(ValueError, match="inner_group_num"):
        fastbert.AlbertConfig(**SIZE, inner_group_num=2)


@pytest.mark.parametrize("model_type", ["new", "deberta"])
def test_unsupported_architecture_is_a_clear_error(model_type: str, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 64}))
    for loader in (fastbert.AutoModel, fastbert.BertModel, fastbert.RobertaModel):
        with pytest.raises(UnsupportedModelError, match="supported: bert, roberta, xlm-roberta, distilbert") as info:
            loader.from_pretrained(tmp_path)
        assert fastbert.families.NOT_YET[model_type] in str(info.value)  # what it would need


def test_a_class_of_another_family_refuses_the_checkpoint(tmp_path) -> None:
    hf_model("roberta").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use fastbert.RobertaModel or fastbert.AutoModel"):
        fastbert.BertModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use fastbert.RobertaForMaskedLM"):
        fastbert.ElectraForMaskedLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_optimize_takes_each_transformers_class(model_type: str) -> None:
    hf = hf_model(model_type, "ForTokenClassification")
    fast = fastbert.optimize(hf)
    assert type(fast).__name__ == NAMES[model_type] + "ForTokenClassification"
    assert getattr(fast, {"xlm-roberta": "roberta", "deberta-v2": "deberta"}.get(model_type, model_type)) is fast.bert
    ids, mask = batch(hf.config, rows=3)
    with torch.no_grad():
        a, b = fast(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_onnx_export_matches_in_onnxruntime(model_type: str, tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    from fastbert.onnx import Session, export, make_inputs

    hf = hf_model(model_type, "ForSequenceClassification", initializer_range=0.3)
    fast = fastbert.optimize(hf)
    report = export(fast, tmp_path / "m.onnx", optimize_graph=True, progress=False)
    assert max(report.parity.values()) <= 1e-4 and max(report.optimized_parity.values()) <= 1e-4
    unfused = fast.config.family.relative_attention or fast.config.disentangled_kinds  # terms on the scores
    assert report.fused["Attention"] == (0 if unfused else fast.config.num_hidden_layers)
    session = Session(tmp_path / "m.onnx")
    inputs = make_inputs(fast.config, 3, 9, seed=3)
    got = session(**inputs)
    with torch.no_grad():
        want = hf(**inputs).logits
    assert type(got).__name__ == "SequenceClassifierOutput"
    first = inputs["attention_mask"][:, 0].bool()  # a sentence head reads the first token: rows where it is real
    torch.testing.assert_close(got.logits[first], want[first], atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "native", "onednn", "triton"])
@pytest.mark.parametrize("model_type", ["roberta", "distilbert", "albert", "electra", "mpnet"])
def test_every_family_runs_unpadded_on_every_backend(model_type: str, backend: str) -> None:
    hf = hf_model(model_type)
    fast = fastbert.optimize(hf)
    ids, mask = batch(hf.config, rows=3, seqlen=9)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).last_hidden_state
        try:
            with fastbert.use_backend(backend):
                got = fast(ids, attention_mask=mask).last_hidden_state
        except fastbert.BackendUnavailable as exc:
            pytest.skip(f"{backend} cannot run here: {exc}")
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", ["roberta", "albert", "mpnet"])
def test_inputs_embeds_position_ids_and_attentions_match(model_type: str) -> None:
    hf = hf_model(model_type)
    hf.config._attn_implementation = "eager"  # attention probabilities come from eager attention only
    fast = fastbert.optimize(hf)
    ids, mask = batch(hf.config, rows=3, seqlen=7, full_pad_row=False)
    embeds = hf.embeddings.word_embeddings(ids).detach()
    positions = (torch.arange(7).flip(0) + 2).unsqueeze(0)
    valid = mask.bool()
    with torch.no_grad():
        for kwargs in ({"inputs_embeds": embeds}, {"input_ids": ids, "position_ids": positions}):
            a, b = fast(attention_mask=mask, **kwargs), hf(attention_mask=mask, **kwargs)
            torch.testing.assert_close(a.last_hidden_state[valid], b.last_hidden_state[valid], atol=ATOL, rtol=0)
        a = fast(ids, attention_mask=mask, output_attentions=True)
        b = hf(ids, attention_mask=mask, output_attentions=True)
    for x, y in zip(a.attentions, b.attentions, strict=True):
        rows = valid[:, None, :, None] & valid[:, None, None, :]
        torch.testing.assert_close(x[rows.expand_as(x)], y[rows.expand_as(y)], atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_bf16_error_is_within_twice_transformers(model_type: str, tmp_path) -> None:
    hf = hf_model(model_type)
    hf.save_pretrained(tmp_path)
    fast = fastbert.AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    hf16 = type(hf).from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ids, mask = batch(hf.config, rows=3)
    valid = mask.bool()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).last_hidden_state[valid]
        ours = fast(ids, attention_mask=mask).last_hidden_state[valid].float()
        theirs = hf16(ids, attention_mask=mask).last_hidden_state[valid].float()
    assert (ours - want).abs().max() <= 2 * (theirs - want).abs().max() + 1e-2


def test_fresh_models_start_like_transformers_tables() -> None:
    """DistilBERT's sinusoidal position table and RoBERTa's zero pad-position row, on a fresh (unloaded) model."""
    hf = hf_model("distilbert")
    config = fastbert.DistilBertConfig(**{k: v for k, v in hf.config.to_dict().items() if k != "model_type"})
    fresh = fastbert.DistilBertModel(config).embeddings.position_embeddings.weight
    torch.testing.assert_close(fresh, hf.embeddings.position_embeddings.weight, atol=1e-6, rtol=0)
    roberta = fastbert.RobertaModel(fastbert.RobertaConfig(**SIZE, max_position_embeddings=40))
    assert (roberta.embeddings.position_embeddings.weight[1] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_every_family_on_cuda_matches_transformers(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: the Triton kernels and CUDA-graph replay (optimize's default there), fp32 with TF32 off."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    hf = hf_model(model_type).cuda()
    fast = fastbert.optimize(hf)
    ids, mask = (t.cuda() for t in batch(hf.config, rows=3))
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).last_hidden_state
        got = fast(ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=ATOL, rtol=0)


def test_export_onnx_command_picks_the_family_class(tmp_path, capsys) -> None:
    pytest.importorskip("onnxruntime")
    from fastbert.cli import main

    hf_model("electra", "ForTokenClassification", initializer_range=0.3).save_pretrained(tmp_path / "ckpt")
    assert main(["export-onnx", str(tmp_path / "ckpt"), str(tmp_path / "m.onnx")]) == 0
    from fastbert.onnx import Session

    session = Session(tmp_path / "m.onnx")
    assert session.model_class == "ElectraForTokenClassification" and session.config.model_type == "electra"
    assert main(["export-onnx", str(tmp_path / "ckpt"), str(tmp_path / "c.onnx"), "--head", "BertForMultipleChoice"])
    assert "Electra has no ForMultipleChoice" in capsys.readouterr().err


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_every_family_quantizes_to_int8(model_type: str) -> None:
    from fastbert.backends import int8

    if int8.unavailable_reason() is not None:
        pytest.skip(int8.unavailable_reason())
    hf = hf_model(model_type)
    fast = fastbert.optimize(hf, quantize="int8")
    ids, mask = batch(hf.config, rows=3)
    with torch.no_grad(), fastbert.ops.use_backend("int8"):  # every GEMM int8, whatever this CPU's timings say
        out = fast(ids, attention_mask=mask).last_hidden_state
    ref = hf(ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    cos = torch.nn.functional.cosine_similarity(out[valid], ref[valid], dim=-1)
    assert cos.min().item() > 0.99 and not torch.allclose(out[valid], ref[valid], atol=ATOL)  # int8 ran, stayed close
