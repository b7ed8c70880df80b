"""Distillation losses. Each takes student and teacher tensors of the same layout and a `[B, S]` (or packed `[T]`)
mask of the positions that count, and returns a scalar averaged over those positions. Computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert.masking import IGNORE_INDEX


def _select(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, S, ...] (or [T, ...]) -> [N, ...] rows where mask is set, in fp32."""
    x = x.float()
    if mask is None:
        return x.reshape(-1, *x.shape[-1:]) if x.dim() > 1 else x
    return x[mask.bool()]


def soft_target_kl(
    student_logits: torch.Tensor,  # [B, S, V]
    teacher_logits: torch.Tensor,  # [B, S, V]
    mask: torch.Tensor | None = None,  # [B, S]
    temperature: float = 2.0,
) -> torch.Tensor:
    """Hinton's soft-target loss: T^2 * KL(softmax(t/T) || softmax(s/T)), mean over masked positions.

    The T^2 factor keeps gradient magnitudes comparable across temperatures.
    """
    s, t = _select(student_logits, mask), _select(teacher_logits, mask)
    if s.shape[0] == 0:
        return student_logits.sum() * 0.0
    log_p_s = F.log_softmax(s / temperature, dim=-1)
    log_p_t = F.log_softmax(t / temperature, dim=-1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)
    return kl.mean() * temperature**2


def mlm_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # [B, S, V], [B, S]
    """Hard-label MLM loss over positions whose label is not -100 (0 when a batch has none)."""
    valid = labels != IGNORE_INDEX
    if not bool(valid.any()):
        return logits.sum() * 0.0
    return F.cross_entropy(logits[valid].float(), labels[valid])


def hidden_cosine(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """DistilBERT's alignment: mean over positions of 1 - cos(student, teacher) ([B, S, H] each)."""
    s, t = _select(student, mask), _select(teacher, mask)
    if s.shape[0] == 0:
        return student.sum() * 0.0
    return (1.0 - F.cosine_similarity(s, t, dim=-1)).mean()


def hidden_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """TinyBERT's alignment: mean squared error over positions and features ([B, S, H] each, student projected)."""
    s, t = _select(student, mask), _select(teacher, mask)
    if s.shape[0] == 0:
        return student.sum() * 0.0
    return F.mse_loss(s, t)


def logits_mse(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None):
    """MSE between raw logits (no temperature), mean over masked positions and the vocabulary."""
    return hidden_mse(student_logits, teacher_logits, mask)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:  # [B, S, H], [B, S] -> [B, H]
    """Sentence-transformers' mean pooling: the average of the real tokens' vectors."""
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


def embedding_loss(student: torch.Tensor, teacher: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """Sentence-encoder objective on pooled embeddings [B, H]: 1 - cos (default) or MSE."""
    s, t = student.float(), teacher.float()
    if metric == "cosine":
        return (1.0 - F.cosine_similarity(s, t, dim=-1)).mean()
    if metric == "mse":
        return F.mse_loss(s, t)
    raise ValueError(f"embedding metric must be 'cosine' or 'mse', got {metric!r}")


def similarity_mse(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:  # [B, Hs], [B, Ht]
    """Relational sentence distillation: MSE between the student's and the teacher's in-batch cosine-similarity
    matrices, over the B * (B - 1) pairs of distinct sentences. Widths may differ and any rotation of the student's
    space scores the same: only what cosine similarity sees of the teacher is asked for."""
    b = student.shape[0]
    if b < 2:
        return student.sum() * 0.0
    s, t = F.normalize(student.float(), dim=-1), F.normalize(teacher.float(), dim=-1)
    off = ~torch.eye(b, dtype=torch.bool, device=s.device)
    return F.mse_loss((s @ s.T)[off], (t @ t.T)[off])


def attention_kl(
    student_probs: torch.Tensor,  # [B, nH, S, S] attention probabilities
    teacher_probs: torch.Tensor,  # [B, nH, S, S]
    attention_mask: torch.Tensor,  # [B, S]
) -> torch.Tensor:
    """MiniLM's attention transfer: KL(teacher row || student row), mean over heads and real query rows."""
    if student_probs.shape != teacher_probs.shape:
        raise ValueError(
            f"attention maps differ in shape: student {tuple(student_probs.shape)} vs teacher "
            f"{tuple(teacher_probs.shape)} (attention distillation needs the same number of heads)"
        )
    rows = attention_mask.bool()[:, None, :].expand(-1, student_probs.shape[1], -1)  # [B, nH, S] real queries
    s, t = student_probs[rows].float(), teacher_probs[rows].float()  # [N, S]
    if s.shape[0] == 0:
        return student_probs.sum() * 0.0
    eps = 1e-12
    return (t * ((t + eps).log() - (s + eps).log())).sum(-1).mean()
