"""oneDNN's bf16 GEMM in one call against calls on row parts (fastbert.backends.onednn.row_parts): BERT-base's and
MiniLM's four GEMM shapes at row counts from one 128-token sentence to a sorted batch of 32, each timed whole and in
halves and quarters, interleaved, median of --iters. Where a part wins, oneDNN split that row count badly between the
threads; row_parts finds the same at first use on the GEMM's own input.

    python -m benchmarks.bench_onednn_rows
    python -m benchmarks.bench_onednn_rows --iters 50 --out /tmp/r

Results: benchmarks/results/onednn_rows_cpu-<cpu kind>.{json,md}. bf16 only: fp32 GEMMs are never cut.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks import model_report
from fastbert import capabilities
from fastbert.backends import onednn

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHAPES = {"BERT-base": ((2304, 768), (768, 768), (3072, 768), (768, 3072)),
          "MiniLM-L6": ((1152, 384), (384, 384), (1536, 384), (384, 1536))}  # fmt: skip  (N, K): QKV, out, FFN in/out
ROWS = (128, 256, 384, 512, 640, 768, 1024)
PARTS = (1, 2, 4)


def gemm_ms(n: int, k: int, rows: int, iters: int) -> dict[int, float]:
    """parts -> median ms of [rows, k] x [k, n] in bf16 on oneDNN's prepacked weight, as `parts` equal calls."""
    weight, bias = torch.randn(n, k).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    pack, _, b = onednn.operands(weight, bias, 1)
    x = torch.randn(rows, k).to(torch.bfloat16)
    chunks = {p: x.chunk(p) for p in PARTS}
    call = torch.ops.mkldnn._linear_pointwise
    times: dict[int, list[float]] = {p: [] for p in PARTS}
    with torch.inference_mode():
        for i in range(iters + 3):  # three warm-up rounds: primitive creation, page faults
            for p in PARTS:
                start = time.perf_counter()
                for part in chunks[p]:
                    call(part, pack, b, "none", [], "")
                if i >= 3:
                    times[p].append(time.perf_counter() - start)
    return {p: statistics.median(t) * 1e3 for p, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    if (why := onednn.unavailable_reason()) is not None:
        parser.error(f"oneDNN's prepacked GEMM is unavailable: {why}")
    rows = [int(r) for r in args.rows.split(",")]
    results = [{"model": model, "n": n, "k": k, "rows": m, "ms": gemm_ms(n, k, m, args.iters)}
               for model, shapes in SHAPES.items() for n, k in shapes for m in rows]  # fmt: skip
    doc = {"device": model_report.device_name(torch.device("cpu")), "cpu": capabilities.cpu_model(),
           "threads": torch.get_num_threads(), "load": os.getloadavg(), "versions": model_report.versions(),
           "commit": model_report.git_commit(), "iters": args.iters, "results": results}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"onednn_rows_cpu-{capabilities.cpu_kind()}")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    load = ", ".join(f"{v:.2f}" for v in doc["load"])
    lines = ["# oneDNN bf16 GEMM: one call vs equal calls on row parts", "",
             f"{doc['device']}; {doc['cpu']}; {doc['threads']} threads; load average {load}; commit {doc['commit']}; "
             f"median of {args.iters} interleaved rounds", "",
             "| model | [M, K] x [K, N] | one call, ms | halves, ms | quarters, ms | best |",
             "|---|---|---:|---:|---:|---|"]  # fmt: skip
    for r in results:
        ms = r["ms"]
        best = min(ms, key=ms.get)
        verdict = "one call" if best == 1 else f"{best} parts, {ms[1] / ms[best]:.2f}x"
        lines.append(f"| {r['model']} | [{r['rows']}, {r['k']}] x [{r['k']}, {r['n']}] | {ms[1]:.3f} | {ms[2]:.3f} | "
                     f"{ms[4]:.3f} | {verdict} |")  # fmt: skip
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
