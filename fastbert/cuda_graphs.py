"""CUDA graphs for small batches: embeddings + encoder captured once per shape bucket and replayed.

At batch 1-8 a BERT forward is a few hundred small kernels and the GPU waits on Python and launch overhead; a graph
replays them all with one launch. Graphs need static shapes, while unpadded execution has a data-dependent token count,
so each graph is captured for a bucket (batch <= Bb, total tokens <= Tb, longest sequence <= Sb) and a call is laid
into it: the real sequences first, then empty sequences up to Bb, then "filler" sequences of at most Sb tokens covering
rows T..Tb (pad token ids, discarded after replay). The layout lives in a static `cu_seqlens`, so replay needs no host
sync and every kernel sees a valid varlen batch.

Captured graphs hold the weights' addresses: any parameter change (in place or new storage) drops them all and the next
call recaptures; enable graphs after moving or casting the model (as `fastbert.optimize` does). Used only in eval mode
without autograd, and not with output_hidden_states/attentions or inputs_embeds.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fastbert.padding import Packing
from fastbert.weight_stamp import stamp

MAX_TOKENS, MAX_BATCH = 4096, 64  # default bucket limits: larger calls run eagerly, where launches no longer dominate


def _bucket_tokens(total: int) -> int:
    """Powers of two up to 256 tokens, then multiples of 256: at most ~2x waste on tiny batches, <25% above 1K."""
    return max(16, 1 << (total - 1).bit_length()) if total <= 256 else math.ceil(total / 256) * 256


class _Graph:
    """One captured bucket: static inputs, the static output, and the graph that links them."""

    def __init__(self, batch: int, tokens: int, seqlen: int, device: torch.device) -> None:
        self.batch, self.tokens, self.seqlen = batch, tokens, seqlen
        self.fillers = math.ceil(tokens / seqlen)
        self.ids = torch.zeros(tokens, dtype=torch.long, device=device)  # [Tb]
        self.types = torch.zeros(tokens, dtype=torch.long, device=device)  # [Tb]
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)  # [Tb]
        self.cu_seqlens = torch.zeros(batch + self.fillers + 1, dtype=torch.int32, device=device)  # [Bb + F + 1]
        self.packing = Packing(
            batch + self.fillers, seqlen, self.cu_seqlens, seqlen, torch.arange(tokens, device=device)
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None  # [Tb, H]

    def load(self, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor, packing: Packing) -> None:
        """Copy one packed batch into the static buffers (device copies only, no host sync)."""
        total, batch = ids.shape[0], packing.batch
        for static, value in ((self.ids, ids), (self.types, types), (self.positions, positions)):
            static[:total].copy_(value, non_blocking=True)
            static[total:].zero_()
        self.cu_seqlens[: batch + 1].copy_(packing.cu_seqlens, non_blocking=True)
        self.cu_seqlens[batch + 1 : self.batch + 1].fill_(total)  # empty sequences up to the bucket's batch
        fillers = torch.arange(1, self.fillers + 1, dtype=torch.int32, device=self.ids.device) * self.seqlen + total
        self.cu_seqlens[self.batch + 1 :].copy_(fillers.clamp_(max=self.tokens))  # rows total..Tb, <= Sb each


class CudaGraphs:
    """Per-bucket CUDA graphs of a BertModel's embeddings + encoder; `model.cuda_graphs = CudaGraphs(model)`."""

    def __init__(
        self, model: nn.Module, max_tokens: int = MAX_TOKENS, max_batch: int = MAX_BATCH, max_graphs: int = 32
    ) -> None:
        self.model, self.max_tokens, self.max_batch, self.max_graphs = model, max_tokens, max_batch, max_graphs
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.pool = None
        self._params = list(model.parameters())  # the stamp is checked every call: keep it a flat loop
        self._stamp: tuple | None = None

    def takes(self, packing: Packing, device: torch.device, plain_call: bool) -> bool:
        """Whether this call can replay a graph (CUDA, eval, no autograd, small enough, a plain forward)."""
        if not plain_call or device.type != "cuda" or self.model.training:
            return False
        if torch.is_grad_enabled() and self._grads():
            return False
        if packing.total == 0 or packing.total > self.max_tokens or packing.batch > self.max_batch:
            return False
        return not torch.cuda.is_current_stream_capturing()

    def run(self, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor, packing: Packing) -> torch.Tensor:
        """Packed ids/types/positions [T] -> the encoder's output [T, H], via the bucket's graph."""
        stamp = self._weights_stamp()
        if stamp != self._stamp:  # weights changed since capture: the graphs read stale addresses
            self.graphs.clear()
            self._stamp = stamp
        total = ids.shape[0]
        seqlen = max(16, 1 << (packing.max_seqlen - 1).bit_length())
        key = (1 << (packing.batch - 1).bit_length(), _bucket_tokens(total), seqlen)
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= self.max_graphs:
                return self._eager(ids, types, positions, packing)
            graph = self._capture(key, ids, types, positions, packing)
        else:
            graph.load(ids, types, positions, packing)
            graph.graph.replay()
        return graph.out[:total].clone()

    def _eager(self, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor, packing: Packing) -> torch.Tensor:
        x = self.model.embeddings(ids, types, positions)
        return self.model.encoder(x, packing)[0]

    def _capture(
        self,
        key: tuple[int, int, int],
        ids: torch.Tensor,
        types: torch.Tensor,
        positions: torch.Tensor,
        packing: Packing,
    ) -> _Graph:
        """Warm up on a side stream (kernel selection, Triton autotuning, caches), then capture into the shared pool."""
        with torch.inference_mode(False):  # normal tensors: later calls may copy into them outside inference mode
            graph = _Graph(*key, device=ids.device)
        graph.load(ids, types, positions, packing)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._eager(graph.ids, graph.types, graph.positions, graph.packing)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph.graph, pool=self.pool):
            graph.out = self._eager(graph.ids, graph.types, graph.positions, graph.packing)
        graph.graph.replay()
        self.graphs[key] = graph
        return graph

    def _grads(self) -> bool:
        return any(p.requires_grad for p in self._params)

    def _weights_stamp(self) -> tuple:
        return stamp(*self._params)


def enable(model: nn.Module, **limits: int) -> nn.Module:
    """Turn on CUDA graphs for `model` (a BertModel or any head around one); returns the model."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    if not hasattr(base, "cuda_graphs"):
        raise TypeError(f"{type(model).__name__} is not a fastbert BertModel or head")
    base.cuda_graphs = CudaGraphs(base, **limits)
    return model
