"""matplotlib for the benchmarks' PNGs, optional: a machine without it still gets the JSON and Markdown results."""

from __future__ import annotations

import sys
from types import ModuleType


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the Agg backend, or None (with a note on stderr) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: PNG plot skipped (JSON and Markdown written)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gemm_bars(doc: dict, roof: float | None, roof_label: str, title: str, path: str) -> bool:
    """The GEMM benchmarks' plot: one group of bars per result row (`doc["results"]`, each with hidden, m, layer and
    gflops per system in `doc["systems"]`), a dashed line at the roof, `title` above; False where matplotlib is
    missing."""
    plt = pyplot()
    if plt is None:
        return False
    rows, names = doc["results"], doc["systems"]
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(rows) + 2), 4.5))
    width = 0.8 / len(names)
    for i, system in enumerate(names):
        ax.bar([j + i * width for j in range(len(rows))], [r["gflops"][system] for r in rows], width, label=system)
    if roof:
        ax.axhline(roof, color="k", linestyle="--", linewidth=1, label=roof_label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"H{r['hidden']} M{r['m']} {r['layer']}" for r in rows], fontsize=7, rotation=35, ha="right")
    ax.set_ylabel("GFLOP/s (higher is better)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
