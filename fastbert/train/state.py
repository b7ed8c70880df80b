"""Resumable training state on disk: `step-N` folders with the model, optimizer, scheduler and every rank's RNG
state, written atomically so a crash or a full disk never leaves a half-written checkpoint, found, pruned and loaded
back so a resumed run repeats the uninterrupted one. (Model files alone are fastbert.checkpoint's.)"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fastbert.errors import DataError
from fastbert.train.distributed import DistEnv, unwrap

try:
    from safetensors import SafetensorError
except ImportError:  # an old safetensors: its writer's errors are RuntimeErrors or OSErrors
    SafetensorError = RuntimeError

STATE_FILE = "trainer_state.pt"
RUN_FILE = "run.json"  # a checkpoint's run identity (the options that define the run), read before resuming it
# what a failed write really raises on a full disk: OSError (open, rename), RuntimeError (torch.save's
# "PytorchStreamWriter failed writing file" / "unexpected pos"), SafetensorError (safetensors' "I/O error")
WRITE_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, SafetensorError)


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
    directory = directory.rstrip(os.sep)
    tmp, old = directory + ".tmp", directory + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(directory):  # moved aside, not deleted, until the new folder holds its name
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def fingerprint(path: str | os.PathLike) -> str:
    """A short SHA-256 of a file's bytes, or of a folder's file names and bytes: what a run read, wherever it lies
    (a run identity names data by content, so a copied checkpoint still resumes and an edited corpus does not)."""
    digest = hashlib.sha256()
    path = os.fspath(path)
    files = [path] if os.path.isfile(path) else sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
    for name in files:
        digest.update(os.path.relpath(name, path).encode())
        with open(name, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def checkpoint_identity(path: str) -> dict[str, Any] | None:
    """The run identity a `step-N` checkpoint was written with, or None (written before checkpoints held one)."""
    file = os.path.join(path, RUN_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(f"{file} is not a readable run identity ({exc})") from None


def rng_state() -> dict[str, Any]:
    """This process's torch, Python, NumPy (and CUDA) RNG states, loadable with torch.load(weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss)  # tensors: loadable with weights_only
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
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
    identity: dict[str, Any] | None = None,
    **stateful: Any,
) -> str:
    """Write `directory/step-{step}` atomically: the model (save_pretrained), then optimizer/scheduler/RNG state.

    `rng` holds one RNG state per rank (`gather_rng_states`; default: this process's). `identity`: the options that
    define the run (`RUN_FILE`), which a resume must match. `stateful` objects
    (optimizer=..., scheduler=..., scaler=...) are saved by their `state_dict()`. The folder appears under its final
    name only once complete, so a crash mid-write leaves the previous checkpoint intact.
    """
    state = {"step": step, "rng": rng if rng is not None else [rng_state()], "extra": extra or {}}
    state.update({name: obj.state_dict() for name, obj in stateful.items() if obj is not None})

    def write(tmp: str) -> None:
        unwrap(model).save_pretrained(tmp)
        torch.save(state, os.path.join(tmp, STATE_FILE))
        if identity is not None:
            with open(os.path.join(tmp, RUN_FILE), "w", encoding="utf-8") as f:
                json.dump(identity, f, indent=1, sort_keys=True)

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


def load_checkpoint(path: str, model: nn.Module, rank: int = 0, **stateful: Any) -> dict[str, Any]:
    """Restore model weights, `stateful` objects and this rank's RNG state from a `step-N` folder; returns the saved
    state dict. A rank the checkpoint has no RNG state for (the run had fewer processes) keeps its own."""
    from fastbert.checkpoint import load_checkpoint_dir

    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise FileNotFoundError(f"no training checkpoint at {path}")
    file = os.path.join(path, STATE_FILE)
    try:  # read first: a damaged state file must fail before the model's weights are replaced
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and type errors alike: the file is damaged or not fastbert's
        reason = str(exc).strip().splitlines()[0][:200]
        raise DataError(f"{file} is not a readable training state ({type(exc).__name__}: {reason})") from None
    if not isinstance(state, dict) or not {"step", "rng"} <= state.keys():
        raise DataError(f"{file} is not a fastbert training state (no step or RNG state in it)")
    unwrap(model).load_checkpoint_state(load_checkpoint_dir(path), strict_heads=True)
    for name, obj in stateful.items():
        if obj is not None and name in state:
            obj.load_state_dict(state[name])
    states = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]  # a dict: written before per-rank
    if rank < len(states):
        set_rng_state(states[rank])
    return state


def save_resumable(
    directory: str,
    step: int,
    model: nn.Module,
    extra: dict,
    rng: Any,
    keep: int,
    stateful: dict[str, Any],
    identity: dict[str, Any] | None = None,
) -> None:
    """A resumable checkpoint, then pruning; a failed write (disk full, folder gone: any of WRITE_ERRORS) is a warning
    that says where the last good checkpoint is, and training goes on: the run is not lost, nothing older is pruned."""
    try:
        save_checkpoint(directory, step, model, extra, rng, identity, **stateful)
    except WRITE_ERRORS as exc:
        last = latest_checkpoint(directory)
        print(f"warning: checkpoint step-{step} not written ({exc}); the last good checkpoint is {last}", flush=True)
        return
    prune_checkpoints(directory, keep, step)
