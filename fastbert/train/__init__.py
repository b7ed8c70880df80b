"""Everything fastbert's training commands share (pretrain, finetune, distill), one module per concern: the loop,
torchrun set-up, resumable state on disk, the batch sampler, AdamW + schedule, precision and the command-line flags."""

from fastbert.train.distributed import DistEnv, init_distributed, resolve_device, unwrap, wrap_model
from fastbert.train.loop import (
    Evaluate,
    LoopConfig,
    check_output_dir,
    fit,
    progress,
    resume_checkpoint,
    run_eval,
    save_final,
)
from fastbert.train.optim import WarmupLinear, make_optimizer
from fastbert.train.options import add_loop_arguments, loop_options, print_summary
from fastbert.train.precision import PRECISION_CHOICES, PRECISIONS, autocast, resolve_precision
from fastbert.train.sampler import LengthGroupedBatchSampler
from fastbert.train.state import (
    STATE_FILE,
    WRITE_ERRORS,
    check_writable,
    checkpoint_identity,
    fingerprint,
    gather_rng_states,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    rng_state,
    save_checkpoint,
    save_resumable,
    set_rng_state,
    write_atomically,
)

__all__ = [
    "PRECISIONS",
    "PRECISION_CHOICES",
    "STATE_FILE",
    "WRITE_ERRORS",
    "DistEnv",
    "Evaluate",
    "LengthGroupedBatchSampler",
    "LoopConfig",
    "WarmupLinear",
    "add_loop_arguments",
    "autocast",
    "check_output_dir",
    "check_writable",
    "checkpoint_identity",
    "fingerprint",
    "fit",
    "gather_rng_states",
    "init_distributed",
    "latest_checkpoint",
    "load_checkpoint",
    "loop_options",
    "make_optimizer",
    "print_summary",
    "progress",
    "prune_checkpoints",
    "resolve_device",
    "resolve_precision",
    "resume_checkpoint",
    "rng_state",
    "run_eval",
    "save_checkpoint",
    "save_final",
    "save_resumable",
    "set_rng_state",
    "unwrap",
    "wrap_model",
    "write_atomically",
]
