"""Pieces every fastbert training loop shares: torchrun/DDP/FSDP set-up, AdamW with warmup, mixed precision,
checkpoints that survive a crash (atomic writes, RNG included), and a progress bar.

Distributed runs are launched with `torchrun`; nothing here spawns processes.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fastbert import capabilities
from fastbert.errors import UsageError

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_CHOICES = ("auto", *PRECISIONS)  # what the CLIs and configs accept; 'auto' follows the machine
STATE_FILE = "trainer_state.pt"


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
    """Join the torchrun process group if launched by torchrun (gloo on CPU, nccl on CUDA); else one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
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
    return model.module if hasattr(model, "module") else model


def make_optimizer(
    model: nn.Module, lr: float, total_steps: int, warmup_steps: int = 0, weight_decay: float = 0.01
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no decay on biases and LayerNorm) with linear warmup then linear decay to 0."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 or "LayerNorm" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupLinear(total_steps, warmup_steps))


class WarmupLinear:
    """LR factor: linear warmup to 1, then linear decay to 0 at `total`. An object, not a closure, so a wall-time
    budget can shorten `total` mid-run and the scheduler's state_dict (which saves it) restores it on resume."""

    def __init__(self, total: int, warmup: int = 0) -> None:
        self.total, self.warmup = total, warmup

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / max(1, self.warmup)
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """('fp32' | 'bf16' | 'fp16', what to tell the user). 'auto' is bf16 where bf16 is fast on `device` (a GPU that
    has it, a CPU with bf16 dot products: fastbert.capabilities), else fp32. An explicit bf16 on a CPU without bf16
    instructions is kept, with a warning: fastbert's GEMMs then run on fp32 arithmetic, but the heads, the
    backward pass and torch's own layers emulate bf16, several times slower than fp32."""
    if precision not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {precision!r}")
    fast = capabilities.fast_dtype(device) == torch.bfloat16
    probe = capabilities.bf16_gemm().why if device.type == "cpu" else f"{device.type} bf16 support"
    if precision == "auto":
        chosen = "bf16" if fast else "fp32"
        return chosen, f"precision auto -> {chosen} on {device.type} ({probe})"
    if precision == "bf16" and not fast:
        return precision, (
            f"warning: bf16 is slow on this {device.type} ({probe}); fastbert's GEMMs run it on fp32 arithmetic, the "
            "rest of training emulates it and can be several times slower than fp32: --precision auto picks fp32 here"
        )
    return precision, f"precision {precision}"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision context for 'bf16'/'fp16'; a no-op for 'fp32'."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def check_writable(directory: str) -> None:
    """Create `directory` and write a probe file in it now, so that a read-only, missing or full output folder is an
    OSError naming it before training starts, not at the first save."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-") as probe:
            probe.write(bytes(1 << 16))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise OSError(f"output folder {directory} is not writable: {exc}") from None


def write_atomically(directory: str, write: Callable[[str], None]) -> str:
    """`write(tmp)` fills a temporary folder beside `directory`, which then replaces it: a failed write (disk full)
    leaves no half-written folder and whatever `directory` held before intact. Returns `directory`."""
    tmp = directory.rstrip(os.sep) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss)  # tensors: loadable with weights_only
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states(env: DistEnv) -> list[dict[str, Any]] | None:
    """Every rank's RNG state, on rank 0 (None elsewhere): a resumed rank must continue its own dropout/masking
    stream, not rank 0's. A collective: every rank calls it."""
    if not env.distributed:
        return [rng_state()]
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)  # sent as bytes: gather_object cannot unpickle tensors itself
    blobs: list[Any] | None = [None] * env.world_size if env.is_main else None
    dist.gather_object(buffer.getvalue(), blobs, dst=0)
    return [torch.load(io.BytesIO(blob), weights_only=True) for blob in blobs] if blobs is not None else None


