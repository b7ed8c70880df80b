"""A 2-process `torchrun` (gloo, CPU) distillation: DDP keeps the ranks' students equal, rank 0 saves that, and a
run crashed after a checkpoint and resumed ends exactly where the uninterrupted run does (per-rank RNG restored)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distill_tiny import make_teacher
from safetensors.torch import load_file

from fastbert import BertForMaskedLM

TORCHRUN = Path(sys.executable).parent / "torchrun"


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
def test_two_process_torchrun_run_saves_rank0_student_and_resumes_exactly(tmp_path):
    teacher = make_teacher(str(tmp_path / "teacher"))
    out = tmp_path / "run"
    worker = Path(__file__).with_name("distill_ddp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(worker), teacher, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    whole, resumed = out / "whole", out / "resumed"
    assert (whole / "rank0.world").read_text() == "2" and (whole / "rank1.world").read_text() == "2"
    assert (whole / "rank0.seed").read_text() != (whole / "rank1.seed").read_text()  # no two ranks share masks
    rank0, rank1 = load_file(whole / "rank0.safetensors"), load_file(whole / "rank1.safetensors")
    saved = BertForMaskedLM.from_pretrained(whole / "student").unique_state_dict()
    initial = BertForMaskedLM.from_pretrained(teacher).state_dict()
    again = load_file(resumed / "rank0.safetensors")
    assert rank0.keys() == rank1.keys() == saved.keys() == again.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
        assert torch.equal(rank0[key], saved[key]), key
        assert torch.equal(rank0[key], again[key]), key  # crash + resume == the uninterrupted run
    moved = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(saved[moved], initial[moved])  # it did train
    assert json.loads((resumed / "losses.json").read_text()) == json.loads((whole / "losses.json").read_text())
    # the final step is saved as the student, not as a resumable checkpoint
    assert sorted(os.listdir(whole / "checkpoints")) == sorted(os.listdir(resumed / "checkpoints")) == ["step-2"]
