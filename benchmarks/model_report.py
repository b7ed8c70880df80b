"""The model suite's outputs: one JSON document (device, versions, commit, peaks, rows), a Markdown table, a PNG."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.plotting import pyplot
from fastbert import capabilities


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = platform.processor()
    return f"{model or platform.machine()} ({os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()})"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "onnxruntime", "triton", "fastbert"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # absent or broken: recorded, not fatal
            out[name] = "unavailable"
    return out


def git_commit() -> str:
    """HEAD, with "+dirty" when tracked files other than benchmarks/results/ differ from it (a suite that has already
    written its results once is still measuring the committed code). Where there is no git repository (a copy of the
    working tree sent to a GPU machine), $FASTBERT_COMMIT as the sender set it, else "unknown"."""
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno", "--", ".", ":!benchmarks/results"],
            cwd=root,
            capture_output=True,
            text=True,
        )
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FASTBERT_COMMIT") or "unknown"


def write_results(directory: str, stem: str, doc: dict[str, Any], markdown: Callable[[dict], str],
                  plot: Callable[[dict, str], object]) -> str:  # fmt: skip
    """`directory`/`stem`.{json,md,png}: the run as data, as a table and as a plot; returns the table."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, stem)
    with open(path + ".json", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    table = markdown(doc)
    with open(path + ".md", "w", encoding="utf-8") as f:
        f.write(table)
    plot(doc, path + ".png")
    return table


UNSTEADY = 0.85  # a fixed GEMM's median speed below this share of its best: the host's other tenants were busy


def host_steadiness(seconds: float = 1.5) -> dict[str, float]:
    """A fixed fp32 GEMM on cache-resident operands ([128, 384] x [384, 384], torch's threads), timed over and over
    for `seconds`: its best and median GFLOP/s. Other tenants of a shared host (a VM's neighbours) slow it for a second
    or two at a time while this machine's load average stays low; on a quiet host the median is within a few percent
    of the best."""
    x, w = torch.randn(128, 384), torch.randn(384, 384)
    flops = 2 * 128 * 384 * 384
    for _ in range(5):
        torch.mm(x, w)
    times, end = [], time.perf_counter() + seconds
    while (start := time.perf_counter()) < end:
        torch.mm(x, w)
        times.append(time.perf_counter() - start)
    times.sort()
    return {"best_gflops": flops / times[0] / 1e9, "median_gflops": flops / times[len(times) // 2] / 1e9}


def cpu_run() -> dict[str, Any]:
    """What every CPU benchmark's JSON opens with: the machine (name, ISA class, results key), torch's threads,
    versions, commit, time, load and the host's steadiness."""
    return {
        "device": device_name(torch.device("cpu")),
        "cpu_kind": capabilities.cpu_kind(),
        "cpu_key": capabilities.cpu_key(),
        "threads": torch.get_num_threads(),
        "versions": versions(),
        "commit": git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": os.getloadavg(),
        "host_steadiness": host_steadiness(),
    }


def document(
    rows: list, peaks: dict[str, float], ceilings: dict[str, float | None], device: torch.device, seconds: float,
    bandwidth: float | None = None,
) -> dict[str, Any]:
    """Everything a reader needs to trust (or distrust) the numbers, including the machine's load."""
    return {
        "device": device_name(device),
        "device_type": device.type,
        "versions": versions(),
        "commit": git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "host_steadiness": host_steadiness() if device.type == "cpu" else None,
        "wall_seconds": round(seconds, 1),
        "peak_flops": dict(peaks),  # the best large matmul measured in this run: the "% peak" denominator
        "arithmetic_peak_flops": dict(ceilings),  # from registers (CPU): what no GEMM can pass (run_model)
        "read_bandwidth": bandwidth,  # bytes/s reading far past the caches (CPU; run_model.measure_read_bandwidth)
        "flops_formula": "per sequence of s real tokens: s * (2 * encoder_params + 4 * layers * s * hidden)",
        "rows": [dataclasses.asdict(r) for r in rows],
    }


def load_warning(doc: dict[str, Any]) -> str | None:
    """One line for every table and plot of a run that was not alone on its CPUs: the neighbours it was given, a
    load average above the CPU count, or a host whose other tenants made a fixed GEMM unsteady; None for a quiet run."""
    load = [*(doc.get("load_average") or ()), *(doc.get("load_average_at_start") or ())]
    cpus = os.cpu_count() or 1
    if doc.get("neighbour_counts"):
        return (f"Busy host on purpose: {doc['neighbours']} ran beside every system (load average up to "
                f"{max(load, default=0):.1f} on {cpus} CPUs).")  # fmt: skip
    if load and max(load) > cpus:
        return (f"Warning: the machine was oversubscribed (load average up to {max(load):.1f} on {cpus} CPUs): "
                "timings measure scheduling stalls as much as compute.")  # fmt: skip
    steady = doc.get("host_steadiness")
    if steady and steady["median_gflops"] < UNSTEADY * steady["best_gflops"]:
        return (f"Warning: the host was unsteady: a fixed cache-resident GEMM ran at a median "
                f"{steady['median_gflops'] / steady['best_gflops']:.0%} of its best speed at the end of the run (other "
                "tenants of the host, which the load average does not show): read the ratios of interleaved rounds, "
                "not absolute figures.")  # fmt: skip
    return None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(doc: dict[str, Any]) -> str:
    """One table per (model, dtype); skipped rows say why. On a GPU the time columns are the GPU's (CUDA events) and
    the host's (until the call returned: launch cost); on a CPU, wall and process CPU time (all threads)."""
    peaks = ", ".join(f"{k} {v / 1e9:,.0f} GFLOP/s" for k, v in doc["peak_flops"].items())
    ceilings = ", ".join(
        f"{k} {v / 1e9:,.0f} GFLOP/s" for k, v in (doc.get("arithmetic_peak_flops") or {}).items() if v is not None
    )
    lines = [
        f"# Model throughput on {doc['device']}",
        "",
        f"commit {doc['commit']}, {doc['date_utc']}, load average at start {doc.get('load_average_at_start')} and "
        f"end {doc['load_average']}, peaks measured (large matmul, the % peak denominator): {peaks}"
        + (f"; arithmetic ceiling (from registers, no memory; fp32 run as bf16x3 on AMX tiles: a sixth of the "
           f"tiles' where higher): {ceilings}" if ceilings else "")
        + (f"; memory read {bw / 1e9:,.1f} GB/s" if (bw := doc.get("read_bandwidth")) else ""),
        "",
    ]
    if doc["device_type"] == "cpu" and (warning := load_warning(doc)):
        lines += [f"**{warning}**", ""]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in doc["rows"]:
        groups.setdefault((row["model"], row["dtype"]), []).append(row)
    if doc.get("capabilities"):
        lines += ["What this CPU was found to do (`fastbert explain`):", ""]
        lines += [*(f"- {c}" for c in doc["capabilities"]), ""]
    labels = doc.get("dtype_labels") or {}
    gpu = doc["device_type"] == "cuda"
    times, second = ("GPU ms | host ms", "host_ms") if gpu else ("ms | cpu ms", "cpu_ms")
    for (model, dtype), rows in groups.items():
        lines += [f"## {model} {labels.get(dtype, dtype)}", ""]
        lines.append(f"| shape | system | mode | {times} | seq/s | real tok/s | vs sdpa | % peak | max abs err |")
        lines.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            if r["skipped"]:
                lines.append(f"| {r['shape']} | {r['system']} | {r['mode']} | skipped: {r['skipped']} | | | | | | |")
                continue
            lines.append(
                f"| {r['shape']} | {r['system']} | {r['mode']} | {r['ms']:.{2 if gpu else 1}f} "
                f"| {_fmt(r.get(second), '.2f' if gpu else '.0f')} "
                f"| {r['seq_per_s']:,.1f} | {r['tok_per_s']:,.0f} | {_fmt(r['speedup_vs_sdpa'], '.2f')}x "
                f"| {r['pct_peak']:.1f} | {r['max_abs_err']:.2e} |"
            )
        bound = " ".join(filter(None, (_bound_line(rows, doc["peak_flops"][dtype]),
                                       _weights_line(rows, doc.get("read_bandwidth"), dtype))))  # fmt: skip
        lines += ["", bound, ""] if bound else [""]
    return "\n".join(lines)


def _shape_bounds(rows: list[dict], peak: float) -> dict[str, tuple[float, float | None]]:
    """Per shape: (the real tokens/s of a system that ran every useful FLOP at the measured peak and did nothing
    else, sdpa's real tokens/s or None). Every system of a shape carries the same useful FLOPs."""
    out = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        timed = [r for r in rows if r["shape"] == shape and not r["skipped"]]
        if timed:
            flops = timed[0]["flops_per_s"] * timed[0]["ms"] / 1e3
            sdpa = next((r["tok_per_s"] for r in timed if r["system"] == "transformers sdpa"), None)
            out[shape] = (timed[0]["real_tokens"] * peak / flops, sdpa)
    return out


def _bound_line(rows: list[dict], peak: float) -> str:
    """The bound per shape, and as a ratio over sdpa: the most any system can show in this table."""
    parts = [
        f"{shape} {bound:,.0f} real tok/s" + (f" = {bound / sdpa:.2f}x sdpa" if sdpa else "")
        for shape, (bound, sdpa) in _shape_bounds(rows, peak).items()
    ]
    return "Bound at 100% of the measured peak on useful FLOPs only: " + "; ".join(parts) + "." if parts else ""


def _weights_line(rows: list[dict], bandwidth: float | None, dtype: str) -> str:
    """Per shape, the real tokens/s of a forward that did nothing but read the encoder's weights once at the measured
    memory bandwidth: a second bound, the tighter one for a few tokens, where the weights outweigh the work."""
    parts = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        timed = [r for r in rows if r["shape"] == shape and not r["skipped"] and r.get("weight_bytes")]
        if bandwidth and timed:
            bound = timed[0]["real_tokens"] * bandwidth / timed[0]["weight_bytes"]
            sdpa = next((r["tok_per_s"] for r in timed if r["system"] == "transformers sdpa"), None)
            parts.append(f"{shape} {bound:,.0f} real tok/s" + (f" = {bound / sdpa:.2f}x sdpa" if sdpa else ""))
    if not parts:
        return ""
    size = max(r["weight_bytes"] for r in rows if r.get("weight_bytes")) / 1e6
    quarter = " (int8 rows read a quarter of them)" if dtype == "fp32" else ""
    return (f"Bound by reading the encoder's {size:,.0f} MB of {dtype} weights once a forward{quarter} at the measured "
            f"{bandwidth / 1e9:,.1f} GB/s: " + "; ".join(parts) + ".")


def plot(doc: dict[str, Any], path: str) -> None:
    """Real tokens/s per system, one panel per (model, dtype), bars grouped by shape, each bar's ratio to
    transformers sdpa above it, the bound per shape, and skipped systems with their reason."""
    plt = pyplot()
    if plt is None:
        return
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in doc["rows"]:
        groups.setdefault((row["model"], row["dtype"]), []).append(row)
    palette = _palette(dict.fromkeys(r["system"] for r in doc["rows"]))
    fig, axes = plt.subplots(len(groups) or 1, 1, figsize=(13, 3.4 * max(1, len(groups))), squeeze=False)
    for ax, ((model, dtype), rows) in zip(axes[:, 0], groups.items(), strict=False):
        _panel(ax, rows, doc["peak_flops"][dtype], palette)
        ax.set_title(f"{model} {(doc.get('dtype_labels') or {}).get(dtype, dtype)}", fontsize=10)
    warning = load_warning(doc) if doc["device_type"] == "cpu" else None
    fig.suptitle(f"{doc['device']} - commit {doc['commit'][:12]}" + (f"\n{warning}" if warning else ""), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _palette(systems: Any) -> dict[str, str]:
    """A distinct colour per system: matplotlib's 20 paired colours, enough for the suite's systems (its default
    cycle has 10, so the 11th system took the first one's colour)."""
    import matplotlib

    colours = matplotlib.colormaps["tab20"].colors
    return {name: matplotlib.colors.to_hex(colours[(2 * i) % 20 + (2 * i) // 20 % 2]) for i, name in enumerate(systems)}


def _panel(ax: Any, rows: list[dict], peak: float, palette: dict[str, str]) -> None:
    """One (model, dtype): bars, ratio labels, skipped reasons, bound lines; the legend outside, right."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    width = 0.8 / len(systems)
    by_key = {(r["system"], r["shape"]): r for r in rows}
    top = max((r["tok_per_s"] for r in rows if not r["skipped"]), default=1.0)
    crowded = len(systems) > 6  # horizontal ratio labels wider than their bars would run into each other
    for i, system in enumerate(systems):
        for j, shape in enumerate(shapes):
            row, x = by_key.get((system, shape)), j + i * width
            if row is None:
                continue
            if row["skipped"]:
                ax.text(x, top * 0.02, f"skipped: {row['skipped'][:48]}", rotation=90, fontsize=5, ha="center",
                        va="bottom", color=palette[system])  # fmt: skip
                continue
            ax.bar(x, row["tok_per_s"], width, color=palette[system], label=system if j == 0 else None)
            if row["speedup_vs_sdpa"] is not None:
                ax.text(x, row["tok_per_s"], f" {row['speedup_vs_sdpa']:.2f}x", fontsize=6, ha="center", va="bottom",
                        rotation=90 if crowded else 0)  # fmt: skip
    bounds = _shape_bounds(rows, peak)
    for j, (bound, sdpa) in ((j, bounds[shape]) for j, shape in enumerate(shapes) if shape in bounds):
        label = f"bound {bound:,.0f}" + (f" = {bound / sdpa:.1f}x sdpa" if sdpa else "")
        if bound <= 1.6 * top:  # a line where it fits; far above the bars, the number only
            ax.hlines(bound, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="dashed", linewidth=0.8)
        # above the bars and their labels, on a white ground, so that neither a bar's label nor the line crosses it
        ax.text(j + 0.4 - width / 2, 1.6 * top, label + " (dashed)" * (bound <= 1.6 * top), fontsize=6, ha="center",
                va="bottom", bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})  # fmt: skip
    ax.set_ylim(0, 1.75 * top)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
    ax.set_ylabel("real tokens/s")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="x: vs sdpa",
              title_fontsize=7)  # fmt: skip


def write(doc: dict[str, Any], out_dir: str) -> list[str]:
    """model_cuda.{json,md,png} or model_cpu-<kind>.* (kind: avx512-bf16, avx512, avx2: results from different CPU
    classes sit side by side) under out_dir; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    kind = f"-{doc['cpu_kind']}" if doc.get("cpu_kind") else ""
    stem = os.path.join(out_dir, f"model_{doc['device_type']}{kind}")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(markdown(doc) + "\n")
    plot(doc, stem + ".png")
    return [stem + ".json", stem + ".md", stem + ".png"]
