"""The fastbert.onnx.Session row of the model throughput suite, and a standalone CPU comparison.

Suite contract (benchmarks/model_systems.py EXTRA_SYSTEMS): `NAME` and `build(hf_model, dtype, device)` returning a
runner `(input_ids, attention_mask, token_type_ids) -> last_hidden_state [B, S, H]`, or None where the row does not
apply (onnxruntime here is the CPU build, so fp32 on CPU only).

Standalone: `python -m benchmarks.onnx_row` times fastbert.onnx.Session (optimized graph), fastbert's BertModel
(fp32) and transformers' BertModel (sdpa) on the same ragged batch in one run, interleaved, and prints the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

import fastbert
from fastbert import BertModel
from fastbert.onnx import Session, export

NAME = "fastbert.onnx.Session (optimized)"
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def session_runner(model: BertModel, threads: int | None = None) -> Runner:
    """Export `model` with onnxruntime's fusions into a temporary directory and wrap the Session as a runner."""
    workdir = tempfile.TemporaryDirectory(prefix="fastbert-onnx-row-")
    path = f"{workdir.name}/bert.onnx"
    report = export(model, path, check=False, optimize_graph=True, progress=False)
    # spin=False: spinning pool threads would steal the CPU from the systems timed next in the interleaved rounds
    session = Session(report.optimized_path, intra_op_threads=threads or torch.get_num_threads(), spin=False)

    token_types = session.config.family.token_types  # MPNet has none: its Session refuses token_type_ids

    def run(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        return session(ids, mask, types if token_types else None).last_hidden_state

    run.workdir = workdir  # the exported files live as long as the runner
    return run


def build(hf_model: nn.Module, dtype: torch.dtype, device: torch.device) -> Runner | None:
    """The suite's entry point: fastbert converted from `hf_model`, exported, optimized, served by onnxruntime."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    return session_runner(fastbert.optimize(hf_model, freeze=False))


def time_runner(run: Runner, inputs: tuple[torch.Tensor, ...], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of `run(*inputs)` after `warmup` calls."""
    with torch.no_grad():
        for _ in range(warmup):
            run(*inputs)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(*inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def ragged_batch(batch: int, seqlen: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """ids, mask, token types with lengths uniform in [seqlen / 4, seqlen] (right padding)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seqlen), generator=gen)
    lengths = torch.randint(seqlen // 4, seqlen + 1, (batch,), generator=gen)
    mask = (torch.arange(seqlen) < lengths.view(-1, 1)).long()
    return ids, mask, torch.zeros_like(ids)


def main(argv: list[str] | None = None) -> int:
    """BERT-base shape, random weights, fp32 CPU: three systems, same inputs, one run, interleaved repeats."""
    import transformers

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    hf_config = transformers.BertConfig(num_hidden_layers=args.layers, attn_implementation="sdpa")
    hf = transformers.BertModel(hf_config).eval()
    fb = BertModel.from_hf(hf).eval()
    inputs = ragged_batch(args.batch, args.seqlen, hf_config.vocab_size)
    runners: dict[str, Runner] = {
        "transformers sdpa": lambda i, m, t: hf(input_ids=i, attention_mask=m, token_type_ids=t).last_hidden_state,
        "fastbert BertModel fp32": lambda i, m, t: fb(i, m, t).last_hidden_state,
        NAME: build(hf, torch.float32, torch.device("cpu")),
    }
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):  # interleaved, so load from other processes hits every system alike
        for name, run in runners.items():
            times[name].append(time_runner(run, inputs, repeats=1, warmup=0 if times[name] else 1))
    with torch.no_grad():
        ref = runners["transformers sdpa"](*inputs)
        errors = {name: (run(*inputs) - ref)[inputs[1].bool()].abs().max().item() for name, run in runners.items()}
    real_tokens = int(inputs[1].sum())
    base = statistics.median(times["transformers sdpa"])
    print(f"batch {args.batch}, seq {args.seqlen}, {real_tokens} real tokens, {torch.get_num_threads()} threads")
    print(f"{'system':40s} {'median ms':>10s} {'real tok/s':>11s} {'vs sdpa':>8s} {'max err':>9s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:40s} {med * 1e3:10.1f} {real_tokens / med:11.0f} {base / med:7.2f}x {errors[name]:9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
