"""Each distillation loss against a value computed by hand; masked-out positions must not count."""

import math

import pytest
import torch

from fastbert.distill import losses

NAN = float("nan")


def test_soft_target_kl_matches_hand_value():
    # position 0: teacher uniform, student softmax([2 ln 3, 0] / T=2) = [3/4, 1/4]; position 1 is masked out
    student = torch.tensor([[[2 * math.log(3.0), 0.0], [NAN, NAN]]])
    teacher = torch.tensor([[[0.0, 0.0], [NAN, NAN]]])
    mask = torch.tensor([[1, 0]])
    expected = 4 * (0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25))  # T^2 * KL
    got = losses.soft_target_kl(student, teacher, mask, temperature=2.0)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    assert losses.soft_target_kl(teacher[:, :1], teacher[:, :1], mask[:, :1]).item() == pytest.approx(0.0, abs=1e-7)


def test_mlm_cross_entropy_matches_hand_value():
    logits = torch.tensor([[[math.log(3.0), 0.0, 0.0], [5.0, -1.0, 2.0]]])
    labels = torch.tensor([[0, -100]])
    assert losses.mlm_cross_entropy(logits, labels).item() == pytest.approx(math.log(5 / 3), rel=1e-6)
    assert losses.mlm_cross_entropy(logits, torch.full_like(labels, -100)).item() == 0.0


def test_hidden_cosine_matches_hand_value():
    student = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [NAN, NAN]]])
    teacher = torch.tensor([[[1.0, 1.0], [0.0, 5.0], [NAN, NAN]]])
    mask = torch.tensor([[1, 1, 0]])
    expected = ((1 - 1 / math.sqrt(2)) + 0.0) / 2
    assert losses.hidden_cosine(student, teacher, mask).item() == pytest.approx(expected, rel=1e-6)


def test_hidden_and_logits_mse_match_hand_value():
    student = torch.tensor([[[1.0, 2.0], [NAN, 0.0]]])
    teacher = torch.tensor([[[3.0, 2.0], [0.0, NAN]]])
    mask = torch.tensor([[1, 0]])
    assert losses.hidden_mse(student, teacher, mask).item() == pytest.approx(2.0)  # (2^2 + 0^2) / 2
    assert losses.logits_mse(student, teacher, mask).item() == pytest.approx(2.0)


def test_mean_pool_and_embedding_loss_match_hand_value():
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [100.0, 100.0]]])
    pooled = losses.mean_pool(hidden, torch.tensor([[1, 1, 0]]))
    assert pooled.tolist() == [[2.0, 0.0]]
    teacher = torch.tensor([[1.0, 1.0]])
    assert losses.embedding_loss(pooled, teacher, "cosine").item() == pytest.approx(1 - 1 / math.sqrt(2), rel=1e-6)
    assert losses.embedding_loss(pooled, teacher, "mse").item() == pytest.approx(1.0)  # ((2-1)^2 + (0-1)^2) / 2
    with pytest.raises(ValueError, match="metric"):
        losses.embedding_loss(pooled, teacher, "l1")


def test_attention_kl_matches_hand_value():
    # one head, three positions, the third padded: rows 0 and 1 count, row 2 does not
    teacher = torch.tensor([[[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.3, 0.3, 0.0]]]])
    student = torch.tensor([[[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]]])
    mask = torch.tensor([[1, 1, 0]])
    assert losses.attention_kl(student, teacher, mask).item() == pytest.approx(math.log(2) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="same number of heads"):
        losses.attention_kl(student, teacher.expand(1, 2, 3, 3), mask)


def test_similarity_mse_compares_cosines_between_distinct_sentences_only():
    teacher = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # pair cosines 1, 0, 0
    student = torch.tensor([[2.0, 0.0], [0.0, 3.0], [0.0, 1.0]])  # pair cosines 0, 0, 1; the diagonal never counts
    assert losses.similarity_mse(student, teacher).item() == pytest.approx(2 / 3)  # (1 + 0 + 1) / 3, each pair twice
    assert losses.similarity_mse(teacher[:, :2] * 5, teacher).item() == pytest.approx(0.0, abs=1e-7)  # scale-free


def test_similarity_mse_is_blind_to_a_rotation_of_the_student_space():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 4, generator=g), torch.randn(6, 8, generator=g)
    rotation, _ = torch.linalg.qr(torch.randn(4, 4, generator=g))
    base = losses.similarity_mse(student, teacher)
    assert base.item() > 0.05
    torch.testing.assert_close(losses.similarity_mse(student @ rotation, teacher), base)
    assert losses.similarity_mse(student[:1], teacher[:1]).item() == 0.0  # one sentence: no pair
