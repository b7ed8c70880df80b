"""The `triton` backend: the fused kernels in fastbert/kernels/ on CUDA tensors, and on CPU tensors under the Triton
interpreter when forced (tests). Its limits are the kernels' own (`fastbert/kernels/limits.py`)."""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

import torch

from fastbert import kernels
from fastbert.backends.spec import KERNEL_OPS, Backend

# The oldest Triton whose interpreter computes the kernels right (tested by `make test-oldest`): 3.6's fails 6 of 8
# embedding kernel tests (tests/test_kernel_embedding.py) that 3.8 and 3.9 pass.
INTERPRETER_MIN = (3, 8)


def triton_version() -> tuple[int, ...]:
    """The installed Triton's (major, minor) release, (0,) when it is not installed (or unreadable)."""
    try:
        return tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0,)


def _device_check(device_type: str) -> str | None:
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "runs on CPU tensors only under TRITON_INTERPRET=1"
    if device_type == "cpu" and (0,) < (version := triton_version()) < INTERPRETER_MIN:
        need = ".".join(map(str, INTERPRETER_MIN))
        return (f"Triton {'.'.join(map(str, version))}'s interpreter gives wrong answers (6 of 8 embedding kernel "
                f"tests fail on 3.6); it needs triton >= {need}")  # fmt: skip
    return None


def _feature(n: int) -> str | None:
    return f"feature dim {n} > {kernels.limits.MAX_FEATURE}" if n > kernels.limits.MAX_FEATURE else None


def _attention_limit(call: dict[str, Any], forced: bool) -> str | None:
    """The attention kernel's limits; and fp32 where torch forbids TF32 goes to torch's exact SDPA (memory-efficient
    kernel), which beats the kernel's IEEE dots (no tensor cores: 7.4 ms a layer at 16 x 512 on an H200), unless
    this backend is chosen by name."""
    qkv, max_seqlen = call["qkv"], call["max_seqlen"]
    if not forced and qkv.dtype == torch.float32 and kernels.limits.fp32_dot_precision() == "ieee":
        return "fp32 without TF32: torch's SDPA is the faster exact path"
    if qkv.shape[-1] > kernels.limits.MAX_HEAD_DIM:
        return f"head dim {qkv.shape[-1]} > {kernels.limits.MAX_HEAD_DIM}"
    if call.get("training") and call.get("dropout_p", 0.0) > 0 and max_seqlen > kernels.limits.MAX_SEQLEN_DROPOUT:
        return f"attention dropout with max_seqlen {max_seqlen} > {kernels.limits.MAX_SEQLEN_DROPOUT}"
    rotary = call.get("rotary")
    if rotary is not None and (rotary.dtype != torch.float32 or rotary.dim() != 3 or rotary.stride(2) != 1):
        return "rotary tables other than [2, T, R/2] fp32 with a unit stride on R/2"
    bias = call.get("position_bias")
    if bias is not None and not bias.is_contiguous():  # the kernels index the table as [nH, 2R + 1] row-major
        return "a non-contiguous position_bias table"
    scores, columns = call.get("position_scores"), call.get("position_columns")
    if scores is not None and scores.dim() == 4 and scores.stride(3) != 1 and scores.shape[3] > 1:
        return "position_scores without a unit stride on W"  # the kernels take any other strides
    if scores is not None and scores.dim() == 4 and scores.shape[3] > kernels.limits.MAX_POSITION_COLUMNS:
        return f"position_scores with W = {scores.shape[3]} > {kernels.limits.MAX_POSITION_COLUMNS} columns"
    if columns is not None and not columns.is_contiguous():
        return "a non-contiguous position_columns"
    return None


SPEC = Backend(
    "triton",
    devices=("cuda", "cpu"),
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    module=kernels,
    ops=KERNEL_OPS,
    limits={
        "embedding_layernorm": lambda call, forced: _feature(call["word_weight"].shape[-1]),
        "bias_residual_layernorm": lambda call, forced: _feature(call["x"].shape[-1]),
        "attention": _attention_limit,
        "gated_act": lambda call, forced: None if call["up"].shape == call["x"].shape and call["up"].dtype == call[
            "x"].dtype else "up broadcasts against x or has another dtype (torch only)",
    },
    device_check=_device_check,
    auto_devices=("cuda",),  # CPU (interpreter) only when forced: tests, never a silent slow path
)
