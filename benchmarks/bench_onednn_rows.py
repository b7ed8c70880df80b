"""oneDNN's bf16 GEMM in one call against calls on row parts (fastbert.backends.onednn.row_parts): BERT-base's and
MiniLM's four GEMM shapes at row counts from one 128-token sentence to a sorted batch of 32, each timed whole and in
halves and quarters, interleaved, median of --iters. Where a part wins, oneDNN split that row count badly between the
threads; row_parts finds the same at first use on the GEMM's own input.

    python -m benchmarks.bench_onednn_rows
    python -m benchmarks.bench_onednn_rows --iters 50 --out /tmp/r

Results: onednn_rows_cpu-<cpu kind>.{json,md,png} in --out (default: a fresh folder, benchmarks/run_folder.py). bf16
only: fp32 GEMMs are never cut.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks import model_report
from benchmarks.plotting import pyplot
from benchmarks.run_folder import run_folder
from fastbert import capabilities
from fastbert.backends import onednn

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


def markdown(doc: dict) -> str:
    """The run as a table: each GEMM and row count in one call, halves and quarters, and which won."""
    lines = ["# oneDNN bf16 GEMM: one call vs equal calls on row parts", "",
             f"{doc['device']}; {doc['cpu']}; {doc['threads']} threads; load average "
             f"{', '.join(f'{v:.2f}' for v in doc['load_average'])}; commit {doc['commit']}; median of {doc['iters']} "
             "interleaved rounds", "",
             *((f"**{warning}**", "") if (warning := model_report.load_warning(doc)) else ()),
             "| model | [M, K] x [K, N] | one call, ms | halves, ms | quarters, ms | best |",
             "|---|---|---:|---:|---:|---|"]  # fmt: skip
    for r in doc["results"]:
        ms = {int(p): v for p, v in r["ms"].items()}  # JSON keys read back as strings
        best = min(ms, key=ms.get)
        verdict = "one call" if best == 1 else f"{best} parts, {ms[1] / ms[best]:.2f}x"
        lines.append(f"| {r['model']} | [{r['rows']}, {r['k']}] x [{r['k']}, {r['n']}] | {ms[1]:.3f} | {ms[2]:.3f} | "
                     f"{ms[4]:.3f} | {verdict} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> bool:
    """One panel per model: one call's time over the best cut's, by row count, a line per GEMM (above 1: cut wins)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(11, 4), sharey=True)
    for ax, model in zip(axes, SHAPES, strict=True):
        for n, k in SHAPES[model]:
            rows = [r for r in doc["results"] if r["model"] == model and (r["n"], r["k"]) == (n, k)]
            gain = [r["ms"]["1"] / min(r["ms"].values()) for r in rows]
            ax.plot([r["rows"] for r in rows], gain, marker="o", label=f"[M, {k}] x [{k}, {n}]")
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("rows (M)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("one call / best cut (above 1: the cut is faster)")
    warning = model_report.load_warning(doc)
    fig.suptitle(f"oneDNN bf16 GEMMs on row parts, {doc['device']}" + (f"\n{warning}" if warning else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    parser.add_argument("--out", default=run_folder())
    args = parser.parse_args(argv)
    if (why := onednn.unavailable_reason()) is not None:
        parser.error(f"oneDNN's prepacked GEMM is unavailable: {why}")
    rows = [int(r) for r in args.rows.split(",")]
    results = [{"model": model, "n": n, "k": k, "rows": m, "ms": gemm_ms(n, k, m, args.iters)}
               for model, shapes in SHAPES.items() for n, k in shapes for m in rows]  # fmt: skip
    doc = {"device": model_report.device_name(torch.device("cpu")), "cpu": capabilities.cpu_model(),
           "threads": torch.get_num_threads(), "load_average": os.getloadavg(), "versions": model_report.versions(),
           "commit": model_report.git_commit(), "iters": args.iters, "results": results}  # fmt: skip
    doc = json.loads(json.dumps(doc))  # as a reader of the JSON file sees it (parts keys as strings)
    print(model_report.write_results(args.out, f"onednn_rows_cpu-{capabilities.cpu_kind()}", doc, markdown, plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
