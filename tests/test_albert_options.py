"""ALBERT options: factorised embeddings (V*E + E*H) and cross-layer sharing (layer parameters / groups)."""

from __future__ import annotations

import pytest
import torch

import fastbert
from fastbert import BertConfig

V, E, H, I, L, P, T = 120, 16, 64, 128, 6, 512, 2  # noqa: E741


def _config(**kw) -> BertConfig:
    base = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=4, intermediate_size=I)
    return BertConfig(**{**base, **kw})


def _attention_params() -> int:
    return 4 * (H * H + H) + 2 * H  # Q, K, V, output dense + LayerNorm


def _ffn_params() -> int:
    return (H * I + I) + (I * H + H) + 2 * H


def _embedding_params(e: int) -> int:
    projection = e * H + H if e != H else 0
    return (V + P + T) * e + 2 * e + projection


@pytest.mark.parametrize(
    "sharing,groups,layers",
    [
        ("none", 1, L * (_attention_params() + _ffn_params())),
        ("all", 1, _attention_params() + _ffn_params()),
        ("all", 2, 2 * (_attention_params() + _ffn_params())),
        ("attention", 1, _attention_params() + L * _ffn_params()),
        ("ffn", 3, L * _attention_params() + 3 * _ffn_params()),
    ],
)
@pytest.mark.parametrize("embedding_size", [None, E])
def test_parameter_counts_follow_the_formulas(sharing: str, groups: int, layers: int, embedding_size) -> None:
    model = fastbert.BertModel(_config(layer_sharing=sharing, num_hidden_groups=groups, embedding_size=embedding_size))
    pooler = H * H + H
    assert model.num_parameters() == _embedding_params(embedding_size or H) + layers + pooler


def test_factorised_embedding_is_v_times_e_plus_e_times_h() -> None:
    full = fastbert.BertModel(_config()).embeddings
    small = fastbert.BertModel(_config(embedding_size=E)).embeddings
    assert small.word_embeddings.weight.numel() + small.projection.weight.numel() == V * E + E * H
    assert full.word_embeddings.weight.numel() == V * H


def test_groups_assign_layers_like_albert() -> None:
    model = fastbert.BertModel(_config(layer_sharing="all", num_hidden_groups=2))
    layers = model.encoder.layer
    assert layers[0] is layers[1] is layers[2] and layers[3] is layers[4] is layers[5]
    assert layers[0] is not layers[3]
    attn = fastbert.BertModel(_config(layer_sharing="attention", num_hidden_groups=1)).encoder.layer
    assert attn[0].attention is attn[5].attention and attn[0].intermediate is not attn[5].intermediate


def test_shared_factorised_model_trains_and_round_trips(tmp_path) -> None:
    config = _config(layer_sharing="all", num_hidden_groups=1, embedding_size=E, hidden_dropout_prob=0.0)
    model = fastbert.BertForMaskedLM(config)
    assert model.cls.predictions.decoder.weight.shape == (V, E)
    corpus = torch.randint(5, 40, (8, 12))  # a tiny corpus the model can memorise
    labels = corpus.clone()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    model.train()
    for _ in range(40):
        loss = model(corpus, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
    model.eval()
    model.save_pretrained(tmp_path)
    again = fastbert.BertForMaskedLM.from_pretrained(tmp_path)
    assert again.config.layer_sharing == "all" and again.config.embedding_dim == E
    assert again.num_parameters() == model.num_parameters()
    with torch.no_grad():
        assert torch.equal(again(corpus).logits, model(corpus).logits)


def test_sharing_config_errors() -> None:
    with pytest.raises(ValueError, match="layer_sharing must be one of"):
        _config(layer_sharing="some")
    with pytest.raises(ValueError, match="num_hidden_groups"):
        _config(layer_sharing="all", num_hidden_groups=L + 1)
