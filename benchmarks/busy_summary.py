"""The encode workload under each background load, side by side: one table and one plot from the runs of
`bench_encode --neighbours` in a folder (one JSON per load and round, the quiet runs among them).

    python -m benchmarks.busy_summary benchmarks/results/busy

For each precision, fastbert against the best other system at every load, and each system's busy/quiet ratio
(its throughput under the load over its own quiet one): what #39 asks of a busy host, in one place. A load run more
than once (`make bench-busy BUSY_ROUNDS=N`) shows the median and the range; each busy run is compared with the quiet
run nearest to it in time, since this kind of machine drifts by 10-20% within an hour.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from collections import defaultdict
from datetime import datetime
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
# the onnxruntime row whose busy/quiet ratio fastbert's must match, per precision (onnxruntime has no bf16)
ONNXRUNTIME = {"fp32": "onnxruntime fp32 (plain export)", "int8": "onnxruntime dynamic int8"}
LEAD = 1.2  # fastbert over the best other system at every load


def load_runs(folder: str) -> list[dict]:
    """The runs in `folder` (any depth), oldest first; a clear error where there is none, or where they come from
    different CPUs."""
    files = sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True))  # flat, or a folder per load
    runs = [json.loads(Path(p).read_text(encoding="utf-8")) for p in files]
    runs = [r for r in runs if "neighbour_counts" in r and r.get("rows")]
    if not runs:
        raise SystemExit(f"busy_summary: no bench_encode runs (JSON with neighbour_counts) in {folder}")
    for key in ("cpu_kind", "cpu_key"):
        found = {r[key] for r in runs if key in r}
        if len(found) > 1:
            raise SystemExit(f"busy_summary: runs from different CPUs ({key}) in {folder}: {sorted(found)}")
    quiet = [r for r in runs if not r["neighbour_counts"]]
    if not quiet:
        raise SystemExit(f"busy_summary: no quiet run (bench_encode without --neighbours) in {folder}")
    if len(quiet) > 1 and any("date_utc" not in r for r in runs):
        raise SystemExit(f"busy_summary: runs without date_utc in {folder}: with several quiet runs, each busy run is "
                         "compared with the one nearest it in time")  # fmt: skip
    return sorted(runs, key=when)


def when(run: dict) -> float:
    """The run's start in seconds (0 where it does not say)."""
    stamp = run.get("date_utc")
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").timestamp() if stamp else 0.0


def label(run: dict) -> str:
    counts = run["neighbour_counts"]
    words = {"spin": "busy loop", "torch": "torch worker"}
    return ", ".join(f"{n} {words.get(k, k)}{'s' if n > 1 else ''}" for k, n in counts.items()) or QUIET


def load_order(run: dict) -> tuple:
    """Quiet first, then by the number of neighbours."""
    return sum(run["neighbour_counts"].values()), sorted(run["neighbour_counts"].items())


def speeds(run: dict) -> dict[str, float]:
    return {r["system"]: r["sentences_per_s"] for r in run["rows"] if "failed" not in r and r["system"] in PRECISIONS}


def spread(values: list[float]) -> dict:
    """Median, low and high of one figure over a load's runs."""
    return {"median": statistics.median(values), "low": min(values), "high": max(values), "runs": len(values)}


