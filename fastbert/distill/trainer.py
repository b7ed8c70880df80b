"""The distillation loop: one process or many under `torchrun` (DDP wraps only the student; the frozen teacher
runs in every process), mixed precision, gradient accumulation, AdamW + warmup, clipping, resumable checkpoints,
a progress bar with loss and throughput, and a held-out evaluation before and after training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fastbert import training
from fastbert.checkpoint import PreTrainedModel
from fastbert.distill.data import LengthGroupedBatches, TeacherCache, collate, read_corpus, tokenize_corpus
from fastbert.distill.models import DistillStudent, has_mlm_head, load_teacher, teacher_targets
from fastbert.distill.objectives import Objectives, weighted_losses
from fastbert.distill.student import block_end_map, init_from_teacher, student_config, uniform_layer_map
from fastbert.heads import BertForMaskedLM
from fastbert.masking import MLMMasker
from fastbert.modeling import BertModel
from fastbert.tokenization import WordPieceTokenizer

log = logging.getLogger("fastbert.distill")


@dataclass
class DistillConfig:
    """Everything a distillation run needs besides the teacher and the corpus."""

    output_dir: str
    num_layers: int | None = None  # default: half the teacher's
    layer_map: list[int] | None = None  # teacher layer copied into each student layer; default uniform
    hidden_size: int | None = None  # narrower student (fresh layers, projections for hidden-state losses)
    student_overrides: dict = field(default_factory=dict)  # e.g. embedding_size, layer_sharing, num_hidden_groups
    init: str = "auto"  # auto: copy what fits | copy: everything must be copied | random
    projection: bool | None = None  # None: learned projection iff the student is narrower
    freeze_embeddings: bool = False  # keep the (copied) word embeddings fixed: less optimizer work per step
    objectives: Objectives = field(default_factory=Objectives.distilbert)
    max_length: int = 128
    batch_size: int = 32  # per process
    grad_accum: int = 1
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    lr: float = 1e-4
    warmup_ratio: float = 0.05
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    precision: str = "fp32"  # student compute: fp32 | bf16 | fp16
    teacher_precision: str = "fp32"  # fp32 | bf16 (teacher weights cast)
    mlm_probability: float = 0.15
    whole_word: bool = False
    cache_teacher: bool = False  # keep teacher targets on disk across epochs (unmasked inputs only)
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    resume: str | None = None  # None | "latest" (in output_dir/checkpoints) | a step-N directory
    eval_fraction: float = 0.02
    max_eval: int = 2000
    eval_every: int = 0  # held-out evaluation every N steps (0: only before and after training)
    seed: int = 0
    device: str | None = None
    log_every: int = 10


@dataclass
class DistillResult:
    student_dir: str
    student: PreTrainedModel  # the trained student (this process's copy)
    history: list[dict]
    eval_before: float
    eval_after: float
    train_seconds: float


def _resolve_resume(cfg: DistillConfig) -> str | None:
    if cfg.resume is None:
        return None
    if cfg.resume == "latest":
        path = training.latest_checkpoint(os.path.join(cfg.output_dir, "checkpoints"))
        if path is None:
            raise FileNotFoundError(f"resume='latest' but there is no checkpoint in {cfg.output_dir}/checkpoints")
        return path
    if not os.path.isfile(os.path.join(cfg.resume, training.STATE_FILE)):
        raise FileNotFoundError(f"no distillation checkpoint at {cfg.resume} (expected {training.STATE_FILE} there)")
    return cfg.resume


def build_student(teacher: PreTrainedModel, cfg: DistillConfig) -> tuple[PreTrainedModel, list[int]]:
    """The student model (MLM head iff a logits objective is on) initialised from the teacher's chosen layers."""
    t_cfg = teacher.config
    layers = cfg.num_layers or max(1, t_cfg.num_hidden_layers // 2)
    layer_map = list(cfg.layer_map) if cfg.layer_map is not None else uniform_layer_map(t_cfg.num_hidden_layers, layers)
    s_cfg = student_config(t_cfg, layers, cfg.hidden_size, **cfg.student_overrides)
    if cfg.objectives.uses_logits:
        student: PreTrainedModel = BertForMaskedLM(s_cfg)
    else:
        student = BertModel(s_cfg)  # with a pooler (the teacher's if it has one) so BertModel.from_pretrained works
    if cfg.init not in ("auto", "copy", "random"):
        raise ValueError(f"init must be 'auto', 'copy' or 'random', got {cfg.init!r}")
    if cfg.init != "random":
        init_from_teacher(student, teacher, layer_map, strict=cfg.init == "copy")
    return student, layer_map


def _projections(s_width: int, t_width: int, cfg: DistillConfig, layer_map: dict[int, int], layers: int) -> dict:
    obj = cfg.objectives
    if not obj.uses_hidden:
        return {}
    project = cfg.projection
    if project is None:
        if s_width > t_width:
            raise ValueError(
                f"the student ({s_width}) is wider than the teacher ({t_width}); hidden-state objectives need a "
                "learned projection: pass projection=True (--projection) if a wider student is what you want"
            )
        project = s_width != t_width
    if not project and s_width != t_width:
        raise ValueError(f"student width {s_width} != teacher width {t_width}: hidden-state objectives need projection")
    if not project:
        return {}
    indices = set(layer_map) if obj.hidden_mse else set()
    if obj.cosine or obj.embedding:
        indices.add(layers)
    return {k: nn.Linear(s_width, t_width) for k in sorted(indices)}


def _cached_targets(cache: TeacherCache, indices, batch, teacher, obj, layer_map) -> dict:
    """Teacher targets from the cache, computing and storing them for examples it lacks."""
    lengths = batch["attention_mask"].sum(1).tolist()
    found = cache.get(indices)
    if found is None:
        t = teacher_targets(teacher, batch, obj, layer_map)
        per_example = []
        for row, n in enumerate(lengths):
            entry = {"embedding": t["embedding"][row]} if "embedding" in t else {}
            if "last" in t:
                entry["last"] = t["last"][row, :n]
            for k, h in t.get("hidden", {}).items():
                entry[f"hidden.{k}"] = h[row, :n]
            per_example.append(entry)
        cache.put(indices, per_example)
        return t
    width = batch["attention_mask"].shape[1]

    def padded(name: str) -> torch.Tensor:
        rows = [e[name] for e in found]
        out = rows[0].new_zeros(len(rows), width, rows[0].shape[-1])
        for i, r in enumerate(rows):
            out[i, : r.shape[0]] = r
        return out

    t: dict = {}
    if "embedding" in found[0]:
        t["embedding"] = torch.stack([e["embedding"] for e in found])
    if "last" in found[0]:
        t["last"] = padded("last")
    if obj.hidden_mse:
        t["hidden"] = {k: padded(f"hidden.{k}") for k in layer_map}
    return {k: (v.to(batch["input_ids"].device) if torch.is_tensor(v) else v) for k, v in t.items()}


def _check(cfg: DistillConfig, teacher: PreTrainedModel, tokenizer: WordPieceTokenizer) -> None:
    obj = cfg.objectives
    obj.validate()
    if tokenizer.vocab_size != teacher.config.vocab_size:
        raise ValueError(
            f"tokenizer vocabulary ({tokenizer.vocab_size}) != teacher vocabulary ({teacher.config.vocab_size}): "
            "distillation needs the teacher's own WordPiece vocabulary"
        )
    if obj.uses_logits and not has_mlm_head(teacher):
        raise ValueError(
            "objectives kl/mlm/logits_mse need a teacher with an MLM head (BertForMaskedLM or BertForPreTraining); "
            f"this teacher is a {type(teacher).__name__}"
        )
    if cfg.cache_teacher and (obj.masks_inputs or obj.uses_logits or obj.attention):
        raise ValueError(
            "cache_teacher caches embeddings/hidden states of unmasked inputs only: switch off kl, mlm, "
            "logits_mse and attention, or cache_teacher"
        )
    for name in ("precision", "teacher_precision"):
        if getattr(cfg, name) not in training.PRECISIONS:
            raise ValueError(f"{name} must be one of {sorted(training.PRECISIONS)}, got {getattr(cfg, name)!r}")
    if cfg.batch_size < 1 or cfg.grad_accum < 1 or cfg.max_length < 2:
        raise ValueError("batch_size and grad_accum must be >= 1 and max_length >= 2")


def distill(
    teacher: str | os.PathLike | nn.Module,
    corpus: str | os.PathLike | Sequence[str],
    config: DistillConfig,
    tokenizer: WordPieceTokenizer | str | None = None,
    eval_corpus: str | os.PathLike | Sequence[str] | None = None,
    on_step: Callable[[int, dict], None] | None = None,
) -> DistillResult:
    """Distil `teacher` into a smaller student on `corpus`; the student (+ tokenizer) lands in output_dir/student.

    `tokenizer` defaults to the teacher directory's own. Every bad input is reported before training starts.
    """
    cfg = config
    env = training.init_distributed(cfg.device)
    resume_path = _resolve_resume(cfg)
    teacher_model = load_teacher(teacher)
    if tokenizer is None:
        if not isinstance(teacher, (str, os.PathLike)):
            raise ValueError("a live teacher model needs its tokenizer: pass tokenizer=")
        tokenizer = teacher
    if not isinstance(tokenizer, WordPieceTokenizer):
        tokenizer = WordPieceTokenizer.from_pretrained(tokenizer)
    _check(cfg, teacher_model, tokenizer)
    obj = cfg.objectives
    texts = read_corpus(corpus)
    eval_texts = read_corpus(eval_corpus) if eval_corpus is not None else None
    if eval_texts is None:
        n_eval = min(cfg.max_eval, int(len(texts) * cfg.eval_fraction))
        eval_texts, texts = (texts[-n_eval:], texts[:-n_eval]) if n_eval else (texts[: min(64, len(texts))], texts)

    torch.manual_seed(cfg.seed)
    teacher_model.requires_grad_(False)
    teacher_model = teacher_model.to(env.device).eval()
    student, init_map = build_student(teacher_model, cfg)  # copied from the full-precision teacher
    if cfg.teacher_precision != "fp32":
        teacher_model = teacher_model.to(training.PRECISIONS[cfg.teacher_precision])
    s_layers, t_layers = student.config.num_hidden_layers, teacher_model.config.num_hidden_layers
    hidden_map = dict(obj.layer_map) if obj.layer_map is not None else block_end_map(t_layers, s_layers)
    if obj.attention:
        if student.config.num_attention_heads != teacher_model.config.num_attention_heads:
            raise ValueError("attention distillation needs as many heads in the student as in the teacher")
    projections = _projections(student.config.hidden_size, teacher_model.config.hidden_size, cfg, hidden_map, s_layers)
    if cfg.freeze_embeddings:
        (student.bert if hasattr(student, "bert") else student).embeddings.word_embeddings.requires_grad_(False)
    if getattr(student, "pooler", None) is not None:
        student.pooler.requires_grad_(False)  # no objective reaches it; frozen, it stays the teacher's (and DDP-safe)
    module = DistillStudent(student, projections, obj).to(env.device)
    module.layer_map = hidden_map

    ids = tokenize_corpus(texts, tokenizer, cfg.max_length)
    eval_ids = tokenize_corpus(eval_texts, tokenizer, cfg.max_length)
    sampler = LengthGroupedBatches([len(r) for r in ids], cfg.batch_size, cfg.seed, env.rank, env.world_size)
    per_epoch = len(sampler)
    total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch / cfg.grad_accum))
    masker = (
        MLMMasker.from_tokenizer(tokenizer, whole_word=cfg.whole_word, probability=cfg.mlm_probability)
        if obj.masks_inputs
        else None
    )
    optimizer, scheduler = training.make_optimizer(
        module, cfg.lr, total_steps, int(cfg.warmup_ratio * total_steps), cfg.weight_decay
    )
    scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.precision == "fp16")
    ckpt_dir = os.path.join(cfg.output_dir, "checkpoints")
    start_step = 0
    torch.manual_seed(cfg.seed + env.rank)  # dropout differs across ranks; a resumed run restores its saved state
    if resume_path is not None:
        state = training.load_checkpoint(
            resume_path,
            student,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            projections=module.projections,
        )
        start_step = int(state["step"])
    wrapped = training.wrap_model(module, env)
    cache = TeacherCache(os.path.join(cfg.output_dir, "teacher_cache"), env.rank) if cfg.cache_teacher else None
    os.makedirs(cfg.output_dir, exist_ok=True)
    history_path = os.path.join(cfg.output_dir, "history.jsonl")
    history = _load_history(history_path, start_step) if env.is_main else []

    def make_batch(rows: list[int], seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        batch = collate([ids[i] for i in rows], tokenizer.pad_id, masker, gen)
        return {k: v.to(env.device) for k, v in batch.items()}

    def evaluate() -> float:
        module.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(eval_ids), cfg.batch_size):
                rows = eval_ids[start : start + cfg.batch_size]
                gen = torch.Generator().manual_seed(cfg.seed + start)
                batch = {k: v.to(env.device) for k, v in collate(rows, tokenizer.pad_id, masker, gen).items()}
                with training.autocast(env.device, cfg.precision):
                    s_out = module(batch)
                t_out = teacher_targets(teacher_model, batch, obj, hidden_map)
                total += float(weighted_losses(obj, s_out, t_out, batch)["total"]) * len(rows)
                count += len(rows)
        module.train()
        return total / count

    if start_step and history and "eval_loss" in history[0]:
        eval_before = history[0]["eval_loss"]
    else:
        eval_before = evaluate()
        if env.is_main:
            history.append({"step": 0, "eval_loss": eval_before})
            _append(history_path, history[-1])
    module.train()
    bar = training.progress(total_steps, "distill", env.is_main, initial=start_step)
    step, micro = start_step, start_step * cfg.grad_accum
    epoch_batches: tuple[int, list[list[int]]] = (-1, [])
    sums: dict[str, float] = {}
    tokens, t0, train_start = 0, time.perf_counter(), time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    while step < total_steps:
        epoch, pos = divmod(micro, per_epoch)
        if epoch_batches[0] != epoch:
            if cache is not None:
                cache.flush()
            epoch_batches = (epoch, sampler.batches(epoch))
        rows = epoch_batches[1][pos]
        batch = make_batch(rows, (((cfg.seed * 1_000_003 + epoch) * 1_000_003 + pos) * 257 + env.rank) % 2**63)
        if cache is not None:
            t_out = _cached_targets(cache, rows, batch, teacher_model, obj, hidden_map)
        else:
            t_out = teacher_targets(teacher_model, batch, obj, hidden_map)
        micro += 1
        sync = micro % cfg.grad_accum == 0
        no_sync = wrapped.no_sync if env.distributed and not sync else contextlib.nullcontext
        with no_sync():
            with training.autocast(env.device, cfg.precision):
                s_out = wrapped(batch)
            parts = weighted_losses(obj, s_out, t_out, batch)
            scaler.scale(parts["total"] / cfg.grad_accum).backward()
        for name, value in parts.items():
            sums[name] = sums.get(name, 0.0) + float(value.detach()) / cfg.grad_accum
        tokens += int(batch["attention_mask"].sum())
        if not sync:
            continue
        scaler.unscale_(optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.max_grad_norm))
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        record = _step_record(step, epoch, sums, env, scheduler, grad_norm, tokens, time.perf_counter() - t0)
        sums = {}
        if env.is_main:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if step % cfg.log_every == 0 or step == total_steps:
                history.append(record)
                _append(history_path, record)
        if step % cfg.checkpoint_every == 0 or step == total_steps:
            if cache is not None:
                cache.flush()
            if env.is_main:
                training.save_checkpoint(
                    ckpt_dir,
                    step,
                    student,
                    {"epoch": epoch},
                    optimizer=optimizer,
                    scheduler=scheduler,
                    scaler=scaler,
                    projections=module.projections,
                )
                _prune(ckpt_dir, cfg.keep_checkpoints)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
            held_out = evaluate()
            if env.is_main:
                history.append({"step": step, "eval_loss": held_out})
                _append(history_path, history[-1])
        if on_step is not None:
            on_step(step, record)
        tokens, t0 = 0, time.perf_counter()
    bar.close()
    train_seconds = time.perf_counter() - train_start
    eval_after = evaluate()
    student_dir = os.path.join(cfg.output_dir, "student")
    if env.is_main:
        history.append({"step": step, "eval_loss": eval_after, "train_seconds": train_seconds})
        _append(history_path, history[-1])
        student.save_pretrained(student_dir)
        tokenizer.save(student_dir)
        with open(os.path.join(cfg.output_dir, "distill_config.json"), "w", encoding="utf-8") as f:
            json.dump(_jsonable(cfg, init_map, hidden_map), f, indent=2)
    if env.distributed:
        dist.barrier()
    return DistillResult(student_dir, student, history, eval_before, eval_after, train_seconds)


