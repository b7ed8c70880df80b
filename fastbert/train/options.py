"""The command-line flags every training command shares (`fastbert pretrain`, `fastbert finetune`): LoopConfig's
fields as flags, back into LoopConfig fields, and the one-line JSON summary a run ends with."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from fastbert.errors import ranged
from fastbert.train.precision import PRECISION_CHOICES


def add_loop_arguments(parser: Any, lr: float, epochs: float) -> None:
    """The LoopConfig options as command-line flags (shared by `fastbert pretrain` and `fastbert finetune`)."""
    parser.add_argument("--lr", type=ranged(float, 0, low_open=True), default=lr)
    parser.add_argument("--epochs", type=ranged(float, 0, low_open=True), default=epochs)
    parser.add_argument("--max-steps", type=ranged(int, 1), help="optimizer steps (overrides --epochs)")
    parser.add_argument(
        "--max-minutes",
        type=ranged(float, 0, low_open=True),
        help="wall-time budget; the LR schedule is fitted into it",
    )
    parser.add_argument("--warmup-ratio", type=ranged(float, 0, 1, high_open=True), default=0.1)
    parser.add_argument("--weight-decay", type=ranged(float, 0), default=0.01)
    parser.add_argument("--grad-accum", type=ranged(int, 1), default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--precision", choices=PRECISION_CHOICES, default="auto", help="auto: bf16 where it is fast here, else fp32"
    )
    parser.add_argument("--eval-every", type=ranged(int, 0), default=0, help="optimizer steps between evaluations")
    parser.add_argument(
        "--save-every", type=ranged(int, 0), default=0, help="optimizer steps between resumable checkpoints"
    )
    parser.add_argument("--log-every", type=ranged(int, 1), default=10)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --output-dir (of this same run; none: start a fresh run)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="train into an --output-dir that holds another run's results"
    )
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="under torchrun")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--threads", type=ranged(int, 1), help="CPU threads per process (1 is far faster on a busy machine)"
    )
    add_compile_arguments(parser)


def add_compile_arguments(parser: Any) -> None:
    """--compile and --compile-backend (shared with `fastbert distill`)."""
    parser.add_argument(
        "--compile", action="store_true", help="run the training forward and backward through torch.compile"
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile's backend with --compile (inductor; aot_eager or eager compile in seconds, for a check)",
    )


def loop_options(args: Any) -> dict[str, Any]:
    """LoopConfig fields from parsed `add_loop_arguments` flags (and applies --threads)."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    names = ("lr", "epochs", "max_steps", "max_minutes", "warmup_ratio", "weight_decay", "grad_accum", "precision")
    names += ("eval_every", "save_every", "log_every", "resume", "overwrite", "strategy", "compile", "compile_backend")
    return {name: getattr(args, name) for name in names}


def print_summary(result: dict[str, Any]) -> None:
    """One JSON line with the final step, metrics and training time, from rank 0 only (the CLIs' last word)."""
    if int(os.environ.get("RANK", "0")) == 0:
        summary = {"step": result["step"], **result["metrics"], "train_seconds": round(result["train_seconds"])}
        print(json.dumps(summary))
