"""The `fastbert` command: `python -m fastbert`, one-line errors with exit codes (2 usage, 1 data), option ranges."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_python_m_fastbert_runs_the_cli() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "fastbert", "--help"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "pretrain" in done.stdout and "export-onnx" in done.stdout
