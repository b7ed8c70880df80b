"""The `onednn` backend: oneDNN GEMMs on weights prepacked once, with their epilogues fused (the
`linear` and `dense_residual_layernorm` ops), and attention without padding.

`linear`: torch's default CPU fp32 matmul leaves much of a modern x86 core idle; oneDNN with a prepacked (blocked)
weight layout gets close to the roof, and fusing bias + GELU into the GEMM saves a pass over the FFN's [T, 4H]
activations. Whether it wins is measured on this machine, not assumed: at first use per (dtype, weight shape, size
class) both paths are timed on the actual input, and the verdict (with its timings) is what the dispatch reports in
`fastbert.explain()`. `FASTBERT_CPU_GEMM=gemm|onednn|torch` skips the measurement (fastbert.backends.gemm).
Inference only (the prepacked op has no autograd). Under CPU autocast the GEMM runs in the autocast dtype on a cached
copy of the weight in that dtype, where autocast itself would recast the fp32 weight on every call. Packs are cached
per weight tensor and rebuilt when it changes (in-place update, new storage) or dies. On a CPU without bf16 dot
products (`fastbert.capabilities`), a bf16 GEMM runs as an fp32 GEMM on a cached fp32 pack of the bf16-rounded weight,
rounded once to bf16 on store: the same arithmetic at fp32 speed, where oneDNN's bf16 would be emulated or refused.

`attention`: on a CPU reading `cu_seqlens` costs nothing, so each sequence gets its own unmasked SDPA call (torch's
flash CPU kernel) straight on the packed tensor: no padded copy, no mask, no work on padding.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastbert import capabilities, reference
from fastbert.backends import timing
from fastbert.backends.spec import Backend
from fastbert.weight_stamp import WeightCache

# activation kind -> (oneDNN post-op, algorithm)
_POST_OPS = {None: ("none", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}
# oneDNN keeps the call unless F.linear is >10% faster: within noise, the fused epilogues (residual, GELU) that one
# timed GEMM does not show decide
_TIE_MARGIN = 1.1
# A residual GEMM (dense_residual_layernorm) stays on oneDNN unless the op without it is 25% faster: with every GEMM on
# oneDNN the native layer stack takes the encoder's later layers (bf16 MiniLM-L6 forwards 1.13-1.44x faster stacked,
# `python -m benchmarks.bench_layer_stack`), which a per-op timing cannot see; with the 10% margin a 12% difference at
# 192 rows, within this host's noise, kept a bf16 model's FFN out on torch and the whole model op by op.
_RESIDUAL_MARGIN = 1.25

# (weight, dtype, GEMM dtype) -> (packed weight, bias in the GEMM dtype)
_packs = WeightCache()
# (GEMM dtype, N, K, fused act, bias, size class) -> (oneDNN wins, why), and for dense_residual_layernorm
# (dtype, GEMM dtype, N, K, 'residual', size class)
_verdicts: dict[tuple, tuple[bool, str]] = {}
# (GEMM dtype, N, K, rows) -> (two calls on the row halves win, why): see row_parts
_splits: dict[tuple, tuple[bool, str]] = {}
# rows below which a GEMM is never cut: a part of fewer than half of them pays a call's fixed cost for too little work
_SPLIT_FROM = 256


@torch.compiler.assume_constant_result  # asked once, maybe while torch.compile traces: mkldnn.is_available breaks it
def unavailable_reason() -> str | None:
    """Why this backend cannot load here, or None."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch has no oneDNN prepacked linear"
    return None


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype oneDNN multiplies in: bf16 only where bf16 GEMMs are fast and oneDNN's bf16 prepack runs
    (fastbert.capabilities), else fp32 on the upcast bf16 operands, the same arithmetic."""
    if dtype != torch.bfloat16:
        return dtype
    native = not capabilities.bf16_via_fp32(torch.device("cpu")) and capabilities.onednn_bf16_prepack().ok
    return dtype if native else torch.float32


def refuses_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    act: str | None = None,
    forced: bool = False,
    residual: dict | None = None,
) -> str | None:
    """The dispatch limit check: why oneDNN should not take this call, or None. Forced by name, it takes every call
    it can run, without the first-use timing; `residual`: a dense_residual_layernorm call, timed as a whole."""
    if torch.compiler.is_compiling():
        return "under torch.compile/export tracing"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return "forward only: inputs require grad"
    if act not in _POST_OPS:
        return f"no fused epilogue for {act!r}"
    dtype = reference.autocast_dtype(x)
    if dtype not in (torch.float32, torch.bfloat16):
        return f"does not take {dtype}"
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or weight.device.type != "cpu":
        return "not a CPU [N, K] weight matching x"
    mode = timing.cpu_gemm_mode()
    if mode == "torch":
        return "FASTBERT_CPU_GEMM=torch"
    if mode in ("gemm", "onednn") or forced or x.numel() == 0:  # gemm: what fastbert's GEMM refuses, oneDNN takes
        return None
    if residual is not None:
        wins, why = _residual_verdict(residual)
    else:
        wins, why = _verdict(x, weight, bias, act, dtype)
    return None if wins else why


def linear(
    x: torch.Tensor,  # [*, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    act: str | None = None,
) -> torch.Tensor:  # [*, N] in reference.autocast_dtype(x)
    """act(x @ weight^T + bias) with the prepacked weight; bias and activation fused into the GEMM."""
    dtype = reference.autocast_dtype(x)
    run = gemm_dtype(dtype)
    packed, b = _packed(weight, bias, dtype, run)
    rows = x.reshape(-1, x.shape[-1]).to(dtype).to(run).contiguous()  # bf16 semantics: operands rounded to dtype
    if rows.shape[0] == 0:
        return rows.new_empty(*x.shape[:-1], weight.shape[0], dtype=dtype)
    attr, algorithm = _POST_OPS[act]
    parts = rows.split(row_parts(rows, packed, b, weight.shape[0]))
    outs = [torch.ops.mkldnn._linear_pointwise(part, packed, b, attr, [], algorithm) for part in parts]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.view(*x.shape[:-1], weight.shape[0]).to(dtype)


def dense_residual_layernorm(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor,  # [N]
    residual: torch.Tensor,  # [T, N], x's dtype
    ln_weight: torch.Tensor,  # [N]
    ln_bias: torch.Tensor,  # [N]
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:  # [T, N]
    """LayerNorm(x @ weight^T + bias + residual): bias and residual added in the GEMM's epilogue, one LayerNorm pass
    after (torch's CPU LayerNorm accumulates bf16 input in fp32, so statistics stay fp32 without an upcast copy).
    No dropout: the limit check leaves training with dropout to the unfused path."""
    if training and dropout_p > 0:
        raise ValueError("the fused oneDNN epilogue has no dropout: pass dropout_p=0 or training=False")
    if x.shape[0] == 0:
        return residual.new_empty(residual.shape)
    dtype = x.dtype
    run = gemm_dtype(dtype)
    packed, b = _packed(weight, bias, dtype, run)
    x, residual = x.to(run).contiguous(), residual.to(run).contiguous()
    parts = row_parts(x, packed, b, weight.shape[0])
    hs = [torch.ops.mkldnn._linear_pointwise.binary(xs, rs, packed, b, "add")
          for xs, rs in zip(x.split(parts), residual.split(parts), strict=True)]  # fmt: skip
    h = hs[0] if len(hs) == 1 else torch.cat(hs)
    return F.layer_norm(h, h.shape[-1:], ln_weight.to(run), ln_bias.to(run), eps).to(dtype)


def _packed(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, run: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cached oneDNN layout of `weight` rounded to `dtype` and held in `run` (and bias likewise), rebuilt when
    either changes."""

    def build() -> tuple[torch.Tensor, torch.Tensor | None]:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype).to(run).contiguous())
        return packed, bias.detach().to(dtype).to(run).contiguous() if bias is not None else None

    return _packs.get(weight, (dtype, run), (bias,), build)


