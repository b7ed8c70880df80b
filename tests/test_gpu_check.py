"""benchmarks/gpu_check.sh hands MODEL_ARGS and TRAIN_ARGS to its stages as a shell splits them, so a quoted system
name with a space (`--systems "transformers sdpa"`) reaches the model suite as one argument. Checked without a GPU:
$PYTHON is a stub that records the stage's arguments and runs nothing else of the stage."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path: Path, stage: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """gpu_check.sh with STAGES=stage; returns the run and the arguments its stage's `python -m ...` got."""
    record = tmp_path / "argv"
    stub = tmp_path / "python"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "${{1-}}" = -m ]; then printf "%s\\n" "$@" > "{record}"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    stub.chmod(0o755)
    run = subprocess.run(
        ["bash", str(SCRIPT)], env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "STAGES": stage,
                                    "OUT": str(tmp_path / "logs"), **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return run, record.read_text().splitlines() if record.exists() else []


def test_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_quoted_model_args_reach_the_suite_as_one_word(tmp_path: Path) -> None:
    value = """--quick --systems "transformers sdpa" 'fastbert (no graphs)' fastbert.optimize --models $HOME"""
    run, argv = _run(tmp_path, "model", MODEL_ARGS=value)
    assert run.returncode == 0, run.stdout + run.stderr
    assert argv == ["-m", "benchmarks.run_model", "--out", "benchmarks/results", "--quick", "--systems",
                    "transformers sdpa", "fastbert (no graphs)", "fastbert.optimize", "--models", "$HOME"]  # fmt: skip


def test_train_args_and_empty_model_args(tmp_path: Path) -> None:
    run, argv = _run(tmp_path, "train", TRAIN_ARGS="--quick")
    assert run.returncode == 0, run.stdout + run.stderr
    assert argv[-1] == "--quick" and argv[:2] == ["-m", "benchmarks.bench_train_step"]
    run, argv = _run(tmp_path, "model")
    assert argv == ["-m", "benchmarks.run_model", "--out", "benchmarks/results"]


def test_unbalanced_quotes_stop_the_run(tmp_path: Path) -> None:
    run, argv = _run(tmp_path, "model", MODEL_ARGS='--systems "transformers sdpa')
    assert run.returncode == 2 and "cannot split model_args" in run.stdout and argv == []