def summarise(runs: list[dict]) -> dict:
    """Per load and precision: fastbert, the best other system and the ratio; per system: busy/quiet ratios, each busy
    run over the quiet run nearest it in time; per load and precision: whether the two bars hold (`verdicts`)."""
    quiet_runs = [r for r in runs if not r["neighbour_counts"]]
    by_load: dict[str, list[dict]] = defaultdict(list)
    for run in sorted(runs, key=load_order):
        by_load[label(run)].append(run)
    table = []
    for load, group in by_load.items():
        got = [speeds(r) for r in group]
        # the highest of the 1, 5 and 15 minute averages: what the table's warning quotes too
        row = {"load": load, "load_average": max(max(r.get("load_average") or [0.0]) for r in group),
               "runs": len(group), "precisions": {}, "busy_over_quiet": {}}  # fmt: skip
        for p in ORDER:
            mine = [g for g in got if f"fastbert {p}" in g]  # the runs where fastbert's row of p ran
            others = defaultdict(list)
            for g in mine:
                for s, v in g.items():
                    if PRECISIONS[s] == p and not s.startswith("fastbert"):
                        others[s].append(v)
            if not others:
                continue
            best = max(others, key=lambda s: statistics.median(others[s]))
            ratios = [g[f"fastbert {p}"] / g[best] for g in mine if best in g]
            row["precisions"][p] = {"fastbert": statistics.median(g[f"fastbert {p}"] for g in mine), "best_other": best,
                                    "other": statistics.median(others[best]), "ratio": spread(ratios)}  # fmt: skip
        if load != QUIET:
            paired = defaultdict(list)
            for run, g in zip(group, got, strict=True):
                quiet = speeds(min(quiet_runs, key=lambda q: abs(when(q) - when(run))))
                for s, v in g.items():
                    if quiet.get(s):
                        paired[s].append(v / quiet[s])
            row["busy_over_quiet"] = {s: spread(v) for s, v in paired.items()}
        table.append(row)
    return {"cpu_kind": runs[0]["cpu_kind"], "device": runs[0]["device"], "workload": runs[0]["workload"],
            "commits": sorted({r["commit"] for r in runs}), "rows": table, "verdicts": verdicts(table)}  # fmt: skip


def verdicts(table: list[dict]) -> list[dict]:
    """Per busy load and precision: fastbert's median lead over the best other system (>= LEAD?) and its median
    busy/quiet ratio against onnxruntime's of that precision (no worse?)."""
    out = []
    for row in (r for r in table if r["load"] != QUIET):
        for p, c in row["precisions"].items():
            mine = row["busy_over_quiet"].get(f"fastbert {p}", {}).get("median")
            theirs = row["busy_over_quiet"].get(ONNXRUNTIME.get(p, ""), {}).get("median")
            out.append({"load": row["load"], "precision": p, "lead": c["ratio"]["median"],
                        "lead_holds": c["ratio"]["median"] >= LEAD, "fastbert_busy_over_quiet": mine,
                        "onnxruntime_busy_over_quiet": theirs,
                        "ratio_holds": None if mine is None or theirs is None else mine >= theirs})  # fmt: skip
    return out


def cell(s: dict, template: str = "{:.2f}") -> str:
    """A median in `template`, with the range after it where there was more than one run."""
    text = template.format(s["median"])
    return text if s["runs"] == 1 else f"{text} ({s['low']:.2f}-{s['high']:.2f})"


