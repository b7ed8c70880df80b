"""Input checks that run before any kernel, with the same errors on every device.

Out-of-range ids would be silent memory errors inside a fused gather on a GPU, so they are caught here. The range
checks need their values on the host: `check_inputs` leaves them on the device as a `RangeCheck`, which the model reads
in the same sync as the packing's lengths (one host sync per forward); `RangeCheck.read_and_check` reads them alone.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from fastbert.backends import native
from fastbert.config import BertConfig

_INT_DTYPES = (torch.int64, torch.int32)  # what every backend's embedding gather takes (torch's F.embedding included)
_MASK_DTYPES = (torch.bool, torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)
_MASK_DTYPES += (torch.float32, torch.float16, torch.bfloat16, torch.float64)
PADDING_WARNING = (
    "input_ids has pad_token_id ({pad}) at the start or end of a row but no attention_mask was given: the padding is "
    "attended to like any token; pass attention_mask (1 = token, 0 = padding)"
)


def _check_ids(name: str, t: torch.Tensor, shape: torch.Size) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor (int64 or int32), got {t.dtype}")
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but input_ids has shape {tuple(shape)}")


def _check_positions(position_ids: torch.Tensor, shape: torch.Size) -> None:
    """position_ids: an int64/int32 tensor of shape [seqlen], [1, seqlen] or [batch, seqlen]."""
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
    if position_ids.dtype not in _INT_DTYPES:
        raise TypeError(f"position_ids must be an integer tensor (int64 or int32), got {position_ids.dtype}")
    batch, seqlen = shape
    if tuple(position_ids.shape) not in ((seqlen,), (1, seqlen), (batch, seqlen)):
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}; expected [{seqlen}], [1, {seqlen}] or "
            f"[{batch}, {seqlen}] for input of shape {tuple(shape)}"
        )


def check_inputs(
    config: BertConfig,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    dtype: torch.dtype | None = None,
) -> tuple[int, int, RangeCheck | None]:
    """Types and shapes now (no sync); returns (batch, seqlen, the value checks still to read), None when there is
    nothing to read (batch 0, or nothing to range-check). `dtype`: the model's, which inputs_embeds must have."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in _INT_DTYPES:
            raise TypeError(f"input_ids must be an integer tensor (int64 or int32), got {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D [batch, seqlen], got shape {tuple(input_ids.shape)}")
        shape = input_ids.shape
    else:
        if not isinstance(inputs_embeds, torch.Tensor):
            raise TypeError(f"inputs_embeds must be a torch.Tensor, got {type(inputs_embeds).__name__}")
        if not inputs_embeds.is_floating_point():
            raise TypeError(f"inputs_embeds must be a floating-point tensor, got {inputs_embeds.dtype}")
        if dtype is not None and inputs_embeds.dtype != dtype:
            raise TypeError(f"inputs_embeds has dtype {inputs_embeds.dtype} but the model is {dtype}: cast it first")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.embedding_dim:
            raise ValueError(
                f"inputs_embeds must be [batch, seqlen, {config.embedding_dim}], got {tuple(inputs_embeds.shape)}"
            )
        shape = inputs_embeds.shape[:2]
    batch, seqlen = int(shape[0]), int(shape[1])
    if seqlen == 0:
        raise ValueError("empty sequence length: input has shape [batch, 0]; every sequence needs at least 1 position")
    family = config.family
    # RoBERTa counts positions from pad_token_id + 1, so its longest sequence is that much shorter
    offset = config.pad_token_id + 1 if family.padded_positions and position_ids is None else 0
    if config.absolute_positions and seqlen + offset > config.max_position_embeddings:
        raise ValueError(
            f"sequence length {seqlen} is longer than max_position_embeddings={config.max_position_embeddings}"
            + (f" - {offset} ({family.model_type} positions start at pad_token_id + 1)" if offset else "")
        )
    if token_type_ids is not None and not family.token_types:
        raise TypeError(f"{family.name} models have no token types: pass no token_type_ids")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype not in _MASK_DTYPES:
            raise TypeError(f"attention_mask must be a bool, integer or float tensor, got {attention_mask!r:.60}")
        if attention_mask.shape != shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has shape {tuple(shape)}; "
                "expected a 2-D 0/1 mask (1 = attend)"
            )
    if token_type_ids is not None:
        _check_ids("token_type_ids", token_type_ids, shape)
    if position_ids is not None:
        _check_positions(position_ids, shape)
    if batch == 0:
        return batch, seqlen, None
    return batch, seqlen, _range_check(config, input_ids, attention_mask, token_type_ids, position_ids)


