"""The `gemm` backend: fastbert's own GEMMs on CPU, fp32 everywhere (the native extension's `fp32_linear`, or
`bf16x3_linear` below) and bf16 on AMX tiles (`bf16_linear`), with the epilogues fused on each tile while it is in L1:
bias + GELU for the FFN's first GEMM, act(gate) * up for a gated one (GeGLU, SwiGLU, fp32: the two weights
interleaved, so a tile holds both products of its outputs), bias + residual + LayerNorm for the output projections
(csrc/cpu/linear.inc, amx_bf16_linear.inc). Weights are packed once into panels of 16 columns (bf16: of k pairs) and
cached until they change.

fp32 on AMX tiles (`bf16x3_linear`, amx_bf16x3_linear.inc): where the kernels have AMX bf16 tiles, an fp32 GEMM
whose K is a multiple of 32 splits x and W into three bf16 parts each and sums the six products that reach fp32's
rounding, with fp32's accuracy (its error against an fp64 reference within 2x that of torch fp32 or the FMA kernel,
tests/test_bf16x3_gemm.py) at 1.1-1.6x the FMA kernel's speed at BERT-base's shapes (`python -m
benchmarks.bench_gemm`), above FMA_ROWS rows: at fewer the GEMM waits on its weight, whose FMA pack (4 bytes an
element) comes faster than the three parts (6). `FASTBERT_CPU_FP32=fma` keeps fp32 GEMMs on vector FMA, `=bf16x3` on
the tiles at any row count.
The kernel keeps its split rows (and, at K over 768, its running sums) allocated on each calling thread between calls,
up to 64 MiB each.

Why its own kernel: at the encoder's shapes (a few hundred rows of K = 384..3072) torch's MKL GEMM and oneDNN leave
15-30% of a core's FMA throughput idle, more at small M, and neither fuses LayerNorm; this tile reaches about 85% of
the FMA peak on AVX2 (`python -m benchmarks.bench_gemm`). In bf16 on AMX, a layer's weights come from L3 or memory
at a third of the rate the tiles consume them; this kernel loads each panel pair once for a group of row blocks whose
x stays in L2 and prefetches the next pair meanwhile (BERT-base's four GEMMs at 128 rows: 0.93 ms, oneDNN 1.45).
Never silently slower: at first use per (weight shape, epilogue, size class, dtype) it is timed against the path that
would run without it (oneDNN or torch, themselves chosen by measurement), on the call's own input; explain() lists
every verdict. `FASTBERT_CPU_GEMM=gemm|onednn|torch` skips the measurement: the first of gemm, oneDNN, torch from the
one named that can take a call takes it, so every process runs the same GEMMs. The same limits and first-use timing
serve the int8 backend, whose kernel shares the fp32 one's tiling and epilogue.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from fastbert import reference
from fastbert.backends import native, timing
from fastbert.backends.spec import COMPOUND_OPS, Backend
from fastbert.weight_stamp import WeightCache

PANEL = 16  # output columns per packed panel
PANEL_COLUMNS = 32  # the pack pads N to a multiple of this (the widest tile, AVX-512's 32 columns)
NO_SCALES = torch.empty(0)  # an fp32 pack's per-channel scales, for `operands`
_TIE_MARGIN = 1.0  # its epilogues are in both timings: faster outright, or the other path keeps the call
FP32_ENV = "FASTBERT_CPU_FP32"
FP32_MODES = ("auto", "bf16x3", "fma")
# fp32 GEMMs of this many rows or fewer (timing's "few" size class) take vector FMA where the tiles could run them
# ("auto"): at so few rows both kernels wait on the weight, and the FMA pack's 4 bytes an element come faster than the
# three bf16 parts' 6, and the FMA kernel cuts such GEMMs by columns alone (csrc/cpu/linear.inc, kFewRows). One
# sequence, back to back, 2 threads: all-MiniLM-L6-v2 1.66x (16 tokens), 1.15x (24), 1.26x (28), 1.10x (32); BERT-base
# 1.55x, 1.19x, 1.21x, 1.09x. A row bucket's bound, so bucketing never changes a GEMM's kernel.
FMA_ROWS = timing.FEW_M

_packs = WeightCache()  # (weight) -> packed panels: fp32, bf16 or bf16x3 parts
# (N, K, act, epilogue (_EPILOGUES), size class) -> (gemm wins, why)
_verdicts: dict[tuple, tuple[bool, str]] = {}

# The path a GEMM takes without this backend: the dispatcher puts its own `linear` and `dense_residual_layernorm`
# here, with this backend excluded, so the first-use timing compares against what would really run.
fallback: dict[str, Callable[..., torch.Tensor]] = {}


def needs_kernel(name: str) -> str | None:
    """Why the native CPU extension's kernel `name` cannot run here, or None."""
    cpu, reason = native.load("_native_cpu")
    if cpu is None:
        return f"needs the native CPU extension ({reason})"
    return None if hasattr(cpu, name) else f"the native CPU extension predates {name}: rebuild it"


