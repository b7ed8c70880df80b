"""What this CPU can do, learned by trying once per process (cached), never guessed from one cpuinfo flag.

The answers steer the dispatch and are reported by `fastbert.explain()`:
- `bf16_gemm()`: are bf16 GEMMs at least as fast as fp32 ones here? Timed once on a small GEMM, bf16 against fp32.
  Where they are not (no bf16 dot-product instructions: AVX2-only x86, AVX-512 without AVX512-BF16 where oneDNN
  emulates), bf16 GEMMs run by the rule below.
- `onednn_bf16_prepack()`: does oneDNN's prepacked bf16 linear run here? (torch's `_is_mkldnn_bf16_supported()` can
  say yes on a CPU where the prepack then refuses: only a try tells.)
- `onednn_bf16_row_cuts()`: does oneDNN's bf16 GEMM split some row counts badly between threads here, so that two calls
  on the row halves beat one? Timed once; where it does not, no GEMM's rows are cut and none is timed per row count.

The rule for bf16 without bf16 instructions: a bf16 GEMM accumulating in fp32 is the same arithmetic as an fp32 GEMM
on the bf16 operands upcast (a product of two bf16 values is exact in fp32; only the summation order may differ),
rounded once to bf16 on store. So such a CPU runs bf16 on its fast fp32 GEMM and keeps bf16 semantics.

`FASTBERT_CPU_ISA=avx2` makes any machine behave like an AVX2-only one: no bf16 instructions, and the native kernels
run their AVX2 build. Tests and benchmarks use it to run, on an AVX-512 machine, what every machine runs.
`FASTBERT_CPU_ISA=avx512bf16` is the other way round, for the logic only: `bf16_gemm()` answers as on a CPU with bf16
dot products (so bf16 is the fast precision and bf16 GEMMs run as bf16), while what executes bf16 instructions is
still tried for real (oneDNN's prepack; the native kernels switch only where the CPU runs that build). Tests use it to
run, on an AVX2 machine, the decisions an AVX-512 BF16 / AMX machine makes.

Probes run outside the caller's autocast and grad mode, on CPU tensors of explicit dtype: they measure the CPU, and a
first fastbert call under `torch.autocast("cpu", dtype=torch.bfloat16)` (or a default device/dtype) must not change
what they compute.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

FORCE_ENV = "FASTBERT_CPU_ISA"
BF16_LOGIC = "avx512bf16"
FORCEABLE = ("avx2", BF16_LOGIC)
# the probe GEMM: [M, K] x [K, N], small enough to cost about a millisecond in fp32, big enough to be GEMM-bound
_PROBE_M, _PROBE_K, _PROBE_N = 256, 512, 512
_PROBE_REPEATS = 5


# oneDNN keeps a primitive (JIT code and a weight layout for it) per GEMM shape in two caches (oneDNN's and ideep's,
# 1024 entries each unless these say otherwise). fastbert leaves them to the user: its row buckets
# (fastbert.execution.rows) hold its own GEMMs to about 100 shapes on a sentence workload, and the caches are the
# whole process's. Capped at 256, sentence-transformers bf16 with padded batches (~380 shapes a pass) in the same
# process evicted fastbert's every pass: its bf16 encode workload fell from 2,164 to 1,704 sentences/s.
ONEDNN_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


@dataclass(frozen=True)
class Finding:
    """One capability: whether it holds here, and what was tried to find out."""

    ok: bool
    why: str


def forced_isa() -> str | None:
    """The CPU this process is told to behave as (`FASTBERT_CPU_ISA`), or None."""
    value = os.environ.get(FORCE_ENV, "").strip().lower()
    if not value or value == "auto":
        return None
    if value not in FORCEABLE:
        raise ValueError(f"{FORCE_ENV}={value!r}: expected one of {FORCEABLE} or 'auto'")
    return value


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo, or ('', {}) where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "", frozenset()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return name, frozenset(flags)


def cpu_model() -> str:
    """The CPU's model name and its vector extensions (informational: decisions come from trying, not from this)."""
    name, flags = _cpuinfo()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
    return f"{name or 'unknown CPU'} ({', '.join(f for f in wanted if f in flags) or 'no AVX2'})"


