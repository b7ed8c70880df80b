"""Fine-tuning: sequence classification/regression, token classification and extractive QA, one loop for all.

`finetune(...)` (or `fastbert finetune ...`) loads a checkpoint and its tokenizer, reads the task's files, trains
with AdamW + warmup/linear decay (under torchrun: DDP or FSDP) and writes `output_dir/final`, a directory that
fastbert's and transformers' `from_pretrained` both load (tokenizer files included).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from fastbert.auto import model_class
from fastbert.checkpoint import check_sizes, load_checkpoint_dir
from fastbert.config import BertConfig
from fastbert.errors import UsageError
from fastbert.finetune.tasks import QATask, SequenceTask, TokenTask
from fastbert.tokenization import WordPieceTokenizer
from fastbert.train import (
    LengthGroupedBatchSampler,
    LoopConfig,
    check_output_dir,
    check_writable,
    fingerprint,
    fit,
    init_distributed,
    trajectory,
)

TASKS = ("sequence", "regression", "token", "qa")

__all__ = ["TASKS", "finetune", "make_task"]


def make_task(kind: str, tokenizer: WordPieceTokenizer, options: dict[str, Any]) -> SequenceTask | TokenTask | QATask:
    """The task object for `kind` ('sequence', 'regression', 'token' or 'qa')."""
    max_length = options.get("max_length", 384 if kind == "qa" else 128)
    if kind in ("sequence", "regression"):
        columns = options.get("text_columns")
        if not columns or options.get("label_column") is None:
            raise ValueError(f"task {kind!r} needs text_columns (one or two) and label_column")
        return SequenceTask(
            tokenizer,
            list(columns),
            str(options["label_column"]),
            regression=kind == "regression",
            labels=options.get("labels"),
            header=options.get("header", True),
            max_length=max_length,
        )
    if kind == "token":
        return TokenTask(tokenizer, options.get("labels"), max_length)
    if kind == "qa":
        stride = options.get("stride", 128)
        if stride >= max_length:
            raise UsageError(f"qa: --stride ({stride}) must be smaller than --max-length ({max_length})")
        return QATask(tokenizer, max_length, stride)
    raise ValueError(f"task must be one of {TASKS}, got {kind!r}")


def finetune(
    task: str,
    model: str,
    train: str,
    output_dir: str,
    dev: str | None = None,
    tokenizer: str | None = None,
    batch_size: int = 32,
    eval_batch_size: int = 128,
    seed: int = 42,
    device: str | None = None,
    loop: dict[str, Any] | None = None,
    **task_options: Any,
) -> dict[str, Any]:
    """Fine-tune checkpoint directory `model` on `train`, scoring on `dev`; returns final metrics and history.

    `loop` holds LoopConfig fields (lr, epochs, max_minutes, grad_accum, precision, ...); defaults lr 3e-5,
    3 epochs, 10% warmup. `task_options`: text_columns/label_column/labels/header (sequence, regression),
    labels (token), stride (qa), max_length (all).
    """
    env = init_distributed(device)
    cfg = LoopConfig(output_dir=output_dir, **{"lr": 3e-5, **(loop or {})})
    check_writable(output_dir)
    tok = WordPieceTokenizer.from_pretrained(tokenizer or model)
    job = make_task(task, tok, task_options)
    train_examples = job.read(train, train=True)
    dev_examples = job.read(dev) if dev else None
    train_feats = job.features(train_examples)
    dev_feats = job.features(dev_examples) if dev_examples else None
    if not os.path.isdir(model):
        raise FileNotFoundError(f"checkpoint directory {model} does not exist")
    identity = {"command": "finetune", "task": task, "model": fingerprint(model), "train": fingerprint(train)}
    identity.update(tokenizer=fingerprint(tokenizer) if tokenizer else None, batch_size=batch_size, seed=seed)
    identity.update(options={k: v for k, v in task_options.items() if v is not None}, **trajectory(cfg))
    cfg = check_output_dir(dataclasses.replace(cfg, identity=identity), env.is_main)
    config = BertConfig.from_pretrained(model)
    tok.token_types = tok.token_types and config.family.token_types  # DistilBERT takes no token_type_ids
    updates = job.config_updates()
    for key, value in updates.items():
        setattr(config, key, value)
    check_sizes(model, config, job.model_class.head_kind, updates)  # before a byte of an untrusted config is built
    torch.manual_seed(seed)
    net = model_class(config.model_type, job.model_class.head_kind)(config)  # RobertaFor... on a RoBERTa checkpoint
    net.load_checkpoint_state(load_checkpoint_dir(model))
    sampler = LengthGroupedBatchSampler(
        [len(f["input_ids"]) for f in train_feats], batch_size, seed, rank=env.rank, world_size=env.world_size
    )
    evaluate = None
    if dev_feats is not None:

        def evaluate(m: torch.nn.Module) -> dict[str, float]:
            return job.evaluate(m, dev_examples, dev_feats, eval_batch_size)

    finish = getattr(job, "finish", None)
    result = fit(net, train_feats, job.collate, sampler, cfg, env, evaluate, desc=f"finetune {task}", finish=finish)
    if env.is_main:
        tok.save(os.path.join(output_dir, "final"))
    return result
