"""The four fine-tuning tasks: what to read, how to turn it into model inputs, which head, how to score it.

Each task yields features as dicts of id lists (`input_ids`, `token_type_ids`) plus its label fields; `collate`
pads a list of them into tensors, and `evaluate` runs the model over a held-out set and returns the task's metrics.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from fastbert.finetune import data, metrics, qa
from fastbert.heads import BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification
from fastbert.tokenization import WordPieceTokenizer

Feature = dict[str, Any]


def predict(
    model: nn.Module, feats: list[Feature], collate, batch_size: int, device: torch.device
) -> list[dict[str, np.ndarray]]:
    """Model outputs per feature (in the given order), computed in length-sorted batches; labels are not passed."""
    order = sorted(range(len(feats)), key=lambda i: len(feats[i]["input_ids"]))
    out: list[dict[str, np.ndarray]] = [{} for _ in feats]
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        batch = collate([feats[i] for i in idx])
        inputs = {k: batch[k].to(device) for k in ("input_ids", "token_type_ids", "attention_mask") if k in batch}
        result = model(**inputs)
        for name in ("logits", "start_logits", "end_logits"):
            if name in result:
                values = result[name].float().cpu().numpy()
                for row, i in enumerate(idx):
                    out[i][name] = values[row]
    return out


class SequenceTask:
    """Single texts or pairs from a CSV/TSV: classification (cross-entropy) or regression (MSE, num_labels 1)."""

    model_class = BertForSequenceClassification

    def __init__(
        self,
        tokenizer: WordPieceTokenizer,
        text_columns: list[str],
        label_column: str,
        regression: bool = False,
        labels: list[str] | None = None,
        header: bool = True,
        max_length: int = 128,
    ) -> None:
        self.tok, self.text_columns, self.label_column = tokenizer, text_columns, label_column
        self.regression, self.labels, self.header, self.max_length = regression, labels, header, max_length
        self.mean, self.std = 0.0, 1.0  # regression targets are fed as (y - mean) / std

    def read(self, path: str, train: bool = False) -> list[data.TextExample]:
        examples = data.read_table(path, self.text_columns, self.label_column, self.header, regression=self.regression)
        if self.regression and train:  # targets are standardised for training: unit scale whatever the units
            values = np.array([e.label for e in examples], dtype=np.float64)
            self.mean, self.std = float(values.mean()), float(values.std()) or 1.0
        if not self.regression:
            if train and self.labels is None:
                self.labels = data.label_set(examples, None, path)
            data.label_set(examples, self.labels, path)
        return examples

    def config_updates(self) -> dict[str, Any]:
        if self.regression:
            return {
                "num_labels": 1,
                "problem_type": "regression",
                "id2label": {0: "LABEL_0"},
                "label2id": {"LABEL_0": 0},
            }
        return {
            "num_labels": len(self.labels),
            "problem_type": "single_label_classification",
            "id2label": dict(enumerate(self.labels)),
            "label2id": {name: i for i, name in enumerate(self.labels)},
        }

    def features(self, examples: list[data.TextExample]) -> list[Feature]:
        pairs = [e.pair for e in examples] if examples and examples[0].pair is not None else None
        encodings = self.tok.encode([e.text for e in examples], pairs, self.max_length)
        index = {name: i for i, name in enumerate(self.labels or [])}
        labels = [(e.label - self.mean) / self.std if self.regression else index[e.label] for e in examples]
        return [
            {"input_ids": enc.ids, "token_type_ids": enc.type_ids, "label": label}
            for enc, label in zip(encodings, labels, strict=True)
        ]

    def finish(self, model: nn.Module) -> None:
        """Fold the target standardisation into the regression head so the saved model predicts in data units."""
        if self.regression:
            with torch.no_grad():
                model.output_layer().weight.mul_(self.std)
                model.output_layer().bias.mul_(self.std).add_(self.mean)

    def collate(self, feats: list[Feature]) -> dict[str, torch.Tensor]:
        batch = self.tok.pad([f["input_ids"] for f in feats], [f["token_type_ids"] for f in feats])
        dtype = torch.float32 if self.regression else torch.long
        batch["labels"] = torch.tensor([f["label"] for f in feats], dtype=dtype)
        return batch

    def evaluate(self, model: nn.Module, examples: list, feats: list[Feature], batch_size: int) -> dict[str, float]:
        device = next(model.parameters()).device
        logits = np.stack([o["logits"] for o in predict(model, feats, self.collate, batch_size, device)])
        gold = np.array([f["label"] for f in feats])
        if self.regression:
            return metrics.pearson_spearman(logits[:, 0], gold)
        return metrics.accuracy_f1(logits.argmax(-1), gold, len(self.labels))


class TokenTask:
    """CoNLL tagging: the first word piece of each word carries its BIO tag, the others are ignored (-100)."""

    model_class = BertForTokenClassification

    def __init__(self, tokenizer: WordPieceTokenizer, labels: list[str] | None = None, max_length: int = 128) -> None:
        self.tok, self.labels, self.max_length = tokenizer, labels, max_length

    def read(self, path: str, train: bool = False) -> list[data.TaggedSentence]:
        sentences = data.read_conll(path)
        if train and self.labels is None:
            self.labels = data.label_set(sentences, None, path)
        data.label_set(sentences, self.labels, path)
        return sentences

    def config_updates(self) -> dict[str, Any]:
        return {
            "num_labels": len(self.labels),
            "id2label": dict(enumerate(self.labels)),
            "label2id": {name: i for i, name in enumerate(self.labels)},
        }

    def features(self, sentences: list[data.TaggedSentence]) -> list[Feature]:
        encodings = self.tok.encode([s.words for s in sentences], max_length=self.max_length, is_pretokenized=True)
        index = {name: i for i, name in enumerate(self.labels)}
        feats = []
        for enc, sentence in zip(encodings, sentences, strict=True):
            labels, previous = [], None
            for word in enc.word_ids:
                first = word is not None and word != previous
                labels.append(index[sentence.tags[word]] if first else -100)
                previous = word
            feats.append({"input_ids": enc.ids, "token_type_ids": enc.type_ids, "labels": labels})
        return feats

    def collate(self, feats: list[Feature]) -> dict[str, torch.Tensor]:
        batch = self.tok.pad([f["input_ids"] for f in feats], [f["token_type_ids"] for f in feats])
        labels = torch.full_like(batch["input_ids"], -100)
        for i, f in enumerate(feats):
            labels[i, : len(f["labels"])] = torch.tensor(f["labels"])
        batch["labels"] = labels
        return batch

    def evaluate(self, model: nn.Module, sentences: list, feats: list[Feature], batch_size: int) -> dict[str, float]:
        """Entity F1 over whole sentences: words cut off by truncation count as predicted 'O'."""
        device = next(model.parameters()).device
        outputs = predict(model, feats, self.collate, batch_size, device)
        predicted = []
        for out, f, sentence in zip(outputs, feats, sentences, strict=True):
            first = [i for i, label in enumerate(f["labels"]) if label != -100]
            tags = [self.labels[int(out["logits"][i].argmax())] for i in first]
            predicted.append(tags + ["O"] * (len(sentence.tags) - len(tags)))
        return metrics.entity_f1(predicted, [s.tags for s in sentences])


class QATask:
    """SQuAD-style extractive QA with sliding windows over long contexts; scored by exact match and F1."""

    model_class = BertForQuestionAnswering

    def __init__(self, tokenizer: WordPieceTokenizer, max_length: int = 384, stride: int = 128) -> None:
        self.tok, self.max_length, self.stride = tokenizer, max_length, stride
        self._windows: dict[int, list[qa.QAWindow]] = {}

    def read(self, path: str, train: bool = False) -> list[data.QAExample]:
        return data.read_squad(path)

    def config_updates(self) -> dict[str, Any]:
        return {"num_labels": 2}

    def features(self, examples: list[data.QAExample]) -> list[Feature]:
        windows = qa.make_windows(self.tok, examples, self.max_length, self.stride)
        self._windows[id(examples)] = windows
        return [
            {"input_ids": w.input_ids, "token_type_ids": w.token_type_ids, "start": w.start, "end": w.end}
            for w in windows
        ]

    def collate(self, feats: list[Feature]) -> dict[str, torch.Tensor]:
        batch = self.tok.pad([f["input_ids"] for f in feats], [f["token_type_ids"] for f in feats])
        batch["start_positions"] = torch.tensor([f["start"] for f in feats])
        batch["end_positions"] = torch.tensor([f["end"] for f in feats])
        return batch

    def evaluate(self, model: nn.Module, examples: list, feats: list[Feature], batch_size: int) -> dict[str, float]:
        device = next(model.parameters()).device
        outputs = predict(model, feats, self.collate, batch_size, device)
        answers = qa.best_answers(
            examples,
            self._windows[id(examples)],
            [o["start_logits"] for o in outputs],
            [o["end_logits"] for o in outputs],
        )
        return metrics.squad_scores(answers, {e.id: [text for text, _ in e.answers] for e in examples})
