"""`fastbert distill TEACHER CORPUS --output DIR`: the command-line face of `fastbert.distill.distill`.

Run it under `torchrun --nproc_per_node N` for data-parallel training (rank 0 saves).
"""

from __future__ import annotations

import argparse
import os

from fastbert.distill.objectives import WEIGHTS, Objectives
from fastbert.errors import ranged
from fastbert.train import PRECISION_CHOICES
from fastbert.train.options import add_compile_arguments

PRESETS = {
    "distilbert": Objectives.distilbert,
    "sentence": Objectives.sentence_embedding,
    "similarity": Objectives.sentence_similarity,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("teacher", help="teacher checkpoint directory (fastbert or transformers)")
    p.add_argument("corpus", help="text file, one sentence or paragraph per line")
    p.add_argument("--output", required=True, help="run folder; the student is written to OUTPUT/student")
    p.add_argument("--tokenizer", help="tokenizer.json/vocab.txt or folder (default: the teacher's)")
    p.add_argument("--eval-corpus", help="held-out text file (default: the last 2%% of the corpus)")
    s = p.add_argument_group("student")
    init_help = "checkpoint the student starts from (its layers, width, tokenizer); another vocabulary than the "
    init_help += "teacher's takes pooled objectives (--preset similarity) and --cache-teacher"
    s.add_argument("--student-init", help=init_help)
    s.add_argument("--layers", type=ranged(int, 1), help="student depth (default: half the teacher's)")
    s.add_argument("--layer-map", type=ranged(int, 0), nargs="+", help="teacher layer copied into each student layer")
    s.add_argument("--hidden-size", type=ranged(int, 1), help="narrower student width")
    s.add_argument("--embedding-size", type=ranged(int, 1), help="ALBERT factorised embedding width")
    s.add_argument("--layer-sharing", choices=["none", "all", "attention", "ffn"], help="ALBERT layer sharing")
    s.add_argument("--num-hidden-groups", type=ranged(int, 1), help="ALBERT groups of shared layers")
    s.add_argument("--init", choices=["auto", "copy", "random"], default="auto")
    s.add_argument("--projection", action="store_true", default=None, help="learned projection to teacher width")
    s.add_argument("--freeze-embeddings", action="store_true")
    o = p.add_argument_group("objectives (any weight given replaces the preset)")
    o.add_argument("--preset", choices=sorted(PRESETS), default="distilbert")
    for name in WEIGHTS:
        o.add_argument(f"--{name.replace('_', '-')}", type=ranged(float, 0), help=f"weight of the {name} loss")
    o.add_argument("--temperature", type=ranged(float, 0, low_open=True), default=2.0)
    o.add_argument("--embedding-metric", choices=["cosine", "mse"], default="cosine")
    t = p.add_argument_group("training")
    t.add_argument("--max-length", type=ranged(int, 2), default=128)
    t.add_argument("--batch-size", type=ranged(int, 1), default=32, help="per process")
    t.add_argument("--grad-accum", type=ranged(int, 1), default=1)
    t.add_argument("--epochs", type=ranged(float, 0, low_open=True), default=1.0)
    t.add_argument("--max-steps", type=ranged(int, 1))
    positive = ranged(float, 0, low_open=True)
    t.add_argument("--max-minutes", type=positive, help="wall-time budget, held-out evaluations included")
    t.add_argument("--lr", type=positive, default=1e-4)
    t.add_argument("--warmup-ratio", type=ranged(float, 0, 1, high_open=True), default=0.05)
    t.add_argument("--weight-decay", type=ranged(float, 0), default=0.01)
    t.add_argument("--max-grad-norm", type=ranged(float, 0), default=1.0, help="0: no clipping")
    t.add_argument(
        "--precision", choices=PRECISION_CHOICES, default="auto", help="auto: bf16 where it is fast here, else fp32"
    )
    t.add_argument("--teacher-precision", choices=PRECISION_CHOICES, default="fp32")
    t.add_argument("--mlm-probability", type=ranged(float, 0, 1, low_open=True, high_open=True), default=0.15)
    t.add_argument("--whole-word", action="store_true")
    t.add_argument("--cache-teacher", action="store_true", help="keep teacher targets on disk across epochs")
    t.add_argument("--checkpoint-every", type=ranged(int, 0), default=500, help="0: no resumable checkpoints")
    t.add_argument("--resume", help="'latest' or a step-N checkpoint folder (of this same run)")
    t.add_argument("--overwrite", action="store_true", help="train into an --output that holds another run's results")
    t.add_argument("--seed", type=ranged(int, 0), default=0)
    t.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    t.add_argument("--threads", type=ranged(int, 1), help="CPU threads per process (1 is far faster on a busy machine)")
    add_compile_arguments(t)


def objectives_from_args(args: argparse.Namespace) -> Objectives:
    given = {name: getattr(args, name) for name in WEIGHTS if getattr(args, name) is not None}
    obj = Objectives(**given) if given else PRESETS[args.preset]()
    obj.temperature, obj.embedding_metric = args.temperature, args.embedding_metric
    return obj


def run(args: argparse.Namespace) -> int:
    import torch

    from fastbert.distill.trainer import DistillConfig, distill

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {
        key: value
        for key, value in (
            ("embedding_size", args.embedding_size),
            ("layer_sharing", args.layer_sharing),
            ("num_hidden_groups", args.num_hidden_groups),
        )
        if value is not None
    }
    config = DistillConfig(
        output_dir=args.output,
        num_layers=args.layers if args.layers is not None else (len(args.layer_map) if args.layer_map else None),
        layer_map=args.layer_map,
        hidden_size=args.hidden_size,
        student_init=args.student_init,
        student_overrides=overrides,
        init=args.init,
        projection=args.projection,
        freeze_embeddings=args.freeze_embeddings,
        objectives=objectives_from_args(args),
        max_length=args.max_length,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        epochs=args.epochs,
        max_steps=args.max_steps,
        max_minutes=args.max_minutes,
        lr=args.lr,
        warmup_ratio=args.warmup_ratio,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        precision=args.precision,
        teacher_precision=args.teacher_precision,
        mlm_probability=args.mlm_probability,
        whole_word=args.whole_word,
        cache_teacher=args.cache_teacher,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        overwrite=args.overwrite,
        seed=args.seed,
        device=args.device,
        compile=args.compile,
        compile_backend=args.compile_backend,
    )
    result = distill(args.teacher, args.corpus, config, tokenizer=args.tokenizer, eval_corpus=args.eval_corpus)
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"student: {result.student_dir}  held-out loss {result.eval_before:.4f} -> {result.eval_after:.4f}  "
            f"({result.train_seconds:.0f} s of training)"
        )
    return 0