def save_checkpoint(
    directory: str,
    step: int,
    model: nn.Module,
    extra: dict[str, Any] | None = None,
    rng: list[dict[str, Any]] | None = None,
    **stateful,
) -> str:
    """Write `directory/step-{step}` atomically: the model (save_pretrained), then optimizer/scheduler/RNG state.

    `rng` holds one RNG state per rank (`gather_rng_states`; default: this process's). `stateful` objects
    (optimizer=..., scheduler=..., scaler=...) are saved by their `state_dict()`. The folder appears under its final
    name only once complete, so a crash mid-write leaves the previous checkpoint intact.
    """
    state = {"step": step, "rng": rng if rng is not None else [rng_state()], "extra": extra or {}}
    state.update({name: obj.state_dict() for name, obj in stateful.items() if obj is not None})

    def write(tmp: str) -> None:
        unwrap(model).save_pretrained(tmp)
        torch.save(state, os.path.join(tmp, STATE_FILE))

    return write_atomically(os.path.join(directory, f"step-{step}"), write)


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete `step-N` folder in `directory`, or None."""
    if not os.path.isdir(directory):
        return None
    steps = [
        int(name.split("-", 1)[1])
        for name in os.listdir(directory)
        if name.startswith("step-")
        and name.split("-", 1)[1].isdigit()
        and os.path.isfile(os.path.join(directory, name, STATE_FILE))
    ]
    return os.path.join(directory, f"step-{max(steps)}") if steps else None


def prune_checkpoints(directory: str, keep: int, upto: int) -> None:
    """Delete all but the newest `keep` complete `step-N` folders with N <= `upto` (the step just saved): folders
    past it, left by another run in the same directory, are not this run's to delete (keep <= 0: delete nothing)."""
    names = os.listdir(directory)
    steps = sorted(int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit() and int(n[5:]) <= upto)
    for step in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(directory, f"step-{step}"), ignore_errors=True)


def load_checkpoint(path: str, model: nn.Module, rank: int = 0, **stateful) -> dict[str, Any]:
    """Restore model weights, `stateful` objects and this rank's RNG state from a `step-N` folder; returns the saved
    state dict. A rank the checkpoint has no RNG state for (the run had fewer processes) keeps its own."""
    from fastbert.checkpoint import load_checkpoint_dir

    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise FileNotFoundError(f"no training checkpoint at {path}")
    unwrap(model).load_checkpoint_state(load_checkpoint_dir(path), strict_heads=True)
    state = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=True)
    for name, obj in stateful.items():
        if obj is not None and name in state:
            obj.load_state_dict(state[name])
    states = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]  # a dict: written before per-rank
    if rank < len(states):
        set_rng_state(states[rank])
    return state


def progress(total: int, desc: str, enabled: bool = True, initial: int = 0) -> Any:
    """A tqdm bar (disabled off rank 0 or when asked); call `.set_postfix(loss=..., tok_s=...)` as you go."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, initial=initial, dynamic_ncols=True)


def cycle(loader: Any, start_epoch: int = 0) -> Iterator[tuple[int, Any]]:
    """(epoch, batch) forever; calls `set_epoch` on the sampler so each epoch reshuffles/remasks deterministically."""
    epoch = start_epoch
    while True:
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


def steps_per_epoch(num_batches: int, grad_accum: int) -> int:
    return max(1, math.ceil(num_batches / max(1, grad_accum)))


class LengthGroupedBatchSampler:
    """Batches of similar length (little padding), reshuffled each epoch from (seed, epoch) alone, split over ranks.

    Indices are shuffled, cut into windows of `batch_size * group` that are sorted by length and cut into batches,
    and the batches are shuffled again. Each rank takes every world_size-th batch (all ranks get the same count).
    `set_epoch(epoch, start)` also skips the first `start` batches: how a resumed run continues mid-epoch.
    """

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        group: int = 50,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.lengths, self.batch_size, self.seed, self.shuffle = list(lengths), batch_size, seed, shuffle
        self.group, self.rank, self.world_size = group, rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _batches(self) -> list[list[int]]:
        n = len(self.lengths)
        if not self.shuffle:
            order = sorted(range(n), key=lambda i: self.lengths[i])
            return [order[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(n, generator=gen).tolist()
        window = self.batch_size * self.group
        batches = []
        for w in range(0, n, window):
            chunk = sorted(order[w : w + window], key=lambda i: self.lengths[i])
            batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        perm = torch.randperm(len(batches), generator=gen).tolist()
        return [batches[i] for i in perm]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        mine = batches[self.rank :: self.world_size][: len(batches) // self.world_size]
        return iter(mine[self.start :])

    def __len__(self) -> int:
        n, window = len(self.lengths), self.batch_size * self.group
        if self.shuffle:
            return ((n // window) * self.group + math.ceil((n % window) / self.batch_size)) // self.world_size
        return math.ceil(n / self.batch_size) // self.world_size
