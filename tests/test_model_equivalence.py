"""fastbert vs transformers in fp32 on CPU: every valid (non-pad) row within atol 1e-5 (DESIGN.md).

Covers BertModel and every head (losses included), every layer's hidden states, attention probabilities,
awkward head dims (312 / 12 = 26), the BERT-base shape and the real all-MiniLM-L6-v2 checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ragged_batch

import fastbert

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
TINY = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
CONFIGS = {
    "tiny": TINY,
    "tiny-gelu_new": {**TINY, "hidden_act": "gelu_new"},
    "tiny-relu": {**TINY, "hidden_act": "relu", "type_vocab_size": 3},
    "head-dim-26": dict(
        vocab_size=120, hidden_size=312, num_hidden_layers=2, num_attention_heads=12, intermediate_size=1200
    ),
}


def assert_rows_close(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Max abs error of every valid row within ATOL (rows = positions; mask selects the valid ones)."""
    if mask is not None:
        ours, theirs = ours[mask.bool()], theirs[mask.bool()]
    assert ours.shape == theirs.shape
    err = (ours - theirs).abs().reshape(ours.shape[0], -1).amax(dim=1) if ours.dim() > 1 else (ours - theirs).abs()
    assert torch.isfinite(ours).all()
    assert err.max().item() <= ATOL, f"max row error {err.max().item():.3g} > {ATOL}"


