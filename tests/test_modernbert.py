"""ModernBERT against transformers' ModernBertModel: random models of awkward sizes (head dim 14, an odd number of
layers so the global/sliding pattern does not divide evenly, windows narrower and wider than the sequences) on ragged
batches with a fully padded row, a batch of 1 and left padding, every hidden state within 1e-5 at valid positions on
each backend; the attention probabilities; checkpoints both ways and fastbert.optimize; the refusals."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers

import fastbert
from fastbert import AutoModel
from fastbert.config import BertConfig
from tests.kernel_checks import assert_close
from tests.test_mpnet import backend_errors, compile_matches_eager, hidden_states_error
from tests.test_mpnet import ragged as mpnet_ragged

ATOL = 1e-5
LENGTHS = [23, 0, 1, 17, 9]


def hf_modernbert(local_attention: int = 8, layers: int = 5, **extra) -> transformers.ModernBertModel:
    """Hidden 56 over 4 heads (head dim 14), 5 layers (global, sliding, sliding, global, sliding), transformers'
    own initialisation with the norms' weights moved off 1 so they matter."""
    config = transformers.ModernBertConfig(
        vocab_size=101, hidden_size=56, intermediate_size=44, num_hidden_layers=layers, num_attention_heads=4,
        local_attention=local_attention, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
        sep_token_id=2, max_position_embeddings=128, attn_implementation="eager", **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.ModernBertModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


def ragged(lengths: list[int], left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids padded with 0 (these models' pad id), right or left, and the mask."""
    return mpnet_ragged(lengths, left, pad=0, vocab=101)


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
@pytest.mark.parametrize("local_attention", [8, 64])
def test_ragged_batches_match_on_every_backend(backend: str, local_attention: int) -> None:
    hf = hf_modernbert(local_attention)
    fast = fastbert.optimize(hf)
    error, single = backend_errors(backend, fast, hf, *ragged(LENGTHS))  # Triton on CPU: its interpreter
    assert error <= ATOL and single <= ATOL


def test_left_padding_and_no_mask_match() -> None:
    hf = hf_modernbert()
    fast = fastbert.optimize(hf)
    ids, mask = ragged([20, 7, 13], left=True)
    assert hidden_states_error(fast, hf, ids, mask) <= ATOL
    full = torch.ones_like(mask)
    assert hidden_states_error(fast, hf, ids, full) <= ATOL


def probabilities_match(hf: torch.nn.Module) -> None:
    """output_attentions: every layer's probabilities within 1e-5 at the query rows of real tokens."""
    fast = fastbert.optimize(hf)
    ids, mask = ragged([12, 5])
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_attentions=True).attentions
        got = fast(ids, attention_mask=mask, output_attentions=True).attentions
    rows = mask.bool()
    assert len(got) == len(want) == hf.config.num_hidden_layers
    for a, b in zip(got, want, strict=True):
        assert (a.transpose(1, 2)[rows] - b.transpose(1, 2)[rows]).abs().max() <= ATOL


def test_attention_probabilities_match() -> None:
    probabilities_match(hf_modernbert())


def test_checkpoints_load_and_save_both_ways(tmp_path) -> None:
    hf = hf_modernbert()
    hf.save_pretrained(tmp_path / "hf")
    fast = AutoModel.from_pretrained(tmp_path / "hf")
    assert type(fast).__name__ == "ModernBertModel" and fast.config.layer_kinds == hf.config.layer_types
    ids, mask = ragged(LENGTHS)
    assert hidden_states_error(fast, hf, ids, mask) <= ATOL
    fast.save_pretrained(tmp_path / "fast")
    again = transformers.ModernBertModel.from_pretrained(tmp_path / "fast").eval()
    want = hf.state_dict()
    assert set(again.state_dict()) == set(want)
    assert all(torch.equal(t, want[k]) for k, t in again.state_dict().items())
    assert BertConfig.from_pretrained(tmp_path / "fast").layer_kinds == hf.config.layer_types


def test_older_configs_without_layer_types_read_the_same_pattern() -> None:
    """Checkpoints saved before layer_types carry global_attn_every_n_layers and the two rope thetas."""
    config = BertConfig.from_dict({"model_type": "modernbert", "num_hidden_layers": 7, "global_attn_every_n_layers": 2,
                                   "global_rope_theta": 5e4, "local_rope_theta": 123.0})  # fmt: skip
    assert config.layer_kinds == ["full_attention", "sliding_attention"] * 3 + ["full_attention"]
    assert config.rope_parameters_of("sliding_attention")["rope_theta"] == 123.0
    assert config.rope_parameters_of("full_attention")["rope_theta"] == 5e4


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_size": 60, "num_attention_heads": 4}, "must be even"),
        ({"num_hidden_layers": 2, "layer_types": ["full_attention"]}, "layer_types must name"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4}}}, "rope_type='yarn'"),
        ({"local_attention": -2}, "local_attention must be"),
    ],
)
def test_bad_configs_are_refused_by_name(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BertConfig.from_dict({"model_type": "modernbert", **fields})


def test_position_ids_and_masks_with_gaps_are_refused() -> None:
    fast = fastbert.optimize(hf_modernbert())
    ids, mask = ragged([6, 6])
    with pytest.raises(ValueError, match="position_ids"):
        fast(ids, attention_mask=mask, position_ids=torch.arange(6)[None])
    mask[0, 2] = 0
    with pytest.raises(ValueError, match="zeros between the ones"):
        fast(ids, attention_mask=mask)


def gradients_match(hf: torch.nn.Module) -> None:
    """Training runs module by module through the reference attention (autograd): every parameter's gradient within
    DESIGN.md's fp32 bound relative to its size, for a loss on the valid positions of the last hidden state."""
    hf.train()
    fast = AutoModel.from_config(BertConfig.from_dict(hf.config.to_dict()))
    fast.load_checkpoint_state(hf.state_dict())
    fast.train()
    ids, mask = ragged(LENGTHS)
    valid = mask.bool()
    weights = torch.randn(valid.sum().item(), hf.config.hidden_size, generator=torch.Generator().manual_seed(2))
    (hf(ids, attention_mask=mask).last_hidden_state[valid] * weights).sum().backward()
    (fast(ids, attention_mask=mask).last_hidden_state[valid] * weights).sum().backward()
    theirs = dict(hf.named_parameters())
    for name, p in fast.named_parameters():
        want = theirs[fastbert.families.to_hf_keys({name: p}, fast.config, "model").popitem()[0]].grad
        if want is None:  # the loss does not reach it (a bare model's pooler)
            assert p.grad is None, name
            continue
        assert (p.grad - want).abs().max() <= ATOL * max(1.0, want.abs().max().item()), name


def test_gradients_match_transformers() -> None:
    gradients_match(hf_modernbert())


def test_explain_says_why_the_layers_run_module_by_module() -> None:
    fast = fastbert.optimize(hf_modernbert())
    ids, mask = ragged([6, 3])
    for _ in range(2):  # the first forward binds, the second runs on the plan
        fast(ids, attention_mask=mask)
    assert "module by module, because its layers are pre-norm" in fastbert.explain()


HEADS = ["ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
         "ForMultipleChoice"]  # fmt: skip


def _head_inputs(suffix: str) -> tuple[dict, dict]:
    """(inputs, labels) for a head: a ragged batch (choices: [2, 3, S] with a padded choice), labels of each kind."""
    ids, mask = ragged([14, 9, 1, 12, 6, 14])
    g = torch.Generator().manual_seed(3)
    if suffix == "ForMultipleChoice":
        return {"input_ids": ids.view(2, 3, -1), "attention_mask": mask.view(2, 3, -1)}, {
            "labels": torch.tensor([2, 0])}  # fmt: skip
    inputs = {"input_ids": ids, "attention_mask": mask}
    if suffix == "ForMaskedLM":
        labels = ids.masked_fill((torch.rand(ids.shape, generator=g) > 0.3) | (mask == 0), -100)
        return inputs, {"labels": labels}
    if suffix == "ForSequenceClassification":
        return inputs, {"labels": torch.randint(0, 3, (6,), generator=g)}
    if suffix == "ForTokenClassification":
        return inputs, {"labels": torch.randint(0, 3, ids.shape, generator=g).masked_fill(mask == 0, -100)}
    # spans: the loss's softmax runs over every position, padded ones included (what pads hold differs), so unpadded
    inputs["attention_mask"] = torch.ones_like(mask)
    return inputs, {"start_positions": torch.tensor([1, 3, 0, 2, 5, 30]), "end_positions": torch.tensor([4] * 6)}


AUTO = {"ForMaskedLM": fastbert.AutoModelForMaskedLM, "ForSequenceClassification":
        fastbert.AutoModelForSequenceClassification, "ForTokenClassification": fastbert.AutoModelForTokenClassification,
        "ForQuestionAnswering": fastbert.AutoModelForQuestionAnswering,
        "ForMultipleChoice": fastbert.AutoModelForMultipleChoice}  # fmt: skip


def head_round_trip(hf: torch.nn.Module, family: str, suffix: str, tmp_path: Path) -> None:
    """Logits and loss of a transformers head within 1e-5 of fastbert's, loaded through AutoModelFor... from the
    directory transformers writes; fastbert's saved directory loads back into transformers with identical tensors."""
    hf.eval().save_pretrained(tmp_path / "hf")
    fast = AUTO[suffix].from_pretrained(tmp_path / "hf").eval()
    assert type(fast).__name__ == family + suffix
    inputs, labels = _head_inputs(suffix)
    with torch.no_grad():
        want, got = hf(**inputs, **labels), fast(**inputs, **labels)
    names = ("start_logits", "end_logits") if suffix == "ForQuestionAnswering" else ("logits",)
    valid = inputs["attention_mask"].bool() if suffix in ("ForMaskedLM", "ForTokenClassification") else None
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        if valid is not None:
            a, b = a[valid], b[valid]
        assert (a - b).abs().max() <= ATOL * max(1.0, b.abs().max().item()), name
    assert abs(got.loss.item() - want.loss.item()) <= ATOL * max(1.0, abs(want.loss.item()))
    fast.save_pretrained(tmp_path / "fast")
    again = getattr(transformers, family + suffix).from_pretrained(tmp_path / "fast").eval()
    mine = again.state_dict()
    assert set(mine) == set(hf.state_dict())
    assert all(torch.equal(t, mine[k]) for k, t in hf.state_dict().items())


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("suffix", HEADS)
def test_every_head_matches_transformers_and_round_trips(suffix: str, pooling: str, tmp_path: Path) -> None:
    """Every head (cls and mean pooling for the sentence heads)."""
    if pooling == "mean" and suffix not in ("ForSequenceClassification", "ForMultipleChoice"):
        pytest.skip("classifier_pooling is read by the sentence heads only")
    config = hf_modernbert().config
    config.num_labels, config.classifier_pooling = (2 if suffix == "ForQuestionAnswering" else 3), pooling
    torch.manual_seed(1)
    head_round_trip(getattr(transformers, "ModernBert" + suffix)(config), "ModernBert", suffix, tmp_path)


def low_precision_matches(hf: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> None:
    """fastbert in `dtype` against transformers, within DESIGN.md's rule: at most 2x transformers' own error in `dtype`
    plus one rounding (tests/kernel_checks.py), at valid positions of the last hidden state. The reference is
    transformers in fp32 (within ~1e-6 of exact, a thousandth of bf16's error): its ModernBERT gives NaN in fp64."""
    valid = mask.bool()
    with torch.no_grad():
        ref64 = hf(ids, attention_mask=mask).last_hidden_state[valid].double()
        theirs = copy.deepcopy(hf).to(dtype)(ids, attention_mask=mask).last_hidden_state[valid]
        ours = fastbert.optimize(hf, dtype=dtype)(ids, attention_mask=mask).last_hidden_state[valid]
    assert ours.dtype == dtype
    assert_close(f"{type(hf).__name__} {dtype}", ours, ref64, theirs)


def test_bf16_within_the_low_precision_rule() -> None:
    ids, mask = ragged(LENGTHS)
    low_precision_matches(hf_modernbert(), ids, mask, torch.bfloat16)


def test_torch_compile_matches_eager() -> None:
    """torch.compile (aot_eager): graph breaks at the unpad sync only, inference and a training step's gradient of a
    layer's fused QKV projection as eager."""
    hf = hf_modernbert()
    fast = AutoModel.from_config(BertConfig.from_dict(hf.config.to_dict()))
    fast.load_checkpoint_state(hf.state_dict())
    compile_matches_eager(fast.eval(), *ragged(LENGTHS), "encoder.layer.1.attn.Wqkv.weight")
