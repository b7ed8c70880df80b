"""Native kernels vs torch (fastbert.reference, the dispatch's fallback) per op, side by side in one run.

Memory-bound ops in GB/s (the bytes each op must move: formulas in `make_cases`), attention also in GFLOP/s; next to
them the copy bandwidth measured in the same run and each side's max error vs an fp64 reference.
CPU timing: native and torch calls interleaved for --budget seconds, each keeping its fastest call (the least disturbed
one on a machine shared with other jobs); --repeats such windows per op, spread over the run, reported as medians with
the range of the per-window speedups. CUDA timing: CUDA events, L2 flushed before every call, median.
Usage: python -m benchmarks.bench_native [--device cpu|cuda --batch 8 --seqlen 128 --hidden 768 --heads 12]
Writes --out.{json,md,png} (default: bench_native_<device> in a fresh folder, benchmarks/run_folder.py); the native
backend's CPU_SLOWER_THAN_TORCH follows them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.model_report import git_commit
from benchmarks.plotting import pyplot
from benchmarks.run_folder import run_folder
from fastbert import reference
from fastbert.backends import native

Fn = Callable[[], torch.Tensor]


def cpu_best_seconds(fns: dict[str, Fn], budget: float) -> dict[str, float]:
    """Fastest single call of each fn, calls interleaved for `budget` seconds (at least 20 each). On a 2-core machine
    shared with other jobs, the minimum is the least-disturbed call, and interleaving gives both sides the same load."""
    best, calls, start = dict.fromkeys(fns, float("inf")), 0, time.perf_counter()
    while calls < 20 or time.perf_counter() - start < budget:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
        calls += 1
    return best


def cuda_seconds(fn: Fn, reps: int = 50) -> float:
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # larger than any L2
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def best_times(fns: dict[str, Fn], device: str, budget: float) -> dict[str, float]:
    """Seconds per call for each implementation, all measured in the same window."""
    for fn in fns.values():
        fn()  # warm-up: first-touch allocations, OpenMP pool, CUDA module load
    if device == "cpu":
        return cpu_best_seconds(fns, budget)
    return {name: cuda_seconds(fn) for name, fn in fns.items()}


def copy_bandwidth(device: str, budget: float) -> float:
    """GB/s of a 64 MiB fp32 copy (read + write): the practical memory-bound ceiling, same run."""
    src = torch.randn(16 * 1024 * 1024, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_times({"copy": lambda: dst.copy_(src)}, device, budget)["copy"] / 1e9


def make_cases(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, tuple[Fn, Fn, Fn, int, float]]:
    """op -> (native call, torch call, fp64 reference call, bytes moved, flops or 0)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.seqlen // 4, args.seqlen + 1, (args.batch,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)]).to(args.device)
    tokens, hidden, heads, inter = int(cu[-1]), args.hidden, args.heads, 4 * args.hidden
    s = torch.finfo(dtype).bits // 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=args.device, dtype=dtype)

    def ints(high: int, n: int) -> torch.Tensor:
        return torch.randint(0, high, (n,), generator=g).to(args.device)

    def up(t: object) -> object:
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    pids = torch.cat([torch.arange(int(n)) for n in lengths]).to(args.device)
    emb = (ints(30522, tokens), ints(2, tokens), pids, rand(30522, hidden), rand(512, hidden), rand(2, hidden),
           rand(hidden), rand(hidden), 1e-12)  # fmt: skip
    act = (rand(tokens, inter), rand(inter))
    brln = (rand(tokens, hidden), rand(hidden), rand(tokens, hidden), rand(hidden), rand(hidden), 1e-12)
    attn = (rand(tokens, 3, heads, hidden // heads), cu, int(lengths.max()))
    cases = {
        # 3 gathered rows read + 1 row written per token, 3 int64 index arrays, 2 LN parameter vectors
        "embedding_layernorm": ("embedding_layernorm", emb, (4 * tokens + 2) * hidden * s + 3 * tokens * 8, 0),
        # x read + out written, bias read once
        "bias_act(gelu)": ("bias_act", act, 2 * tokens * inter * s + inter * s, 0),
        # x and residual read, out written, 3 parameter vectors
        "bias_residual_layernorm": ("bias_residual_layernorm", brln, 3 * tokens * hidden * s + 3 * hidden * s, 0),
        # packed qkv read + output written (the minimum: scores never leave cache); 2 GEMMs of 2 L^2 D flops per head
        "attention": ("attention", attn, 4 * tokens * hidden * s, 4 * float((lengths.double() ** 2).sum()) * hidden),
    }  # fmt: skip
    if args.device == "cuda":
        del cases["attention"]  # CUDA attention is the Triton backend's job
    return {
        name: (lambda op=op, a=a: getattr(native, op)(*a), lambda op=op, a=a: getattr(reference, op)(*a),
               lambda op=op, a=a: getattr(reference, op)(*map(up, a)), nbytes, flops)
        for name, (op, a, nbytes, flops) in cases.items()
    }  # fmt: skip


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def table(meta: dict, rows: list[dict]) -> str:
    m = meta
    head = (
        f"native vs torch on {m['device_name']}, {m['threads']} threads, ISA {m['isa']}, torch {m['torch']}, commit "
        f"{m['commit']}; copy {m['copy_GB/s']:.1f} GB/s; batch {m['batch']}, lengths U[{m['seqlen'] // 4}, "
        f"{m['seqlen']}], hidden {m['hidden']}, {m['heads']} heads"
    )
    columns = ("op", "dtype", "native GB/s", "torch GB/s", "native/torch (range)", "native max err", "torch max err")
    lines = [head, "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in rows:
        n, t = r["native"], r["torch"]
        flops = f" ({n['GFLOP/s']:.1f} vs {t['GFLOP/s']:.1f} GFLOP/s)" if r["flops"] else ""
        lo, hi = r["speedup_range"]
        lines.append(f"| {r['op']} | {r['dtype']} | {n['GB/s']:.2f} | {t['GB/s']:.2f} | x{r['speedup']:.2f} "
                     f"({lo:.2f}-{hi:.2f}){flops} | {n['max_err']:.2g} | {t['max_err']:.2g} |")  # fmt: skip
    return "\n".join(lines)


def plot(meta: dict, rows: list[dict], path: Path) -> None:
    """Grouped bars, native vs torch GB/s per (op, dtype), the copy bandwidth as a line."""
    plt = pyplot()
    if plt is None:
        return

    labels = [f"{r['op']}\n{r['dtype']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    ax.bar([x - 0.2 for x in xs], [r["native"]["GB/s"] for r in rows], 0.4, label="native")
    ax.bar([x + 0.2 for x in xs], [r["torch"]["GB/s"] for r in rows], 0.4, label="torch")
    ax.axhline(meta["copy_GB/s"], color="gray", linestyle="--", label="copy")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("GB/s (bytes the op must move)")
    ax.set_title(f"{meta['device_name']}, {meta['threads']} threads, commit {meta['commit']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=128, help="lengths uniform in [seqlen/4, seqlen]")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--dtypes", default=None, help="default: float32,bfloat16 (cpu), + float16 (cuda)")
    parser.add_argument("--ops", default=None, help="comma-separated subset, e.g. bias_act,attention (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="torch (and native) CPU threads; default: torch's")
    parser.add_argument("--budget", type=float, default=1.0, help="CPU seconds of interleaved calls per op and repeat")
    parser.add_argument("--repeats", type=int, default=5, help="report medians over this many timing windows per op")
    parser.add_argument("--out", type=Path, default=None, help="default: bench_native_<device> in a fresh run folder")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ext, reason = native.load("_native_cuda" if args.device == "cuda" else "_native_cpu")
    if ext is None:
        print(f"native {args.device} kernels unavailable: {reason}")
        return 1
    dtypes = args.dtypes or ("float32,bfloat16" if args.device == "cpu" else "float32,float16,bfloat16")
    cases = {}
    for name in dtypes.split(","):
        for op, case in make_cases(args, getattr(torch, name)).items():
            if args.ops is None or op.split("(")[0] in args.ops.split(","):
                cases[op, name] = case
    times: dict[tuple[str, str], list[dict[str, float]]] = {key: [] for key in cases}
    for rep in range(args.repeats):  # repeats spread each op's windows over the whole run
        for key, (fn_native, fn_torch, *_) in cases.items():
            times[key].append(best_times({"native": fn_native, "torch": fn_torch}, args.device, args.budget))
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    rows = []
    for (op, name), (fn_native, fn_torch, fn_ref, nbytes, flops) in cases.items():
        ref, ratios = fn_ref(), sorted(t["torch"] / t["native"] for t in times[op, name])
        row = {"op": op, "dtype": name, "bytes": nbytes, "flops": flops, "speedup_range": [ratios[0], ratios[-1]]}
        for impl, fn in (("native", fn_native), ("torch", fn_torch)):
            t = statistics.median(x[impl] for x in times[op, name])
            row[impl] = {"ms": t * 1e3, "GB/s": nbytes / t / 1e9, "GFLOP/s": flops / t / 1e9 if flops else None,
                         "max_err": (fn().double() - ref).abs().max().item()}  # fmt: skip
        row["speedup"] = row["torch"]["ms"] / row["native"]["ms"]
        rows.append(row)
    meta = {
        **{k: v for k, v in vars(args).items() if k != "out"},
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else cpu_name(),
        "threads": torch.get_num_threads(),
        "isa": ext.isa() if args.device == "cpu" else "sm_90a / compute_80 PTX",
        "torch": torch.__version__,
        "commit": git_commit(),
        "copy_GB/s": copy_bandwidth(args.device, args.budget),
    }
    out = args.out or Path(run_folder()) / f"bench_native_{args.device}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    out.with_suffix(".md").write_text(table(meta, rows) + "\n")
    plot(meta, rows, out.with_suffix(".png"))
    print(table(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
