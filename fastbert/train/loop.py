"""The one training loop (`fit`) behind `fastbert pretrain`, `finetune` and `distill`: any model whose batches give
`.loss`; accumulation, mixed precision, clipping, evaluation, checkpoints, a wall-time budget, exact resume."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from fastbert.errors import UsageError
from fastbert.train.distributed import DistEnv, unwrap, wrap_model
from fastbert.train.optim import make_optimizer
from fastbert.train.precision import autocast, resolve_precision
from fastbert.train.sampler import LengthGroupedBatchSampler
from fastbert.train.state import (
    WRITE_ERRORS,
    checkpoint_identity,
    gather_rng_states,
    latest_checkpoint,
    load_checkpoint,
    save_resumable,
    write_atomically,
)


@dataclass
class LoopConfig:
    """How long and how to train; shared by pretraining and fine-tuning."""

    output_dir: str
    lr: float = 5e-5
    epochs: float = 3.0
    max_steps: int | None = None  # optimizer steps; overrides epochs
    max_minutes: float | None = None  # wall-time budget, evaluations included: training stops to end inside it
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_accum: int = 1
    precision: str = "auto"  # fp32 | bf16 | fp16 | auto: bf16 where it is fast here, else fp32
    max_grad_norm: float = 1.0
    eval_every: int = 0  # optimizer steps, at most a third of the run (MIN_EVALS); 0 = only at the end
    save_every: int = 0  # optimizer steps; 0 = only the final model
    log_every: int = 10
    resume: bool | str = False  # True: the newest checkpoint in output_dir/checkpoints, if any; str: that step-N
    overwrite: bool = False  # move another run's results in output_dir aside (else refused) and train afresh
    identity: dict[str, Any] | None = None  # the options that define the run (data, model, objective, seed, lr...)
    run_files: tuple[str, ...] = ()  # what else the run keeps in output_dir (moved aside with it by `overwrite`)
    resume_flag: str = "--resume"  # how the command asks to continue a run (a refusal's suggestion)
    strategy: str = "ddp"
    keep_checkpoints: int = 0  # the newest N resumable checkpoints are kept; 0 = all
    final_dir: str = "final"  # where the trained model is written, under output_dir
    compile: bool = False  # training forwards (and their backward) through torch.compile; evaluation stays eager
    compile_backend: str = "inductor"  # torch.compile's backend when compile is set

    def __post_init__(self) -> None:
        """Reject values no run can use, naming the field, before any work (max_steps=-5 would train 0 steps)."""
        rules = (
            ("lr", self.lr >= 0, ">= 0"),
            ("epochs", self.epochs > 0, "> 0"),
            ("max_steps", self.max_steps is None or self.max_steps >= 1, ">= 1"),
            ("max_minutes", self.max_minutes is None or self.max_minutes > 0, "> 0"),
            ("warmup_ratio", 0 <= self.warmup_ratio < 1, "in [0, 1)"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("grad_accum", self.grad_accum >= 1, ">= 1"),
            ("max_grad_norm", self.max_grad_norm >= 0, ">= 0"),
            ("eval_every", self.eval_every >= 0, ">= 0"),
            ("save_every", self.save_every >= 0, ">= 0"),
            ("log_every", self.log_every >= 1, ">= 1"),
        )
        for name, ok, rule in rules:
            if not ok:
                raise UsageError(f"{name} must be {rule}, got {getattr(self, name)!r}")
        if self.overwrite and self.resume:
            raise UsageError("--overwrite and --resume contradict each other: continue the run, or replace it")
        if self.compile and isinstance(self.compile_backend, str):
            check_compile_backend(self.compile_backend)
        if self.identity is not None:  # as a checkpoint's run.json reads back (tuples as lists, keys as strings)
            self.identity = json.loads(json.dumps(self.identity, sort_keys=True))


def check_compile_backend(name: str) -> None:
    """A UsageError listing torch.compile's backends unless `name` is one: a typo fails in one line before any data is
    read, not in a traceback at the first forward (torch._dynamo is imported only when compiling)."""
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())  # the debug ones (eager, aot_eager) included
    if name not in known:
        shown = ", ".join(sorted(b for b in known if "TESTING" not in b))
        raise UsageError(f"--compile-backend {name!r} is not a torch.compile backend: choose one of {shown}")


# LoopConfig fields that change what a run computes: a run's identity holds them (`trajectory`), a resume must match
# them. Not here: how long (epochs, max_steps, max_minutes: a resume may extend a run), how often it reports or saves,
# and how it executes (strategy, compile: the same arithmetic by other kernels, like another device).
TRAJECTORY = ("lr", "warmup_ratio", "weight_decay", "grad_accum", "max_grad_norm", "precision")


def trajectory(cfg: LoopConfig) -> dict[str, Any]:
    """The loop options a run identity holds (`TRAJECTORY`), as given (precision 'auto' stays 'auto')."""
    return {name: getattr(cfg, name) for name in TRAJECTORY}


Evaluate = Callable[[nn.Module], dict[str, float]]
MIN_EVALS = 3  # with eval_every set, a run evaluates at least this often (the final evaluation included)
clock = time.perf_counter  # the loop's wall clock (tests replace it with a fake one)


def eval_interval(eval_every: int, total: int) -> int:
    """Steps between evaluations: `eval_every`, shortened so a run of `total` steps evaluates MIN_EVALS times."""
    return min(eval_every, max(1, math.ceil(total / MIN_EVALS)))


def budget_steps(budget: float, elapsed: float, step: int, train_s: float, eval_s: float, interval: int) -> int:
    """The last step a budget allows: the steps left (each with its share of periodic evaluations) must fit in the
    time left after the final evaluation. `train_s`: time spent on the `step` steps so far, evaluations excluded."""
    per_step = train_s / max(1, step) + (eval_s / interval if interval else 0.0)
    return step + max(0, int((budget - elapsed - eval_s) / max(per_step, 1e-9)))


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def run_eval(model: nn.Module, evaluate: Evaluate, env: DistEnv, precision: str) -> dict[str, float]:
    """Evaluate in eval mode, no grad, same precision as training; back to train mode after."""
    model.eval()
    with torch.no_grad(), autocast(env.device, precision):
        metrics = evaluate(model)
    model.train()
    return metrics


def progress(total: int, desc: str, enabled: bool = True, initial: int = 0) -> Any:
    """A tqdm bar (disabled off rank 0 or when asked); call `.set_postfix(loss=..., tok_s=...)` as you go."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, initial=initial, dynamic_ncols=True)


