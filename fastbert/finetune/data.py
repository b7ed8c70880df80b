"""Reading fine-tuning data: CSV/TSV tables, CoNLL token files, SQuAD-style JSON. Bad input is a clear error.

Every reader names the file and the line (or record) at fault: a missing column, an empty file, a label outside
the label set, a non-numeric regression target, a malformed BIO tag.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field

from fastbert.errors import DataError, read_text

csv.field_size_limit(2**31 - 1)


@dataclass
class TextExample:
    text: str
    pair: str | None
    label: str | float


@dataclass
class TaggedSentence:
    words: list[str]
    tags: list[str]


@dataclass
class QAExample:
    id: str
    question: str
    context: str
    answers: list[tuple[str, int]] = field(default_factory=list)  # (text, character start); empty = unanswerable


def _column(name: str, header: list[str] | None, width: int, path: str) -> int:
    """A column by header name, or by 0-based index when the table has no header."""
    if header is not None and name in header:
        return header.index(name)
    if name.lstrip("-").isdigit() and int(name) < width:
        return int(name)
    known = f"columns {header}" if header is not None else f"{width} columns (use 0-based indices)"
    raise DataError(f"{path}: no column {name!r}; the table has {known}")


def read_table(
    path: str | os.PathLike,
    text_columns: list[str],
    label_column: str,
    header: bool = True,
    delimiter: str | None = None,
    regression: bool = False,
) -> list[TextExample]:
    """Rows of a CSV/TSV as examples: one or two text columns and a label (a float when `regression`).

    The delimiter is a tab when the first line holds one (or the file ends in .tsv), else a comma. Tab files are
    read without quote handling, so quotes inside sentences (as in STS-B) stay text.
    """
    path = os.fspath(path)
    if not 1 <= len(text_columns) <= 2:
        raise DataError(f"give one or two text columns, got {text_columns}")
    text = read_text(path)
    if delimiter is None:
        delimiter = "\t" if "\t" in text.split("\n", 1)[0] or path.endswith(".tsv") else ","
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    rows = [row for row in csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, quoting=quoting) if row]
    names = [c.strip() for c in rows.pop(0)] if header and rows else None
    if not rows:
        raise DataError(f"{path}: no data rows")
    width = len(names) if names is not None else len(rows[0])
    cols = [_column(c, names, width, path) for c in text_columns]
    label = _column(label_column, names, width, path)
    needed = max(*cols, label) + 1
    examples = []
    for line, row in enumerate(rows, start=2 if names is not None else 1):
        if len(row) < needed:
            raise DataError(f"{path}:{line}: {len(row)} fields, need at least {needed}")
        value: str | float = row[label].strip()
        if regression:
            try:
                value = float(value)
            except ValueError:
                raise DataError(f"{path}:{line}: regression label {value!r} is not a number") from None
        elif value == "":
            raise DataError(f"{path}:{line}: empty label")
        examples.append(TextExample(row[cols[0]], row[cols[1]] if len(cols) == 2 else None, value))
    return examples


def label_set(examples: list, labels: list[str] | None, path: str) -> list[str]:
    """The label list (given, or sorted from the training data); raises if an example's label is not in it."""
    found = {t for e in examples for t in (e.tags if isinstance(e, TaggedSentence) else [e.label])}
    if labels is None:
        return sorted(found)
    unknown = sorted(found - set(labels))
    if unknown:
        raise DataError(f"{path}: labels {unknown[:10]} are not in the label set {labels}")
    return list(labels)


def _check_bio(tags: list[str], path: str, line: int) -> None:
    for tag in tags:
        if tag != "O" and (len(tag) < 3 or tag[:2] not in ("B-", "I-")):
            raise DataError(f"{path}:{line}: tag {tag!r} is not BIO (O, B-TYPE or I-TYPE)")


def read_conll(path: str | os.PathLike, tag_column: int = -1) -> list[TaggedSentence]:
    """CoNLL: a token per line (word first, tag in `tag_column`), blank lines between sentences; -DOCSTART- skipped."""
    path = os.fspath(path)
    sentences, words, tags, start = [], [], [], 1
    lines = read_text(path).splitlines() + [""]
    for number, raw in enumerate(lines, start=1):
        parts = raw.split()
        if not parts or parts[0] == "-DOCSTART-":
            if words:
                _check_bio(tags, path, start)
                sentences.append(TaggedSentence(words, tags))
            words, tags, start = [], [], number + 1
            continue
        if len(parts) < 2:
            raise DataError(f"{path}:{number}: expected 'word ... tag', got {raw!r}")
        words.append(parts[0])
        tags.append(parts[tag_column])
    if not sentences:
        raise DataError(f"{path}: no sentences")
    return sentences


def read_squad(path: str | os.PathLike) -> list[QAExample]:
    """SQuAD v1/v2 JSON: data -> paragraphs -> qas; answers checked against their context."""
    path = os.fspath(path)
    try:
        data = json.loads(read_text(path))["data"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: not SQuAD JSON (expected {{'data': [...]}}): {exc}") from None
    examples = []
    for i, article in enumerate(data):
        for j, paragraph in enumerate(article.get("paragraphs", [])):
            for k, qa in enumerate(paragraph.get("qas", [])):
                where = f"{path}: article {i}, paragraph {j}, question {k}"
                try:
                    examples.append(_squad_example(qa, paragraph["context"], path))
                except KeyError as exc:  # a field SQuAD always has: say which, and where
                    raise DataError(f"{where}: no {exc} field (SQuAD needs context, id, question, answers)") from None
                except DataError:
                    raise
                except (TypeError, ValueError, AttributeError) as exc:
                    raise DataError(f"{where}: not a SQuAD question ({exc})") from None
    if not examples:
        raise DataError(f"{path}: no questions")
    return examples


def _squad_example(qa: dict, context: str, path: str) -> QAExample:
    """One SQuAD question; each answer must be found in `context` where it says it starts."""
    answers = []
    for a in [] if qa.get("is_impossible") else qa.get("answers", []):
        text, begin = a["text"], int(a["answer_start"])
        if context[begin : begin + len(text)] != text:
            raise DataError(f"{path}: question {qa['id']}: answer {text!r} is not at {begin}")
        answers.append((text, begin))
    return QAExample(str(qa["id"]), qa["question"], context, answers)