def unavailable_reason() -> str | None:
    """Why fastbert's GEMMs cannot run here, or None: they need the native CPU extension."""
    return needs_kernel("fp32_linear")


def pack_panels(values: torch.Tensor, k_per_step: int) -> torch.Tensor:
    """An [N, K] weight (fp32, or int8 values as int16 or int8) as the kernels read it: [ceil(N / 32) * 2, steps, 16,
    k_per_step], N zero-padded to 32 and K to a whole step, where a step is one k (fp32), a k pair (int8 as int16) or
    four k (int8 quads)."""
    n, k = values.shape
    padded = values.contiguous()
    if n % PANEL_COLUMNS or k % k_per_step:  # BERT's widths need no padding: one copy, the permuting one, not three
        padded = values.new_zeros(-(-n // PANEL_COLUMNS) * PANEL_COLUMNS, -(-k // k_per_step) * k_per_step)
        padded[:n, :k] = values
    steps = padded.shape[1] // k_per_step
    return padded.view(padded.shape[0] // PANEL, PANEL, steps, k_per_step).permute(0, 2, 1, 3).contiguous()


def packed(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The cached panels of `weight` in `dtype` (fp32, one k a step; bf16, k pairs), rebuilt if the weight changes."""
    step = 2 if dtype == torch.bfloat16 else 1
    return _packs.get(weight, (dtype,), (), lambda: pack_panels(weight.detach().to(dtype), step))


def bf16_parts(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 values as three bf16 parts, v ~ v0 + v1 + v2 to fp32's 24 bits (each part the rounded remainder of the
    ones before); an infinite or NaN v0 has zero lower parts."""
    v = values.float()
    v0 = v.bfloat16()
    rest = torch.where(v0.float().isfinite(), v - v0.float(), 0.0)
    v1 = rest.bfloat16()
    return v0, v1, (rest - v1.float()).bfloat16()


def pack_bf16x3(weight: torch.Tensor) -> torch.Tensor:
    """An [N, K] fp32 weight as `bf16x3_linear` reads it: [ceil(N / 32) * 2, 3, K / 2, 16, 2] bf16, each panel's three
    parts (bf16_parts) one after another, each a bf16 pack's panel."""
    return torch.stack([pack_panels(part, 2) for part in bf16_parts(weight.detach())], 1).contiguous()


def fp32_mode() -> str:
    """How fastbert's fp32 GEMMs multiply here: "auto" (AMX bf16 tiles, three bf16 parts an operand, above FMA_ROWS
    rows; vector FMA at fewer) where the kernels have AMX bf16 tiles, else "fma"; FASTBERT_CPU_FP32=bf16x3 asks for
    the tiles at any row count, =fma for vector FMA anywhere. A value that is not a mode is a ValueError listing
    them."""
    asked = os.environ.get(FP32_ENV, "auto")
    if asked not in FP32_MODES:
        raise ValueError(f"{FP32_ENV}={asked!r} is not one of {', '.join(FP32_MODES)}")
    cpu, _ = native.load("_native_cpu")
    has_tiles = cpu is not None and hasattr(cpu, "bf16x3_linear") and cpu.has_bf16_linear()
    return asked if asked != "fma" and has_tiles else "fma"


def rows_of(x: torch.Tensor) -> int:
    """The rows of a GEMM on x [*, K]: what its kernel and its size class are chosen by."""
    return x.numel() // max(x.shape[-1], 1)


def fp32_kernel(k: int, rows: int, mode: str | None = None) -> str:
    """The kernel an fp32 GEMM of `rows` rows over K takes: "bf16x3" where `mode` (fp32_mode() when None) allows the
    tiles and K is whole tile steps of 32, in "auto" only above FMA_ROWS rows; else "fma"."""
    mode = mode or fp32_mode()
    if mode == "fma" or k % 32 or (mode == "auto" and rows <= FMA_ROWS):
        return "fma"
    return "bf16x3"


def fp32_pack(weight: torch.Tensor, rows: int, mode: str | None = None) -> torch.Tensor:
    """The cached pack of an fp32 weight for the kernel a call of `rows` rows takes (fp32_kernel): bf16x3 parts or
    fp32 panels (a weight called at both sizes keeps both)."""
    if fp32_kernel(weight.shape[1], rows, mode) == "bf16x3":
        return _packs.get(weight, ("bf16x3",), (), lambda: pack_bf16x3(weight))
    return packed(weight)


def operands(
    weight: torch.Tensor, bias: torch.Tensor, rows: int, mode: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GEMM of `rows` rows as the native `encoder_layers` takes it (fastbert.execution.stack): (packed panels, bf16
    for a bf16 weight, bf16x3 parts or fp32 for an fp32 one (fp32_pack, in `mode`: fp32_mode() read once for a
    forward's layers); no scales; bias)."""
    if weight.dtype == torch.bfloat16:
        return packed(weight, torch.bfloat16), NO_SCALES, bias
    return fp32_pack(weight, rows, mode), NO_SCALES, bias


def bf16_refusal(op: str, call: dict) -> str | None:
    """Why the bf16 GEMM on AMX tiles cannot take a bf16 call, or None."""
    if (why := needs_kernel("bf16_linear")) is not None:
        return why
    cpu, _ = native.load("_native_cpu")
    if not cpu.has_bf16_linear():
        return f"bf16 GEMMs need AMX bf16 tiles; the {cpu.isa()} kernels in use have none"
    if op == "gated_linear":
        return "no gated bf16 GEMM (its epilogue has no gate)"
    if (k := call["x"].shape[-1]) % 32:
        return f"K = {k} is not a multiple of 32 (the AMX bf16 tile's step)"
    return None


def linear(
    x: torch.Tensor,  # [*, K] fp32
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    act: str | None = None,
) -> torch.Tensor:  # [*, N] fp32
    """act(x @ weight^T + bias), bias and activation applied on each tile of the GEMM; in x's dtype (fp32, or bf16 on
    AMX tiles)."""
    cpu, _ = native.load("_native_cpu")
    if x.dtype == torch.bfloat16:
        return cpu.bf16_linear(x, packed(weight, torch.bfloat16), weight.shape[0], bias, act)
    pack = fp32_pack(weight, rows_of(x))
    run = cpu.bf16x3_linear if pack.dtype == torch.bfloat16 else cpu.fp32_linear
    return run(x, pack, weight.shape[0], bias, act)


def gate_group() -> int:
    """The column group a gated weight's activated and up rows are interleaved in: half the kernels' tile (8 on AVX2
    and the scalar build, 16 on AVX-512)."""
    cpu, _ = native.load("_native_cpu")
    return cpu.gate_group()


def interleaved(first: torch.Tensor, second: torch.Tensor, group: int) -> torch.Tensor:
    """Rows (or entries) of two [N, ...] tensors interleaved in groups: first[0:g], second[0:g], first[g:2g], ...:
    a gated weight (or bias) as its GEMM's tiles read it, each tile holding both products of the same g outputs."""
    n = first.shape[0]
    return torch.stack((first.reshape(n // group, group, -1), second.reshape(n // group, group, -1)), 1).reshape(
        2 * n, *first.shape[1:])  # fmt: skip


def gated_operands(
    weight: torch.Tensor, bias: torch.Tensor | None, up_weight: torch.Tensor | None, up_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(activated weight, its bias, up weight, its bias) of a `gated_linear` call: a stacked [2N, K] weight's halves
    (and its [2N] bias's) when there is no up_weight."""
    if up_weight is None:
        weight, up_weight = weight.chunk(2)
        bias, up_bias = bias.chunk(2) if bias is not None else (None, None)
    return weight, bias, up_weight, up_bias


def gated_pack(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    build: Callable[[torch.Tensor], object],
    cache: WeightCache,
    variant: tuple = (),
) -> tuple[object, torch.Tensor | None]:
    """(`build` of the interleaved [2N, K] weight, the interleaved fp32 [2N] biases or None) of a gated call, cached in
    `cache` on `weight` and rebuilt when any of the four tensors or the kernels' group changes; a missing bias beside
    a present one reads as zeros."""
    group = gate_group()

    def make() -> tuple[object, torch.Tensor | None]:
        first, b, second, c = gated_operands(weight, bias, up_weight, up_bias)
        packed_weight = build(interleaved(first.detach().float(), second.detach().float(), group))
        if b is None and c is None:
            return packed_weight, None
        b = b.detach().float() if b is not None else c.new_zeros(c.shape, dtype=torch.float32)
        c = c.detach().float() if c is not None else b.new_zeros(b.shape)
        return packed_weight, interleaved(b, c, group)

    parts = (bias, up_weight, up_bias)
    return cache.get(weight, ("gated", group, *map(id, parts), *variant), parts, make)


def gated_linear(
    x: torch.Tensor,  # [*, K] fp32
    weight: torch.Tensor,  # [N, K], or [2N, K] with no up_weight
    bias: torch.Tensor | None = None,  # [N] or [2N]
    up_weight: torch.Tensor | None = None,  # [N, K]
    up_bias: torch.Tensor | None = None,  # [N]
    act: str = "gelu",
) -> torch.Tensor:  # [*, N] fp32
    """act(x @ weight^T + bias) * (x @ up_weight^T + up_bias) on one GEMM over the interleaved weight: each tile
    computes both products of its outputs and writes only the gated values."""
    cpu, _ = native.load("_native_cpu")
    pack, biases = gated_pack(weight, bias, up_weight, up_bias, lambda w: pack_panels(w, 1), _packs)
    width = weight.shape[0] * (2 if up_weight is not None else 1)  # the interleaved weight's rows: 2N
    return cpu.fp32_linear(x, pack, width, biases, act, gated=gate_group())


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
    """LayerNorm(x @ weight^T + bias + residual): bias and residual on each tile, LayerNorm in a second pass over the
    finished rows (kept in fp32 for a bf16 x)."""
    cpu, _ = native.load("_native_cpu")
    if x.dtype == torch.bfloat16:
        return cpu.bf16_linear(x, packed(weight, torch.bfloat16), weight.shape[0], bias, None, residual, ln_weight,
                               ln_bias, eps)  # fmt: skip
    pack = fp32_pack(weight, rows_of(x))
    run = cpu.bf16x3_linear if pack.dtype == torch.bfloat16 else cpu.fp32_linear
    return run(x, pack, weight.shape[0], bias, None, residual, ln_weight, ln_bias, eps)


# a verdict key's epilogue part: False (bias and activation), True (residual + LayerNorm), "gated" (act * up); a
# gated call with an up_weight is keyed by one of its two [N, K] weights ("gated twice")
_EPILOGUES = {"dense_residual_layernorm": True, "gated_linear": "gated"}


def gated_refusal(call: dict) -> str | None:
    """Why the gated GEMM kernel cannot take a `gated_linear` call's shapes, or None."""
    weight, up_weight, act = call["weight"], call.get("up_weight"), call.get("act", "gelu")
    if act not in reference.GATE_ACTIVATIONS:
        return f"activation {act!r} is none of {reference.GATE_ACTIVATIONS}"
    if up_weight is None and weight.shape[0] % 2:
        return f"a stacked gated weight needs an even number of rows, got {weight.shape[0]}"
    if up_weight is not None and up_weight.shape != weight.shape:
        return f"up_weight {tuple(up_weight.shape)} is not shaped like weight {tuple(weight.shape)}"
    width = weight.shape[0] // (2 if up_weight is None else 1)
    if width % (group := gate_group()):
        return f"gated width {width} is not a multiple of the tile's group of {group} columns"
    return None


def refuses_call(
    call: dict,
    forced: bool,
    op: str,
    verdict: Callable[[], tuple[bool, str]],
    bf16: Callable[[str, dict], str | None] | None = None,
) -> str | None:
    """The limits of fastbert's GEMM kernels (fp32, bf16 and int8): inference on CPU tensors of one dtype, fp32 (or
    bf16 where `bf16` says why not, or None), a gated call's shapes; then, unless forced by name, the measured
    `verdict()` for this shape."""
    x, weight = call["x"], call["weight"]
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in call.values()):
        return "forward only: inputs require grad"
    if call.get("training") and call.get("dropout_p", 0.0) > 0:
        return "no dropout in the GEMM epilogue"
    if torch.is_autocast_enabled("cpu"):
        return "under autocast: these GEMMs take and give fp32"
    if torch.compiler.is_compiling():
        return "under torch.compile/export tracing"
    dtype = torch.bfloat16 if bf16 is not None and x.dtype == torch.bfloat16 else torch.float32
    if not all(t.dtype is dtype and t.is_cpu for t in call.values() if isinstance(t, torch.Tensor)):
        return "takes fp32 CPU tensors only" if bf16 is None else "takes fp32 or bf16 CPU tensors, one dtype throughout"
    if dtype == torch.bfloat16 and (why := bf16(op, call)) is not None:
        return why
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return "not an [N, K] weight matching x"
    if weight.shape[1] == 0:
        return "K = 0: an empty product, left to torch"
    if op == "gated_linear" and (why := gated_refusal(call)) is not None:
        return why
    if forced or x.numel() == 0 or native.oversubscribed():
        return None  # oversubscribed: this kernel's regions follow the busy-host policy, oneDNN's team would stall
        # (and a verdict timed now would be the load's)
    wins, why = verdict()
    return None if wins else why


def judge(
    verdicts: dict[tuple, tuple[bool, str]],
    op: str,
    call: dict,
    mine: Callable[..., torch.Tensor],
    other: Callable[..., torch.Tensor],
    names: tuple[str, str],
    margin: float,
    kernel: str | None = None,
) -> tuple[bool, str]:
    """`mine` against `other` (the path that runs without it) on this call, per (weight shape, epilogue, size class):
    the fp32 and int8 GEMM backends' first-use verdict, checked again while provisional (timing.judge). `names`:
    (mine, other) in words; `kernel`: which of its kernels `mine` runs, where that varies (a verdict per kernel)."""
    x, weight = call["x"], call["weight"]
    rows = rows_of(x)
    dtype = str(x.dtype).removeprefix("torch.")
    if kernel is not None:
        dtype += f" as {kernel}"
    key = (*weight.shape, call.get("act"), _EPILOGUES.get(op, False), timing.size_class(rows), dtype)
    verdict = verdicts.get(key)
    if verdict is not None and getattr(verdict, "evidence", None) is None:  # settled: no words to build
        return verdict
    if op == "gated_linear":
        epilogue = f" gated: {key[2]}(one half) * the other" + ("" if call.get("up_weight") is None else ", twice")
    else:
        epilogue = " + residual + LayerNorm" if key[3] else (f" + {key[2]}" if key[2] else "")
    what = timing.gemm_words(rows, weight, epilogue + ("" if dtype == "float32" else f" in {dtype}"))
    return timing.judge(verdicts, key, lambda: mine(**call), lambda: other(**call), names, what, margin)


def summary(verdicts: dict[tuple, tuple[bool, str]], what: str, rest: str) -> str | None:
    """explain()'s paragraph for a backend chosen per GEMM shape by first-use timing; None before any was judged."""
    if not verdicts:
        return None
    chosen = sum(wins for wins, _ in verdicts.values())
    lines = [why for _, why in verdicts.values()]
    return f"{what}, timed at first use: {chosen} of {len(lines)} shapes run here ({rest})\n  " + "\n  ".join(lines)


def _refuses(op: str, call: dict, forced: bool) -> str | None:
    mode = timing.cpu_gemm_mode()
    if mode in ("onednn", "torch") and not forced:
        return f"FASTBERT_CPU_GEMM={mode}"
    mine = {"linear": linear, "dense_residual_layernorm": dense_residual_layernorm, "gated_linear": gated_linear}[op]
    forced = forced or mode == "gemm"

    def verdict() -> tuple[bool, str]:
        x = call["x"]
        fp32 = x.dtype == torch.float32 and op != "gated_linear"
        kernel = fp32_kernel(x.shape[-1], rows_of(x)) if fp32 else None
        return judge(_verdicts, op, call, mine, fallback[op], ("gemm", "oneDNN/torch"), _TIE_MARGIN, kernel)

    return refuses_call(call, forced, op, verdict, bf16_refusal)


def verdicts() -> dict[tuple, tuple[bool, str]]:
    """Every first-use timing so far: (N, K, act, epilogue, size class, dtype) -> (gemm wins, why)."""
    return dict(_verdicts)


def describe() -> str | None:
    """How fastbert's GEMMs multiply here, which shapes run on them and why the others do not, for explain(); None
    without the kernels."""
    if unavailable_reason() is not None:
        return None
    cpu, _ = native.load("_native_cpu")
    bf16 = ("bf16 on AMX tiles (tdpbf16ps: 16 x 16 fp32 sums of 32 bf16 products each) where K is a multiple of 32"
            if getattr(cpu, "has_bf16_linear", bool)() else "no bf16 (no AMX tiles here: bf16 GEMMs run on oneDNN)")
    if (mode := fp32_mode()) != "fma":
        rows = f"above {FMA_ROWS} rows " if mode == "auto" else ""
        fp32 = (f"fp32 on AMX bf16 tiles {rows}where K is a multiple of 32 (bf16x3: each operand as three bf16 parts, "
                f"six products summed in fp32, fp32's accuracy; {FP32_ENV}=fma for vector FMA"
                + (", =bf16x3 for the tiles at any row count" if rows else "") + "), else on vector FMA tiles")
    else:
        why = f"{FP32_ENV}=fma" if os.environ.get(FP32_ENV) == "fma" else "no AMX bf16 tiles here"
        fp32 = f"fp32 on vector FMA tiles ({why})"
    judged = summary(_verdicts, "GEMMs on fastbert's kernels", "the rest run on oneDNN or torch, measured faster")
    return f"fastbert's GEMMs: {fp32}; {bf16}" + (f"\n{judged}" if judged else "")


SPEC = Backend(
    "gemm",
    devices=("cpu",),
    dtypes=(torch.float32, torch.bfloat16),
    module=sys.modules[__name__],
    ops=COMPOUND_OPS,
    limits={op: (lambda call, forced, op=op: _refuses(op, call, forced)) for op in COMPOUND_OPS},
    decides_per_call="times each GEMM shape class at first use against the path without it",
)
