"""Distillation data: a corpus (text file or list of sentences) tokenised with the teacher's WordPiece vocabulary,
padded batches with dynamic masking, and an optional on-disk teacher-output cache. (Batches are length-grouped and
sharded over ranks by the shared `fastbert.train.LengthGroupedBatchSampler`.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

from fastbert.errors import DataError, read_text
from fastbert.masking import MLMMasker
from fastbert.tokenization import WordPieceTokenizer


def read_corpus(source: str | os.PathLike | Sequence[str]) -> list[str]:
    """Non-empty stripped lines of a text file, or the non-empty items of a list of sentences."""
    if isinstance(source, (str, os.PathLike)):
        texts = [line.strip() for line in read_text(source).splitlines()]
    else:
        texts = [str(t).strip() for t in source]
    texts = [t for t in texts if t]
    if not texts:
        raise DataError(f"the corpus is empty (no non-blank lines in {source if isinstance(source, str) else 'list'})")
    return texts


def tokenize_corpus(texts: Sequence[str], tokenizer: WordPieceTokenizer, max_length: int) -> list[list[int]]:
    """`[CLS] text [SEP]` ids per text, truncated to max_length (encoded in chunks to bound padding memory)."""
    out: list[list[int]] = []
    for i in range(0, len(texts), 1024):
        enc = tokenizer(list(texts[i : i + 1024]), max_length=max_length)
        lengths = enc["attention_mask"].sum(1).tolist()
        out.extend(row[:n] for row, n in zip(enc["input_ids"].tolist(), lengths, strict=True))
    return out


def collate(
    ids: Sequence[Sequence[int]],
    pad_id: int,
    masker: MLMMasker | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest row; with a masker, add dynamically masked inputs and MLM labels."""
    width = max(len(r) for r in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": torch.zeros_like(input_ids)}
    if masker is not None:
        batch["input_ids"], batch["labels"] = masker(input_ids, attention_mask, generator=generator)
    return batch


class TeacherCache:
    """Teacher targets per example (pooled embeddings, hidden states), kept in memory and in `directory` as
    safetensors shards, so later epochs and resumed runs skip the teacher. Only valid for unmasked inputs.

    Examples are stored by corpus index, which says nothing of whose targets they are: `key` names them (the
    teacher by content, the tokenised inputs, the teacher's precision, which targets) and is kept with the shards
    in `key.json`. A cache whose key differs, or that has none, holds another run's targets: it is emptied and
    rebuilt (`rebuilt` says why), never read. Rank 0 empties it; another rank only declines to read it.
    """

    KEY_FILE = "key.json"

    def __init__(self, directory: str, key: dict, rank: int = 0) -> None:
        self.directory, self.rank = directory, rank
        self.key = json.loads(json.dumps(key, sort_keys=True))  # as key.json reads back (tuples as lists...)
        self.rebuilt = ""
        os.makedirs(directory, exist_ok=True)
        self.entries: dict[int, dict[str, torch.Tensor]] = {}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.shards = 0
        self.read: set[str] = set()  # shard files already loaded
        shards = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        theirs = self._stored_key()
        if theirs != self.key:
            if shards or theirs is not None:
                self.rebuilt = self._why(theirs)
            if rank == 0:
                for name in shards:
                    os.remove(os.path.join(directory, name))
                tmp = os.path.join(directory, self.KEY_FILE + ".tmp")
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(self.key, f, indent=1, sort_keys=True)
                os.replace(tmp, os.path.join(directory, self.KEY_FILE))  # written last: shards under it are its own
            return
        self.refresh()

    def refresh(self) -> None:
        """Read the shards in the folder not read yet (another rank's, written since this cache was opened)."""
        from safetensors.torch import load_file

        for name in sorted(n for n in os.listdir(self.directory) if n.endswith(".safetensors")):
            if name not in self.read:
                for key, value in load_file(os.path.join(self.directory, name)).items():
                    index, field = key.split("/", 1)
                    self.entries.setdefault(int(index), {})[field] = value
                self.read.add(name)

    def _stored_key(self) -> dict | None:
        """The key the shards in the folder were written under; None if none (or unreadable)."""
        try:
            with open(os.path.join(self.directory, self.KEY_FILE), encoding="utf-8") as f:
                stored = json.load(f)
        except (OSError, ValueError):
            return None
        return stored if isinstance(stored, dict) else None

    def _why(self, theirs: dict | None) -> str:
        """Why the folder's targets are not this run's, in one line."""
        if theirs is None:
            return f"teacher cache {self.directory} holds targets of unknown origin (no {self.KEY_FILE}): rebuilding it"
        differ = sorted(k for k in theirs.keys() | self.key.keys() if theirs.get(k) != self.key.get(k))
        return f"teacher cache {self.directory} holds another run's targets ({', '.join(differ)} differ): rebuilding it"

    def get(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]] | None:
        """Every example's targets, or None if any is missing."""
        found = [self.entries.get(i) for i in indices]
        return None if any(f is None for f in found) else found

    def put(self, indices: Sequence[int], targets: list[dict[str, torch.Tensor]]) -> None:
        for i, t in zip(indices, targets, strict=True):
            entry = {k: v.detach().float().cpu().clone() for k, v in t.items()}  # own storage each
            self.entries[i] = self.pending[i] = entry

    def flush(self) -> None:
        """Write what was added since the last flush as a new shard (atomically)."""
        from safetensors.torch import save_file

        if not self.pending:
            return
        tensors = {f"{i}/{k}": v for i, entry in self.pending.items() for k, v in entry.items()}
        while os.path.exists(path := os.path.join(self.directory, f"rank{self.rank}-{self.shards:05d}.safetensors")):
            self.shards += 1
        save_file(tensors, path + ".tmp")
        os.replace(path + ".tmp", path)
        self.read.add(os.path.basename(path))
        self.pending = {}
