"""Native CPU kernels vs torch (fastbert.reference, the dispatch's fallback) per op, side by side in one run.

Memory-bound ops in GB/s (bytes each op must move, formulas in `CASES`), attention also in GFLOP/s; next to them the
machine's copy bandwidth measured in the same run and the max error vs an fp64 reference. Median of
torch.utils.benchmark's blocked_autorange. Usage: python benchmarks/bench_native.py [--batch 8 --seqlen 128 ...]
Writes JSON + Markdown to benchmarks/results/ (the op table in fastbert/native.py is set from these ratios).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import benchmark

from fastbert import native, reference

RESULTS = Path(__file__).resolve().parent / "results"


def median_seconds(fn: Callable[[], torch.Tensor], min_run_time: float) -> float:
    fn()  # warm-up (first-touch allocations, OpenMP pool start)
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def copy_bandwidth(min_run_time: float) -> float:
    """GB/s of a 64 MiB fp32 copy (read + write): the machine's practical memory-bound ceiling."""
    src = torch.randn(16 * 1024 * 1024)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / median_seconds(lambda: dst.copy_(src), min_run_time) / 1e9


def make_cases(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, tuple]:
    """op -> (native call, torch call, fp64 reference call, bytes moved, flops or 0)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.seqlen // 4, args.seqlen + 1, (args.batch,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    tokens, hidden, heads, inter = int(cu[-1]), args.hidden, args.heads, 4 * args.hidden
    s = torch.finfo(dtype).bits // 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    word, pos, typ = rand(30522, hidden), rand(512, hidden), rand(2, hidden)
    w, b = rand(hidden), rand(hidden)
    ids = torch.randint(0, 30522, (tokens,), generator=g)
    pids = torch.cat([torch.arange(int(n)) for n in lengths])
    tt = torch.randint(0, 2, (tokens,), generator=g)
    emb = (ids, tt, pids, word, pos, typ, w, b, 1e-12)
    x_i, b_i = rand(tokens, inter), rand(inter)
    x_h, res = rand(tokens, hidden), rand(tokens, hidden)
    brln = (x_h, b, res, w, b, 1e-12)
    qkv = rand(tokens, 3, heads, hidden // heads)
    attn = (qkv, cu, int(lengths.max()))

    def up(t: object) -> object:
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    flops = 4 * float((lengths.double() ** 2).sum()) * hidden  # QK^T and PV: 2 * 2 * L^2 * D per head, summed
    return {
        # 3 gathered rows read + 1 row written per token, 3 index arrays, LN params
        "embedding_layernorm": (lambda: native.embedding_layernorm(*emb), lambda: reference.embedding_layernorm(*emb),
                                lambda: reference.embedding_layernorm(*map(up, emb)),
                                4 * tokens * hidden * s + 3 * tokens * 8 + 2 * hidden * s, 0),
        # x read + out written, bias read once
        "bias_act(gelu)": (lambda: native.bias_act(x_i, b_i), lambda: reference.bias_act(x_i, b_i),
                           lambda: reference.bias_act(x_i.double(), b_i.double()), 2 * tokens * inter * s + inter * s, 0),
        # x and residual read, out written, 3 parameter vectors
        "bias_residual_layernorm": (lambda: native.bias_residual_layernorm(*brln),
                                    lambda: reference.bias_residual_layernorm(*brln),
                                    lambda: reference.bias_residual_layernorm(*map(up, brln)),
                                    3 * tokens * hidden * s + 3 * hidden * s, 0),
        # packed qkv read once + output written once (the minimum; scores never leave cache)
        "attention": (lambda: native.attention(*attn), lambda: reference.attention(*attn),
                      lambda: reference.attention(qkv.double(), cu, attn[2]), 4 * tokens * hidden * s, flops),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=128, help="lengths uniform in [seqlen/4, seqlen]")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds of timing per measurement")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_native")
    args = parser.parse_args()
    if reason := native.unavailable_reason():
        print(f"native backend unavailable: {reason}")
        return 1
    ext, _ = native.load("_native_cpu")
    copy_gbs = copy_bandwidth(args.min_run_time)
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for op, (fn_native, fn_torch, fn_ref, nbytes, flops) in make_cases(args, dtype).items():
            ref = fn_ref()
            row = {"op": op, "dtype": name, "bytes": nbytes, "flops": flops}
            for impl, fn in (("native", fn_native), ("torch", fn_torch)):
                t = median_seconds(fn, args.min_run_time)
                row[impl] = {"ms": t * 1e3, "GB/s": nbytes / t / 1e9, "GFLOP/s": flops / t / 1e9 if flops else None,
                             "max_err": (fn().double() - ref).abs().max().item()}  # fmt: skip
            row["speedup"] = row["torch"]["ms"] / row["native"]["ms"]
            rows.append(row)
            print(f"{op:26s} {name:9s} native {row['native']['GB/s']:7.2f} GB/s  torch {row['torch']['GB/s']:7.2f} GB/s"
                  f"  x{row['speedup']:.2f}" + (f"  ({row['native']['GFLOP/s']:.1f} vs {row['torch']['GFLOP/s']:.1f}"
                  " GFLOP/s)" if flops else ""), flush=True)  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "isa": ext.isa(),
            "torch": torch.__version__, "commit": commit, "copy_GB/s": copy_gbs, "shape": vars(args) | {"out": None}}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    lines = [f"native vs torch, {meta['threads']} threads, ISA {meta['isa']}, torch {meta['torch']}, commit {commit}, "
             f"copy {copy_gbs:.1f} GB/s; batch {args.batch}, lengths U[{args.seqlen // 4}, {args.seqlen}], "
             f"hidden {args.hidden}, {args.heads} heads", "",
             "| op | dtype | native GB/s | torch GB/s | speedup | native max err | torch max err |", "|---" * 7 + "|"]  # fmt: skip
    for r in rows:
        extra = f" ({r['native']['GFLOP/s']:.1f} vs {r['torch']['GFLOP/s']:.1f} GFLOP/s)" if r["flops"] else ""
        lines.append(f"| {r['op']} | {r['dtype']} | {r['native']['GB/s']:.2f} | {r['torch']['GB/s']:.2f} | "
                     f"x{r['speedup']:.2f}{extra} | {r['native']['max_err']:.2g} | {r['torch']['max_err']:.2g} |")  # fmt: skip
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
