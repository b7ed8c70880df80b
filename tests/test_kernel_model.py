"""BertModel end to end on the Triton kernels (interpreter on CPU): matches transformers in fp32, and its
gradients match the torch backend's."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, requires_triton

import fastbert

pytestmark = requires_triton
transformers = pytest.importorskip("transformers")

ATOL = 1e-5
# head dim 52 / 2 = 26 (TinyBERT-like, not a power of two); intermediate 100 (not a power of two)
TINY = dict(vocab_size=99, hidden_size=52, num_hidden_layers=2, num_attention_heads=2, intermediate_size=100)
BERT_KERNEL_OPS = set(fastbert.ops.KERNEL_OPS) - {"gated_act"}  # the kernels a BERT runs: it has no gated feed-forward


def _batch(vocab: int, batch: int = 3, seqlen: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ragged batch: one full row, one shorter, one fully padded."""
    lengths = torch.tensor([seqlen, 6, 0])[:batch]
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, vocab, (batch, seqlen)) * mask
    types = (torch.arange(seqlen)[None, :] >= lengths[:, None] // 2).long() * mask
    return ids.to(DEVICE), mask.to(DEVICE), types.to(DEVICE)


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_bert_model_on_triton_matches_transformers(act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "torch")  # on CPU, oneDNN would fuse GELU and bias_act would not run
    hf = transformers.BertModel(transformers.BertConfig(**TINY, hidden_act=act)).to(DEVICE).eval()
    fb = fastbert.BertModel.from_hf(hf).eval()
    ids, mask, types = _batch(TINY["vocab_size"])
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, token_type_ids=types)
        with fastbert.use_backend("triton"):
            ours = fb(ids, attention_mask=mask, token_type_ids=types)
    decisions = fastbert.ops.decisions()
    assert all(decisions[op].startswith("triton") for op in BERT_KERNEL_OPS)  # `linear` stays automatic
    valid = mask.bool()
    err = (ours.last_hidden_state[valid] - theirs.last_hidden_state[valid]).abs().max().item()
    assert err <= ATOL, f"max error at valid positions {err:.3g} > {ATOL}"
    assert (ours.last_hidden_state[~valid] == 0).all()
    pooled_err = (ours.pooler_output[:2] - theirs.pooler_output[:2]).abs().max().item()
    assert pooled_err <= ATOL, f"pooler error {pooled_err:.3g}"


def test_bert_model_backward_on_triton_matches_torch_backend() -> None:
    config = fastbert.BertConfig(**TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = fastbert.BertModel(config).to(DEVICE).train()
    ids, mask, types = _batch(TINY["vocab_size"])
    weights = torch.randn(*ids.shape, TINY["hidden_size"], device=DEVICE)
    results = {}
    for backend in ("torch", "triton"):
        model.zero_grad()
        with fastbert.use_backend(backend):
            out = model(ids, attention_mask=mask, token_type_ids=types)
        loss = (out.last_hidden_state * weights).sum() + out.pooler_output[:2].sum()
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-5, atol=1e-5)
    for name, ref in results["torch"][1].items():
        got = results["triton"][1][name]
        err = (got - ref).abs().max().item()
        assert err <= 1e-5 * max(1.0, ref.abs().max().item()), f"{name}: grad error {err:.3g}"


def test_bert_model_trains_with_dropout_on_triton() -> None:
    """Dropout in every fused op: finite loss and grads, and a fixed seed reproduces the step exactly."""
    model = fastbert.BertModel(fastbert.BertConfig(**TINY)).to(DEVICE).train()
    ids, mask, types = _batch(TINY["vocab_size"])
    losses = []
    for _ in range(2):
        torch.manual_seed(3)
        model.zero_grad()
        with fastbert.use_backend("triton"):
            loss = model(ids, attention_mask=mask, token_type_ids=types).last_hidden_state.square().mean()
        loss.backward()
        losses.append((loss.item(), model.embeddings.word_embeddings.weight.grad.clone()))
    assert losses[0][0] == losses[1][0] and torch.equal(losses[0][1], losses[1][1])
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.gpu
def test_bert_model_on_cuda_dispatches_to_triton_and_matches_transformers() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    config = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=2, num_attention_heads=12,
                  intermediate_size=3072)
    hf = transformers.BertModel(transformers.BertConfig(**config)).cuda().eval()
    fb = fastbert.BertModel.from_hf(hf).eval()
    lengths = torch.randint(32, 129, (8,))
    mask = (torch.arange(128)[None, :] < lengths[:, None]).long().cuda()
    ids = torch.randint(1, 30522, (8, 128), device="cuda") * mask
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask).last_hidden_state
        ours = fb(ids, attention_mask=mask).last_hidden_state
    decisions = fastbert.ops.decisions()
    assert all(decisions[op].startswith("triton") for op in BERT_KERNEL_OPS)  # `linear` stays automatic
    err = (ours - theirs)[mask.bool()].abs().max().item()
    assert err <= ATOL, f"max error at valid positions {err:.3g} > {ATOL}"
