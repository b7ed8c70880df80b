"""pytest-benchmark, CPU: embedding gather + sum + LayerNorm, transformers-style eager modules vs fastbert's
dispatched op on the same packed tokens. No GPU claims: on CPU `fastbert.ops` picks the native or torch path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastbert import ops, reference

TOKENS, HIDDEN, VOCAB, POSITIONS = 256, 768, 30522, 512


@pytest.mark.parametrize("path", ["eager", "fastbert"])
def test_embedding_layernorm(benchmark, path: str) -> None:
    word, pos, types = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(POSITIONS, HIDDEN), nn.Embedding(2, HIDDEN)
    ln = nn.LayerNorm(HIDDEN, eps=1e-12)
    ids, tt = torch.randint(0, VOCAB, (TOKENS,)), torch.randint(0, 2, (TOKENS,))
    positions = torch.arange(TOKENS) % 128
    args = (ids, tt, positions, word.weight, pos.weight, types.weight, ln.weight, ln.bias, 1e-12)
    with torch.no_grad():
        if path == "eager":
            fn = lambda: ln(word(ids) + types(tt) + pos(positions))
        else:
            fn = lambda: ops.embedding_layernorm(*args)
        benchmark.group = f"embedding_layernorm {TOKENS}x{HIDDEN}"
        out = benchmark(fn)
        torch.testing.assert_close(out, reference.embedding_layernorm(*args))
