"""Gradient checkpointing (`gradient_checkpointing_enable`, as Trainer calls it): the same losses and gradients as
without, dropout included, on the fused loop and module by module (ModernBERT's pre-norm layers, DeBERTa's
disentangled attention), with far fewer activations kept; peft's reentrant set-up with frozen embeddings trains."""

from __future__ import annotations

import pytest
import torch

from fastbert import BertConfig
from fastbert.auto import CLASSES

TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=64, pad_token_id=0)  # fmt: skip
ATOL = 1e-5  # DESIGN: fp32


def model(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return CLASSES[model_type, "sequence"](BertConfig.from_dict(dict(model_type=model_type, **TINY))).train()


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (3, 12), generator=gen)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    return ids, mask, torch.tensor([0, 1, 1])


def steps(m: torch.nn.Module, count: int = 2) -> tuple[list[float], list[torch.Tensor], list[int]]:
    """`count` forward + backward passes (the first binds the plan, the next runs it) with seeded dropout: the losses,
    the summed gradients and the elements autograd kept in each forward."""
    ids, mask, labels = batch()
    losses, kept = [], []
    for step in range(count):
        torch.manual_seed(10 + step)
        kept.append(0)

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept[-1] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = m(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad for p in m.parameters() if p.requires_grad], kept


@pytest.mark.parametrize("model_type", ["bert", "modernbert", "deberta-v2"])
def test_checkpointed_training_gives_the_same_gradients_and_keeps_less(model_type: str) -> None:
    plain, checkpointed = model(model_type), model(model_type)
    checkpointed.gradient_checkpointing_enable()
    assert checkpointed.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    want, got = steps(plain), steps(checkpointed)
    assert got[0] == want[0]  # the same dropout masks in the recomputation
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert all(g < w / 2 for g, w in zip(got[2], want[2], strict=True)), (got[2], want[2])
    checkpointed.gradient_checkpointing_disable()
    checkpointed.zero_grad()
    assert steps(checkpointed)[2] == want[2]


@pytest.mark.parametrize("model_type", ["bert", "modernbert"])
def test_every_other_layer_and_the_encoders_own_flag(model_type: str) -> None:
    """every_n_layers=2 (Trainer's key) recomputes layers 0 and 2 of 3: it keeps more than all three, less than none;
    transformers 4's way, `model.bert.encoder.gradient_checkpointing = True`, recomputes every layer."""
    plain, every_other, flagged = model(model_type), model(model_type), model(model_type)
    every_other.activation_checkpointing_enable(every_n_layers=2)
    flagged.bert.encoder.gradient_checkpointing = True
    want, half, full = steps(plain), steps(every_other), steps(flagged)
    for got in (half, full):
        assert got[0] == want[0]
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert full[2][-1] < half[2][-1] < want[2][-1], (full[2], half[2], want[2])
    with pytest.raises(ValueError, match="every_n_layers must be a positive integer"):
        plain.activation_checkpointing_enable(every_n_layers=0)
    with pytest.raises(ValueError, match="offload=True"):
        plain.activation_checkpointing_enable(offload=True)


@pytest.mark.parametrize("peft", [False, True])
def test_reentrant_checkpointing_with_frozen_embeddings_trains_the_layers(peft: bool) -> None:
    """A reentrant checkpoint sees no graph where its input needs no grad: with frozen embeddings the layers would
    silently get none. Checkpointing makes the layers' input require grad, and so does peft's
    enable_input_require_grads, without sending the embeddings module by module."""
    plain, checkpointed = model("bert"), model("bert")
    for m in (plain, checkpointed):
        m.get_input_embeddings().requires_grad_(False)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if peft:
        checkpointed.enable_input_require_grads()
    want, got = steps(plain), steps(checkpointed)
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    notes = [plan.note for plan in checkpointed.bert.plans.plans.values()]
    assert notes and all(note.startswith("one loop over the layers") for note in notes), notes  # the fused loop
    with pytest.raises(TypeError, match="must be a dict"):
        checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs=True)


def test_inference_ignores_checkpointing() -> None:
    m = model("bert")
    ids, mask, _ = batch()
    with torch.no_grad():
        want = m.eval()(ids, attention_mask=mask).logits
        m.gradient_checkpointing_enable()
        torch.testing.assert_close(m(ids, attention_mask=mask).logits, want, atol=0, rtol=0)