def save_final(
    model: nn.Module, directory: str, env: DistEnv, strategy: str, finish: Callable[[nn.Module], None] | None = None
) -> None:
    """The trained model as a transformers-loadable directory (FSDP gathers the full weights first).

    `finish(model)` edits the full, unwrapped model in place just before it is written (e.g. folding a target
    normalisation into the head). A failed write (full disk: any of WRITE_ERRORS) is retried once in a new folder
    under the temporary directory ($TMPDIR), so the trained weights outlive the process; either way it ends in an
    OSError that says where the model is (or that it is lost, and which checkpoint is the last good one).
    """
    gather = contextlib.nullcontext()
    if strategy == "fsdp" and env.distributed:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        gather = FSDP.summon_full_params(model, writeback=finish is not None)
    with gather:
        if finish is not None:
            finish(unwrap(model))
        if not env.is_main:
            return
        try:
            write_atomically(directory, unwrap(model).save_pretrained)
            return
        except WRITE_ERRORS as exc:
            failed = f"the trained model could not be written to {directory} ({type(exc).__name__}: {exc})"
        spare = None
        try:
            spare = tempfile.mkdtemp(prefix="fastbert-final-")
            kept = write_atomically(os.path.join(spare, os.path.basename(directory)), unwrap(model).save_pretrained)
        except WRITE_ERRORS as exc:
            if spare is not None:
                shutil.rmtree(spare, ignore_errors=True)
            last = latest_checkpoint(os.path.join(os.path.dirname(directory), "checkpoints"))
            saved = f"the last good checkpoint is {last}" if last else "no resumable checkpoint was written"
            raise OSError(f"{failed}; nor to the temporary directory ({exc}); {saved}") from None
        raise OSError(f"{failed}; it was saved to {kept} instead: move it where it belongs") from None