def _step_record(step, epoch, sums, env, scheduler, grad_norm, tokens, seconds) -> dict:
    names = sorted(sums)
    values = torch.tensor([sums[n] for n in names] + [float(tokens)], dtype=torch.float64)
    if env.distributed:  # mean loss over ranks, total tokens
        dist.all_reduce(values)
        values[:-1] /= env.world_size
    record = {"step": step, "epoch": epoch, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm}
    record.update(
        {("loss" if n == "total" else f"loss_{n}"): float(v) for n, v in zip(names, values[:-1].tolist(), strict=True)}
    )
    record["tokens_per_s"] = float(values[-1]) / max(seconds, 1e-9)
    return record


def _append(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _load_history(path: str, upto: int) -> list[dict]:
    """Records of a resumed run up to its checkpoint (later ones were lost with the crash and are rewritten)."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in records if r["step"] <= upto] if upto else []
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    return kept


def _prune(directory: str, keep: int) -> None:
    steps = sorted(int(n.split("-")[1]) for n in os.listdir(directory) if n.startswith("step-") and n[5:].isdigit())
    for s in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(directory, f"step-{s}"), ignore_errors=True)


def _jsonable(cfg: DistillConfig, init_map: list[int], hidden_map: dict[int, int]) -> dict:
    out = dataclasses.asdict(cfg)
    out["init_layer_map"] = init_map
    out["hidden_layer_map"] = {str(k): v for k, v in hidden_map.items()}
    return out
