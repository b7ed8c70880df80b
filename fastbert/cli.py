"""The `fastbert` command. Each subcommand lives with its subsystem and is imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module defining `add_arguments(parser)` and `run(args) -> int`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "explain": ("fastbert.cli", "show which backend each fused op would use here, and why"),
    "pretrain": ("fastbert.pretrain.cli", "pretrain a BERT/ALBERT with MLM + NSP/SOP on a text corpus"),
    "finetune": ("fastbert.finetune.cli", "fine-tune on classification, regression, tagging or extractive QA"),
    "export-onnx": ("fastbert.onnx.cli", "export a checkpoint to ONNX, check it in onnxruntime, optionally optimize"),
    "distill": ("fastbert.distill.cli", "train a smaller student from a BERT teacher (torchrun for many processes)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="device to probe (cpu, cuda)")


def run(args: argparse.Namespace) -> int:
    """`fastbert explain`: run a tiny model once and print the dispatch decisions."""
    import torch

    from fastbert import BertConfig, BertModel, explain

    config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    model = BertModel(config).to(args.device).eval()
    with torch.no_grad():
        model(torch.randint(0, 32, (2, 8), device=args.device))
    print(explain())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastbert", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if argv and argv[0] == name:  # import only the subsystem actually asked for
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return importlib.import_module(COMMANDS[args.command][0]).run(args)


if __name__ == "__main__":
    sys.exit(main())
