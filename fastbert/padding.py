"""Unpad once, repad once: the encoder runs on `[total_tokens, H]` and never sees a padding token.

`Packing` carries what every layer needs (`cu_seqlens`, `max_seqlen`) plus how to get back to `[B, S, ...]`.
Building it costs the only host sync of a forward pass (`max_seqlen` and the packed size must be Python ints); the
model's input checks ride on the same sync (`unpad_and_read`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastbert.backends import native


@dataclass(frozen=True)
class Packing:
    """Where the valid tokens of a `[batch, seqlen]` batch sit once packed."""

    batch: int
    seqlen: int
    cu_seqlens: torch.Tensor  # [batch + 1] int32: sequence b owns packed rows cu_seqlens[b]:cu_seqlens[b + 1]
    max_seqlen: int
    indices: torch.Tensor | None  # [total] int64 flat positions in batch * seqlen; None when nothing is padded

    @property
    def total(self) -> int:
        return self.batch * self.seqlen if self.indices is None else self.indices.numel()

    @property
    def lengths(self) -> torch.Tensor:  # [batch] int32
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> [T, ...] (a view when nothing is padded)."""
        flat = x.reshape(self.batch * self.seqlen, *x.shape[2:])
        return flat if self.indices is None else flat.index_select(0, self.indices)

    def repad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, S, ...] with zeros at padded positions."""
        if self.indices is None:
            return x.reshape(self.batch, self.seqlen, *x.shape[1:])
        out = x.new_zeros(self.batch * self.seqlen, *x.shape[1:]).index_copy(0, self.indices, x)
        return out.view(self.batch, self.seqlen, *x.shape[1:])


def dense(batch: int, seqlen: int, device: torch.device) -> Packing:
    """A batch with no padding: packing is a reshape."""
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    return Packing(batch, seqlen, cu, seqlen, None)


def unpad(attention_mask: torch.Tensor | None, batch: int, seqlen: int, device: torch.device) -> Packing:
    """Packing for a 0/1 key mask `[B, S]` (1 = real token); any layout of ones works, not only left-aligned."""
    return unpad_and_read(attention_mask, batch, seqlen, device)[0]


def unpad_and_read(
    attention_mask: torch.Tensor | None,
    batch: int,
    seqlen: int,
    device: torch.device,
    also_read: torch.Tensor | None = None,
) -> tuple[Packing, list[int]]:
    """`unpad`, reading `also_read` (1-D int64 on `device`, e.g. input checks) to the host in the same sync, so a
    forward pass syncs once. Returns the packing and those values."""
    extra = torch.zeros(0, dtype=torch.int64, device=device) if also_read is None else also_read.to(device)
    if attention_mask is None or batch == 0:
        packing = dense(batch, seqlen, device)  # launched before the sync, which then waits for it too
        return packing, (extra.tolist() if extra.numel() else [])
    if device.type == "cpu" and (cpu := native.input_reader(attention_mask, extra)) is not None:
        max_seqlen, _, cu, indices = cpu.mask_packing(attention_mask)  # one pass; the sync is the extra's read
        return Packing(batch, seqlen, cu, max_seqlen, indices), (extra.tolist() if extra.numel() else [])
    valid = attention_mask.to(device=device, dtype=torch.bool)
    lengths = valid.sum(dim=1, dtype=torch.int64)
    cu = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))  # before the sync: nothing after it waits for it
    stats = torch.cat([torch.stack([lengths.max(), lengths.sum()]), extra]).tolist()  # the one host sync
    max_seqlen, total, values = int(stats[0]), int(stats[1]), stats[2:]
    if total == batch * seqlen:
        return Packing(batch, seqlen, cu, seqlen, None), values
    indices = valid.reshape(-1).nonzero_static(size=total).squeeze(1)  # sized by `total`: no second sync
    return Packing(batch, seqlen, cu, max_seqlen, indices), values


def rows_with_gaps(attention_mask: torch.Tensor) -> torch.Tensor:
    """[1] int64: how many rows of a [B, S] mask have zeros between their ones (packing closes such gaps, which changes
    a relative position's distance), computed on the mask's device for a later read."""
    valid = attention_mask.to(torch.bool)
    count = valid.sum(dim=1)
    first = valid.int().argmax(dim=1)
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(dim=1)
    return ((count > 0) & (last - first + 1 != count)).sum().reshape(1).to(torch.int64)