@functools.cache
def cpu_key() -> str:
    """The CPU model as a results key: '<vendor>-family<F>-model<M>' from /proc/cpuinfo (Zen 4 and Zen 5, both "AMD
    EPYC" with AVX-512 BF16, are families 25 and 26), or 'unknown-cpu'."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown-cpu"
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if not all(fields.get(k) for k in ("vendor_id", "cpu family", "model")):
        return "unknown-cpu"
    return f"{fields['vendor_id'].lower()}-family{fields['cpu family']}-model{fields['model']}"


def cpu_kind() -> str:
    """A short name for the class of CPU, to label results: 'avx512-amx', 'avx512-bf16', 'avx512', 'avx2' (also when
    forced) or 'other'. A label only: what runs is decided by the probes."""
    flags = _cpuinfo()[1]
    if forced_isa() == "avx2":  # the AVX2 kernels run; a forced avx512bf16 changes decisions, not what this CPU is
        return "avx2"
    if "avx512f" in flags:
        if "avx512_bf16" not in flags:
            return "avx512"
        return "avx512-amx" if {"amx_tile", "amx_int8", "amx_bf16"} <= flags else "avx512-bf16"  # avx512amx's need
    return "avx2" if "avx2" in flags else "other"


def onednn_bf16_prepack() -> Finding:
    """Does oneDNN's prepacked bf16 linear run here? (tried once; `FASTBERT_CPU_ISA=avx2` says no without trying)"""
    if forced_isa() == "avx2":
        return Finding(False, f"not used: {FORCE_ENV}={forced_isa()}")
    return _try_onednn_bf16_prepack()


def _probe(fn: Callable[[], Finding]) -> Callable[[], Finding]:
    """Run a probe once per process (cached), outside the caller's autocast and grad mode and outside any dispatch
    mode: when the first ask comes from a torch.compile trace, its fake tensors would time nothing, cache a wrong
    finding for good, and can crash a oneDNN kernel that is handed one."""

    @functools.cache
    @functools.wraps(fn)
    def run() -> Finding:
        with _real_tensors(), torch.no_grad(), torch.autocast("cpu", enabled=False):
            return fn()

    return run


def _real_tensors() -> contextlib.AbstractContextManager:
    """Leave the active torch dispatch modes (a trace's FakeTensorMode) for the block; torch's own helper."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _cpu_randn(*shape: int) -> torch.Tensor:
    """fp32 noise on the CPU whatever the caller's default device and dtype, from a generator of its own: a probe that
    runs mid-training (the row-count probe runs at a plan's first forward) must not move the caller's random stream."""
    return torch.randn(*shape, device="cpu", dtype=torch.float32, generator=torch.Generator().manual_seed(0))


@_probe
def _try_onednn_bf16_prepack() -> Finding:
    """Try oneDNN's prepacked bf16 linear on a tiny GEMM and check its result against fp32."""
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not torch.backends.mkldnn.is_available():
        return Finding(False, "this torch has no oneDNN prepacked linear")
    x, w = _cpu_randn(4, 32), _cpu_randn(16, 32)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16())
        out = torch.ops.mkldnn._linear_pointwise(x.bfloat16(), packed, None, "none", [], "")
    except RuntimeError as exc:
        return Finding(False, f"refused: {str(exc).splitlines()[0][:160]}")
    expected = F.linear(x.bfloat16().float(), w.bfloat16().float())
    if not torch.allclose(out.float(), expected, rtol=2e-2, atol=1e-1):
        return Finding(False, "ran, but its result is wrong")
    return Finding(True, "a prepacked bf16 GEMM ran and matched fp32")


def bf16_gemm() -> Finding:
    """Are bf16 GEMMs at least as fast as fp32 GEMMs here? (timed once; `FASTBERT_CPU_ISA` says no (avx2) or yes
    (avx512bf16) without timing)"""
    if forced_isa() == "avx2":
        return Finding(False, f"{FORCE_ENV}={forced_isa()}: behaving as a CPU without bf16 instructions")
    if forced_isa() == BF16_LOGIC:
        return Finding(True, f"{FORCE_ENV}={forced_isa()}: deciding as on a CPU with bf16 dot products")
    return _time_bf16_gemm()


@_probe
def _time_bf16_gemm() -> Finding:
    """The best bf16 GEMM path here (oneDNN prepacked where it runs, else torch's) timed against torch's fp32."""
    a, b = _cpu_randn(_PROBE_M, _PROBE_K), _cpu_randn(_PROBE_N, _PROBE_K)
    a16, b16 = a.bfloat16(), b.bfloat16()
    runs = {"fp32": lambda: F.linear(a, b), "bf16": lambda: F.linear(a16, b16)}
    if onednn_bf16_prepack().ok:
        packed = torch.ops.mkldnn._reorder_linear_weight(b16)
        runs["bf16"] = lambda: torch.ops.mkldnn._linear_pointwise(a16, packed, None, "none", [], "")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a per-core property; one thread's CPU time ignores a busy machine's scheduling
    try:
        best = _best_seconds(runs)
    finally:
        torch.set_num_threads(threads)
    fp32, bf16 = best["fp32"], best["bf16"]
    ratio = fp32 / bf16
    shape = f"[{_PROBE_M}, {_PROBE_K}] x [{_PROBE_K}, {_PROBE_N}]"
    verdict = "native bf16 dot products" if ratio >= 1 else "emulated: no bf16 dot-product instructions"
    return Finding(ratio >= 1, f"{verdict} (bf16 GEMM {ratio:.2f}x fp32's speed on {shape})")


