"""Length-grouped batches (little padding) whose order depends only on (seed, epoch), split over ranks, so a
resumed run can skip to where it stopped."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch


class LengthGroupedBatchSampler:
    """Batches of similar length (little padding), reshuffled each epoch from (seed, epoch) alone, split over ranks.

    Indices are shuffled, cut into windows of `batch_size * group` that are sorted by length and cut into batches,
    and the batches are shuffled again. Each rank takes every world_size-th batch (all ranks get the same count).
    `set_epoch(epoch, start)` also skips the first `start` batches: how a resumed run continues mid-epoch.
    """

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        group: int = 50,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.lengths, self.batch_size, self.seed, self.shuffle = list(lengths), batch_size, seed, shuffle
        self.group, self.rank, self.world_size = group, rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _batches(self) -> list[list[int]]:
        n = len(self.lengths)
        if not self.shuffle:
            order = sorted(range(n), key=lambda i: self.lengths[i])
            return [order[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(n, generator=gen).tolist()
        window = self.batch_size * self.group
        batches = []
        for w in range(0, n, window):
            chunk = sorted(order[w : w + window], key=lambda i: self.lengths[i])
            batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        perm = torch.randperm(len(batches), generator=gen).tolist()
        return [batches[i] for i in perm]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        mine = batches[self.rank :: self.world_size][: len(batches) // self.world_size]
        return iter(mine[self.start :])

    def __len__(self) -> int:
        n, window = len(self.lengths), self.batch_size * self.group
        if self.shuffle:
            return ((n // window) * self.group + math.ceil((n % window) / self.batch_size)) // self.world_size
        return math.ceil(n / self.batch_size) // self.world_size
