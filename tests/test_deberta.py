"""DeBERTa-v2/v3's disentangled attention against transformers: the buckets and the per-(query, key) terms are
transformers', each layout (v3: log buckets, shared keys, normalised rows, no absolute positions or token types; v2:
no buckets, own position projections, absolute positions; c2p or p2c alone; no relative attention) on every backend,
sequences far longer than the bucket range, left padding, gradients for fine-tuning, output_attentions, the context
pooler and both MLM heads, and the refusals. tests/test_families.py runs DeBERTa through every family check (heads,
checkpoints both ways, ONNX, int8, bf16)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf_deberta

import fastbert
from fastbert import relative_positions
from tests.conftest import NATIVE_CPU
from tests.test_mpnet import backend_errors, compile_matches_eager, hidden_states_error, replay_matches
from tests.test_mpnet import ragged as mpnet_ragged

ATOL = 1e-5
SIZE = dict(vocab_size=99, hidden_size=78, num_attention_heads=3, num_hidden_layers=3, intermediate_size=37,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=320)  # fmt: skip
V3 = dict(relative_attention=True, position_buckets=16, max_relative_positions=64, pos_att_type="p2c|c2p",
          norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False, type_vocab_size=0)  # fmt: skip
LAYOUTS = {
    "v3": V3,
    "v2": dict(relative_attention=True, position_buckets=-1, max_relative_positions=-1, pos_att_type=["c2p", "p2c"],
               share_att_key=False, position_biased_input=True, type_vocab_size=2),  # fmt: skip
    "c2p-only": {**V3, "pos_att_type": ["c2p"], "share_att_key": False},
    "p2c-only": {**V3, "pos_att_type": ["p2c"], "max_relative_positions": -1},
    "no-relative": dict(relative_attention=False, pos_att_type=["p2c", "c2p"], position_biased_input=True),
}
LENGTHS = [300, 0, 1, 150, 41]  # past every layout's bucket range, an empty row, one token


def hf_deberta_model(layout: str = "v3", head: str = "Model", **extra) -> torch.nn.Module:
    """A random DeBERTa of awkward sizes (head dim 26) with relative embeddings large enough to matter."""
    config = transformers.DebertaV2Config(**{**SIZE, **LAYOUTS[layout], **extra})
    torch.manual_seed(0)
    model = getattr(transformers, "DebertaV2" + head)(config).eval()
    base = model if head == "Model" else model.deberta
    if config.relative_attention:
        with torch.no_grad():
            base.encoder.rel_embeddings.weight.normal_()
    return model


def ragged(lengths: list[int], left: bool = False, vocab: int = 99) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids padded with DeBERTa's pad id 0, right or left, and the mask."""
    return mpnet_ragged(lengths, left, pad=0, vocab=vocab)


@pytest.mark.parametrize(("buckets", "longest"), [(256, 512), (16, 64), (-1, 64)])
def test_rows_of_each_distance_are_transformers(buckets: int, longest: int) -> None:
    """The row every (query, key) reads, for sequences up to 700 tokens, is transformers' clamp(bucket + span)."""
    seqlen = 700
    first, width, columns = relative_positions.deberta_rows(seqlen, buckets, longest, torch.device("cpu"))
    span = relative_positions.deberta_span(buckets, longest)
    x = torch.zeros(1, seqlen, 1)
    want = hf_deberta.build_relative_position(x, x, bucket_size=buckets, max_position=longest)[0]  # [S, S] q - k
    want = torch.clamp(want + span, 0, 2 * span - 1)
    pos = torch.arange(seqlen)
    got = columns.long()[pos[None, :] - pos[:, None] + seqlen - 1] + first
    assert torch.equal(got, want) and width == int(want.max() - want.min()) + 1
    radius, table = relative_positions.deberta_row_table(buckets, longest)
    assert torch.equal(table[(pos[None, :] - pos[:, None]).clamp(-radius, radius) + radius], want)


