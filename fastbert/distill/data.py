"""Distillation data: a corpus (text file or list of sentences) tokenised with the teacher's WordPiece vocabulary,
length-grouped batches sharded over ranks, dynamic masking per batch, and an optional on-disk teacher-output cache.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from fastbert.masking import MLMMasker
from fastbert.tokenization import WordPieceTokenizer


def read_corpus(source: str | os.PathLike | Sequence[str]) -> list[str]:
    """Non-empty stripped lines of a text file, or the non-empty items of a list of sentences."""
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"corpus file {source} does not exist")
        with open(source, encoding="utf-8") as f:
            texts = [line.strip() for line in f]
    else:
        texts = [str(t).strip() for t in source]
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError(f"the corpus is empty (no non-blank lines in {source if isinstance(source, str) else 'list'})")
    return texts


def tokenize_corpus(texts: Sequence[str], tokenizer: WordPieceTokenizer, max_length: int) -> list[list[int]]:
    """`[CLS] text [SEP]` ids per text, truncated to max_length (encoded in chunks to bound padding memory)."""
    out: list[list[int]] = []
    for i in range(0, len(texts), 1024):
        enc = tokenizer(list(texts[i : i + 1024]), max_length=max_length)
        lengths = enc["attention_mask"].sum(1).tolist()
        out.extend(row[:n] for row, n in zip(enc["input_ids"].tolist(), lengths, strict=True))
    return out


class LengthGroupedBatches:
    """Batches of similar length (little padding): shuffle, sort within chunks of `group` batches, shuffle the
    batches; each rank takes every world-th batch of an equal share. Deterministic in (seed, epoch)."""

    def __init__(
        self, lengths: Sequence[int], batch_size: int, seed: int = 0, rank: int = 0, world: int = 1, group: int = 50
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.lengths = np.asarray(lengths)
        self.batch_size, self.seed, self.rank, self.world, self.group = batch_size, seed, rank, world, group
        if len(self) == 0:
            raise ValueError(f"{len(self.lengths)} examples make fewer than one batch per rank ({world} ranks)")

    def batches(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng((self.seed, epoch))
        order = rng.permutation(len(self.lengths))
        chunk = self.batch_size * self.group
        out = []
        for start in range(0, len(order), chunk):
            part = order[start : start + chunk]
            part = part[np.argsort(-self.lengths[part], kind="stable")]
            out.extend(part[i : i + self.batch_size].tolist() for i in range(0, len(part), self.batch_size))
        out = [out[i] for i in rng.permutation(len(out))]
        usable = len(out) // self.world * self.world  # every rank gets the same number of batches (DDP)
        return out[self.rank : usable : self.world]

    def __len__(self) -> int:
        chunk = self.batch_size * self.group
        full, last = divmod(len(self.lengths), chunk)
        total = full * self.group + -(-last // self.batch_size)
        return total // self.world


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
    safetensors shards, so later epochs and resumed runs skip the teacher. Only valid for unmasked inputs."""

    def __init__(self, directory: str, rank: int = 0) -> None:
        from safetensors.torch import load_file

        self.directory, self.rank = directory, rank
        os.makedirs(directory, exist_ok=True)
        self.entries: dict[int, dict[str, torch.Tensor]] = {}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.shards = 0
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                for key, value in load_file(os.path.join(directory, name)).items():
                    index, field = key.split("/", 1)
                    self.entries.setdefault(int(index), {})[field] = value

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
        self.pending = {}
