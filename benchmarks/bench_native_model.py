"""BertModel forward with automatic dispatch (native where the native backend lists it) vs the torch backend, one run.

BERT-base shape, random weights, lengths uniform in [seqlen/4, seqlen]; calls interleaved, fastest of --iters each
(the machine may be shared), real (non-pad) tokens/s and the max difference between the two outputs.
Usage: python benchmarks/bench_native_model.py [--batch 8 --seqlen 128 --layers 12 --dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

import fastbert
from fastbert import ops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = fastbert.BertConfig(num_hidden_layers=args.layers)  # BERT-base defaults otherwise
    model = fastbert.BertModel(config).eval()
    lengths = torch.randint(args.seqlen // 4, args.seqlen + 1, (args.batch,))
    mask = (torch.arange(args.seqlen)[None] < lengths[:, None]).long()
    ids = torch.randint(1, config.vocab_size, (args.batch, args.seqlen)) * mask
    tokens, valid = int(mask.sum()), mask.bool()
    for name in args.dtypes.split(","):
        model = model.to(getattr(torch, name))
        best, outs, decisions = {"auto": float("inf"), "torch": float("inf")}, {}, ""
        with torch.no_grad():
            for it in range(args.iters + 1):  # the first round warms up
                for backend in best:
                    with ops.use_backend(backend):
                        start = time.perf_counter()
                        outs[backend] = model(ids, attention_mask=mask).last_hidden_state
                        took = time.perf_counter() - start
                    best[backend] = min(best[backend], took) if it else best[backend]
                    decisions = fastbert.explain() if backend == "auto" else decisions
        diff = (outs["auto"].float() - outs["torch"].float())[valid].abs().max().item()
        speeds = ", ".join(f"{b} {tokens / t:.0f} tokens/s ({t * 1e3:.0f} ms)" for b, t in best.items())
        print(f"{name}: {speeds}; auto/torch x{best['torch'] / best['auto']:.2f}; max |auto - torch| {diff:.2g}")
        print("  auto dispatch: " + decisions.replace("\n", "; "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