def hf_pair(hf_cls: type, fb_cls: type, config: dict, **extra) -> tuple[torch.nn.Module, torch.nn.Module]:
    hf = hf_cls(transformers.BertConfig(**config, **extra)).eval()
    return hf, fb_cls.from_hf(hf).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bert_model_matches_transformers(name: str) -> None:
    cfg = CONFIGS[name]
    hf, fb = hf_pair(transformers.BertModel, fastbert.BertModel, cfg)
    ids, mask, types = ragged_batch(cfg["vocab_size"], 4, 12, empty_row=True)
    with torch.no_grad():
        a = hf(ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
        b = fb(ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    assert_rows_close(b.last_hidden_state, a.last_hidden_state, mask)
    assert len(b.hidden_states) == cfg["num_hidden_layers"] + 1
    for ours, theirs in zip(b.hidden_states, a.hidden_states, strict=True):
        assert_rows_close(ours, theirs, mask)
    assert_rows_close(b.pooler_output[:-1], a.pooler_output[:-1])  # the last row is fully padded
    assert (b.last_hidden_state[~mask.bool()] == 0).all(), "padded positions must be zeros"
    assert torch.isfinite(b.pooler_output).all()


def test_a_model_without_its_pooler_converts_without_one(caplog: pytest.LogCaptureFixture) -> None:
    """transformers' BertModel(config, add_pooling_layer=False): pooler_output None, nothing newly initialised."""
    hf = transformers.BertModel(transformers.BertConfig(**TINY), add_pooling_layer=False).eval()
    fb = fastbert.BertModel.from_hf(hf).eval()
    optimized = fastbert.optimize(hf)
    ids, mask, types = ragged_batch(TINY["vocab_size"], 3, 9)
    with torch.no_grad():
        a, b = hf(ids, attention_mask=mask), fb(ids, attention_mask=mask)
    assert a.pooler_output is None and b.pooler_output is None and fb.pooler is None and optimized.pooler is None
    assert_rows_close(b.last_hidden_state, a.last_hidden_state, mask)
    assert "newly initialised" not in caplog.text


def test_attention_probabilities_match_eager_transformers() -> None:
    hf = transformers.BertModel(transformers.BertConfig(**TINY, attn_implementation="eager")).eval()
    fb = fastbert.BertModel.from_hf(hf).eval()
    ids, mask, types = ragged_batch(TINY["vocab_size"], 3, 10)
    with torch.no_grad():
        a = hf(ids, attention_mask=mask, output_attentions=True)
        b = fb(ids, attention_mask=mask, output_attentions=True)
    assert len(b.attentions) == TINY["num_hidden_layers"]
    valid = mask.bool()
    for ours, theirs in zip(b.attentions, a.attentions, strict=True):
        assert ours.shape == theirs.shape
        q_rows = valid[:, None, :, None] & valid[:, None, None, :]  # valid query x valid key
        assert (ours - theirs).abs()[q_rows.expand_as(ours)].max() <= ATOL
    assert_rows_close(b.last_hidden_state, a.last_hidden_state, mask)


def test_position_ids_and_inputs_embeds_match() -> None:
    hf, fb = hf_pair(transformers.BertModel, fastbert.BertModel, TINY)
    ids, mask, _ = ragged_batch(TINY["vocab_size"], 2, 9)
    pos = torch.randint(0, 512, (2, 9))
    embeds = torch.randn(2, 9, TINY["hidden_size"])
    with torch.no_grad():
        assert_rows_close(
            fb(ids, attention_mask=mask, position_ids=pos)[0], hf(ids, attention_mask=mask, position_ids=pos)[0], mask
        )
        assert_rows_close(
            fb(inputs_embeds=embeds, attention_mask=mask)[0], hf(inputs_embeds=embeds, attention_mask=mask)[0], mask
        )


def test_float_and_bool_masks_are_the_same_as_int() -> None:
    fb = fastbert.BertModel(fastbert.BertConfig(**TINY)).eval()
    ids, mask, _ = ragged_batch(TINY["vocab_size"], 3, 8)
    with torch.no_grad():
        ref = fb(ids, attention_mask=mask).last_hidden_state
        for m in (mask.bool(), mask.float()):
            assert torch.equal(fb(ids, attention_mask=m).last_hidden_state, ref)


def test_output_access_by_attribute_key_index_and_tuple() -> None:
    fb = fastbert.BertModel(fastbert.BertConfig(**TINY)).eval()
    ids = torch.randint(0, 99, (2, 5))
    out = fb(ids)
    assert out[0] is out.last_hidden_state is out["last_hidden_state"]
    assert out[1] is out.pooler_output
    as_tuple = fb(ids, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 2
    assert torch.equal(as_tuple[0], out.last_hidden_state)


def _labels_for(head: str, batch: int, seqlen: int, mask: torch.Tensor, vocab: int) -> dict:
    valid = mask.bool()
    if head in ("BertForMaskedLM", "BertForPreTraining"):
        labels = torch.full((batch, seqlen), -100)
        pick = valid & (torch.rand(batch, seqlen) < 0.3)
        pick[0, 1] = True
        labels[pick] = torch.randint(0, vocab, (int(pick.sum()),))
        extra = {"next_sentence_label": torch.randint(0, 2, (batch,))} if head == "BertForPreTraining" else {}
        return {"labels": labels, **extra}
    if head == "BertForNextSentencePrediction":
        return {"labels": torch.randint(0, 2, (batch,))}
    if head == "BertForTokenClassification":
        labels = torch.randint(0, 3, (batch, seqlen))
        return {"labels": labels.masked_fill(~valid, -100)}
    if head == "BertForQuestionAnswering":
        start, end = torch.randint(0, seqlen, (batch,)), torch.randint(0, seqlen, (batch,))
        end[0] = seqlen + 5  # outside the input: ignored, as in transformers
        return {"start_positions": start, "end_positions": end}
    raise AssertionError(head)


HEADS = [
    ("BertForMaskedLM", {}),
    ("BertForPreTraining", {}),
    ("BertForNextSentencePrediction", {}),
    ("BertForTokenClassification", {"num_labels": 3}),
    ("BertForQuestionAnswering", {}),
]


@pytest.mark.parametrize("config_name", ["tiny", "head-dim-26"])
@pytest.mark.parametrize("head,extra", HEADS, ids=[h for h, _ in HEADS])
def test_heads_match_transformers(head: str, extra: dict, config_name: str) -> None:
    cfg = CONFIGS[config_name]
    hf, fb = hf_pair(getattr(transformers, head), getattr(fastbert, head), cfg, **extra)
    ids, mask, types = ragged_batch(cfg["vocab_size"], 3, 10)
    if head == "BertForQuestionAnswering":
        # transformers' span softmax runs over padded positions too, whose logits it computes from padding; fastbert
        # zeros padded states instead. Both agree at valid positions, so the loss is compared on an unpadded batch.
        mask = torch.ones_like(mask)
    labels = _labels_for(head, 3, 10, mask, cfg["vocab_size"])
    with torch.no_grad():
        a = hf(ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True, **labels)
        b = fb(ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True, **labels)
    assert abs(a.loss.item() - b.loss.item()) <= ATOL
    token_level = head not in ("BertForNextSentencePrediction",)
    for key in [k for k in b if k not in ("loss", "hidden_states", "seq_relationship_logits")]:
        assert_rows_close(b[key], a[key], mask if token_level and b[key].dim() >= 2 else None)
    if "seq_relationship_logits" in b:
        assert_rows_close(b.seq_relationship_logits, a.seq_relationship_logits)
    for ours, theirs in zip(b.hidden_states, a.hidden_states, strict=True):
        assert_rows_close(ours, theirs, mask)


@pytest.mark.parametrize(
    "num_labels,problem,labels",
    [
        (3, None, lambda b: torch.randint(0, 3, (b,))),
        (1, None, lambda b: torch.randn(b)),
        (3, "multi_label_classification", lambda b: torch.randint(0, 2, (b, 3)).float()),
    ],
    ids=["single-label", "regression", "multi-label"],
)
def test_sequence_classification_losses_match(num_labels: int, problem: str | None, labels) -> None:
    hf, fb = hf_pair(
        transformers.BertForSequenceClassification,
        fastbert.BertForSequenceClassification,
        TINY,
        num_labels=num_labels,
        problem_type=problem,
    )
    ids, mask, _ = ragged_batch(TINY["vocab_size"], 4, 8)
    y = labels(4)
    with torch.no_grad():
        a, b = hf(ids, attention_mask=mask, labels=y), fb(ids, attention_mask=mask, labels=y)
    assert_rows_close(b.logits, a.logits)
    assert abs(a.loss.item() - b.loss.item()) <= ATOL
    assert fb.config.problem_type == hf.config.problem_type


def test_multiple_choice_matches_transformers() -> None:
    hf, fb = hf_pair(transformers.BertForMultipleChoice, fastbert.BertForMultipleChoice, TINY)
    ids, mask, types = ragged_batch(TINY["vocab_size"], 6, 7)
    ids, mask, types = (t.view(2, 3, 7) for t in (ids, mask, types))
    labels = torch.tensor([0, 2])
    with torch.no_grad():
        a = hf(ids, attention_mask=mask, token_type_ids=types, labels=labels)
        b = fb(ids, attention_mask=mask, token_type_ids=types, labels=labels)
    assert b.logits.shape == (2, 3)
    assert_rows_close(b.logits, a.logits)
    assert abs(a.loss.item() - b.loss.item()) <= ATOL


def test_bert_base_shape_matches_transformers() -> None:
    cfg = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    hf, fb = hf_pair(transformers.BertModel, fastbert.BertModel, cfg)
    ids, mask, types = ragged_batch(30522, 2, 24)
    with torch.no_grad():
        a = hf(ids, attention_mask=mask, token_type_ids=types)
        b = fb(ids, attention_mask=mask, token_type_ids=types)
    assert_rows_close(b.last_hidden_state, a.last_hidden_state, mask)
    assert_rows_close(b.pooler_output, a.pooler_output)


def test_real_minilm_checkpoint_matches_transformers(minilm_dir) -> None:
    hf = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    fb = fastbert.BertModel.from_pretrained(minilm_dir)
    assert not fb.training
    ids, mask, types = ragged_batch(30522, 3, 32, empty_row=True)
    with torch.no_grad():
        a = hf(ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
        b = fb(ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    for ours, theirs in zip(b.hidden_states, a.hidden_states, strict=True):
        assert_rows_close(ours, theirs, mask)
    assert_rows_close(b.pooler_output[:-1], a.pooler_output[:-1])
