"""Extractive QA: long contexts as overlapping windows, answer spans as token positions, and back to text.

A context longer than `max_length` is cut into windows that overlap by `stride` tokens (`WordPieceTokenizer.windows`); a
window that does not hold the whole answer is trained to point at [CLS] (position 0). At prediction time each
window proposes its best spans and the highest start+end logit over all windows of a question wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastbert.finetune.data import QAExample
from fastbert.tokenization import WordPieceTokenizer


@dataclass
class QAWindow:
    example: int  # index of the QAExample this window came from
    input_ids: list[int]
    token_type_ids: list[int]
    offsets: list[tuple[int, int] | None]  # character span of each context token in the context; None elsewhere
    start: int = 0  # gold start/end token (0 = [CLS]: no answer in this window)
    end: int = 0


def make_windows(
    tokenizer: WordPieceTokenizer, examples: list[QAExample], max_length: int = 384, stride: int = 128
) -> list[QAWindow]:
    """Tokenise (question, context) pairs into windows of at most max_length tokens overlapping by `stride`."""
    per_example = tokenizer.windows([e.question for e in examples], [e.context for e in examples], max_length, stride)
    windows = []
    for i, (example, pieces) in enumerate(zip(examples, per_example, strict=True)):
        for enc in pieces:
            offsets = [off if seq == 1 else None for off, seq in zip(enc.offsets, enc.sequence_ids, strict=True)]
            window = QAWindow(i, list(enc.ids), list(enc.type_ids), offsets)
            if example.answers:
                text, begin = example.answers[0]
                window.start, window.end = _token_span(offsets, begin, begin + len(text))
            windows.append(window)
    return windows


def _token_span(offsets: list[tuple[int, int] | None], begin: int, end: int) -> tuple[int, int]:
    """First and last token covering characters [begin, end) if the window holds all of them, else (0, 0)."""
    inside = [i for i, off in enumerate(offsets) if off is not None]
    if not inside or offsets[inside[0]][0] > begin or offsets[inside[-1]][1] < end:
        return 0, 0
    first = next(i for i in inside if offsets[i][1] > begin)
    last = next(i for i in reversed(inside) if offsets[i][0] < end)
    return first, last


def best_answers(
    examples: list[QAExample],
    windows: list[QAWindow],
    start_logits: list[np.ndarray],
    end_logits: list[np.ndarray],
    n_best: int = 20,
    max_answer_tokens: int = 30,
) -> dict[str, str]:
    """Question id -> answer text: the best-scoring valid span (inside the context, end >= start, not too long)."""
    best: dict[int, tuple[float, str]] = {}
    for window, s_log, e_log in zip(windows, start_logits, end_logits, strict=True):
        context = examples[window.example].context
        n = len(window.offsets)
        starts = np.argsort(s_log[:n])[::-1][:n_best]
        ends = np.argsort(e_log[:n])[::-1][:n_best]
        for s in starts:
            for e in ends:
                if window.offsets[s] is None or window.offsets[e] is None or e < s or e - s + 1 > max_answer_tokens:
                    continue
                score = float(s_log[s] + e_log[e])
                if window.example not in best or score > best[window.example][0]:
                    best[window.example] = (score, context[window.offsets[s][0] : window.offsets[e][1]])
    return {e.id: best[i][1] if i in best else "" for i, e in enumerate(examples)}
