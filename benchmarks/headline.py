"""The headline of a benchmark run: each system's fp32 and best precision side by side, on the encode workload and on
BERT-base, with the CPU and the load printed above it.

    python -m benchmarks.headline benchmarks/results/runs/<cpu>/<time>    # writes headline.md there and prints it

Reads what `make bench` wrote into that folder (model_cpu-*.json, encode_cpu-*.json without a model suffix); a
suite that did not run leaves its columns empty. Systems are grouped by who makes them; within a group the fastest
row of each precision counts (onnxruntime on its plain export or on fastbert's, OpenVINO's f32 or its default).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any

from benchmarks import model_report

# system name in a suite -> (group, precision); a precision of None: the table's own dtype
ENCODE = {
    "fastbert fp32": ("fastbert", "fp32"),
    "fastbert int8": ("fastbert", "int8"),
    "fastbert bf16": ("fastbert", "bf16"),
    "onnxruntime fp32 (fastbert export)": ("onnxruntime", "fp32"),
    "onnxruntime fp32 (plain export)": ("onnxruntime", "fp32"),
    "onnxruntime dynamic int8": ("onnxruntime", "int8"),
    "OpenVINO fp32": ("OpenVINO", "fp32"),
    "OpenVINO default": ("OpenVINO", "default"),
    "OpenVINO int8 (NNCF)": ("OpenVINO", "int8"),
    "OpenVINO int8": ("OpenVINO", "int8"),
    "sentence-transformers": ("transformers", "fp32"),
    "sentence-transformers bf16": ("transformers", "bf16"),
    "torch dynamic int8": ("transformers", "int8"),
}
MODEL = {
    "fastbert": ("fastbert", None),
    "fastbert int8": ("fastbert", "int8"),
    "onnxruntime": ("onnxruntime", None),
    "onnxruntime int8": ("onnxruntime", "int8"),
    "OpenVINO": ("OpenVINO", None),
    "OpenVINO int8 (NNCF)": ("OpenVINO", "int8"),
    "transformers eager": ("transformers", None),
    "transformers sdpa": ("transformers", None),
    "transformers sdpa + compile": ("transformers", None),
    "torch dynamic int8": ("transformers", "int8"),
}
GROUPS = ("fastbert", "OpenVINO", "onnxruntime", "transformers")
HEADLINE_MODEL, HEADLINE_BATCH, HEADLINE_SEQLEN = "bert-base", 8, 128  # the model suite's headline shape, ragged

Entry = tuple[float, str]  # (throughput, label: precision and, for the encode workload, its STS-B Spearman)


def _load(folder: str, pattern: str) -> dict[str, Any] | None:
    paths = sorted(p for p in glob.glob(os.path.join(folder, pattern)) if "-mpnet" not in os.path.basename(p))
    if not paths:
        return None
    with open(paths[0], encoding="utf-8") as f:
        return json.load(f)


def encode_entries(doc: dict[str, Any]) -> dict[str, dict[str, Entry]]:
    """group -> precision -> the fastest row's (sentences/s, label)."""
    out: dict[str, dict[str, Entry]] = {}
    for row in doc["rows"]:
        if "failed" in row or row["system"] not in ENCODE:
            continue
        group, precision = ENCODE[row["system"]]
        if precision == "default":  # OpenVINO's own choice: the precision it ran (bf16 where the CPU has it)
            precision = "bf16" if "bf16" in row.get("note", "") else "fp32"
        entry = (row["sentences_per_s"], f"{precision}, STS-B {row['spearman']:.2f}")
        if entry[0] > out.setdefault(group, {}).get(precision, (0.0, ""))[0]:
            out[group][precision] = entry
    return out