def test_dense_terms_are_transformers_disentangled_bias() -> None:
    """position_scores gathered by distance (the reference's [B, nH, S, S] form) equal transformers' c2p + p2c."""
    hf = hf_deberta_model("v3", share_att_key=False)
    attn = hf.encoder.layer[0].attention.self
    seqlen, heads, dim = 90, 3, 26
    x = torch.randn(1, seqlen, 78)
    rel = hf.encoder.get_rel_embedding()
    relative = hf.encoder.get_rel_pos(x)
    q = attn.transpose_for_scores(attn.query_proj(x), heads)
    k = attn.transpose_for_scores(attn.key_proj(x), heads)
    with torch.no_grad():
        want = attn.disentangled_attention_bias(q, k, relative, rel, 3)  # [nH, S, S]
        fast = fastbert.optimize(hf)
        terms = fast.encoder.relative_terms(seqlen)
        mine = fast.encoder.layer[0].attention.self
        scores = torch.matmul(torch.stack([q, k]), mine.position_projections(terms.rows))  # [2, nH, S, W]
        got = relative_positions.dense_scores(scores, terms.columns, None, 1, seqlen)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert dim * heads == 78


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_matches_every_hidden_state(layout: str) -> None:
    hf = hf_deberta_model(layout)
    fast = fastbert.optimize(hf)
    ids, mask = ragged(LENGTHS)
    assert hidden_states_error(fast, hf, ids, mask) <= ATOL
    assert hidden_states_error(fast, hf, ids[:1], mask[:1]) <= ATOL  # a batch of one


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_long_ragged_batches_match_on_every_backend(backend: str) -> None:
    hf = hf_deberta_model("v3")
    fast = fastbert.optimize(hf)
    lengths = LENGTHS if backend != "triton" else [70, 0, 1, 17]  # the interpreter is slow: one row past 64
    error, single = backend_errors(backend, fast, hf, *ragged(lengths))
    assert error <= ATOL and single <= ATOL


def test_left_padding_and_ignored_token_types_and_positions_match() -> None:
    """Left padding; DeBERTa-v3 has no type table and no position table: token_type_ids (its tokenizer gives them)
    and position_ids are read by neither model."""
    hf = hf_deberta_model("v3")
    fast = fastbert.optimize(hf)
    ids, mask = ragged([40, 7, 33], left=True)
    assert hidden_states_error(fast, hf, ids, mask) <= ATOL
    types, positions = torch.ones_like(ids), torch.arange(40).flip(0).expand(3, 40)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, token_type_ids=types, position_ids=positions).last_hidden_state
        got = fast(ids, attention_mask=mask, token_type_ids=types, position_ids=positions).last_hidden_state
    valid = mask.bool()
    assert (got[valid] - want[valid]).abs().max() <= ATOL


def test_fine_tuning_gradients_match_transformers() -> None:
    """A sequence classifier's loss and the gradients of the relative embedding, its LayerNorm, a layer's position
    projections and query weight, in training mode without dropout."""
    hf = hf_deberta_model("v3", "ForSequenceClassification", share_att_key=False, num_labels=3)
    fast = fastbert.optimize(hf, freeze=False).train()
    hf.train()
    ids, mask = ragged([150, 20, 1])
    labels = torch.tensor([0, 2, 1])
    layer = "encoder.layer.1.attention.self."
    names = ("encoder.rel_embeddings.weight", "encoder.LayerNorm.weight", layer + "pos_key_proj.weight",
             layer + "pos_query_proj.bias", "encoder.layer.0.attention.self.query_proj.weight")  # fmt: skip
    losses, grads = [], []
    for model in (hf, fast):
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        losses.append(out.loss.detach())
        params = dict(model.deberta.named_parameters())
        grads.append([params[n.replace(".query_proj", ".query") if model is fast else n].grad for n in names])
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for name, want, got in zip(names, *grads, strict=True):
        assert got is not None and want.abs().max() > 0, name
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=name)


