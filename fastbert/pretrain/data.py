"""Pretraining corpora: documents -> sentences -> token ids -> sentence pairs labelled for NSP or SOP.

NSP (BERT): segment B is the text that follows A in its document (label 0) or, half the time, text from another
document (label 1). SOP (ALBERT): A and B are always consecutive in one document; half the time they are swapped
(label 1). As in BERT, pairs fill a target length of real sentences, and an over-long pair is trimmed from a
random end of its longer segment.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable

from fastbert.errors import DataError, read_text
from fastbert.tokenization import WordPieceTokenizer

_WIKITEXT_TITLE = re.compile(r"^ ?= [^=].* = ?$")
_WIKITEXT_HEADING = re.compile(r"^ ?(= )+.*( =)+ ?$")
# a sentence ends at . ! or ? followed by space, except WikiText's escaped "@.@" (decimal points)
_SENTENCE_END = re.compile(r"(?<=[^@][.!?])\s+(?=\S)")

OBJECTIVES = ("nsp", "sop")
MIN_LENGTH = 5  # [CLS] A [SEP] B [SEP] with one token in each segment


def split_sentences(text: str) -> list[str]:
    """Sentences of a paragraph, split after . ! ? (not after WikiText's '@.@')."""
    return [s.strip() for s in _SENTENCE_END.split(text.strip()) if s.strip()]


def read_documents(path: str | os.PathLike) -> list[list[str]]:
    """A text file as documents of sentences.

    WikiText (lines ' = Title = ' open a document, ' = = Section = = ' headings are dropped, '<unk>' becomes
    BERT's [UNK]) is recognised by its titles; any other file is one document per blank-line-separated block.
    """
    path = os.fspath(path)
    lines = read_text(path).splitlines()
    if not any(line.strip() for line in lines):
        raise DataError(f"{path}: the corpus is empty")
    wikitext = any(_WIKITEXT_TITLE.match(line) for line in lines)
    documents: list[list[str]] = []
    current: list[str] = []
    for line in lines:
        starts_document = _WIKITEXT_TITLE.match(line) if wikitext else not line.strip()
        if starts_document:
            if current:
                documents.append(current)
            current = []
            continue
        if not line.strip() or (wikitext and _WIKITEXT_HEADING.match(line)):
            continue
        text = line.replace("<unk>", "[UNK]") if wikitext else line
        current.extend(split_sentences(text))
    if current:
        documents.append(current)
    return documents


def tokenize_documents(tokenizer: WordPieceTokenizer, documents: list[list[str]]) -> list[list[list[int]]]:
    """Word-piece ids of every sentence (no special tokens); empty sentences dropped, then empty documents."""
    flat = [s for doc in documents for s in doc]
    ids = iter(tokenizer.encode_ids(flat))
    tokenized = [[x for x in (next(ids) for _ in doc) if x] for doc in documents]
    return [doc for doc in tokenized if doc]


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Trim the longer segment, one token at a time from a random end, until the pair fits."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        del longer[0 if rng.random() < 0.5 else -1]


def make_pairs(
    documents: list[list[list[int]]],
    max_length: int = 128,
    objective: str = "nsp",
    seed: int = 0,
    short_seq_prob: float = 0.1,
) -> list[tuple[list[int], list[int], int]]:
    """(segment A ids, segment B ids, label) for every chunk of every document; labels balanced 50/50.

    Label 0 means "B follows A"; 1 means "B is random" (NSP) or "A and B are swapped" (SOP).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if max_length < MIN_LENGTH:
        raise ValueError(f"max_length must be >= {MIN_LENGTH} ([CLS] A [SEP] B [SEP]), got {max_length}")
    if len(documents) < 2 and objective == "nsp":
        raise ValueError(
            f"NSP needs at least two documents (random segments come from another document), got {len(documents)}"
        )
    rng = random.Random(seed)
    max_tokens = max_length - 3  # [CLS] A [SEP] B [SEP]
    pairs = []
    for d, doc in enumerate(documents):
        target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
        chunk: list[list[int]] = []
        size = 0
        for i, sentence in enumerate(doc):
            chunk.append(sentence)
            size += len(sentence)
            if i < len(doc) - 1 and size < target:
                continue
            if len(chunk) < 2 and not (objective == "nsp" and chunk):
                chunk, size = [], 0
                continue
            split = rng.randint(1, len(chunk) - 1) if len(chunk) > 1 else 1
            a = [t for s in chunk[:split] for t in s]
            b = [t for s in chunk[split:] for t in s]
            label = int(rng.random() < 0.5) if b else 1
            if objective == "nsp" and label == 1:
                b = _random_segment(documents, d, max_tokens - len(a), rng)
            elif objective == "sop" and label == 1:
                a, b = b, a
            _truncate_pair(a, b, max_tokens, rng)
            if a and b:
                pairs.append((a, b, label))
            chunk, size = [], 0
            target = rng.randint(2, max_tokens) if rng.random() < short_seq_prob else max_tokens
    return pairs


def _random_segment(documents: list[list[list[int]]], avoid: int, length: int, rng: random.Random) -> list[int]:
    """Consecutive sentences from a random other document, starting at a random sentence, up to `length` tokens."""
    other = rng.randrange(len(documents) - 1)
    doc = documents[other if other < avoid else other + 1]
    start = rng.randrange(len(doc))
    out: list[int] = []
    for sentence in doc[start:]:
        out.extend(sentence)
        if len(out) >= length:
            break
    return out[: max(1, length)]


def encode_pairs(
    tokenizer: WordPieceTokenizer, pairs: Iterable[tuple[list[int], list[int], int]]
) -> list[dict[str, list[int] | int]]:
    """`[CLS] A [SEP] B [SEP]` ids with segment ids 0/0.../1...; the label as `next_sentence_label`."""
    cls, sep = tokenizer.cls_id, tokenizer.sep_id
    return [
        {
            "input_ids": [cls, *a, sep, *b, sep],
            "token_type_ids": [0] * (len(a) + 2) + [1] * (len(b) + 1),
            "next_sentence_label": label,
        }
        for a, b, label in pairs
    ]
