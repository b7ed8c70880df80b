"""Plot a training run's history.json (written by fastbert pretrain/finetune): loss and held-out metrics vs time.

Usage: python docs/plot_history.py RUN_DIR/history.json OUT.png METRIC [METRIC ...] [--baseline KEY]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("history")
    parser.add_argument("out")
    parser.add_argument("metrics", nargs="+", help="held-out metric keys to plot on the right panel")
    parser.add_argument("--baseline", help="metric key drawn as a dashed reference line (e.g. baseline_accuracy)")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    with open(args.history, encoding="utf-8") as f:
        history = json.load(f)["history"]
    losses = [h for h in history if "loss" in h]
    evals = [h for h in history if args.metrics[0] in h]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([h["elapsed_s"] / 60 for h in losses], [h["loss"] for h in losses])
    left.set(xlabel="wall time (min)", ylabel="training loss", title="training loss")
    for key in args.metrics:
        right.plot([h["elapsed_s"] / 60 for h in evals], [h[key] for h in evals], marker="o", label=key)
    if args.baseline and evals:
        right.axhline(evals[-1][args.baseline], ls="--", color="gray", label=args.baseline)
        right.axhline(2 * evals[-1][args.baseline], ls=":", color="gray", label=f"2 x {args.baseline}")
    right.set(xlabel="wall time (min)", ylabel="held-out metric (x100)", title="held-out")
    right.legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
