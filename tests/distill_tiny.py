"""A tiny MLM teacher with its own WordPiece vocabulary, saved as a checkpoint directory (shared by the distill
tests and the torchrun worker they launch)."""

from __future__ import annotations

import os

import torch

from fastbert import AutoModelForMaskedLM, BertConfig
from fastbert.tokenization import WordPieceTokenizer

WORDS = "the cat dog sat ran on a mat big small red blue house tree under over quickly slowly jumps sleeps".split()


def corpus(n: int = 96, seed: int = 0) -> list[str]:
    """Short random sentences over a small word list."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g).tolist()
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist()) for k in lengths]


def make_teacher(directory: str, layers: int = 4, hidden: int = 32, seed: int = 0, model_type: str = "bert") -> str:
    """Write a randomly initialised masked-LM teacher of `model_type`'s family (BERT's sizes; ModernBERT with a
    4-token window; ModernBERT and EuroBERT padding with id 0) and its tokenizer to `directory`."""
    os.makedirs(directory, exist_ok=True)
    tok = WordPieceTokenizer.train(corpus(200) + WORDS, vocab_size=64, min_frequency=1)
    torch.manual_seed(seed)
    extra = {"modernbert": {"local_attention": 4, "pad_token_id": 0}, "eurobert": {"pad_token_id": 0}}
    extra = extra.get(model_type, {})
    config = BertConfig.from_dict(dict(
        model_type=model_type,
        **extra,
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ))  # fmt: skip
    AutoModelForMaskedLM.from_config(config).save_pretrained(directory)
    tok.save(directory)
    return directory