def model_entries(doc: dict[str, Any]) -> dict[str, dict[str, Entry]]:
    """group -> precision -> the fastest BERT-base headline-shape row's (real tokens/s, label)."""
    out: dict[str, dict[str, Entry]] = {}
    for row in doc["rows"]:
        if row.get("skipped") or row["model"] != HEADLINE_MODEL or "ragged" not in row["shape"]:
            continue
        if (row["batch"], row["seqlen"]) != (HEADLINE_BATCH, HEADLINE_SEQLEN):
            continue
        if row["system"] not in MODEL or not row.get("tok_per_s"):
            continue
        group, precision = MODEL[row["system"]]
        precision = precision or row["dtype"]
        entry = (row["tok_per_s"], precision)
        if entry[0] > out.setdefault(group, {}).get(precision, (0.0, ""))[0]:
            out[group][precision] = entry
    return out


def _cells(entries: dict[str, dict[str, Entry]], group: str) -> tuple[Entry | None, Entry | None]:
    """(fp32 entry, best entry of any precision) of one group."""
    mine = entries.get(group, {})
    return mine.get("fp32"), max(mine.values(), default=None)


def _fmt(entry: Entry | None, label: bool) -> str:
    if entry is None:
        return "-"
    return f"{entry[0]:,.0f}" + (f" ({entry[1]})" if label else "")


def _lead(entries: dict[str, dict[str, Entry]], index: int) -> str:
    """fastbert's ratio to the best other group in one column, or '-'."""
    ours = _cells(entries, "fastbert")[index]
    others = [c for g in GROUPS[1:] if (c := _cells(entries, g)[index]) is not None]
    if ours is None or not others:
        return "-"
    return f"{ours[0] / max(others)[0]:.2f}x"


def headline(folder: str) -> str:
    encode, model = _load(folder, "encode_cpu-*.json"), _load(folder, "model_cpu-*.json")
    if encode is None and model is None:
        raise SystemExit(f"headline: no encode_cpu-*.json or model_cpu-*.json in {folder}")
    first = encode or model
    enc, mod = (encode_entries(encode) if encode else {}), (model_entries(model) if model else {})
    lines = [
        "# fastbert on this CPU: the headline",
        "",
        f"CPU: {first['device']}; key `{first.get('cpu_key', 'unknown-cpu')}`, class {first.get('cpu_kind')}; "
        f"commit {first['commit'][:12]}; {first['date_utc']}",
    ]
    loads = [d for d in (model, encode) if d is not None]
    warnings = [w for d in loads if (w := model_report.load_warning({**d, "device_type": "cpu"}))]
    lines.append("Load: " + ("; ".join(dict.fromkeys(warnings)) if warnings else "quiet (load average below the CPU "
                             "count at start and end of each suite)"))  # fmt: skip
    lines += [
        "",
        "| system | encode, fp32 (sentences/s) | encode, best precision | BERT-base 8 x 128 ragged, fp32 (real "
        "tokens/s) | BERT-base, best precision |",
        "|---|---:|---:|---:|---:|",
    ]
    for group in GROUPS:
        e, m = _cells(enc, group), _cells(mod, group)
        name = "**fastbert**" if group == "fastbert" else group
        lines.append(f"| {name} | {_fmt(e[0], False)} | {_fmt(e[1], True)} | {_fmt(m[0], False)} | "
                     f"{_fmt(m[1], True)} |")  # fmt: skip
    lines.append(f"| fastbert vs the best other | {_lead(enc, 0)} | {_lead(enc, 1)} | {_lead(mod, 0)} | "
                 f"{_lead(mod, 1)} |")  # fmt: skip
    lines += [
        "",
        "Encode: the 3,000 STS-B dev sentences through all-MiniLM-L6-v2 in batches of 32 sorted by length, "
        "tokenisation included (bench_encode). BERT-base: 8 sequences of up to 128 tokens, ragged (run_model). "
        "transformers: sentence-transformers / transformers sdpa, and torch's dynamic int8. The tables behind each "
        "figure are in this folder.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.headline", description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a run's folder (make bench's BENCH_OUT)")
    args = parser.parse_args(argv)
    table = headline(args.folder)
    with open(os.path.join(args.folder, "headline.md"), "w", encoding="utf-8") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
