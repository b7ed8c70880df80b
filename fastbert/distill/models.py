"""Teacher loading (fastbert/transformers directory or live model), the trainable student module (student plus the
learned projections to the teacher's width, computing the distillation loss), and the teacher's targets for a batch."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fastbert.auto import BY_NAME, model_class
from fastbert.checkpoint import PreTrainedModel
from fastbert.config import BertConfig
from fastbert.distill.losses import mean_pool
from fastbert.distill.objectives import Objectives, weighted_losses

# checkpoints whose MLM head the teacher keeps (loaded as the family's ForMaskedLM)
MLM_ARCHITECTURES = ("BertForPreTraining", "AlbertForPreTraining", *(n for n in BY_NAME if n.endswith("ForMaskedLM")))


def load_teacher(teacher: str | os.PathLike | nn.Module) -> PreTrainedModel:
    """A checkpoint directory (MLM head kept when it has one), a fastbert model, or a live transformers model of a
    supported family."""
    if isinstance(teacher, PreTrainedModel):
        return teacher
    if isinstance(teacher, nn.Module):
        name = type(teacher).__name__
        if name not in BY_NAME or not hasattr(teacher, "config"):
            raise TypeError(f"cannot use a {name} as teacher: expected a fastbert or transformers encoder model")
        return BY_NAME[name].from_hf(teacher)
    path = os.fspath(teacher)
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"teacher {path} is not a checkpoint directory (no config.json)")
    with open(config, encoding="utf-8") as f:
        architectures = json.load(f).get("architectures") or []
    kind = "mlm" if any(a in MLM_ARCHITECTURES for a in architectures) else "model"
    return model_class(BertConfig.from_pretrained(path).model_type, kind).from_pretrained(path)


def encoder_inputs(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's ids and mask, and its token types where the model's family has them (not MPNet, DistilBERT)."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if model.config.family.token_types:
        inputs["token_type_ids"] = batch["token_type_ids"]
    return inputs


def has_mlm_head(model: nn.Module) -> bool:
    return hasattr(model, "cls") and hasattr(model.cls, "predictions")


@dataclass
class DistillOutput:
    """What the shared training loop reads: the weighted total and each objective's loss."""

    loss: torch.Tensor
    losses: dict[str, torch.Tensor]


Targets = Callable[[dict[str, torch.Tensor]], dict]


class DistillStudent(nn.Module):
    """The student, its projections (student width -> teacher width, one per projected hidden state) and the loss.

    This is what the training loop runs and DDP wraps: `forward(**batch)` gets the teacher's targets from `targets`
    (a frozen teacher, never a submodule: it stays out of DDP, the optimizer and train mode) and returns the weighted
    objectives. It saves and loads as the bare student; the projections live in training checkpoints only.
    """

    def __init__(
        self,
        student: PreTrainedModel,
        projections: dict[int, nn.Linear],
        obj: Objectives,
        layer_map: dict[int, int],
        targets: Targets,
    ) -> None:
        super().__init__()
        self.student, self.obj, self.layer_map, self.targets = student, obj, layer_map, targets
        self.projections = nn.ModuleDict({str(k): p for k, p in projections.items()})

    def project(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        proj = self.projections[str(index)] if str(index) in self.projections else None
        return proj(hidden) if proj is not None else hidden

    def forward(self, **batch: torch.Tensor) -> DistillOutput:
        """Batch: input_ids, attention_mask, token_type_ids [B, S], optional labels [B, S] and corpus index [B]."""
        student = self.student_outputs(batch)
        with torch.autocast(batch["input_ids"].device.type, enabled=False):  # teacher and losses at their own precision
            parts = weighted_losses(self.obj, student, self.targets(batch), batch)
        return DistillOutput(parts.pop("total"), parts)

    def student_outputs(self, batch: dict[str, torch.Tensor]) -> dict:
        """What the active objectives need from the student, projected to the teacher's width."""
        obj = self.obj
        want_hidden = bool(obj.hidden_mse) or has_mlm_head(self.student) and bool(obj.cosine or obj.uses_embedding)
        out = self.student(
            **encoder_inputs(self.student, batch),
            output_hidden_states=want_hidden,
            output_attentions=bool(obj.attention),
        )
        layers = self.student.config.num_hidden_layers
        result: dict = {"logits": out.logits if has_mlm_head(self.student) else None}
        last = out.hidden_states[-1] if want_hidden else out.last_hidden_state
        if obj.cosine or obj.embedding:
            result["last"] = self.project(layers, last)
        if obj.similarity or obj.anchor:  # in the student's own space: no projection
            result["sentence"] = mean_pool(last.float(), batch["attention_mask"])
        if obj.hidden_mse:
            result["hidden"] = {k: self.project(k, out.hidden_states[k]) for k in self.layer_map}
        if obj.attention:
            result["attentions"] = {k: out.attentions[k - 1] for k in self.layer_map if k > 0}
        return result

    def save_pretrained(self, directory: str) -> None:
        self.student.save_pretrained(directory)

    def load_checkpoint_state(self, state: dict[str, torch.Tensor], strict_heads: bool = False) -> None:
        self.student.load_checkpoint_state(state, strict_heads=strict_heads)


@torch.no_grad()
def teacher_targets(
    teacher: PreTrainedModel, batch: dict[str, torch.Tensor], obj: Objectives, layer_map: dict[int, int]
) -> dict:
    """What the active objectives need from the teacher, in fp32; hidden/attention keyed by the student's index."""
    want_hidden = bool(obj.hidden_mse) or has_mlm_head(teacher) and bool(obj.cosine or obj.uses_embedding)
    out = teacher(
        **encoder_inputs(teacher, batch),
        output_hidden_states=want_hidden,
        output_attentions=bool(obj.attention),
    )
    result: dict = {}
    if obj.uses_logits:
        logits = out.get("logits", out.get("prediction_logits"))
        result["logits"] = logits.float()
    if obj.cosine or obj.uses_embedding:
        last = (out.hidden_states[-1] if want_hidden else out.last_hidden_state).float()
        if obj.cosine:
            result["last"] = last
        if obj.uses_embedding:
            result["embedding"] = mean_pool(last, batch["attention_mask"])
    if obj.hidden_mse:
        result["hidden"] = {k: out.hidden_states[j].float() for k, j in layer_map.items()}
    if obj.attention:
        result["attentions"] = {k: out.attentions[j - 1].float() for k, j in layer_map.items() if k > 0}
    return result
