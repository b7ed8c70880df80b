"""fastbert's host work per BERT-base forward on the CUDA path, on any CPU, side by side with transformers.

    python -m benchmarks.bench_host              # batch 1 x 128 and 8 x 128 ragged; training at 2 x 64
    python -m benchmarks.bench_host --shapes 1x128 32x512

Python calls and dispatch decisions are counted (deterministic: tests/test_host_work.py asserts ceilings on them);
host ms is the wall time of one forward with the Triton launches stubbed and torch's GEMMs running on this CPU, so it
includes the GEMMs: a figure for comparing the rows of one run, not a GPU host time. The graphed row stubs graph
capture and replay (benchmarks/host_work.py), and is also counted phase by phase: before the host sync, between it and
the replay (what serialises the GPU), after. The training rows: a forward under bf16 autocast, and a whole step
(forward, backward, fused AdamW) next to transformers'. Results: host_work_cpu.{json,md} in --out
(default: a fresh folder, benchmarks/run_folder.py).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's kernels are built: launches go to the interpreter

import torch  # noqa: E402

from benchmarks import model_report  # noqa: E402
from benchmarks.host_work import BERT_BASE, count, cuda_path, host_ms, phases, stub_graphs, training_step  # noqa: E402
from benchmarks.run_folder import run_folder  # noqa: E402


def inputs(shape: str) -> tuple[torch.Tensor, torch.Tensor]:
    """'BxS': a batch of B sequences padded to S, lengths uniform in [S/4, S] (all S when B is 1)."""
    batch, seqlen = (int(v) for v in shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(seqlen // 4, seqlen + 1, (batch,), generator=gen) if batch > 1 else torch.tensor([seqlen])
    mask = (torch.arange(seqlen)[None] < lengths[:, None]).long()
    return torch.randint(1, 1000, (batch, seqlen), generator=gen) * mask, mask


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers' sdpa BertModel, fastbert's) with the same random BERT-base weights."""
    import transformers

    import fastbert

    torch.manual_seed(0)
    config = transformers.BertConfig(**BERT_BASE)
    config._attn_implementation = "sdpa"
    hf = transformers.BertModel(config).eval()
    return hf, fastbert.BertModel.from_hf(hf).eval()


def rows(shape: str) -> tuple[list[dict], list[dict]]:
    """(the inference rows, the graphed forward's phases) at one shape."""
    hf, fb = models()
    ids, mask = inputs(shape)
    out, phased = [], []
    with torch.no_grad():
        hf(ids, attention_mask=mask)
        work = count(lambda: hf(ids, attention_mask=mask))
        out.append(dict(system="transformers sdpa", ms=host_ms(lambda: hf(ids, attention_mask=mask)), **vars(work)))
        with cuda_path() as launches:
            for name in ("fastbert (plan, eager)", "fastbert (plan, CUDA graphs stubbed)"):
                if "graphs" in name:
                    stub_graphs(fb)
                for _ in range(2):  # the first binds the plan, the second captures
                    fb(ids, attention_mask=mask)
                work = count(lambda: fb(ids, attention_mask=mask), launches)
                out.append(dict(system=name, ms=host_ms(lambda: fb(ids, attention_mask=mask)), **vars(work)))
            weights = {id(p) for p in fb.parameters()}
            for phase, work in phases(lambda: fb(ids, attention_mask=mask), weights).items():
                phased.append(dict(shape=shape, phase=phase, **vars(work)))
    return [dict(shape=shape, **r) for r in out], phased


def training_rows(shape: str) -> list[dict]:
    """A training forward under bf16 autocast, and a training step next to transformers', at one shape."""
    hf, fb = models()
    ids, mask = inputs(shape)
    hf.train(), fb.train()
    out = []
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_path() as launches:
        for _ in range(2):
            fb(ids, attention_mask=mask)
        work = count(lambda: fb(ids, attention_mask=mask), launches)
        out.append(dict(system="fastbert (plan, training forward, bf16 autocast)", ms=0.0, **vars(work)))
    step = training_step(hf, ids, mask)
    for _ in range(2):
        step()
    out.append(dict(system="transformers sdpa, training step (fwd + bwd + fused AdamW)", ms=host_ms(step, 3),
                    **vars(count(step))))  # fmt: skip
    with cuda_path() as launches:
        step = training_step(fb, ids, mask)
        for _ in range(2):
            step()
        out.append(dict(system="fastbert, training step (fwd + bwd + fused AdamW)", ms=host_ms(step, 3),
                        **vars(count(step, launches))))  # fmt: skip
    return [dict(shape=shape, **r) for r in out]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1x128", "8x128"])
    parser.add_argument("--train-shape", default="2x64", help="the training rows' shape (a step runs backward on CPU)")
    parser.add_argument("--out", default=run_folder())
    args = parser.parse_args(argv)
    results = [rows(shape) for shape in args.shapes]
    table, phased = [r for t, _ in results for r in t], [r for _, p in results for r in p]
    table += training_rows(args.train_shape)
    lines = ["| shape | system | Python calls | dispatches | Triton launches | host ms (CPU GEMMs included) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['shape']} | {r['system']} | {r['python_calls']:,} | {r['dispatches']} | {r['launches']} | "
              + (f"{r['ms']:.1f} |" if r["ms"] else "- |") for r in table]  # fmt: skip
    lines += ["", "The graphed forward by phase (the host sync is the packing's one read; graphs stubbed):", "",
              "| shape | phase | Python calls | ATen ops (non-view) | weight attribute reads |",
              "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['shape']} | {r['phase']} | {r['python_calls']} | {r['aten_ops']} | {r['parameter_reads']} |"
              for r in phased]  # fmt: skip
    print("\n".join(lines))
    meta = dict(device=model_report.device_name(torch.device("cpu")), versions=model_report.versions(),
                commit=model_report.git_commit())  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_work_cpu.json"), "w", encoding="utf-8") as fh:
        json.dump(dict(meta=meta, rows=table, graphed_phases=phased), fh, indent=1)
    with open(os.path.join(args.out, "host_work_cpu.md"), "w", encoding="utf-8") as fh:
        fh.write("# Host work per BERT-base forward: the CUDA path with Triton launches stubbed\n\n")
        fh.write(f"{meta['device']}; commit {meta['commit']}; {meta['versions']}\n\n" + "\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
