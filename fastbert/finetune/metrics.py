"""Task metrics: accuracy/macro-F1, Pearson/Spearman, entity-level F1 over BIO tags, SQuAD exact match and F1."""

from __future__ import annotations

import collections
import re
import string

import numpy as np


def accuracy_f1(pred: np.ndarray, gold: np.ndarray, num_labels: int) -> dict[str, float]:
    """Accuracy and macro-averaged F1 over the classes, x100."""
    f1s = []
    for c in range(num_labels):
        tp = np.sum((pred == c) & (gold == c))
        denom = np.sum(pred == c) + np.sum(gold == c)
        if denom:
            f1s.append(2 * tp / denom)
    return {"accuracy": 100 * float(np.mean(pred == gold)), "macro_f1": 100 * float(np.mean(f1s)) if f1s else 0.0}


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties given their average rank (what Spearman's rho needs)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2
        i = j + 1
    return ranks


def pearson_spearman(pred: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    """Pearson and Spearman correlation, x100 (the STS-B convention)."""
    pred, gold = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    pearson = float(np.corrcoef(pred, gold)[0, 1])
    spearman = float(np.corrcoef(_ranks(pred), _ranks(gold))[0, 1])
    return {"pearson": 100 * pearson, "spearman": 100 * spearman}


def entity_spans(tags: list[str]) -> set[tuple[str, int, int]]:
    """(type, first, last) of each entity in a BIO sequence; an I- that does not continue its type opens one."""
    spans, current = set(), None
    for i, tag in enumerate([*tags, "O"]):
        kind = tag[2:] if tag != "O" else None
        continues = tag.startswith("I-") and current is not None and current[0] == kind
        if current is not None and not continues:
            spans.add((current[0], current[1], i - 1))
            current = None
        if kind is not None and not continues:
            current = (kind, i)
    return spans


def entity_f1(pred: list[list[str]], gold: list[list[str]]) -> dict[str, float]:
    """Entity-level precision/recall/F1 (exact type and boundaries), x100, micro-averaged over sentences."""
    tp = n_pred = n_gold = 0
    for p, g in zip(pred, gold, strict=True):
        ps, gs = entity_spans(p), entity_spans(g)
        tp, n_pred, n_gold = tp + len(ps & gs), n_pred + len(ps), n_gold + len(gs)
    precision = tp / n_pred if n_pred else 0.0
    recall = tp / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": 100 * precision, "recall": 100 * recall, "f1": 100 * f1}


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def squad_f1(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], answers: dict[str, list[str]]) -> dict[str, float]:
    """Exact match and F1 (best over the gold answers; '' is the answer to an unanswerable question), x100."""
    em = f1 = 0.0
    for qid, golds in answers.items():
        golds = golds or [""]
        pred = predictions.get(qid, "")
        em += max(float(normalize_answer(pred) == normalize_answer(g)) for g in golds)
        f1 += max(squad_f1(pred, g) for g in golds)
    n = max(1, len(answers))
    return {"exact_match": 100 * em / n, "f1": 100 * f1 / n}
