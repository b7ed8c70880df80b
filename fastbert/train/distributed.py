"""Where a process sits in a `torchrun` job and how the model is wrapped for it (DDP or FSDP); one process is rank 0
of 1. Distributed runs are launched with `torchrun`; nothing here spawns processes."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fastbert.errors import UsageError


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a torchrun job (a single process is rank 0 of 1)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str | None = None) -> DistEnv:
    """Join the torchrun process group if launched by torchrun (gloo on CPU, nccl on CUDA); else one process.
    On CUDA each process takes its local rank's GPU: more processes on a node than GPUs is a UsageError, raised
    before any CUDA call (each rank would otherwise die on its own 'invalid device ordinal')."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        processes, gpus = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), local + 1), torch.cuda.device_count()
        if processes > gpus:
            raise UsageError(
                f"{processes} processes on this node but only {gpus} GPU{'s' if gpus != 1 else ''}: "
                f"use --nproc_per_node {gpus} or --device cpu (gloo)"
            )
        dev = torch.device("cuda", local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return DistEnv(rank, world, local, dev)


def resolve_device(name: str) -> torch.device:
    """`name` as a torch.device this machine has; a UsageError naming --device otherwise (not torch's own error)."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"--device {name!r} is not a device name (cpu, cuda, cuda:N)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available here (use --device cpu)")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: fastbert trains on cpu or cuda")
    return dev


def wrap_model(model: nn.Module, env: DistEnv, strategy: str = "ddp") -> nn.Module:
    """DistributedDataParallel (default) or FSDP around a model already on env.device; identity for one process."""
    if not env.distributed:
        return model
    if strategy == "ddp":
        ids = [env.device.index] if env.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        # device_id given on CPU too (FSDP then runs over gloo); original parameter names kept for weight decay
        return FullyShardedDataParallel(model, device_id=env.device, use_orig_params=True)
    raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP/FSDP wrapper (the model itself when unwrapped)."""
    return model.module if hasattr(model, "module") else model