@dataclass(frozen=True)
class RangeCheck:
    """Min and max of each id tensor, then a bad-mask flag, on the inputs' device, until the caller reads them."""

    limits: tuple[tuple[str, str, int], ...]  # (input name, config field, bound) per id tensor
    has_mask_flag: bool
    values: torch.Tensor  # [2 * len(limits) + has_mask_flag + (pad_id is not None)] int64
    pad_id: int | None = None  # set when no attention_mask came: the last value flags pad ids at a row's ends

    def read_and_check(self) -> None:
        """Read the values now (a host sync of its own) and raise if any input is out of range."""
        self.raise_if_bad(self.values.tolist())

    def raise_if_bad(self, values: list[int]) -> None:
        """`values` = `self.values` on the host; raises ValueError naming the first input out of its range."""
        for i, (name, field, bound) in enumerate(self.limits):
            low, high = values[2 * i], values[2 * i + 1]
            if low < 0 or high >= bound:
                bad = low if low < 0 else high
                raise ValueError(f"{name} contains {bad}, outside [0, {bound}) ({field}={bound})")
        flags = values[2 * len(self.limits) :]
        if self.has_mask_flag and flags[0]:
            raise ValueError("attention_mask must contain only 0 and 1 (1 = attend, 0 = padding)")
        if self.pad_id is not None and flags[-1]:  # as transformers warns: likely padding, nothing says so
            warnings.warn(PADDING_WARNING.format(pad=self.pad_id), stacklevel=2)


def _range_check(
    config: BertConfig,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> RangeCheck | None:
    checks: list[tuple[str, torch.Tensor]] = []
    if input_ids is not None:
        checks.append(("input_ids", input_ids))
    if token_type_ids is not None and config.token_types:  # without a table (type_vocab_size 0) they are not read
        checks.append(("token_type_ids", token_type_ids))
    if position_ids is not None:
        checks.append(("position_ids", position_ids))
    flagged_mask = attention_mask if attention_mask is not None and attention_mask.dtype != torch.bool else None
    pad_id = config.pad_token_id if attention_mask is None and input_ids is not None else None
    if not checks and flagged_mask is None and pad_id is None:
        return None
    cpu = native.input_reader(input_ids, attention_mask, token_type_ids, position_ids)
    if cpu is not None:  # one pass each, the same values
        ends = input_ids if pad_id is not None else None
        values = cpu.input_ranges([t for _, t in checks], flagged_mask, ends, 0 if pad_id is None else pad_id)
    else:
        values = _range_values([t for _, t in checks], flagged_mask, input_ids, pad_id)
    limits = {
        "input_ids": ("vocab_size", config.vocab_size),
        "token_type_ids": ("type_vocab_size", config.type_vocab_size),
        "position_ids": ("max_position_embeddings", config.max_position_embeddings),
    }
    named = tuple((name, *limits[name]) for name, _ in checks)
    return RangeCheck(named, flagged_mask is not None, values, pad_id)


def _range_values(
    ids: list[torch.Tensor], flagged_mask: torch.Tensor | None, input_ids: torch.Tensor | None, pad_id: int | None
) -> torch.Tensor:
    """RangeCheck.values with torch's ops, left on the inputs' device: (min, max) per id tensor, whether the mask
    holds a value other than 0 and 1, whether a pad id is in the first or last column (the flags where asked)."""
    parts = [torch.stack([t.min(), t.max()]).long() for t in ids]
    if flagged_mask is not None:
        parts.append(((flagged_mask != 0) & (flagged_mask != 1)).any().long().view(1))
    if pad_id is not None:  # transformers' cheap test: a pad id in the first or last column
        ends = torch.stack([input_ids[:, 0], input_ids[:, -1]])  # slices: a list index is a host-to-device copy
        parts.append((ends == pad_id).any().long().view(1))
    return torch.cat([t.to(parts[0].device) for t in parts])