RUN_MARKS = ("history.json", "checkpoints")  # with the final folder: what a run leaves in its output folder


def _identity_differences(theirs: dict[str, Any], ours: dict[str, Any] | None) -> str:
    """'option: value there, value now' for each option two run identities disagree on."""
    ours = ours or {}
    differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    return "; ".join(f"{k}: {theirs.get(k)} there, {ours.get(k)} now" for k in differ)


def move_run_aside(cfg: LoopConfig) -> str | None:
    """Move what a run left in `cfg.output_dir` (its final folder, history, checkpoints, `run_files`) into a new
    `output_dir/.replaced-<time>-XXXX` folder, so that nothing of it can be resumed or mistaken for the new run's;
    returns that folder (None: there was nothing to move). Nothing is deleted: the user decides."""
    names = [n for n in (cfg.final_dir, *RUN_MARKS, *cfg.run_files) if os.path.lexists(os.path.join(cfg.output_dir, n))]
    if not names:
        return None
    aside = tempfile.mkdtemp(prefix=time.strftime(".replaced-%Y%m%d-%H%M%S-"), dir=cfg.output_dir)
    for name in names:
        os.replace(os.path.join(cfg.output_dir, name), os.path.join(aside, name))
    return aside


def check_output_dir(cfg: LoopConfig, is_main: bool = True) -> LoopConfig:
    """Refuse an output folder that holds another run's results (its final model, history or checkpoints) unless
    `overwrite`, or `resume` with a checkpoint of this run to continue: a new run never silently replaces an old one.

    With `overwrite`, rank 0 (`is_main`) moves the old run aside (`move_run_aside`) and says where (under torchrun a
    collective: every rank calls it); the config returned is the one to go on with (after the move, nothing is left to
    overwrite). An interrupted run of the same options (checkpoints, no final model) is refused with the suggestion to
    resume it.
    """
    if not os.path.isdir(cfg.output_dir):
        return cfg
    if cfg.overwrite:
        aside = move_run_aside(cfg) if is_main else None
        if aside:
            print(f"--overwrite: the previous run in {cfg.output_dir} was moved to {aside}", flush=True)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank looks into output_dir before the old run is out of it
        return replace(cfg, overwrite=False)
    last = latest_checkpoint(os.path.join(cfg.output_dir, "checkpoints"))
    marks = [m for m in (cfg.final_dir, *RUN_MARKS) if os.path.exists(os.path.join(cfg.output_dir, m))]
    marks = [m for m in marks if m != "checkpoints" or last]
    if not marks or (cfg.resume and resume_checkpoint(cfg)):
        return cfg
    theirs = checkpoint_identity(last) if last and cfg.identity is not None else None
    if not cfg.resume and marks == ["checkpoints"] and (theirs is None or theirs == cfg.identity):
        raise UsageError(
            f"{cfg.output_dir} holds an interrupted run of these options (its last checkpoint is {last}): pass "
            f"{cfg.resume_flag} to continue it, --overwrite to move it aside and start afresh, or choose another "
            "--output-dir"
        )
    what = ", ".join(marks)
    if theirs is not None and theirs != cfg.identity:
        what += f"; {_identity_differences(theirs, cfg.identity)}"
    why = " and no checkpoint to --resume" if cfg.resume else ""
    raise UsageError(
        f"{cfg.output_dir} holds another run ({what}){why}: pass --overwrite to move it aside and start afresh, or "
        "choose another --output-dir"
    )


