"""Training precision: which of fp32/bf16/fp16 a run uses ('auto' follows the machine, saying why) and the autocast
context that applies it."""

from __future__ import annotations

import contextlib

import torch

from fastbert import capabilities

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_CHOICES = ("auto", *PRECISIONS)  # what the CLIs and configs accept; 'auto' follows the machine


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """('fp32' | 'bf16' | 'fp16', what to tell the user). 'auto' is bf16 where bf16 is fast on `device` (a GPU that
    has it, a CPU with bf16 dot products: fastbert.capabilities), else fp32. An explicit bf16 on a CPU without bf16
    instructions is kept, with a warning: fastbert's GEMMs then run on fp32 arithmetic, but the heads, the
    backward pass and torch's own layers emulate bf16, several times slower than fp32."""
    if precision not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {precision!r}")
    fast = capabilities.fast_dtype(device) == torch.bfloat16
    probe = capabilities.bf16_gemm().why if device.type == "cpu" else f"{device.type} bf16 support"
    if precision == "auto":
        chosen = "bf16" if fast else "fp32"
        return chosen, f"precision auto -> {chosen} on {device.type} ({probe})"
    if precision == "bf16" and not fast:
        return precision, (
            f"warning: bf16 is slow on this {device.type} ({probe}); fastbert's GEMMs run it on fp32 arithmetic, the "
            "rest of training emulates it and can be several times slower than fp32: --precision auto picks fp32 here"
        )
    return precision, f"precision {precision}"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision context for 'bf16'/'fp16'; a no-op for 'fp32'."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)
