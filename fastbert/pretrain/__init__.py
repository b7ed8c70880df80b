"""Pretraining: MLM (dynamic 80/10/10 masking, optional whole-word) + NSP (BERT) or SOP (ALBERT) on text files.

`pretrain(...)` (or `fastbert pretrain ...`) reads documents, builds or loads a WordPiece vocabulary, cuts
sentence pairs, and trains `BertForPreTraining` (from a config, BERT or ALBERT options, or a checkpoint) with the
shared loop: length-grouped batches, mixed precision, accumulation, AdamW + warmup/decay, resumable checkpoints,
held-out MLM and NSP/SOP accuracy; DDP/FSDP under torchrun. `output_dir/final` loads in transformers.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from fastbert.config import BertConfig
from fastbert.errors import DataError, UsageError
from fastbert.heads import BertForPreTraining
from fastbert.masking import MLMMasker
from fastbert.pretrain.data import encode_pairs, make_pairs, read_documents, tokenize_documents
from fastbert.pretrain.objective import HeldOutEval, PretrainCollator, PretrainingObjective, most_frequent_token
from fastbert.tokenization import WordPieceTokenizer
from fastbert.train import (
    LengthGroupedBatchSampler,
    LoopConfig,
    check_output_dir,
    check_writable,
    fingerprint,
    fit,
    init_distributed,
    resume_checkpoint,
    trajectory,
)

__all__ = ["build_model", "checkpoint_tokenizer", "load_corpus", "pretrain"]


def load_corpus(
    train: list[str], heldout: str | None, heldout_fraction: float, seed: int, min_documents: int = 1
) -> tuple[list[list[str]], list[list[str]]]:
    """Training and held-out documents: `heldout` file, or a random `heldout_fraction` of the training documents.

    Each side of the split keeps at least `min_documents` (NSP: 2, its random segments come from another document);
    a corpus too small for that is not split (all of it trains, nothing is held out)."""
    docs = [d for path in train for d in read_documents(path)]
    if heldout:
        return docs, read_documents(heldout)
    if not 0 < heldout_fraction < 1 or len(docs) < 2 * min_documents:
        return docs, []
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n = min(len(docs) - min_documents, max(min_documents, round(heldout_fraction * len(docs))))
    held = set(order[:n])
    return [d for i, d in enumerate(docs) if i not in held], [docs[i] for i in sorted(held)]


def model_config(config: str | None, vocab_size: int, **overrides: Any) -> BertConfig:
    """A config.json (or the defaults) with BertConfig fields `overrides`; fields no model can take are a UsageError,
    sizes too large for this machine a ValueError naming the file (or the options) and the field."""
    values = (BertConfig.from_json_file(config) if config else BertConfig()).to_dict()
    try:
        shape = BertConfig.from_dict({**values, **overrides, "vocab_size": vocab_size})
    except ValueError as exc:
        raise UsageError(f"model options {overrides}: {exc}") from None
    shape.check_fits(lambda field: config if config and field not in overrides else "model options")
    return shape


def checkpoint_tokenizer(checkpoint: str, given: str | None = None) -> WordPieceTokenizer:
    """The tokenizer saved with a checkpoint being resumed; a `given` one with another vocabulary is a UsageError, and
    so is a checkpoint without one (written before checkpoints held it) unless `given` names it."""
    try:
        tok = WordPieceTokenizer.from_pretrained(checkpoint)
    except FileNotFoundError:
        if given:
            return WordPieceTokenizer.from_pretrained(given)
        raise UsageError(f"{checkpoint} holds no tokenizer: resume it with the run's own --tokenizer") from None
    if given and WordPieceTokenizer.from_pretrained(given).backend.get_vocab() != tok.backend.get_vocab():
        raise UsageError(f"--tokenizer {given} is not the vocabulary {checkpoint} was trained with")
    return tok


def build_model(
    vocab_size: int, init_from: str | None = None, config: str | None = None, **overrides: Any
) -> BertForPreTraining:
    """BertForPreTraining from a checkpoint directory, a config.json, or BertConfig fields (BERT or ALBERT)."""
    if init_from:
        return BertForPreTraining.from_pretrained(init_from).train()
    return BertForPreTraining(model_config(config, vocab_size, **overrides))


def pretrain(
    train: list[str],
    output_dir: str,
    heldout: str | None = None,
    heldout_fraction: float = 0.05,
    tokenizer: str | None = None,
    vocab_size: int = 8000,
    objective: str = "nsp",
    whole_word: bool = False,
    mlm_probability: float = 0.15,
    max_length: int = 128,
    batch_size: int = 32,
    max_heldout_pairs: int = 1000,
    init_from: str | None = None,
    config: str | None = None,
    model_options: dict[str, Any] | None = None,
    seed: int = 0,
    device: str | None = None,
    loop: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Pretrain on text files `train`; returns the final held-out metrics, the baseline and the history.

    The tokenizer is `tokenizer` (a tokenizer.json/vocab.txt or directory), the checkpoint's own (`init_from`), or a
    new WordPiece vocabulary of `vocab_size` learnt from the training documents. `model_options` are BertConfig
    fields (num_hidden_layers, hidden_size, embedding_size, layer_sharing, ...).
    """
    model_options = model_options or {}
    env = init_distributed(device)
    cfg = LoopConfig(output_dir=output_dir, **{"lr": 5e-4, "warmup_ratio": 0.05, **(loop or {})})
    shape = BertConfig.from_pretrained(init_from) if init_from else model_config(config, vocab_size, **model_options)
    if max_length > shape.max_position_embeddings:
        raise UsageError(
            f"max_length {max_length} > the model's max_position_embeddings {shape.max_position_embeddings}"
        )
    check_writable(output_dir)
    least = 2 if objective == "nsp" else 1
    train_docs, held_docs = load_corpus(train, heldout, heldout_fraction, seed, least)
    if heldout and len(held_docs) < least:
        raise DataError(f"{heldout}: NSP needs at least two held-out documents (random segments come from another)")
    if not heldout and heldout_fraction > 0 and not held_docs and env.is_main:
        print(
            f"{len(train_docs)} documents: too few to hold any out ({objective.upper()} needs {least} on each side, "
            f"{2 * least} in all); training on all of them, no held-out evaluation",
            flush=True,
        )
    cfg = dataclasses.replace(
        cfg,
        identity={
            "command": "pretrain",
            "train": [fingerprint(path) for path in train],
            "heldout": fingerprint(heldout) if heldout else None,
            "heldout_fraction": heldout_fraction,
            "vocab_size": vocab_size,
            "objective": objective,
            "whole_word": whole_word,
            "mlm_probability": mlm_probability,
            "max_length": max_length,
            "batch_size": batch_size,
            "init_from": fingerprint(init_from) if init_from else None,
            "config": fingerprint(config) if config else None,
            "model_options": model_options,
            "seed": seed,
            **trajectory(cfg),
        },
    )
    cfg = check_output_dir(cfg, env.is_main)
    resumed = resume_checkpoint(cfg)
    if resumed:  # the vocabulary the checkpoint was trained with, never a newly learnt one
        tok = checkpoint_tokenizer(resumed, tokenizer)
    elif tokenizer or init_from:
        tok = WordPieceTokenizer.from_pretrained(tokenizer or init_from)
    else:  # every rank learns the same vocabulary from the same documents (deterministic)
        tok = WordPieceTokenizer.train((s for d in train_docs for s in d), vocab_size=vocab_size)
    feats = encode_pairs(tok, make_pairs(tokenize_documents(tok, train_docs), max_length, objective, seed))
    held_pairs = make_pairs(tokenize_documents(tok, held_docs), max_length, objective, seed + 1) if held_docs else []
    held = encode_pairs(tok, held_pairs)
    held = held[:max_heldout_pairs]
    collate = PretrainCollator(tok, MLMMasker.from_tokenizer(tok, whole_word=whole_word, probability=mlm_probability))
    torch.manual_seed(seed)
    model = PretrainingObjective(build_model(tok.vocab_size, init_from, config, **model_options), tok)
    evaluate = None
    if held:
        evaluate = HeldOutEval(held, collate, 64, most_frequent_token(feats, tok.special_ids))
    sampler = LengthGroupedBatchSampler(
        [len(f["input_ids"]) for f in feats], batch_size, seed, rank=env.rank, world_size=env.world_size
    )
    if env.is_main:
        n_tokens = sum(len(f["input_ids"]) for f in feats)
        print(f"{len(train_docs)} documents -> {len(feats)} pairs ({n_tokens} tokens); {len(held)} held-out pairs")
    return fit(model, feats, collate, sampler, cfg, env, evaluate, desc=f"pretrain mlm+{objective}")