def resume_checkpoint(cfg: LoopConfig) -> str | None:
    """The checkpoint a run with these settings continues from: `resume` itself, the newest one, or None.

    A checkpoint written by another run (its run identity differs from `cfg.identity`) is a UsageError naming the
    options that differ; one without an identity (written before checkpoints held one) is taken as this run's.
    """
    if isinstance(cfg.resume, str):
        path = cfg.resume
    else:
        path = latest_checkpoint(os.path.join(cfg.output_dir, "checkpoints")) if cfg.resume else None
    theirs = checkpoint_identity(path) if path and cfg.identity is not None else None
    if theirs is not None and theirs != cfg.identity:
        raise UsageError(
            f"{path} is a checkpoint of another run ({_identity_differences(theirs, cfg.identity)}): resume it with "
            "that run's options, or pass --overwrite (or another --output-dir) to start this one afresh"
        )
    return path


def _with_precision(cfg: LoopConfig, env: DistEnv) -> LoopConfig:
    """cfg with 'auto' precision resolved for this device; the run says what it picked and why (rank 0)."""
    precision, why = resolve_precision(cfg.precision, env.device)
    if env.is_main and (cfg.precision != precision or why.startswith("warning")):
        print(why, flush=True)
    return replace(cfg, precision=precision)


def fit(
    model: nn.Module,
    dataset: Any,
    collate: Callable[[list[Any]], dict[str, torch.Tensor]],
    sampler: LengthGroupedBatchSampler,
    cfg: LoopConfig,
    env: DistEnv,
    evaluate: Evaluate | None = None,
    desc: str = "train",
    finish: Callable[[nn.Module], None] | None = None,
    state: dict[str, Any] | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    eval_seconds: float | None = None,
) -> dict[str, Any]:
    """Train `model` (already seeded and built identically on every rank); returns the last metrics and history.

    Writes `output_dir/checkpoints/step-N` every `save_every` steps, `output_dir/<final_dir>` at the end (rank 0) and
    `output_dir/history.json` (loss averaged over ranks with any `.losses` parts, lr, grad norm, eval metrics, elapsed
    seconds per logged step). `state`: more objects with a state_dict that checkpoints hold (e.g. trainable modules
    the saved model leaves out); `on_step(step, record)` runs after every optimizer step ({} if none was logged).
    Resumes exactly (data order depends only on (seed, epoch), every rank's RNG state is restored). A wall-time budget
    covers training and every evaluation, the final one included: from the measured step and evaluation times the loop
    stops early enough, and from step 10 fits the LR schedule to the steps that fit, so decay still ends at 0.
    `eval_seconds`: the time of an evaluation the caller ran just before (counted in the budget, and the estimate of
    one evaluation); with a budget and none given, the loop times one before training (recorded at the start step).
    `cfg.compile`: the training forward runs through torch.compile (its first steps compile; evaluation stays eager).
    """
    cfg = _with_precision(cfg, env)
    if cfg.strategy == "fsdp" and env.distributed and cfg.save_every:
        raise ValueError("resumable checkpoints (save_every) need --strategy ddp; FSDP runs save the final model only")
    model.to(env.device)
    wrapped = wrap_model(model, env, cfg.strategy)
    # checkpoints, clipping, evaluation and saving keep the module itself (its parameter names, no _orig_mod.)
    forward = torch.compile(wrapped, backend=cfg.compile_backend) if cfg.compile else wrapped
    # its own generator: each new DataLoader iterator draws a seed, which must not advance the global RNG that
    # masking and dropout use (or a resumed run, which starts a fresh iterator mid-epoch, would diverge)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate, num_workers=0, generator=torch.Generator()
    )
    batches = len(sampler)
    if batches == 0:
        raise ValueError("the training set gives no batch on this rank (too few examples for batch size x ranks)")
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * batches / cfg.grad_accum))
    optimizer, scheduler = make_optimizer(
        wrapped, cfg.lr, total, warmup_steps=int(cfg.warmup_ratio * total), weight_decay=cfg.weight_decay
    )
    schedule = scheduler.lr_lambdas[0]
    scaler = torch.amp.GradScaler(env.device.type) if cfg.precision == "fp16" else None
    ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
    cfg = check_output_dir(cfg, env.is_main)
    step, history, elapsed_before, extra = 0, [], 0.0, {}
    stateful = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, **(state or {})}
    if env.distributed:  # the model is built alike everywhere; from here each rank draws its own masks and dropout
        torch.manual_seed(torch.initial_seed() + env.rank)
    last = resume_checkpoint(cfg)
    if last:
        saved = load_checkpoint(last, wrapped, env.rank, **stateful)
        step, extra = saved["step"], saved["extra"]
        history, elapsed_before = extra.get("history", []), extra.get("elapsed", 0.0)
        if env.is_main:
            known = checkpoint_identity(last) is not None and cfg.identity is not None
            why = "its run identity (data, model, objective, seed, lr, precision...) matches this run's"
            said = why if known else "it holds no run identity to check"
            print(f"resumed from {last} at step {step}: {said}", flush=True)
        planned = extra.get("total", schedule.total)  # the run's own total, before any budget fitted the schedule
        if step >= total:
            raise UsageError(f"{last} is at step {step}, not before the {total} steps asked for: nothing to train")
        if total != planned:  # another --max-steps (or --epochs): train to the new total
            schedule.retarget(step, total)
            if env.is_main:
                print(
                    f"resumed with {total} steps instead of {planned}: the learning rate decays linearly from its "
                    f"value at step {step} to 0 at step {total}",
                    flush=True,
                )
    elif cfg.resume and env.is_main:
        print(f"--resume: no checkpoint in {ckpt_dir}; starting a fresh run", flush=True)
    micro = step * cfg.grad_accum
    epoch, offset = divmod(micro, batches)
    budget = cfg.max_minutes * 60 if cfg.max_minutes else None
    start = clock() - elapsed_before - (0.0 if last else eval_seconds or 0.0)
    metrics: dict[str, float] = {}
    eval_total = extra.get("eval_total", eval_seconds or 0.0)  # seconds spent evaluating, in the budget's clock
    if budget and evaluate and eval_seconds is None and "eval_seconds" not in extra:  # its cost is reserved: time one
        t_eval = clock()
        metrics = run_eval(wrapped, evaluate, env, cfg.precision)
        eval_seconds = clock() - t_eval
        eval_total += eval_seconds
        history.append({"step": step, **metrics, "elapsed_s": round(clock() - start, 2)})
    eval_seconds = extra.get("eval_seconds", eval_seconds or 0.0)
    last_eval = extra.get("last_eval", step)
    bar = progress(schedule.total, desc, env.is_main, initial=step)
    sums: dict[str, torch.Tensor] = {}  # loss (and its parts) summed over the optimizer steps since the last record
    seen, tokens, grad_norm = 0, 0, None
    wrapped.train()
    while step < schedule.total:
        sampler.set_epoch(epoch, offset)
        offset = 0
        for batch in loader:
            tokens += int(batch["attention_mask"].sum()) if "attention_mask" in batch else 0
            batch = _to(batch, env.device)
            sync = (micro + 1) % cfg.grad_accum == 0
            no_sync = wrapped.no_sync() if env.distributed and not sync else contextlib.nullcontext()
            with no_sync:
                with autocast(env.device, cfg.precision):
                    out = forward(**batch)
                loss = out.loss / cfg.grad_accum
                (scaler.scale(loss) if scaler else loss).backward()
            parts = {"loss": loss, **{f"loss_{k}": v / cfg.grad_accum for k, v in getattr(out, "losses", {}).items()}}
            for name, value in parts.items():  # summed on the device: no host sync until a step is logged
                sums[name] = sums.get(name, 0.0) + value.detach().float()
            micro += 1
            if not sync:
                continue
            if scaler:
                scaler.unscale_(optimizer)
            if cfg.max_grad_norm:  # FSDP's own clip sees every shard's norm; the plain one would see only local ones
                if hasattr(wrapped, "clip_grad_norm_"):
                    grad_norm = wrapped.clip_grad_norm_(cfg.max_grad_norm)
                else:
                    grad_norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.max_grad_norm)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step, seen = step + 1, seen + 1
            bar.update(1)
            record: dict[str, Any] = {}
            interval = eval_interval(cfg.eval_every, schedule.total) if evaluate and cfg.eval_every else 0
            evaluating = interval and step - last_eval >= interval and step < schedule.total
            if step % cfg.log_every == 0 or step == schedule.total or evaluating:
                means = torch.stack(list(sums.values())) / seen  # on env.device: NCCL reduces no CPU tensor
                if env.distributed:  # the loss over all ranks' batches, not rank 0's alone
                    torch.distributed.all_reduce(means)
                    means /= env.world_size
                record = {"step": step, "epoch": round(micro / batches, 3)}
                record.update(zip(sums, means.tolist(), strict=True))
                record["lr"] = scheduler.get_last_lr()[0]
                if grad_norm is not None:
                    record["grad_norm"] = float(grad_norm)
                sums, seen = {}, 0
                if evaluating:
                    t_eval = clock()
                    metrics = run_eval(wrapped, evaluate, env, cfg.precision)
                    eval_seconds = clock() - t_eval
                    eval_total, last_eval = eval_total + eval_seconds, step
                    record.update(metrics)
                record["elapsed_s"] = round(clock() - start, 2)
                history.append(record)
                tok_s = tokens / max(1e-9, clock() - start - elapsed_before)  # this process's, this session
                scores = {k: f"{v:.4g}" for k, v in metrics.items()}
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{tok_s:.0f}", **scores)
            if budget:  # stop where the budget ends, the final evaluation included; from step 10 fit the schedule
                elapsed = clock() - start
                eval_s = eval_seconds if evaluate else 0.0
                allowed = budget_steps(budget, elapsed, step, elapsed - eval_total, eval_s, interval)
                fit_steps = max(step, min(total, allowed)) if step >= 10 else min(schedule.total, max(step, allowed))
                if step < 10 and allowed > step:  # too few steps to fit a schedule to: only stop if it must
                    fit_steps = schedule.total
                total_now = torch.tensor(fit_steps, device=env.device)
                if env.distributed:  # every rank must stop at the same step: rank 0 decides
                    torch.distributed.broadcast(total_now, src=0)
                schedule.total = int(total_now)
                schedule.warmup = min(schedule.warmup, max(1, int(cfg.warmup_ratio * schedule.total)))
                bar.total = schedule.total
            if cfg.save_every and step % cfg.save_every == 0 and step < schedule.total:
                timing = {"eval_total": eval_total, "eval_seconds": eval_seconds, "last_eval": last_eval}
                extra = {"history": history, "elapsed": clock() - start, "total": total, **timing}
                rng = gather_rng_states(env)
                if env.is_main:
                    save_resumable(ckpt_dir, step, wrapped, extra, rng, cfg.keep_checkpoints, stateful, cfg.identity)
                if env.distributed:
                    torch.distributed.barrier()
            if on_step is not None:
                on_step(step, record)
            if step >= schedule.total:
                break
        epoch += 1
    bar.close()
    if evaluate:
        metrics = run_eval(wrapped, evaluate, env, cfg.precision)
        elapsed = round(clock() - start, 2)
        history.append({"step": step, "epoch": round(micro / batches, 3), **metrics, "elapsed_s": elapsed})
    save_final(wrapped, os.path.join(cfg.output_dir, cfg.final_dir), env, cfg.strategy, finish)
    result = {"step": step, "metrics": metrics, "history": history, "train_seconds": clock() - start}
    if env.is_main:
        with open(os.path.join(cfg.output_dir, "history.json"), "w", encoding="utf-8") as f:
            json.dump({"config": {k: v for k, v in asdict(cfg).items() if k != "history"}, **result}, f, indent=1)
    return result
