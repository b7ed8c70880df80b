"""The encode workload under each background load, side by side: one table and one plot from the runs of
`bench_encode --neighbours` in a folder (one JSON per load, the quiet run among them).

    python -m benchmarks.busy_summary benchmarks/results/busy

For each precision, fastbert against the best other system at every load, and each system's busy/quiet ratio
(its throughput under the load over its own quiet one): what #39 asks of a busy host, in one place.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

from benchmarks import model_report
from benchmarks.plotting import pyplot

# system -> precision; fastbert's own row of each precision is "fastbert <precision>"
PRECISIONS = {
    "fastbert fp32": "fp32",
    "onnxruntime fp32 (plain export)": "fp32",
    "onnxruntime fp32 (fastbert export)": "fp32",
    "OpenVINO fp32": "fp32",
    "sentence-transformers": "fp32",
    "fastbert bf16": "bf16",
    "OpenVINO default": "bf16",  # bf16 where the CPU has bf16 instructions (its row's note says what it ran)
    "sentence-transformers bf16": "bf16",
    "fastbert int8": "int8",
    "onnxruntime dynamic int8": "int8",
    "OpenVINO int8 (NNCF)": "int8",
    "torch dynamic int8": "int8",
}
ORDER = ("fp32", "bf16", "int8")
QUIET = "none (quiet)"


def load_runs(folder: str) -> list[dict]:
    """The runs in `folder`, quiet first, then by the number of neighbours; a clear error where there is none."""
    files = sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True))  # flat, or a folder per load
    runs = [json.loads(Path(p).read_text(encoding="utf-8")) for p in files]
    runs = [r for r in runs if "neighbour_counts" in r and r.get("rows")]
    if not runs:
        raise SystemExit(f"busy_summary: no bench_encode runs (JSON with neighbour_counts) in {folder}")
    loads = [label(r) for r in runs]
    if len(set(loads)) < len(loads):
        raise SystemExit(f"busy_summary: more than one run of a load in {folder}: {sorted(loads)}")
    kinds = {r["cpu_kind"] for r in runs}
    if len(kinds) > 1:
        raise SystemExit(f"busy_summary: runs from different CPU kinds in {folder}: {sorted(kinds)}")
    return sorted(runs, key=lambda r: (sum(r["neighbour_counts"].values()), sorted(r["neighbour_counts"].items())))


def label(run: dict) -> str:
    counts = run["neighbour_counts"]
    words = {"spin": "busy loop", "torch": "torch worker"}
    return ", ".join(f"{n} {words.get(k, k)}{'s' if n > 1 else ''}" for k, n in counts.items()) or QUIET


def speeds(run: dict) -> dict[str, float]:
    return {r["system"]: r["sentences_per_s"] for r in run["rows"] if "failed" not in r and r["system"] in PRECISIONS}


def summarise(runs: list[dict]) -> dict:
    """Per load and precision: fastbert, the best other system and the ratio; per system: busy/quiet ratios."""
    quiet = next((speeds(r) for r in runs if not r["neighbour_counts"]), None)
    table = []
    for run in runs:
        got = speeds(run)
        # the highest of the 1, 5 and 15 minute averages: what the table's warning quotes too
        row = {"load": label(run), "load_average": max(run.get("load_average") or [0.0]), "precisions": {}}
        for p in ORDER:
            mine = got.get(f"fastbert {p}")
            others = {s: v for s, v in got.items() if PRECISIONS[s] == p and not s.startswith("fastbert")}
            if mine is None or not others:
                continue
            best = max(others, key=others.get)
            row["precisions"][p] = {"fastbert": mine, "best_other": best, "other": others[best],
                                    "ratio": mine / others[best]}  # fmt: skip
        row["busy_over_quiet"] = {s: v / quiet[s] for s, v in got.items() if quiet and quiet.get(s)}
        table.append(row)
    return {"cpu_kind": runs[0]["cpu_kind"], "device": runs[0]["device"], "workload": runs[0]["workload"],
            "commits": sorted({r["commit"] for r in runs}), "rows": table}  # fmt: skip


def markdown(summary: dict) -> str:
    lines = [f"# The encode workload under background load: {summary['device']} ({summary['cpu_kind']})", "",
             f"{summary['workload']}; commits {', '.join(c[:7] for c in summary['commits'])}. Sentences/s; the ratio "
             "is fastbert over the best other system of that precision.", ""]  # fmt: skip
    present = [p for p in ORDER if any(p in r["precisions"] for r in summary["rows"])]
    head = "| neighbours | load avg | " + " | ".join(f"{p}: fastbert / best other | ratio" for p in present) + " |"
    lines += [head, "|---|---:|" + "---:|---:|" * len(present)]
    for r in summary["rows"]:
        cells = []
        for p in present:
            c = r["precisions"].get(p)
            cells += ([f"{c['fastbert']:,.0f} / {c['other']:,.0f} ({c['best_other']})", f"**{c['ratio']:.2f}x**"]
                      if c else ["-", "-"])  # fmt: skip
        lines.append(f"| {r['load']} | {r['load_average']:.1f} | " + " | ".join(cells) + " |")
    systems = sorted({s for r in summary["rows"] for s in r["busy_over_quiet"]}, key=lambda s: (PRECISIONS[s], s))
    lines += ["", "Busy / quiet (each system's throughput under the load over its own quiet run):", "",
              "| neighbours | " + " | ".join(systems) + " |", "|---|" + "---:|" * len(systems)]  # fmt: skip
    for r in (r for r in summary["rows"] if r["load"] != QUIET):
        ratios = [f"{r['busy_over_quiet'][s]:.2f}" if s in r["busy_over_quiet"] else "-" for s in systems]
        lines.append(f"| {r['load']} | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = summary["rows"]
    present = [p for p in ORDER if any(p in r["precisions"] for r in rows)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(present), 1)
    for i, p in enumerate(present):
        xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(rows))]
        ys = [r["precisions"].get(p, {}).get("ratio", 0.0) for r in rows]
        ax.bar(xs, ys, width, label=p)
        for x, y, r in zip(xs, ys, rows, strict=True):
            if y:
                ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=7)
                ax.annotate(r["precisions"][p]["best_other"].replace(" (plain export)", ""), (x, 0.05), rotation=90,
                            ha="center", va="bottom", fontsize=6, color="white")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.2, color="black", ls="--", lw=0.8, label="1.2x")
    ax.set_xticks(range(len(rows)), [r["load"] for r in rows], fontsize=8)
    ax.set_ylabel("fastbert / best other system")
    ax.set_title(f"Encode workload under background load: {summary['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.busy_summary", description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a folder of bench_encode --neighbours runs (JSON), the quiet run among them")
    args = parser.parse_args(argv)
    summary = summarise(load_runs(args.folder))
    print(model_report.write_results(args.folder, f"summary_cpu-{summary['cpu_kind']}", summary, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
