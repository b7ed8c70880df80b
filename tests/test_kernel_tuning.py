"""Measured launch settings (fastbert/kernels/tuning.py): a device's table is read and its nearest entry used, the
rule decides where the table has no entry, is refused or broken, and the output does not depend on which settings
ran. The tables here are written for "cpu" (Triton's interpreter), the name a CPU device files its table under; the
tuner's own dry run (benchmarks/tune_kernels.py) writes one that loads."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fastbert
from fastbert import kernels
from fastbert.kernels import tuning
from tests.kernel_checks import DEVICE, nan_poisoned_empty, requires_triton

ROOT = Path(__file__).resolve().parents[1]
# the kernel files (the package exports functions of the same names)
bias_act = importlib.import_module("fastbert.kernels.bias_act")
bias_residual_layernorm = importlib.import_module("fastbert.kernels.bias_residual_layernorm")
pytestmark = requires_triton


@pytest.fixture
def tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder of tables read in place of the shipped ones; every cached answer forgotten before and after."""
    monkeypatch.setenv(tuning.ENV, str(tmp_path))
    tuning.reset()
    yield tmp_path
    monkeypatch.delenv(tuning.ENV)
    tuning.reset()


def write(folder: Path, kernels_: dict) -> None:
    name = tuning.device_name(DEVICE)
    (folder / tuning.file_name(name)).write_text(json.dumps({"device": name, "kernels": kernels_}))


def entry(n: int, rows: int, block_m: int, block_n: int, warps: int, dtype: str = "fp32") -> dict:
    return {"dtype": dtype, "n": n, "rows": rows, "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps,
            "num_stages": None}  # fmt: skip


