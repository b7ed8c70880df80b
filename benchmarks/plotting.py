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
