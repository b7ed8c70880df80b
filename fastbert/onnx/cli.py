"""`fastbert export-onnx CHECKPOINT OUTPUT.onnx`: load a checkpoint, export it, check it, optionally optimize it."""

from __future__ import annotations

import argparse
import json
import os

from fastbert.errors import DataError, ranged
from fastbert.onnx.exporter import DTYPES, OPSET
from fastbert.onnx.graph import SPECS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a transformers- or fastbert-saved checkpoint directory")
    parser.add_argument("output", help="where to write the .onnx file")
    parser.add_argument(
        "--head", choices=sorted(SPECS), help="model class, for any family (default: the config's architectures)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--opset", type=ranged(int, OPSET), default=OPSET)
    parser.add_argument("--optimize", action="store_true", help="also write onnxruntime's fused graph")
    parser.add_argument("--optimized-output", help="path of the fused graph (default: OUTPUT with .opt.onnx)")
    parser.add_argument("--no-check", action="store_true", help="skip the onnxruntime vs PyTorch parity check")
    parser.add_argument("--quantize", choices=["int8"], help="write the dynamically quantised int8 graph to OUTPUT, "
                        "with its parity against fastbert's int8 model")  # fmt: skip


def _head_of(checkpoint: str) -> str:
    """The head kind of the first of the config's `architectures` fastbert has a class for, else the bare model."""
    from fastbert.auto import BY_NAME

    path = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(path):
        return "model"
    with open(path, encoding="utf-8") as f:
        architectures = json.load(f).get("architectures") or []
    return next((BY_NAME[a].head_kind for a in architectures if a in BY_NAME), "model")


def run(args: argparse.Namespace) -> int:
    """Export and print the report; bad paths, bad checkpoints and failed checks are one-line errors (fastbert.cli)."""
    from fastbert.auto import model_class
    from fastbert.config import BertConfig
    from fastbert.heads import HEADS
    from fastbert.onnx.exporter import export

    if not os.path.isdir(args.checkpoint):
        raise DataError(f"checkpoint directory {args.checkpoint} does not exist")
    model_type = BertConfig.from_pretrained(args.checkpoint).model_type  # checks config.json before _head_of reads it
    kind = HEADS[args.head].head_kind if args.head else _head_of(args.checkpoint)
    model = model_class(model_type, kind).from_pretrained(args.checkpoint)
    export(
        model,
        args.output,
        dtype=args.dtype,
        opset=args.opset,
        check=not args.no_check,
        optimize_graph=args.optimize,
        optimized_path=args.optimized_output,
        quantize=args.quantize,
    )
    return 0
