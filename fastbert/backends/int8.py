"""The `int8` backend: dynamic int8 GEMMs on CPU for models that ask for them (`fastbert.optimize(model,
quantize="int8")`, or `quantize="int8"` in the config), on the native extension's `int8_linear` kernel.

Weights are quantised once per output channel, symmetric (q = round(w * 127 / max|w_n|)), and cached until they
change; activations are quantised per row (token) on every call, symmetric; products accumulate in int32; the
dequantisation, bias and epilogue (GELU, or residual + LayerNorm) run in fp32 on each tile while it is in L1
(csrc/cpu/int8_linear.inc). Attention, softmax, LayerNorm statistics and the embedding stay fp32.

Never silently slower: at first use per (weight shape, epilogue, size class) the int8 kernel is timed against the fp32
path that would run instead, on the call's own input, and a GEMM runs int8 only where int8 was faster; explain() lists
every verdict with its timings. Forced by name (`use_backend("int8")`) it takes every call it can run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from fastbert.backends import native, timing
from fastbert.backends.spec import Backend
from fastbert.weight_stamp import WeightCache

LEVELS = 127  # symmetric int8: [-127, 127], so that negation is exact and both operands share one range
PANEL_COLUMNS = 32  # the pack pads N to a multiple of this (the widest tile, AVX-512's 32 columns)
_TIE_MARGIN = 1.0  # int8 changes the numbers: it must be faster outright to be chosen


class QuantizedWeight(NamedTuple):
    """A weight quantised per output channel, as the kernel reads it (the integers: `quantize_rows(weight)`)."""

    packed: torch.Tensor  # [ceil(N / 32) * 2, ceil(K / 2), 16, 2] int16 holding int8 values
    scale: torch.Tensor  # [N] fp32: w ~ values * scale[:, None]


_weights = WeightCache()  # (weight) -> QuantizedWeight
# (N, K, act, residual + LayerNorm, size class) -> (int8 wins, why)
_verdicts: dict[tuple, tuple[bool, str]] = {}

# The fp32 path a GEMM takes when int8 does not: the dispatcher puts its own `linear` and `dense_residual_layernorm`
# here, with this backend excluded, so the first-use timing compares against what would really run.
fallback: dict[str, Callable[..., torch.Tensor]] = {}


def unavailable_reason() -> str | None:
    """Why int8 GEMMs cannot run here, or None: they need the native CPU extension."""
    cpu, reason = native.load("_native_cpu")
    if cpu is None:
        return f"needs the native CPU extension ({reason})"
    return None if hasattr(cpu, "int8_linear") else "the native CPU extension predates int8_linear: rebuild it"


def quantize_weight(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8 of an [N, K] weight (an output channel is a row: `quantize_rows`), packed for
    the kernel. Only the pack and the scales are kept: the integers are needed by references, not at run time."""
    values, scale = quantize_rows(weight.detach().float())
    n, k = values.shape
    padded = torch.zeros(-(-n // PANEL_COLUMNS) * PANEL_COLUMNS, k + k % 2, dtype=torch.int16)
    padded[:n, :k] = values.to(torch.int16)
    packed = padded.view(padded.shape[0] // 16, 16, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()
    return QuantizedWeight(packed, scale[:, 0].contiguous())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of [M, K] fp32 rows: (values [M, K] as fp32 integers, scale [M, 1]). The same fp32
    operations as the kernel's activation quantisation (a true division for 127 / max|x|, round half to even), so both
    give the same integers; weights are quantised by the same rule, per output channel."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, LEVELS) / amax, torch.zeros_like(amax))
    return torch.round(x * inv), amax / LEVELS


def quantized(weight: torch.Tensor) -> QuantizedWeight:
    """The cached quantisation of `weight`, rebuilt if the weight changes."""
    return _weights.get(weight, (), (), lambda: quantize_weight(weight))


def linear(
    x: torch.Tensor,  # [*, K] fp32
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    act: str | None = None,
) -> torch.Tensor:  # [*, N] fp32
    """act(x @ weight^T + bias) with int8 operands and int32 accumulation; bias and activation fused."""
    q = quantized(weight)
    cpu, _ = native.load("_native_cpu")
    return cpu.int8_linear(x, q.packed, q.scale, bias, act)


def dense_residual_layernorm(
    x: torch.Tensor,  # [T, K] fp32
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor,  # [N]
    residual: torch.Tensor,  # [T, N] fp32
    ln_weight: torch.Tensor,  # [N]
    ln_bias: torch.Tensor,  # [N]
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:  # [T, N]
    """LayerNorm(x @ weight^T + bias + residual) with an int8 GEMM; the epilogue in fp32 on each tile of rows."""
    q = quantized(weight)
    cpu, _ = native.load("_native_cpu")
    return cpu.int8_linear(x, q.packed, q.scale, bias, None, residual, ln_weight, ln_bias, eps)


def _refuses(op: str, call: dict, forced: bool) -> str | None:
    """Inference on fp32 tensors of one device, then (unless forced) the measured verdict for this shape."""
    x, weight = call["x"], call["weight"]
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in call.values()):
        return "forward only: inputs require grad"
    if call.get("training") and call.get("dropout_p", 0.0) > 0:
        return "no dropout in the int8 epilogue"
    if torch.is_autocast_enabled("cpu"):
        return "under autocast: the int8 GEMM's input and output are fp32"
    if torch.compiler.is_compiling():
        return "under torch.compile/export tracing"
    tensors = [t for t in call.values() if isinstance(t, torch.Tensor)]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return "takes fp32 CPU tensors only"
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return "not an [N, K] weight matching x"
    if forced or x.numel() == 0:
        return None
    wins, why = _verdict(op, call)
    return None if wins else why


def _verdict(op: str, call: dict) -> tuple[bool, str]:
    """Time the int8 kernel against the fp32 path that would run without it, once per shape and size class."""
    x, weight = call["x"], call["weight"]
    rows = x.numel() // x.shape[-1]
    key = (*weight.shape, call.get("act"), op == "dense_residual_layernorm", timing.size_class(rows))
    if key not in _verdicts:
        mine = linear if op == "linear" else dense_residual_layernorm
        with torch.no_grad():
            fast, plain = timing.best_times(lambda: mine(**call), lambda: fallback[op](**call))
        wins = fast * _TIE_MARGIN < plain
        shape = f"[{rows}, {weight.shape[1]}] x [{weight.shape[1]}, {weight.shape[0]}]"
        epilogue = " + residual + LayerNorm" if key[3] else (f" + {key[2]}" if key[2] else "")
        _verdicts[key] = (
            wins,
            f"{'int8' if wins else 'fp32'} for {shape}{epilogue}: int8 {fast * 1e3:.2f} ms vs fp32 "
            f"{plain * 1e3:.2f} ms CPU time",
        )
    return _verdicts[key]


def verdicts() -> dict[tuple, tuple[bool, str]]:
    """Every first-use timing so far: (N, K, act, residual + LayerNorm, size class) -> (int8 wins, why)."""
    return dict(_verdicts)


def describe() -> str | None:
    """Which GEMM shapes run int8 here and why the others do not, for explain(); None before any was judged."""
    if not _verdicts:
        return None
    chosen = sum(wins for wins, _ in _verdicts.values())
    lines = [why for _, why in _verdicts.values()]
    return (f"GEMMs of int8-quantized models, timed at first use: {chosen} of {len(lines)} shapes run int8 (the rest "
            "stay fp32, measured slower in int8)\n  " + "\n  ".join(lines))  # fmt: skip


SPEC = Backend(
    "int8",
    devices=("cpu",),
    dtypes=(torch.float32,),
    module=sys.modules[__name__],
    ops=("linear", "dense_residual_layernorm"),
    limits={
        "linear": lambda call, forced: _refuses("linear", call, forced),
        "dense_residual_layernorm": lambda call, forced: _refuses("dense_residual_layernorm", call, forced),
    },
    opt_in="only in models quantized with fastbert.optimize(model, quantize='int8')",
)
