"""The pretraining step: MLM (decoder run on masked positions only) + NSP/SOP, and its held-out evaluation.

`BertForPreTraining.forward` scores every position against the vocabulary; only ~15% carry a label, so here the
decoder sees just those rows: same loss, a fraction of the head's FLOPs. The wrapped model is what gets saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastbert.heads import BertForPreTraining
from fastbert.masking import IGNORE_INDEX, MLMMasker
from fastbert.tokenization import WordPieceTokenizer


@dataclass
class StepOutput:
    loss: torch.Tensor
    mlm_logits: torch.Tensor  # [N, V] at the N masked positions
    mlm_labels: torch.Tensor  # [N]
    sentence_logits: torch.Tensor  # [B, 2]


class PretrainingObjective(nn.Module):
    """MLM cross-entropy over masked tokens + NSP/SOP cross-entropy; saves/loads as the inner BertForPreTraining,
    saved with its tokenizer (so every checkpoint, and the final model, carries the vocabulary it was trained on)."""

    def __init__(self, model: BertForPreTraining, tokenizer: WordPieceTokenizer | None = None) -> None:
        super().__init__()
        self.model, self.tokenizer = model, tokenizer

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S]
        attention_mask: torch.Tensor,  # [B, S]
        token_type_ids: torch.Tensor,  # [B, S]
        labels: torch.Tensor,  # [B, S] original ids at masked positions, -100 elsewhere
        next_sentence_label: torch.Tensor,  # [B]
    ) -> StepOutput:
        out = self.model.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        selected = labels != IGNORE_INDEX
        mlm_logits = self.model.cls.predictions(out.last_hidden_state[selected])
        mlm_labels = labels[selected]
        # sum / count rather than mean: a batch with nothing masked gives 0, not NaN
        mlm = F.cross_entropy(mlm_logits.float(), mlm_labels, reduction="sum") / max(1, mlm_labels.numel())
        sentence_logits = self.model.cls.seq_relationship(out.pooler_output)
        loss = mlm + F.cross_entropy(sentence_logits.float(), next_sentence_label)
        return StepOutput(loss, mlm_logits, mlm_labels, sentence_logits)

    def save_pretrained(self, directory: str) -> None:
        self.model.save_pretrained(directory)
        if self.tokenizer is not None:
            self.tokenizer.save(directory)

    def load_checkpoint_state(self, state, strict_heads: bool = False) -> None:
        self.model.load_checkpoint_state(state, strict_heads=strict_heads)


class PretrainCollator:
    """Pads pairs and masks them afresh on every call (dynamic masking: a new mask each epoch)."""

    def __init__(self, tokenizer: WordPieceTokenizer, masker: MLMMasker) -> None:
        self.tok, self.masker = tokenizer, masker

    def __call__(self, feats: list[dict], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        batch = self.tok.pad([f["input_ids"] for f in feats], [f["token_type_ids"] for f in feats])
        batch["input_ids"], batch["labels"] = self.masker(batch["input_ids"], batch["attention_mask"], generator)
        batch["next_sentence_label"] = torch.tensor([f["next_sentence_label"] for f in feats])
        return batch


def most_frequent_token(feats: list[dict], special_ids: frozenset[int]) -> int:
    """The commonest non-special token id of a corpus: the baseline predictor's constant guess."""
    counts: dict[int, int] = {}
    for f in feats:
        for t in f["input_ids"]:
            if t not in special_ids:
                counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.__getitem__)


class HeldOutEval:
    """MLM and NSP/SOP accuracy on a held-out set masked once with a fixed seed (every evaluation sees the same).

    `baseline_accuracy` is what always predicting the training corpus' most frequent token scores on it.
    """

    def __init__(
        self, feats: list[dict], collate: PretrainCollator, batch_size: int, frequent_id: int, seed: int = 1234
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        order = sorted(range(len(feats)), key=lambda i: len(feats[i]["input_ids"]))
        self.batches = [
            collate([feats[i] for i in order[b : b + batch_size]], gen) for b in range(0, len(order), batch_size)
        ]
        labels = torch.cat([b["labels"][b["labels"] != IGNORE_INDEX] for b in self.batches])
        self.baseline_accuracy = 100 * float((labels == frequent_id).float().mean())

    def __call__(self, model: nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        hits = total = s_hits = s_total = 0
        loss = 0.0
        for batch in self.batches:
            out = model(**{k: v.to(device) for k, v in batch.items()})
            hits += int((out.mlm_logits.argmax(-1) == out.mlm_labels).sum())
            total += out.mlm_labels.numel()
            loss += float(F.cross_entropy(out.mlm_logits.float(), out.mlm_labels, reduction="sum"))
            s_hits += int((out.sentence_logits.argmax(-1) == batch["next_sentence_label"].to(device)).sum())
            s_total += batch["next_sentence_label"].numel()
        return {
            "mlm_accuracy": 100 * hits / max(1, total),
            "mlm_loss": loss / max(1, total),
            "sentence_accuracy": 100 * s_hits / max(1, s_total),
            "baseline_accuracy": self.baseline_accuracy,
        }