def test_output_attentions_match() -> None:
    hf = hf_deberta_model("v3")
    ids, mask = ragged([30, 12, 1])
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_attentions=True).attentions
        got = fastbert.optimize(hf)(ids, attention_mask=mask, output_attentions=True).attentions
    valid = (mask[:, None, :, None] * mask[:, None, None, :]).bool().expand_as(want[0])
    for a, b in zip(got, want, strict=True):
        assert (a[valid] - b[valid]).abs().max() <= ATOL


@pytest.mark.parametrize("legacy", [True, False])
def test_both_mlm_heads_load_run_and_save_under_transformers_names(legacy: bool, tmp_path) -> None:
    hf = hf_deberta_model("v3", "ForMaskedLM", legacy=legacy)
    hf.save_pretrained(tmp_path / "hf")
    fast = fastbert.DebertaV2ForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    ids, mask = ragged([25, 9])
    picked = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.3
    labels = ids.masked_fill(~(picked & mask.bool()), -100)
    with torch.no_grad():
        want, got = hf(ids, attention_mask=mask, labels=labels), fast(ids, attention_mask=mask, labels=labels)
    valid = mask.bool()
    assert (got.logits[valid] - want.logits[valid]).abs().max() <= ATOL
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    fast.save_pretrained(tmp_path / "fast")
    back = transformers.DebertaV2ForMaskedLM.from_pretrained(tmp_path / "fast")
    original = hf.state_dict()
    assert original.keys() == back.state_dict().keys()
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in original.items())


def test_context_pooler_heads_match_with_their_activation_and_labels() -> None:
    """Sequence classification and multiple choice pool the first token through `pooler.dense` and
    pooler_hidden_act (relu here, not BERT's tanh)."""
    for head in ("ForSequenceClassification", "ForMultipleChoice"):
        hf = hf_deberta_model("v3", head, pooler_hidden_act="relu", num_labels=3)
        fast = fastbert.optimize(hf)
        ids, mask = ragged([20, 11, 5, 20])
        labels = torch.tensor([1, 0]) if head == "ForMultipleChoice" else torch.tensor([0, 1, 2, 1])
        if head == "ForMultipleChoice":
            ids, mask = ids.view(2, 2, 20), mask.view(2, 2, 20)
        with torch.no_grad():
            want, got = hf(ids, attention_mask=mask, labels=labels), fast(ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(got.loss, want.loss, atol=ATOL, rtol=1e-5)


def test_a_mask_with_gaps_is_refused() -> None:
    ids, mask = ragged([9, 9])
    mask[0, 4] = 0
    with pytest.raises(ValueError, match="zeros between the ones"):
        fastbert.optimize(hf_deberta_model("v3"))(ids, attention_mask=mask)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [("conv_kernel_size", 3, "convolution"), ("embedding_size", 64, "embed_proj"),
     ("attention_head_size", 20, "attention_head_size"), ("pos_att_type", ["p2p"], "pos_att_type")],
)  # fmt: skip
def test_what_fastbert_does_not_compute_is_refused_by_name(field: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        fastbert.DebertaV2Config(**{**SIZE, **V3, field: value})


@pytest.mark.parametrize("layout", ["v3", "v2", "no-relative"])
def test_the_loop_and_graph_replay_add_the_terms(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first forward binds the plan, the loop executor computes each layer's scores from the tensors (the
    layer stack passes, saying why); a (CPU stand-in) graph replays that loop; both give transformers' output, in
    training mode too (the loop with autograd)."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")  # every GEMM on a kernel the layer stack has, where it is built
    hf = hf_deberta_model(layout)
    ids, mask = ragged(LENGTHS)
    valid = mask.bool()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).last_hidden_state[valid]
    fast = fastbert.optimize(hf)
    with torch.inference_mode():
        for _ in range(2):
            got = fast(ids, attention_mask=mask).last_hidden_state[valid]
    said = "\n".join(plan.describe() for plan in fast.plans.plans.values())
    if NATIVE_CPU is not None and layout == "no-relative":  # no terms: the layer stack runs 2-3 at DeBERTa's scale
        assert "the CPU layer stack" in said
    elif NATIVE_CPU is not None:
        assert "one loop over the layers' tensors" in said and "computes no position scores" in said
    assert (got - want).abs().max() <= ATOL
    replay_matches(hf, ids, mask, want)
    trained = fastbert.optimize(hf, freeze=False).train()
    for _ in range(2):
        got = trained(ids, attention_mask=mask).last_hidden_state[valid]
    assert "one loop over the layers' tensors" in "\n".join(p.describe() for p in trained.plans.plans.values())
    assert (got.detach() - want).abs().max() <= ATOL


