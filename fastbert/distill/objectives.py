"""Which distillation losses to combine, with what weights, and how to compute the weighted total for a batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from fastbert.distill import losses

WEIGHTS = ("kl", "mlm", "cosine", "hidden_mse", "logits_mse", "embedding", "similarity", "anchor", "attention")


@dataclass
class Objectives:
    """Loss weights (0 = off) and their settings.

    kl: soft-target KL on MLM logits at `temperature` (x T^2); mlm: hard MLM cross-entropy on 80/10/10-masked
    inputs; cosine: 1 - cos between last hidden states (DistilBERT); hidden_mse: MSE between mapped hidden states,
    student projected to the teacher's width (TinyBERT); logits_mse: MSE between logits; embedding: mean-pooled
    sentence embedding vs the teacher's (`embedding_metric` cosine or mse); similarity: MSE between in-batch cosine
    similarity matrices of those embeddings (any student width or vocabulary, no projection); anchor: 1 - cos between
    the student's pooled embedding and that of the whole model it started from (`student_init`), which keeps that
    model's space while the other objectives pull toward the teacher; attention: KL between
    mapped layers' attention probabilities (MiniLM/TinyBERT; runs the slower attention path that materialises them).
    `layer_map` maps student hidden_states indices (0 = embeddings, k = output of layer k) to the teacher's for
    hidden_mse and attention; default: TinyBERT's block ends (`student.block_end_map`).
    """

    kl: float = 0.0
    mlm: float = 0.0
    cosine: float = 0.0
    hidden_mse: float = 0.0
    logits_mse: float = 0.0
    embedding: float = 0.0
    similarity: float = 0.0
    anchor: float = 0.0
    attention: float = 0.0
    temperature: float = 2.0
    embedding_metric: str = "cosine"
    layer_map: dict[int, int] | None = field(default=None)

    @classmethod
    def distilbert(cls) -> Objectives:
        """DistilBERT's loss: 5 * KL(T=2) + 2 * MLM + 1 * cosine(last hidden)."""
        return cls(kl=5.0, mlm=2.0, cosine=1.0)

    @classmethod
    def sentence_embedding(cls, metric: str = "cosine") -> Objectives:
        """For sentence encoders: match the teacher's mean-pooled embedding."""
        return cls(embedding=1.0, embedding_metric=metric)

    @classmethod
    def sentence_similarity(cls, weight: float = 10.0, anchor: float = 0.0) -> Objectives:
        """For sentence encoders of another width or vocabulary: match the teacher's cosine similarities between the
        sentences of each batch (the weight brings the squared cosine errors to the scale of a unit loss), optionally
        anchored to the space of the model the student starts from."""
        return cls(similarity=weight, anchor=anchor)

    @property
    def pooled_only(self) -> bool:
        """Every active objective compares pooled sentence embeddings: no token of the two inputs is aligned."""
        return set(self.weights()) <= {"embedding", "similarity", "anchor"}

    def weights(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in WEIGHTS if getattr(self, name)}

    def validate(self) -> None:
        if any(getattr(self, name) < 0 for name in WEIGHTS):
            raise ValueError(f"objective weights must be >= 0: {asdict(self)}")
        if not self.weights():
            raise ValueError(f"no distillation objective is switched on (set a weight > 0 among {WEIGHTS})")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.embedding_metric not in ("cosine", "mse"):
            raise ValueError(f"embedding_metric must be 'cosine' or 'mse', got {self.embedding_metric!r}")

    @property
    def uses_logits(self) -> bool:
        return bool(self.kl or self.mlm or self.logits_mse)

    @property
    def masks_inputs(self) -> bool:
        """MLM-style objectives see 80/10/10-masked inputs (teacher and student alike, as in DistilBERT)."""
        return bool(self.kl or self.mlm)

    @property
    def uses_embedding(self) -> bool:
        """The teacher's mean-pooled sentence embedding is a target."""
        return bool(self.embedding or self.similarity)

    @property
    def uses_hidden(self) -> bool:
        return bool(self.cosine or self.hidden_mse or self.embedding)


def weighted_losses(
    obj: Objectives,
    student: dict,  # from DistillStudent.student_outputs
    teacher: dict,  # from teacher_targets
    batch: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Each active objective's loss and their weighted sum under "total"."""
    mask = batch["attention_mask"]
    out: dict[str, torch.Tensor] = {}
    if obj.kl:
        out["kl"] = losses.soft_target_kl(student["logits"], teacher["logits"], mask, obj.temperature)
    if obj.mlm:
        out["mlm"] = losses.mlm_cross_entropy(student["logits"], batch["labels"])
    if obj.logits_mse:
        out["logits_mse"] = losses.logits_mse(student["logits"], teacher["logits"], mask)
    if obj.cosine:
        out["cosine"] = losses.hidden_cosine(student["last"], teacher["last"], mask)
    if obj.embedding:
        pooled = losses.mean_pool(student["last"].float(), mask)
        out["embedding"] = losses.embedding_loss(pooled, teacher["embedding"], obj.embedding_metric)
    if obj.similarity:
        out["similarity"] = losses.similarity_mse(student["sentence"], teacher["embedding"])
    if obj.anchor:
        out["anchor"] = losses.embedding_loss(student["sentence"], teacher["anchor"], "cosine")
    if obj.hidden_mse:
        terms = [losses.hidden_mse(student["hidden"][k], teacher["hidden"][k], mask) for k in student["hidden"]]
        out["hidden_mse"] = torch.stack(terms).mean()
    if obj.attention:
        terms = [losses.attention_kl(s, teacher["attentions"][k], mask) for k, s in student["attentions"].items()]
        out["attention"] = torch.stack(terms).mean()
    out["total"] = sum(getattr(obj, name) * value for name, value in out.items())
    return out
