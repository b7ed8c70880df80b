"""Which device each torchrun process trains on: more processes on a node than GPUs is one clear usage error before
any CUDA call (it was rank 1's 'invalid device ordinal' traceback), and --device cpu runs them all over gloo.
CUDA is faked here (is_available / device_count), so the decision is tested on any machine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastbert.errors import UsageError
from fastbert.train import distributed

TORCHRUN = Path(sys.executable).parent / "torchrun"


@pytest.fixture
def one_gpu_two_processes(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Rank 1 of `torchrun --nproc_per_node 2` on a one-GPU machine; returns the devices set_device was called with."""
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend: calls.append(backend))
    return calls


@pytest.mark.parametrize("device", [None, "cuda"])
def test_more_processes_than_gpus_is_one_clear_error(one_gpu_two_processes: list, device: str | None) -> None:
    expected = "2 processes on this node but only 1 GPU: use --nproc_per_node 1 or --device cpu (gloo)"
    with pytest.raises(UsageError, match=re.escape(expected)):
        distributed.init_distributed(device)
    assert one_gpu_two_processes == []  # refused before set_device and the process group


def test_device_cpu_runs_every_process_over_gloo(one_gpu_two_processes: list) -> None:
    env = distributed.init_distributed("cpu")
    assert env.device == torch.device("cpu") and (env.rank, env.world_size, env.local_rank) == (1, 2, 1)
    assert one_gpu_two_processes == ["gloo"]


def test_one_process_per_gpu_takes_its_local_gpu(one_gpu_two_processes: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env = distributed.init_distributed(None)
    assert env.device == torch.device("cuda", 1)
    assert one_gpu_two_processes == [torch.device("cuda", 1), "nccl"]


@pytest.mark.gpu
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")
def test_torchrun_with_more_processes_than_gpus_says_so(tmp_path: Path) -> None:
    """The real thing: one more process than this machine has GPUs; every rank stops on the one clear line."""
    script = tmp_path / "join.py"
    script.write_text("from fastbert.train.distributed import init_distributed\ninit_distributed()\n")
    processes = torch.cuda.device_count() + 1
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(processes), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"{processes} processes on this node but only {processes - 1} GPU" in proc.stdout + proc.stderr
    assert "invalid device ordinal" not in proc.stdout + proc.stderr
