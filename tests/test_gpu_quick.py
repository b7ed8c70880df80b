"""benchmarks/gpu_quick.sh keeps to its budget: a stage runs under min(its cap, the time left), none starts with too
little left, a failing stage does not stop the next but sets the exit code, and everything finished is in the pack
after every stage. Checked without a GPU: $PYTHON is a stub that logs its arguments, sleeps or fails on request."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_quick.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")  # fmt: skip


def _run(tmp_path: Path, stages: str, budget: int, behave: str = "") -> subprocess.CompletedProcess:
    """gpu_quick.sh with a stub python: `behave` maps a module to what the stub does ("sleep N" or "fail")."""
    stub = tmp_path / "python"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$@" >> "{tmp_path}/calls"\n'
        f'case "$*" in {behave} *) echo ran ;; esac\n'
    )
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "STAGES": stages, "BUDGET": str(budget), "MIN_LEFT": "3",
           "OUT": str(tmp_path / "out"), "PACK": str(tmp_path / "pack.tgz")}  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def test_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_a_stage_runs_under_the_time_left_and_later_ones_are_skipped(tmp_path: Path) -> None:
    run = _run(tmp_path, "probe graphs", budget=6, behave='*gpu_host_probe*) sleep 30 ;;')
    assert "=== probe (cap 6 s, 6 s left)" in run.stdout
    assert "=== probe: exit 124" in run.stdout  # stopped at the budget, not at its own 120 s cap
    assert "=== graphs SKIPPED" in run.stdout
    assert run.returncode == 124


def test_a_failing_stage_sets_the_exit_code_and_the_next_still_runs(tmp_path: Path) -> None:
    run = _run(tmp_path, "probe graphs", budget=60, behave="*gpu_host_probe*) echo broken; exit 3 ;;")
    assert "=== probe: exit 3" in run.stdout and "=== graphs: exit 0" in run.stdout
    assert run.returncode == 3
    calls = (tmp_path / "calls").read_text()
    assert "benchmarks.gpu_host_probe" in calls and "tests/test_cuda_graphs.py" in calls


def test_the_pack_holds_every_finished_stages_log(tmp_path: Path) -> None:
    run = _run(tmp_path, "probe model16", budget=60)
    assert run.returncode == 0, run.stdout + run.stderr
    with tarfile.open(tmp_path / "pack.tgz") as pack:
        names = {Path(n).name for n in pack.getnames()}
    assert {"probe.log", "model16.log"} <= names
    model_call = next(line for line in (tmp_path / "calls").read_text().splitlines() if "run_model" in line)
    assert "--dtypes fp16" in model_call and "fastbert (no graphs)" in model_call


def test_an_unknown_stage_is_an_error(tmp_path: Path) -> None:
    run = _run(tmp_path, "nonsense", budget=10)
    assert run.returncode == 2 and "unknown stage nonsense" in run.stdout
