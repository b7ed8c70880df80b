"""`fastbert.warmup`: a model's first-request costs paid before traffic, on a CPU or a GPU."""

from __future__ import annotations

import torch
from torch import nn

from fastbert.execution.graphs import CudaGraphs, _base


def warmup(model: nn.Module, shapes: list[tuple[int, int]], vocab_id: int = 1000) -> int:
    """Forwards of full-length sequences at each (batch, seqlen), twice, in the model's current mode: the plan is
    bound; on a GPU the kernels are compiled and the token buckets those shapes fall in captured (ragged traffic falls
    in other buckets: warm up with batches like it); on a CPU the weights are packed and each GEMM's size class timed
    (one shape under 128 tokens and one over cover both). Returns how many CUDA-graph buckets are captured after (0 on
    a CPU)."""
    base = _base(model)
    shapes = _checked(shapes)
    device = next(base.parameters()).device
    with torch.inference_mode():
        for batch, seqlen in shapes:
            ids = torch.full((batch, seqlen), min(vocab_id, base.config.vocab_size - 1), device=device)
            for _ in range(2):  # the first binds the plan, the second captures
                base(ids, attention_mask=torch.ones_like(ids))
    graphs = base.cuda_graphs
    return len(graphs.graphs) if isinstance(graphs, CudaGraphs) else 0


def _checked(shapes: object) -> list[tuple[int, int]]:
    """`shapes` as a list of (batch, seqlen) positive ints, or a ValueError that shows the expected form."""
    if isinstance(shapes, tuple) and len(shapes) == 2 and all(isinstance(v, int) for v in shapes):
        shapes = [shapes]  # one shape given bare: (8, 128)
    try:
        out = [(int(b), int(s)) for b, s in shapes]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        out = []
    if not out or any(b < 1 or s < 1 for b, s in out):
        raise ValueError(f"shapes must be a list of (batch, seqlen) pairs of positive ints, e.g. [(1, 16), (8, 128)]; "
                         f"got {shapes!r}")
    return out