def operands(weight: torch.Tensor, bias: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GEMM of `rows` rows as the native `encoder_layers` takes it (fastbert.execution.stack): (the prepacked MKLDNN
    weight, the rows of each call as int64 (row_parts, as decided so far), the bias in the GEMM's dtype); the native
    call makes this module's calls, in its order."""
    dtype = weight.dtype if weight.dtype == torch.bfloat16 else torch.float32
    run = gemm_dtype(dtype)
    packed, b = _packed(weight, bias, dtype, run)
    return packed, _parts_tensor(_decided_parts((run, *weight.shape), rows)), b


def row_parts(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """The rows each oneDNN call of a GEMM on `rows` [M, K] (N outputs) takes: all M, or, where two calls on its
    halves were measured faster at this M (timed at first use like the other verdicts), each half cut by the same rule.

    Why: oneDNN's bf16 GEMM on AMX splits some shapes badly between threads. On 2 threads [M, 768] x [768, 768] at
    M = 448-1024 took as long as on one thread (640 rows: 439 us; two calls on 320 rows: 259 us), [M, 1536] x [1536,
    384] at 256-512 rows 1.1-1.7x longer than calls on 128 rows (`python -m benchmarks.bench_onednn_rows`; the cut that
    wins moves between runs and row counts, so it is timed, not assumed). fp32 GEMMs showed no such row counts, and
    GEMMs with more outputs than inputs (QKV, FFN in) gained at most 1.13x from halves, less than a first use spends
    timing every row count; so only bf16 GEMMs with N <= K are cut, and only on a CPU where a probe found halves
    faster at all (without AMX one call won at every row count, and timing each new one cost a stream of batches a third
    of its first pass). FASTBERT_CPU_GEMM leaves this alone: it picks the backend, and this is how oneDNN takes the
    GEMM."""
    m, k = rows.shape
    shape = (rows.dtype, n, k)
    if _cuttable(*shape, m) and getattr(_splits.get((*shape, m)), "evidence", True) is not None:  # unsettled
        for half in rows.split(_halves(m)):  # the halves' verdicts first: the cut timed here runs them
            row_parts(half, packed, bias, n)
        parts, call = _cut(shape, m), torch.ops.mkldnn._linear_pointwise

        def cut() -> list[torch.Tensor]:
            return [call(part, packed, bias, "none", [], "") for part in rows.split(parts)]

        what = f"[{m}, {k}] x [{k}, {n}] bfloat16 in {len(parts)} calls of {min(parts)}+ rows"
        timing.judge(_splits, (*shape, m), cut, lambda: call(rows, packed, bias, "none", [], ""),
                     ("oneDNN on row parts", "one oneDNN call"), what, _TIE_MARGIN)  # fmt: skip
    return _decided_parts(shape, m)


def parts_settled(weight: torch.Tensor, rows: int) -> bool:
    """Whether row_parts would time nothing for a GEMM of `weight` on `rows` rows (its cut is settled, or the GEMM is
    never cut): the CPU layer stack's question before it sends a layer's oneDNN GEMMs to the native call."""
    dtype = weight.dtype if weight.dtype == torch.bfloat16 else torch.float32
    shape = (gemm_dtype(dtype), *weight.shape)
    return not _cuttable(*shape, rows) or getattr(_splits.get((*shape, rows)), "evidence", True) is None


def _decided_parts(shape: tuple, m: int) -> tuple[int, ...]:
    """The rows of each call for a GEMM of `shape` (GEMM dtype, N, K) on `m` rows, from the verdicts so far, timing
    nothing (one call where none was made): row_parts' answer, and what the native layer stack passes."""
    verdict = _splits.get((*shape, m)) if _cuttable(*shape, m) else None
    return _cut(shape, m) if verdict is not None and verdict[0] else (m,)


def _cut(shape: tuple, m: int) -> tuple[int, ...]:
    """The calls of `m` rows cut in halves, each half as the verdicts so far take it."""
    return tuple(p for half in _halves(m) for p in _decided_parts(shape, half))


def _halves(m: int) -> tuple[int, int]:
    return m - m // 2, m // 2


def _cuttable(dtype: torch.dtype, n: int, k: int, m: int) -> bool:
    """Whether row_parts times cutting a [m, k] x [k, n] GEMM in `dtype` (see its docstring for why these): only on a
    CPU where halves were found faster at all (capabilities.onednn_bf16_row_cuts)."""
    return dtype == torch.bfloat16 and n <= k and m >= _SPLIT_FROM and capabilities.onednn_bf16_row_cuts().ok


@functools.lru_cache(maxsize=256)
def _parts_tensor(parts: tuple[int, ...]) -> torch.Tensor:
    """The row parts as the native layer stack takes them, made once per distinct tuple (every forward asks)."""
    return torch.tensor(parts, dtype=torch.int64)


# The dense_residual_layernorm a call takes without this backend: the dispatcher puts its own here, with oneDNN
# excluded (a GEMM, then bias + residual + LayerNorm in one pass), so the timing compares the two whole ops.
fallback: dict[str, Callable[..., torch.Tensor]] = {}


def _residual_verdict(call: dict) -> tuple[bool, str]:
    """oneDNN's dense_residual_layernorm (bias and residual in the GEMM's epilogue, then LayerNorm) against the op
    without oneDNN, on this very call, once per size class: the bare GEMMs alone would leave out the epilogues, which
    differ between the two."""
    x, weight = call["x"], call["weight"]
    dtype = reference.autocast_dtype(x)  # in the key: the rival differs by dtype even where the GEMM's does not
    rows, run = x.numel() // x.shape[-1], gemm_dtype(dtype)
    key = (dtype, run, *weight.shape, "residual", timing.size_class(rows))
    verdict = _verdicts.get(key)
    if verdict is not None and getattr(verdict, "evidence", None) is None:  # settled (timing.judge re-checks the rest)
        return verdict
    what = timing.gemm_words(rows, weight, f" {str(run).removeprefix('torch.')} + residual + LayerNorm")
    op = fallback["dense_residual_layernorm"]
    return timing.judge(_verdicts, key, lambda: dense_residual_layernorm(**call), lambda: op(**call),
                        ("oneDNN", "the op without it"), what, 1 / _RESIDUAL_MARGIN)  # fmt: skip


# What runs a GEMM's bias + activation when oneDNN does not take the GEMM: the dispatcher puts its `bias_act` op here
# (the calibration times oneDNN against that path) without this module importing the dispatcher.
fallback_bias_act: Callable[..., torch.Tensor] = reference.bias_act


def _verdict(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str | None, dtype: torch.dtype
) -> tuple[bool, str]:
    """oneDNN against what would run without it, on this very input, once per size class: F.linear, then (with a bias
    and an activation) the `bias_act` op, as `fastbert.ops.linear` falls back; both in the GEMM dtype."""
    rows, run = x.numel() // x.shape[-1], gemm_dtype(dtype)
    # bf16 via fp32 is fp32's case
    key = (run, *weight.shape, act is not None, bias is not None, timing.size_class(rows))
    verdict = _verdicts.get(key)
    if verdict is not None and getattr(verdict, "evidence", None) is None:  # settled (timing.judge re-checks the rest)
        return verdict
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        xs = x.reshape(rows, -1).to(dtype)
        w, b = weight.to(dtype).to(run), bias.to(dtype).to(run) if bias is not None else None
    fused = act is not None and b is not None

    def plain() -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            xr = xs.to(run)
            if fused:
                return fallback_bias_act(F.linear(xr, w), b, act).to(dtype)
            return reference.linear(xr, w, b, act).to(dtype)

    def mine() -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return linear(xs, weight, bias, act)

    what = timing.gemm_words(rows, weight, f" {str(run).removeprefix('torch.')}")
    other = "F.linear + bias_act" if fused else "F.linear"
    return timing.judge(_verdicts, key, mine, plain, ("oneDNN", other), what, 1 / _TIE_MARGIN)


def verdicts() -> dict[tuple, tuple[bool, str]]:
    """Every calibration made so far: (GEMM dtype, N, K, fused act, bias, size class), or (dtype, GEMM dtype, N, K,
    'residual', size class) for dense_residual_layernorm -> (oneDNN wins, timings)."""
    return dict(_verdicts)


def attention(
    qkv: torch.Tensor,  # [T, 3, nH, D] packed tokens
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    max_seqlen: int,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
    position_bias: torch.Tensor | None = None,  # refused (_refuses_attention)
    position_scores: torch.Tensor | None = None,  # refused
    position_columns: torch.Tensor | None = None,  # refused
    rotary: torch.Tensor | None = None,  # refused
    window: int | None = None,  # refused
) -> torch.Tensor:  # [T, nH, D]
    """softmax(q k^T * scale) v within each sequence: one SDPA call per sequence, one per batch if none is padded."""
    if position_bias is not None or position_scores is not None or rotary is not None or window is not None:
        raise ValueError("the onednn attention takes no relative position terms, rotary positions or window")
    total, _, heads, dim = qkv.shape
    p = dropout_p if training else 0.0
    batch = cu_seqlens.numel() - 1
    with reference.no_autocast(qkv.device):
        if total == batch * max_seqlen:  # nothing padded: the packed tensor is a [B, S] batch already
            q, k, v = qkv.view(batch, max_seqlen, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=scale)  # [B, nH, S, D]
            return out.transpose(1, 2).reshape(total, heads, dim)
        per_head = qkv.permute(1, 2, 0, 3)  # [3, nH, T, D] view
        bounds = cu_seqlens.tolist()
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end > start:  # [1, nH, L, D]: 4-D inputs take the flash kernel
                q, k, v = per_head[:, None, :, start:end].unbind(0)
                outs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=scale)[0].transpose(0, 1))
    # one gather of the per-sequence [L, nH, D] views back into packed order (every row belongs to one sequence)
    return torch.cat(outs) if outs else qkv.new_empty(0, heads, dim)


def refuses_dense_residual_layernorm(call: dict, forced: bool) -> str | None:
    """The fused epilogue's limits: inference with one dtype throughout, then the GEMM's own."""
    if call.get("training") and call.get("dropout_p", 0.0) > 0:
        return "no dropout in the fused epilogue"
    x, weight, residual = call["x"], call["weight"], call["residual"]
    if not x.dtype == residual.dtype == weight.dtype or torch.is_autocast_enabled(x.device.type):
        return "mixed dtypes or autocast (the epilogue adds the residual in the GEMM's dtype)"
    return refuses_linear(x, weight, forced=forced, residual=call)


def _refuses_attention(call: dict, forced: bool) -> str | None:
    if call.get("position_bias") is not None or call.get("position_scores") is not None:
        return "no relative position terms (SDPA takes them only as a materialised [nH, L, L] mask)"
    if call.get("rotary") is not None or call.get("window") is not None:
        return "no rotary positions or window (SDPA would need them applied or masked in separate passes)"
    # a loop over cu_seqlens read on the host: torch.compile/export trace the reference instead
    return "under torch.compile/export tracing" if torch.compiler.is_compiling() else None


SPEC = Backend(
    "onednn",
    devices=("cpu",),
    dtypes=(torch.float32, torch.bfloat16),
    module=sys.modules[__name__],
    ops=("linear", "dense_residual_layernorm", "attention"),
    forward_only=True,
    decides_per_call="times each GEMM size class at first use against the path without it",
    limits={
        "linear": lambda call, forced: refuses_linear(**call, forced=forced),
        "dense_residual_layernorm": refuses_dense_residual_layernorm,
        "attention": _refuses_attention,
    },
)
