"""The `int8` backend: dynamic int8 GEMMs on CPU for models that ask for them (`fastbert.optimize(model,
quantize="int8")`, or `quantize="int8"` in the config), on the native extension's `int8_linear` kernel.

Weights are quantised once per output channel, symmetric (q = round(w * 127 / max|w_n|)), and cached until they change;
activations are quantised per row (token) on every call, symmetric; products accumulate in int32; the dequantisation,
bias and epilogue (GELU, a gated feed-forward's act * up, or residual + LayerNorm) run in fp32 on each tile while it is
in L1 (csrc/cpu/linear.inc, shared with the fp32 `gemm` backend). Attention, softmax, LayerNorm statistics and the
embedding stay fp32.

Never silently slower: at first use per (weight shape, epilogue, size class) the int8 kernel is timed against the fp32
path that would run instead, on the call's own input, and a GEMM runs int8 only where int8 was faster; explain() lists
every verdict with its timings. Forced by name (`use_backend("int8")`) it takes every call it can run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from fastbert.backends import gemm, native
from fastbert.backends.spec import COMPOUND_OPS, Backend
from fastbert.weight_stamp import WeightCache

LEVELS = 127  # symmetric int8: [-127, 127], so that negation is exact and both operands share one range
_TIE_MARGIN = 1.0  # int8 changes the numbers: it must be faster outright to be chosen


class QuantizedWeight(NamedTuple):
    """A weight quantised per output channel, as the kernel reads it (the integers: `quantize_rows(weight)`)."""

    # [ceil(N / 32) * 2, ceil(K / s), 16, s]: int16 pairs (s = 2) or, with VNNI, int8 quads (s = 4, `pack_quads`: one
    # more step per panel, its column sums)
    packed: torch.Tensor
    scale: torch.Tensor  # [N] fp32: w ~ values * scale[:, None]


_weights = WeightCache()  # (weight) -> QuantizedWeight
# (N, K, act, epilogue (gemm._EPILOGUES), size class) -> (int8 wins, why)
_verdicts: dict[tuple, tuple[bool, str]] = {}

# The fp32 path a GEMM takes when int8 does not: the dispatcher puts its own `linear` and `dense_residual_layernorm`
# here, with this backend excluded, so the first-use timing compares against what would really run.
fallback: dict[str, Callable[..., torch.Tensor]] = {}


def unavailable_reason() -> str | None:
    """Why int8 GEMMs cannot run here, or None: they need the native CPU extension."""
    return gemm.needs_kernel("int8_linear") or gemm.needs_kernel("int8_max_k")


def k_per_step() -> int:
    """k values per step of the pack the kernels in use read: 4 (int8 quads for VNNI's u8 x s8 dot product, twice the
    multiply-adds of an int16 pair per instruction) or 2 (int16 pairs)."""
    cpu, _ = native.load("_native_cpu")
    return cpu.int8_k_per_step() if cpu is not None and hasattr(cpu, "int8_k_per_step") else 2


def quantize_weight(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8 of an [N, K] weight (an output channel is a row: `quantize_rows`), packed for
    the kernels in use. Only the pack and the scales are kept: the integers are needed by references, not at run
    time."""
    values, scale = quantize_rows(weight.detach().float())
    packed = pack_quads(values) if k_per_step() == 4 else gemm.pack_panels(values.to(torch.int16), 2)
    return QuantizedWeight(packed, scale[:, 0].contiguous())