def markdown(summary: dict) -> str:
    runs = sorted({r["runs"] for r in summary["rows"]})
    rounds = str(runs[0]) if len(runs) == 1 else f"{runs[0]}-{runs[-1]}"
    lines = [f"# The encode workload under background load: {summary['device']} ({summary['cpu_kind']})", "",
             f"{summary['workload']}; commits {', '.join(c[:7] for c in summary['commits'])}; {rounds} run(s) of each "
             "load. Sentences/s (medians over a load's runs); the ratio is fastbert over the best other system of that "
             "precision, run by run: median (low-high).", ""]  # fmt: skip
    present = [p for p in ORDER if any(p in r["precisions"] for r in summary["rows"])]
    head = "| neighbours | load avg | " + " | ".join(f"{p}: fastbert / best other | ratio" for p in present) + " |"
    lines += [head, "|---|---:|" + "---:|---:|" * len(present)]
    for r in summary["rows"]:
        cells = []
        for p in present:
            c = r["precisions"].get(p)
            speeds_cell = f"{c['fastbert']:,.0f} / {c['other']:,.0f} ({c['best_other']})" if c else "-"
            cells += [speeds_cell, cell(c["ratio"], "**{:.2f}x**") if c else "-"]
        lines.append(f"| {r['load']} | {r['load_average']:.1f} | " + " | ".join(cells) + " |")
    systems = sorted({s for r in summary["rows"] for s in r["busy_over_quiet"]}, key=lambda s: (PRECISIONS[s], s))
    lines += ["", "Busy / quiet (each system's throughput under the load over its quiet run nearest in time):", "",
              "| neighbours | " + " | ".join(systems) + " |", "|---|" + "---:|" * len(systems)]  # fmt: skip
    for r in (r for r in summary["rows"] if r["load"] != QUIET):
        ratios = [cell(r["busy_over_quiet"][s]) if s in r["busy_over_quiet"] else "-" for s in systems]
        lines.append(f"| {r['load']} | " + " | ".join(ratios) + " |")
    lines += ["", f"The bars, on the medians: fastbert >= {LEAD}x the best other system at each precision, and its "
              "busy/quiet ratio no worse than onnxruntime's of that precision:", "",
              "| neighbours | precision | lead | holds | busy/quiet: fastbert / onnxruntime | holds |",
              "|---|---|---:|---|---:|---|"]  # fmt: skip
    word = {True: "yes", False: "**no**", None: "-"}
    for v in summary["verdicts"]:
        mine, theirs = v["fastbert_busy_over_quiet"], v["onnxruntime_busy_over_quiet"]
        pair = "-" if mine is None or theirs is None else f"{mine:.3f} / {theirs:.3f}"
        lines.append(f"| {v['load']} | {v['precision']} | {v['lead']:.2f}x | {word[v['lead_holds']]} | {pair} | "
                     f"{word[v['ratio_holds']]} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str) -> None:
    """Left: fastbert over the best other system per load and precision (bars: medians; whiskers: the range). Right:
    busy/quiet, fastbert (solid) against onnxruntime (dashed) per precision."""
    plt = pyplot()
    if plt is None:
        return
    rows = summary["rows"]
    present = [p for p in ORDER if any(p in r["precisions"] for r in rows)]
    colours = dict(zip(ORDER, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(len(present), 1)
    for i, p in enumerate(present):
        xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(rows))]
        stats = [r["precisions"].get(p, {}).get("ratio") for r in rows]
        ys = [s["median"] if s else 0.0 for s in stats]
        err = [[s["median"] - s["low"] if s else 0.0 for s in stats],
               [s["high"] - s["median"] if s else 0.0 for s in stats]]  # fmt: skip
        ax.bar(xs, ys, width, yerr=err, capsize=2, label=p, color=colours[p])
        for x, y, s, r in zip(xs, ys, stats, rows, strict=True):
            if y:
                ax.annotate(f"{y:.2f}", (x, s["high"]), ha="center", va="bottom", fontsize=7)  # above the whisker
                ax.annotate(r["precisions"][p]["best_other"].replace(" (plain export)", ""), (x, 0.05), rotation=90,
                            ha="center", va="bottom", fontsize=6, color="white")  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(LEAD, color="black", ls="--", lw=0.8, label=f"{LEAD}x")
    ax.set_xticks(range(len(rows)), [r["load"] for r in rows], fontsize=8)
    ax.set_ylabel("fastbert / best other system")
    ax.legend(fontsize=8)
    busy = [r for r in rows if r["load"] != QUIET]
    for p in (p for p in present if p in ONNXRUNTIME):
        for system, style in ((f"fastbert {p}", "-o"), (ONNXRUNTIME[p], "--s")):
            ys = [r["busy_over_quiet"].get(system, {}).get("median", float("nan")) for r in busy]
            bx.plot(range(len(busy)), ys, style, color=colours[p], label=system.replace(" (plain export)", ""))
    bx.set_xticks(range(len(busy)), [r["load"] for r in busy], fontsize=7, rotation=20)
    bx.set_ylim(0, 1)
    bx.set_ylabel("busy / quiet (median)")
    bx.legend(fontsize=7)
    fig.suptitle(f"Encode workload under background load: {summary['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.busy_summary", description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a folder of bench_encode --neighbours runs (JSON), quiet runs among them")
    args = parser.parse_args(argv)
    summary = summarise(load_runs(args.folder))
    print(model_report.write_results(args.folder, f"summary_cpu-{summary['cpu_kind']}", summary, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
