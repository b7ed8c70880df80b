"""Plot a training run's history.json (written by fastbert pretrain/finetune): loss and held-out metrics vs time.

Usage: python docs/plot_history.py RUN_DIR/history.json OUT.png PANEL [PANEL ...] [--baseline KEY]
where each PANEL is a comma-separated list of metric keys drawn together (e.g. spearman,pearson).
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
    parser.add_argument("panels", nargs="+", help="comma-separated held-out metric keys, one panel each")
    parser.add_argument("--baseline", help="key drawn as dashed reference lines in the first panel (1x and 2x)")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    with open(args.history, encoding="utf-8") as f:
        history = json.load(f)["history"]
    losses = [h for h in history if "loss" in h]
    panels = [p.split(",") for p in args.panels]
    evals = [h for h in history if panels[0][0] in h]
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(5.5 * (1 + len(panels)), 4))
    axes[0].plot([h["elapsed_s"] / 60 for h in losses], [h["loss"] for h in losses])
    axes[0].set(xlabel="wall time (min)", ylabel="training loss", title="training loss")
    for i, (ax, keys) in enumerate(zip(axes[1:], panels, strict=True)):
        for key in keys:
            ax.plot([h["elapsed_s"] / 60 for h in evals], [h[key] for h in evals], marker="o", label=key)
        if i == 0 and args.baseline and evals:
            ax.axhline(evals[-1][args.baseline], ls="--", color="gray", label=args.baseline)
            ax.axhline(2 * evals[-1][args.baseline], ls=":", color="gray", label=f"2 x {args.baseline}")
        ax.set(xlabel="wall time (min)", ylabel="held-out (x100)", title=", ".join(keys))
        ax.legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