def new_row_count_cost(dtype: torch.dtype) -> Finding:
    """Does a GEMM at a row count this process has not seen cost over four times one it has, in `dtype` (fp32 or
    bf16, as oneDNN runs it)? oneDNN compiles a kernel per shape: with AMX a new bf16 row count took 10-20x the GEMM
    itself, an fp32 one 1.7-1.9x (an AVX-512 Xeon), where rounding row counts up would cost more than it saves.
    Timed once per dtype; `FASTBERT_ROW_BUCKETS` (fastbert.execution.rows) overrides."""
    return _time_new_row_counts(dtype)


_ROW_PROBE_K, _ROW_PROBE_N = 512, 1024
_ROW_PROBE_FRESH = (317, 331, 347)  # row counts no bucket of fastbert.execution.rows is: unseen unless timed here
_ROW_PROBE_PRIME = 300


def _seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call: the compile runs on the calling thread, the GEMM on torch's whole team."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@functools.cache
def _time_new_row_counts(dtype: torch.dtype) -> Finding:
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return Finding(False, "this torch has no oneDNN prepacked linear: no GEMM is compiled per row count")
    if dtype == torch.bfloat16 and not onednn_bf16_prepack().ok:
        return Finding(False, "bf16 GEMMs do not run on oneDNN's bf16 kernels here")
    with _real_tensors(), torch.no_grad(), torch.autocast("cpu", enabled=False):
        w = _cpu_randn(_ROW_PROBE_N, _ROW_PROBE_K).to(dtype)
        x = _cpu_randn(max(_ROW_PROBE_FRESH), _ROW_PROBE_K).to(dtype)
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            run = lambda rows: torch.ops.mkldnn._linear_pointwise(x[:rows], packed, None, "none", [], "")  # noqa: E731
            run(_ROW_PROBE_PRIME)  # one-time set-up (the weight's layout, thread pools) out of the timings
        except RuntimeError as exc:
            return Finding(False, f"oneDNN refused the probe GEMM: {str(exc).splitlines()[0][:160]}")
        fresh = [_seconds(functools.partial(run, rows)) for rows in _ROW_PROBE_FRESH]
        seen = min(_seconds(functools.partial(run, rows)) for _ in range(_PROBE_REPEATS) for rows in _ROW_PROBE_FRESH)
    first = statistics.median(fresh)
    name = str(dtype).removeprefix("torch.")
    words = (f"a {name} GEMM at a new row count took {first * 1e3:.2f} ms, {first / seen:.1f}x one already seen "
             f"([{_ROW_PROBE_FRESH[0]}, {_ROW_PROBE_K}] x [{_ROW_PROBE_K}, {_ROW_PROBE_N}])")
    return Finding(first > 4 * seen, words)


# where oneDNN's bf16 GEMM split rows badly between 2 threads (AMX): [M, 768] x [768, 768] at M = 512-768 took
# 1.41-1.55x two calls on its row halves (`python -m benchmarks.bench_onednn_rows`), at all three
_CUT_PROBE_ROWS, _CUT_PROBE_K, _CUT_PROBE_N = (512, 640, 768), 768, 768
_CUT_PROBE_MARGIN = 1.1  # halves this much faster (median of the three): worth timing row counts as they come


def onednn_bf16_row_cuts() -> Finding:
    """Can two oneDNN bf16 GEMM calls on a GEMM's row halves beat one call here? With AMX, oneDNN split some row counts
    badly between threads, and fastbert.backends.onednn.row_parts times cutting at every new row count; elsewhere one
    call won at every count, and that timing cost the first pass over a stream of new row counts a third of its speed
    (all-mpnet-base-v2 bf16 on a Zen 4). Timed once on the shape where AMX split worst, with torch's threads."""
    return _time_row_cuts()


