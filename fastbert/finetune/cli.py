"""`fastbert finetune`: sequence classification/regression, token classification or QA from the command line."""

from __future__ import annotations

import argparse

from fastbert.errors import ranged
from fastbert.train import add_loop_arguments, loop_options, print_summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("task", choices=["sequence", "regression", "token", "qa"])
    parser.add_argument("--model", required=True, help="checkpoint directory (fastbert or transformers layout)")
    parser.add_argument("--tokenizer", help="tokenizer.json / vocab.txt or its directory (default: --model)")
    parser.add_argument("--train", required=True, help="training file (CSV/TSV, CoNLL or SQuAD JSON)")
    parser.add_argument("--dev", help="held-out file scored during and after training")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--text-columns", nargs="+", help="one or two column names (or 0-based indices)")
    parser.add_argument("--label-column", help="label column name (or 0-based index)")
    parser.add_argument("--no-header", action="store_true", help="the table has no header row")
    parser.add_argument("--labels", nargs="+", help="the label set (default: the labels seen in --train)")
    parser.add_argument("--max-length", type=ranged(int, 5), help="tokens per input (default 128; 384 for qa)")
    parser.add_argument("--stride", type=ranged(int, 0), default=128, help="qa: overlap of context windows, in tokens")
    parser.add_argument("--batch-size", type=ranged(int, 1), default=32)
    parser.add_argument("--eval-batch-size", type=ranged(int, 1), default=128)
    parser.add_argument("--seed", type=ranged(int, 0), default=42)
    add_loop_arguments(parser, lr=3e-5, epochs=3.0)


def run(args: argparse.Namespace) -> int:
    from fastbert.finetune import finetune

    options = {"text_columns": args.text_columns, "label_column": args.label_column, "header": not args.no_header}
    options.update({"labels": args.labels, "stride": args.stride})
    if args.max_length is not None:
        options["max_length"] = args.max_length
    result = finetune(
        args.task,
        args.model,
        args.train,
        args.output_dir,
        dev=args.dev,
        tokenizer=args.tokenizer,
        batch_size=args.batch_size,
        eval_batch_size=args.eval_batch_size,
        seed=args.seed,
        device=args.device,
        loop=loop_options(args),
        **options,
    )
    print_summary(result)
    return 0