def test_file_names_are_the_device_name_in_plain_characters() -> None:
    assert tuning.file_name("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3.json"
    assert tuning.file_name("NVIDIA H200") != tuning.file_name("NVIDIA H100 80GB HBM3")


def test_the_nearest_entry_by_rows_is_used(tables: Path) -> None:
    write(tables, {"bias_act": [entry(96, 16, 2, 32, 1), entry(96, 1024, 8, 64, 2), entry(48, 16, 4, 16, 1)]})
    assert tuning.settings("bias_act", DEVICE, torch.float32, 96, 32, bias_act._rule) == (2, 32, 1, None)
    assert tuning.settings("bias_act", DEVICE, torch.float32, 96, 512, bias_act._rule) == (8, 64, 2, None)
    assert "the table's entry for 1024 rows" in tuning.describe()


def test_the_rule_decides_without_a_matching_entry(tables: Path) -> None:
    write(tables, {"bias_act": [entry(96, 16, 2, 32, 1, dtype="fp16")]})
    launch = tuning.settings("bias_act", DEVICE, torch.float32, 96, 16, bias_act._rule)
    assert launch == bias_act._rule(96, 16)
    assert "no bias_act entry for n=96 fp32" in tuning.describe()


def test_a_device_without_a_table_runs_the_rule(tables: Path) -> None:
    assert tuning.settings("bias_act", DEVICE, torch.float32, 96, 16, bias_act._rule) == bias_act._rule(96, 16)
    assert f"no table for {tuning.device_name(DEVICE)}" in tuning.describe()
    assert "the kernels' rules" in tuning.note(DEVICE)


def test_an_entry_that_breaks_the_kernel_is_refused(tables: Path) -> None:
    write(tables, {"bias_residual_layernorm": [entry(96, 16, 4, 64, 2)], "bias_act": [entry(96, 16, 3, 32, 1)]})
    launch = tuning.settings("bias_residual_layernorm", DEVICE, torch.float32, 96, 16, bias_residual_layernorm._rule)
    assert launch == bias_residual_layernorm._rule(96, 16)
    assert tuning.settings("bias_act", DEVICE, torch.float32, 96, 16, bias_act._rule) == bias_act._rule(96, 16)
    said = tuning.describe()
    assert "BLOCK_N=64 < 96: the LayerNorm needs the whole row" in said and "BLOCK_M=3 is not a power of two" in said


def test_a_broken_table_falls_back_to_the_rule_and_says_why(tables: Path) -> None:
    (tables / tuning.file_name(tuning.device_name(DEVICE))).write_text("{not json")
    assert tuning.settings("bias_act", DEVICE, torch.float32, 96, 16, bias_act._rule) == bias_act._rule(96, 16)
    assert "unreadable" in tuning.describe() and "unreadable" in tuning.note(DEVICE)


def test_measured_settings_give_the_rules_output(tables: Path) -> None:
    """The table changes how the work is cut, not what is computed: bias+GELU and the LayerNorm, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(40, 96, generator=gen).to(DEVICE) for _ in range(2))
    bias, w, b = (torch.randn(96, generator=gen).to(DEVICE) for _ in range(3))
    rule_act = kernels.bias_act_inference(x, bias)
    rule_ln = kernels.bias_residual_layernorm_inference(x, bias, res, w, b, 1e-12)
    write(tables, {"bias_act": [entry(96, 64, 1, 32, 1)], "bias_residual_layernorm": [entry(96, 64, 1, 128, 1)]})
    tuning.reset()
    with nan_poisoned_empty():
        assert torch.equal(kernels.bias_act_inference(x, bias), rule_act)
        assert torch.equal(kernels.bias_residual_layernorm_inference(x, bias, res, w, b, 1e-12), rule_ln)
    said = tuning.describe()
    assert "bias_act n=96 fp32 rows~64" in said and "the table's entry for 64 rows" in said


def test_a_trial_overrides_the_table_and_ends_with_its_block(tables: Path) -> None:
    write(tables, {"bias_act": [entry(96, 16, 2, 32, 1)]})
    with tuning.trial("bias_act", (4, 128, 2, 3)):
        assert tuning.settings("bias_act", DEVICE, torch.float32, 96, 16, bias_act._rule) == (4, 128, 2, 3)
    assert tuning.settings("bias_act", DEVICE, torch.float32, 96, 16, bias_act._rule) == (2, 32, 1, None)
    with pytest.raises(ValueError, match="not a power of two"):
        with tuning.trial("bias_act", (3, 128, 2, None)):
            pass


def test_the_tuners_dry_run_writes_a_table_the_kernels_accept(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "benchmarks.tune_kernels", "--dry-run", "--out", str(tmp_path), "--models", "minilm",
           "--dtypes", "fp16", "--kernels", "bias_act", "bias_residual_layernorm", "attention"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    table = json.loads((tmp_path / tuning.file_name("cpu")).read_text())
    assert set(table["kernels"]) == {"bias_act", "bias_residual_layernorm", "attention"}
    for kernel, found in table["kernels"].items():
        for e in found:
            launch = (e["BLOCK_M"], e["BLOCK_N"], e["num_warps"], e["num_stages"])
            assert tuning.problem(kernel, e["n"], launch) is None, (kernel, e)
            assert e["ms"] > 0 and e["rule_ms"] > 0


def test_a_plan_bound_to_triton_says_where_its_launch_settings_come_from(tables: Path) -> None:
    """The plan reads the device's table when it binds; explain() says so, and lists what each launch used."""
    from benchmarks.host_work import CUDA_PATH_EXCLUDED
    from fastbert import ops
    from tests.conftest import tiny_bert

    model, ids = tiny_bert(), torch.randint(1, 120, (2, 9), generator=torch.Generator().manual_seed(0))
    hidden = model.config.hidden_size
    write(tables, {"bias_residual_layernorm": [entry(hidden, 32, 1, max(16, 1 << (hidden - 1).bit_length()), 1)]})
    with torch.no_grad(), ops.use_backend("triton"), ops.exclude_backends(*CUDA_PATH_EXCLUDED):
        model(ids)
        model(ids)
    said = fastbert.explain()
    assert f"launch settings: measured table {tuning.file_name(tuning.device_name(DEVICE))} (1 entries)" in said
    assert f"bias_residual_layernorm n={hidden} fp32 rows~32" in said and "the table's entry for 32 rows" in said
    assert "attention n=" in said and "the rule (the table has no attention entry" in said
