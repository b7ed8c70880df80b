"""pytest-benchmark, CPU: attention on a ragged batch, transformers-style eager (padded [B, nH, S, S] scores with an
additive mask) vs fastbert's dispatched op on packed tokens. No GPU claims: on CPU `fastbert.ops` picks the native
or torch path. Lengths are uniform in [S/4, S] (DESIGN.md), so the packed path skips the padding."""

from __future__ import annotations

import math

import pytest
import torch

from fastbert import ops, reference
from fastbert.padding import unpad

BATCH, SEQLEN, HEADS, HEAD_DIM = 4, 64, 4, 64


def _eager(padded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, S, 3, nH, D] -> [B, S, nH, D] the way transformers' eager BertSelfAttention computes it."""
    q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    scores = scores + (1.0 - mask[:, None, None, :].float()) * torch.finfo(scores.dtype).min
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("path", ["eager", "fastbert"])
def test_attention_ragged(benchmark, path: str) -> None:
    lengths = torch.randint(SEQLEN // 4, SEQLEN + 1, (BATCH,))
    mask = (torch.arange(SEQLEN)[None, :] < lengths[:, None]).long()
    padded = torch.randn(BATCH, SEQLEN, 3, HEADS, HEAD_DIM)
    packing = unpad(mask, BATCH, SEQLEN, padded.device)
    qkv = packing.pack(padded)
    with torch.no_grad():
        if path == "eager":
            fn = lambda: packing.pack(_eager(padded, mask))
        else:
            fn = lambda: ops.attention(qkv, packing.cu_seqlens, packing.max_seqlen)
        benchmark.group = f"attention B={BATCH} S<={SEQLEN} nH={HEADS} D={HEAD_DIM}"
        out = benchmark(fn)
        torch.testing.assert_close(out, reference.attention(qkv, packing.cu_seqlens, packing.max_seqlen))