def test_torch_compile_inference_and_training_match_eager() -> None:
    """torch.compile of a DeBERTa: inference breaks at the unpad sync only (the row window is a constant to it), and
    a training step's loss and the relative embedding's gradient match eager."""
    ids, mask = ragged([70, 20, 1])
    compile_matches_eager(fastbert.optimize(hf_deberta_model("v3"), freeze=False), ids, mask,
                          "encoder.rel_embeddings.weight")  # fmt: skip


def test_the_new_mlm_head_reads_the_word_embeddings_even_untied(tmp_path) -> None:
    """legacy=False multiplies by the word embeddings whatever tie_word_embeddings says, as transformers does."""
    hf = hf_deberta_model("v3", "ForMaskedLM", legacy=False, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    fast = fastbert.DebertaV2ForMaskedLM.from_pretrained(tmp_path).eval()
    ids, mask = ragged([25, 9])
    with torch.no_grad():
        want, got = hf(ids, attention_mask=mask).logits, fast(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (got[valid] - want[valid]).abs().max() <= ATOL


@pytest.mark.parametrize("kind", ["skipped negative", "all negative", "soft", "regression"])
def test_sequence_loss_follows_debertas_own_rule(kind: str) -> None:
    """Without a problem_type, DeBERTa's classifier skips negative labels (0 when all are), takes a distribution
    per row as soft labels, and regresses for one label; the config's problem_type stays unset."""
    labels = {"skipped negative": torch.tensor([0, -1, 2, 1]), "all negative": torch.full((4,), -1),
              "soft": torch.softmax(torch.randn(4, 3, generator=torch.Generator().manual_seed(3)), -1),
              "regression": torch.tensor([0.5, -1.0, 2.0, 0.0])}[kind]  # fmt: skip
    hf = hf_deberta_model("v3", "ForSequenceClassification", num_labels=1 if kind == "regression" else 3)
    fast = fastbert.optimize(hf)
    ids, mask = ragged([20, 11, 5, 20])
    with torch.no_grad():
        want, got = hf(ids, attention_mask=mask, labels=labels), fast(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss.float(), want.loss.float(), atol=ATOL, rtol=1e-5)
    assert fast.config.problem_type is None


def test_a_layer_norm_without_relative_attention_loads_both_ways(tmp_path) -> None:
    hf = hf_deberta_model("no-relative", norm_rel_ebd="layer_norm")
    hf.save_pretrained(tmp_path / "hf")
    fast = fastbert.DebertaV2Model.from_pretrained(tmp_path / "hf").eval()
    ids, mask = ragged([30, 4])
    assert hidden_states_error(fast, hf, ids, mask) <= ATOL
    fast.save_pretrained(tmp_path / "fast")
    back = transformers.DebertaV2Model.from_pretrained(tmp_path / "fast")
    assert back.state_dict().keys() == hf.state_dict().keys()


def test_a_repeated_relative_term_is_counted_once_in_the_scale() -> None:
    hf = hf_deberta_model("v3", pos_att_type="c2p|c2p")
    ids, mask = ragged([60, 7])
    assert hidden_states_error(fastbert.optimize(hf), hf, ids, mask) <= ATOL
