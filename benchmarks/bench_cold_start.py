"""The first request after a process starts, side by side: transformers, fastbert on a machine it has never timed,
fastbert once its GEMM timings are kept (fastbert/backends/timing_store.py), and fastbert after `fastbert.warmup` at
start-up (not timed: it is the server's start, before traffic). BERT-base on this CPU, fp32.

    python -m benchmarks.bench_cold_start                  # shapes 1x16 and 8x128, 3 fresh processes per row
    python -m benchmarks.bench_cold_start --shapes 32x128 --runs 5

Each run is a fresh Python process: build the model (random weights, BERT-base config), then time its first forward
and the median of the next five. The figure is the ratio first / steady: what the first request pays over every later
one (1.0: no stall). Results: cold_start_cpu.{json,md} in --out
(default: a fresh folder, benchmarks/run_folder.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from benchmarks import model_report
from benchmarks.run_folder import run_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, statistics, sys, time
import torch
system, batch, seqlen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
if system == "transformers":
    import transformers
    model = transformers.BertModel(transformers.BertConfig(attn_implementation="sdpa")).eval()
else:
    import fastbert
    model = fastbert.BertModel(fastbert.BertConfig()).eval()
    if system == "fastbert-warmup":  # the server's start-up: one shape per GEMM size class
        fastbert.warmup(model, [(1, 16), (8, 128)])
ids = torch.randint(1000, 20000, (batch, seqlen))
times = []
for _ in range(6):
    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids)
    times.append(time.perf_counter() - start)
print(json.dumps({"first": times[0], "steady": statistics.median(times[1:])}))
"""

SYSTEMS = {  # row name -> (model, keep timings between the runs)
    "transformers sdpa": ("transformers", False),
    "fastbert, nothing timed yet": ("fastbert", False),
    "fastbert, timings kept": ("fastbert", True),
    "fastbert, warmup() at start-up": ("fastbert-warmup", False),
}


def run_once(system: str, shape: str, cache_dir: str, keep: bool) -> dict[str, float]:
    env = {**os.environ, "FASTBERT_TIMING_CACHE": "1" if keep else "0", "FASTBERT_CACHE_DIR": cache_dir}
    batch, seqlen = shape.split("x")
    child = subprocess.run([sys.executable, "-c", CHILD, system, batch, seqlen], env=env, cwd=ROOT,
                           capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(child.stdout.strip().splitlines()[-1])


def rows(shape: str, runs: int) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for name, (system, keep) in SYSTEMS.items():
            if keep:
                run_once(system, shape, cache_dir, True)  # the process that times and keeps
            samples = [run_once(system, shape, cache_dir, keep) for _ in range(runs)]
            first = statistics.median(s["first"] for s in samples)
            steady = statistics.median(s["steady"] for s in samples)
            out.append(dict(shape=shape, system=name, first_ms=first * 1e3, steady_ms=steady * 1e3,
                            ratio=first / steady))  # fmt: skip
            print(f"{shape} {name}: first {first * 1e3:.0f} ms, steady {steady * 1e3:.1f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1x16", "8x128"])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per row (the median is reported)")
    parser.add_argument("--out", default=run_folder())
    args = parser.parse_args(argv)
    table = [r for shape in args.shapes for r in rows(shape, args.runs)]
    lines = ["| shape | system | first forward / steady | first ms | steady ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['system']} | {r['ratio']:.1f}x | {r['first_ms']:.0f} | {r['steady_ms']:.1f} |"
              for r in table]  # fmt: skip
    print("\n".join(lines))
    meta = dict(device=model_report.device_name(torch.device("cpu")), versions=model_report.versions(),
                commit=model_report.git_commit(), runs=args.runs)  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cold_start_cpu.json"), "w", encoding="utf-8") as fh:
        json.dump(dict(meta=meta, rows=table), fh, indent=1)
    with open(os.path.join(args.out, "cold_start_cpu.md"), "w", encoding="utf-8") as fh:
        fh.write("# The first forward of a fresh process over its steady state, BERT-base fp32\n\n")
        fh.write(f"{meta['device']}; commit {meta['commit']}; median of {args.runs} processes; "
                 f"{meta['versions']}\n\n" + "\n".join(lines) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