@_probe
def _time_row_cuts() -> Finding:
    """One oneDNN bf16 call against two on the row halves at each probe row count, best of a few interleaved each."""
    if not onednn_bf16_prepack().ok:
        return Finding(False, "bf16 GEMMs do not run on oneDNN's bf16 kernels here")
    threads = torch.get_num_threads()
    if threads < 2:
        return Finding(False, "one thread: a GEMM's rows have no threads to be split between")
    w = _cpu_randn(_CUT_PROBE_N, _CUT_PROBE_K).bfloat16()
    x = _cpu_randn(max(_CUT_PROBE_ROWS), _CUT_PROBE_K).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w)

    def call(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")

    gains = []
    for m in _CUT_PROBE_ROWS:
        rows = x[:m]
        runs = {"one": functools.partial(call, rows), "halves": lambda rows=rows: [call(h) for h in rows.chunk(2)]}
        best = _best_seconds(runs, time.perf_counter)  # wall: the whole team's split of the rows
        gains.append(best["one"] / best["halves"])
    gain = statistics.median(gains)  # one disturbed row count cannot decide; AMX lost at all three
    shape = (f"[{'/'.join(map(str, _CUT_PROBE_ROWS))}, {_CUT_PROBE_K}] x [{_CUT_PROBE_K}, {_CUT_PROBE_N}] bf16 on "
             f"{threads} threads: {', '.join(f'{g:.2f}x' for g in gains)}")
    if gain >= _CUT_PROBE_MARGIN:
        return Finding(True, f"two calls on the row halves beat one call by {gain:.2f}x (median over {shape}): row "
                             "counts are timed")
    return Finding(False, f"two calls on the row halves did not beat one call by {_CUT_PROBE_MARGIN}x (median "
                          f"{gain:.2f}x over {shape}): one call at every row count")


def _best_seconds(runs: dict, clock: Callable[[], float] = time.thread_time) -> dict[str, float]:
    """Best-of-N seconds per run, interleaved, on `clock`: by default this thread's CPU time, so time the process
    spends descheduled on a shared machine does not count; time.perf_counter for what a whole thread team does. A
    noisy moment hits every run alike."""
    for fn in runs.values():
        fn()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(_PROBE_REPEATS):
        for name, fn in runs.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


@torch.compiler.assume_constant_result  # torch.compile runs it (untraced) and keeps its answer: no probe in a graph
def _bf16_gemm_fast() -> bool:
    """bf16_gemm().ok: what the dispatch asks, as a constant a trace can hold (the probe itself never traced)."""
    return bf16_gemm().ok


def bf16_via_fp32(device: torch.device) -> bool:
    """Should bf16 GEMMs on `device` run as fp32 GEMMs on upcast operands (the rule above)? CPU without bf16 only."""
    return device.type == "cpu" and not _bf16_gemm_fast()


def fast_dtype(device: torch.device) -> torch.dtype:
    """The training/benchmark default for `device`: bf16 where it is fast (a CUDA GPU that has it, a CPU with bf16
    dot products), else fp32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if device.type == "cpu" and bf16_gemm().ok else torch.float32


def report() -> list[str]:
    """What was found, one line each, for explain(). Runs the probes if they have not run yet."""
    lines = [f"CPU: {cpu_model()}"]
    if forced_isa() == "avx2":
        lines.append(f"{FORCE_ENV}={forced_isa()}: behaving as an {forced_isa().upper()}-only CPU")
    elif forced_isa() == BF16_LOGIC:
        lines.append(f"{FORCE_ENV}={forced_isa()}: deciding as on a CPU with bf16 dot products (what executes bf16 "
                     "instructions is still tried)")
    bf16 = bf16_gemm()
    lines.append(f"bf16 GEMMs: {'fast' if bf16.ok else 'slow'}: {bf16.why}")
    if not bf16.ok:
        lines.append("  so bf16 runs as fp32 GEMMs on the upcast bf16 operands, rounded once to bf16 (same arithmetic)")
    lines.append(f"oneDNN bf16 prepack: {'yes' if onednn_bf16_prepack().ok else 'no'}: {onednn_bf16_prepack().why}")
    if bf16.ok and onednn_bf16_prepack().ok:
        cuts = onednn_bf16_row_cuts()
        lines.append(f"oneDNN bf16 GEMMs cut by rows: {'timed per row count' if cuts.ok else 'never'}: {cuts.why}")
    lines.append(f"fast precision here: {str(fast_dtype(torch.device('cpu'))).removeprefix('torch.')}")
    caches = ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in ONEDNN_CACHE_ENV)
    lines.append(f"oneDNN primitive caches: {caches} (unset: 1024 entries each, oneDNN's default)")
    return lines
