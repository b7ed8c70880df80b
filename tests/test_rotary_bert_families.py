"""The rotary families on BERT's post-norm layers, GTE (a gated feed-forward with GELU, biases), NomicBERT (SwiGLU, no
biases in the attention and FFN GEMMs) and Jina-embeddings-v3 (XLM-R's layers and heads), against transformers:
random models of awkward sizes (head dim 14, 3 layers, with and without token types) on ragged batches with a fully
padded row, a batch of 1 and left padding, every hidden state within 1e-5 at valid positions on each backend; each
head's logits and loss from the files transformers writes (their original layouts) and back; gradients; bf16;
output_attentions; the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastbert
from fastbert.config import BertConfig
from tests.test_modernbert import (
    gradients_match,
    head_round_trip,
    low_precision_matches,
    probabilities_match,
    ragged,
)
from tests.test_mpnet import backend_errors, compile_matches_eager, replay_matches

transformers = pytest.importorskip("transformers")
FAMILIES = [name for name in ("Gte", "NomicBert", "JinaEmbeddingsV3") if hasattr(transformers, name + "Model")]
if not FAMILIES:
    pytest.skip("this transformers has no native GTE or NomicBERT class", allow_module_level=True)

ATOL = 1e-5
LENGTHS = [23, 0, 1, 17, 9]


def hf_model(family: str, suffix: str = "Model", type_vocab_size: int = 2, **extra) -> torch.nn.Module:
    """Hidden 56 over 4 heads (head dim 14), 3 layers, transformers' initialisation with the norms moved off 1."""
    config = getattr(transformers, family + "Config")(
        vocab_size=101, hidden_size=56, intermediate_size=44, num_hidden_layers=3, num_attention_heads=4,
        type_vocab_size=type_vocab_size, pad_token_id=0, max_position_embeddings=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager", **{"num_labels": 3, **extra},
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, family + suffix)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
@pytest.mark.parametrize("type_vocab_size", [2, 0])
@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_batches_match_on_every_backend(family: str, backend: str, type_vocab_size: int) -> None:
    if family != "Gte" and type_vocab_size == 0:
        pytest.skip(f"transformers' {family} always builds a token-type table (GTE's type_vocab_size 0 has none)")
    hf = hf_model(family, type_vocab_size=type_vocab_size)
    fast = fastbert.optimize(hf)
    error, single = backend_errors(backend, fast, hf, *ragged(LENGTHS))  # Triton on CPU: its interpreter
    assert error <= ATOL and single <= ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_token_types_left_padding_and_explain(family: str) -> None:
    hf = hf_model(family)
    fast = fastbert.optimize(hf)
    ids, mask = ragged([20, 7, 13], left=True)
    types = (torch.arange(20)[None] % 2).expand(3, 20)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        got = fast(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    assert (want - got)[mask.bool()].abs().max() <= ATOL
    with torch.no_grad():  # the plan bound by the first forward: the loop (rotation and gates in it), not the stack
        again = fast(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    assert (want - again)[mask.bool()].abs().max() <= ATOL
    said = fastbert.explain()
    assert "one loop over the layers' tensors" in said
    assert "rotary positions and gated feed-forwards are not in the native layer stack" in said


@pytest.mark.parametrize("suffix", ["ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                                    "ForQuestionAnswering"])  # fmt: skip
@pytest.mark.parametrize("family", FAMILIES)
def test_every_head_matches_transformers_and_round_trips(family: str, suffix: str, tmp_path: Path) -> None:
    if not hasattr(transformers, family + suffix):
        pytest.skip(f"transformers has no {family}{suffix}")
    head_round_trip(hf_model(family, suffix, num_labels=2 if suffix == "ForQuestionAnswering" else 3), family, suffix,
                    tmp_path)  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_transformers(family: str) -> None:
    gradients_match(hf_model(family))


@pytest.mark.skipif("Gte" not in FAMILIES, reason="this transformers has no native GTE class")
def test_the_rope_base_and_refusals() -> None:
    assert BertConfig.from_dict({"model_type": "gte"}).rope_parameters_of("full_attention")["rope_theta"] == 160_000.0
    flat = BertConfig.from_dict({"model_type": "gte", "rope_parameters": {"rope_type": "default", "rope_theta": 5e4}})
    assert flat.rope_parameters_of("full_attention")["rope_theta"] == 5e4
    with pytest.raises(ValueError, match="rope_type='ntk'"):
        BertConfig.from_dict({"model_type": "gte", "rope_parameters": {"rope_type": "ntk", "rope_theta": 5e4}})
    for model_type, theta in (("nomic_bert", 1e3), ("jina_embeddings_v3", 2e4)):
        config = BertConfig.from_dict({"model_type": model_type})
        assert config.rope_parameters_of("full_attention")["rope_theta"] == theta
    fast = fastbert.optimize(hf_model("Gte"))
    ids, mask = ragged([6, 6])
    with pytest.raises(ValueError, match="position_ids"):
        fast(ids, attention_mask=mask, position_ids=torch.arange(6)[None])


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_within_the_low_precision_rule(family: str) -> None:
    ids, mask = ragged(LENGTHS)
    low_precision_matches(hf_model(family), ids, mask, torch.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_probabilities_match(family: str) -> None:
    probabilities_match(hf_model(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_matches_eager(family: str) -> None:
    hf = hf_model(family)
    fast = fastbert.AutoModel.from_config(BertConfig.from_dict(hf.config.to_dict()))
    fast.load_checkpoint_state(hf.state_dict())
    compile_matches_eager(fast.eval(), *ragged(LENGTHS), "encoder.layer.1.attention.self.query.weight")


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_replay_rotates_and_gates(family: str) -> None:
    """The loop under (CPU stand-in) graph capture: the rotary tables are built inside the captured region from the
    batch's cu_seqlens, the gate and the zero-bias rows are read where they lie; a replay gives transformers' output."""
    hf = hf_model(family)
    ids, mask = ragged(LENGTHS)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).last_hidden_state[mask.bool()]
    replay_matches(hf, ids, mask, want)