def pack_quads(values: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 values (any dtype holding them) as the VNNI and AMX kernels read them: the quad panels, each
    followed by one step of its 16 columns' 128 * sum_k values[n, k] as int32, the correction for x's u8 shift (x + 128)
    that would otherwise be summed from the whole weight on every call. [ceil(N / 32) * 2, ceil(K / 4) + 1, 16, 4]"""
    panels = gemm.pack_panels(values.to(torch.int8), 4)
    sums = torch.zeros(panels.shape[0] * gemm.PANEL, dtype=torch.int32)
    sums[: values.shape[0]] = 128 * values.to(torch.int32).sum(1)
    return torch.cat((panels, sums.view(torch.int8).view(panels.shape[0], 1, gemm.PANEL, 4)), 1)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of [M, K] fp32 rows: (values [M, K] as fp32 integers, scale [M, 1]). The same fp32
    operations as the kernel's activation quantisation (a true division for 127 / max|x|, round half to even), so both
    give the same integers; weights are quantised by the same rule, per output channel."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, LEVELS) / amax, torch.zeros_like(amax))
    return torch.round(x * inv), amax / LEVELS


def quantized(weight: torch.Tensor) -> QuantizedWeight:
    """The cached quantisation of `weight` in the pack the kernels in use read, rebuilt if the weight changes."""
    return _weights.get(weight, (k_per_step(),), (), lambda: quantize_weight(weight))


def operands(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GEMM as the native `encoder_layers` takes it (fastbert.execution.stack): (int8 pack, scales, bias)."""
    q = quantized(weight)
    return q.packed, q.scale, bias


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


def gated_linear(
    x: torch.Tensor,  # [*, K] fp32
    weight: torch.Tensor,  # [N, K], or [2N, K] with no up_weight
    bias: torch.Tensor | None = None,  # [N] or [2N]
    up_weight: torch.Tensor | None = None,  # [N, K]
    up_bias: torch.Tensor | None = None,  # [N]
    act: str = "gelu",
) -> torch.Tensor:  # [*, N] fp32
    """act(x @ weight^T + bias) * (x @ up_weight^T + up_bias) on one int8 GEMM over the interleaved weight (each row
    quantised per channel as on its own), the gated values written from each tile."""
    q, biases = gemm.gated_pack(weight, bias, up_weight, up_bias, quantize_weight, _weights, (k_per_step(),))
    cpu, _ = native.load("_native_cpu")
    return cpu.int8_linear(x, q.packed, q.scale, biases, act, gated=gemm.gate_group())


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
    """LayerNorm(x @ weight^T + bias + residual) with an int8 GEMM; dequantisation, bias and residual in fp32 on each
    tile, LayerNorm in a second pass over the finished rows."""
    q = quantized(weight)
    cpu, _ = native.load("_native_cpu")
    return cpu.int8_linear(x, q.packed, q.scale, bias, None, residual, ln_weight, ln_bias, eps)


def max_k() -> int:
    """The longest K the int8 kernels in use take: their int32 sums bound it (the extension's own rule)."""
    cpu, _ = native.load("_native_cpu")
    return cpu.int8_max_k()


def _refuses(op: str, call: dict, forced: bool) -> str | None:
    k, longest = call["x"].shape[-1], max_k()
    if k > longest:
        return f"K = {k} > {longest}: int8 products would overflow their int32 sums"
    mine = {"linear": linear, "dense_residual_layernorm": dense_residual_layernorm, "gated_linear": gated_linear}[op]
    return gemm.refuses_call(
        call, forced, op, lambda: gemm.judge(_verdicts, op, call, mine, fallback[op], ("int8", "fp32"), _TIE_MARGIN)
    )


def verdicts() -> dict[tuple, tuple[bool, str]]:
    """Every first-use timing so far: (N, K, act, epilogue, size class, dtype) -> (int8 wins, why)."""
    return dict(_verdicts)


def describe() -> str | None:
    """How int8 GEMMs multiply here, which shapes run int8 and why the others do not, for explain(); None without the
    kernel."""
    if unavailable_reason() is not None:
        return None
    cpu, _ = native.load("_native_cpu")
    how = ("u8 x s8 on AVX512-VNNI (vpdpbusd: four multiply-adds per 32-bit lane)" if k_per_step() == 4
           else "int16 pairs (two multiply-adds per 32-bit lane; no VNNI kernels here)")  # fmt: skip
    if cpu.isa() == "avx512amx":
        how = ("u8 x s8 on AMX tiles (tdpbusd: 16 x 16 sums of 64 multiply-adds each) where K is a multiple of 64, "
               "else " + how + "; attention's products on bf16 tiles (tdpbf16ps) where bf16 attention would take them")
    judged = gemm.summary(_verdicts, "GEMMs of int8-quantized models", "the rest stay fp32, measured slower in int8")
    return f"int8 GEMMs multiply as {how}" + (f"\n{judged}" if judged else "")


SPEC = Backend(
    "int8",
    devices=("cpu",),
    dtypes=(torch.float32,),
    module=sys.modules[__name__],
    ops=COMPOUND_OPS,
    limits={op: (lambda call, forced, op=op: _refuses(op, call, forced)) for op in COMPOUND_OPS},
    decides_per_call="times each GEMM shape class at first use against the path without it",
    opt_in="only in models quantized with fastbert.optimize(model, quantize='int8')",
)
