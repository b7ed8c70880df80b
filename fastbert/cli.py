"""The `fastbert` command. Each subcommand lives with its subsystem and is imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from fastbert.errors import exit_code

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
    """`fastbert explain`: run a tiny model once, and a gated feed-forward's two ops, and print the dispatch
    decisions."""
    import torch

    from fastbert import BertConfig, BertModel, explain, ops
    from fastbert.train.distributed import resolve_device

    device = resolve_device(args.device)
    config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    model = BertModel(config).to(device).eval()
    ids = torch.randint(1, 32, (2, 8), device=device)  # no pad id (0): padding is the mask's, as in real batches
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3], device=device)  # a ragged batch: the unpadded path runs
    x = torch.randn(13, 32, device=device)  # a gated feed-forward's two ops (GeGLU, as ModernBERT's), which BERT lacks
    with torch.no_grad():
        model(ids, attention_mask=mask)
        ops.gated_act(*ops.gated_linear(x, torch.randn(128, 32, device=device)).chunk(2, dim=-1))
    print(explain())
    return 0


class Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (and where help is), not the whole usage block: exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; an error the user can fix is one line on stderr and exit code 2 (usage) or 1 (data),
    a bug keeps its traceback (as does every error under --debug)."""
    parser = Parser(prog="fastbert", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--debug", action="store_true", help="show the full traceback of any error")
        if argv and argv[0] == name:  # import only the subsystem actually asked for
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args)
    except Exception as exc:
        code = exit_code(exc)
        if code is None or args.debug:
            raise
        print(f"fastbert {args.command}: error: {exc}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
