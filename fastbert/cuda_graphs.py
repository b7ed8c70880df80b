"""CUDA graphs for every batch size: embeddings + encoder captured once per bucket and replayed.

A BERT forward is a few hundred kernels; at small and medium batches the GPU waits on the host to launch them, and a
graph replays them all with one launch. On by default for a CUDA model in eval mode without autograd (a plain forward:
input_ids, no output_hidden_states/attentions); `enable(model, ...)` sets the limits, `disable(model)` turns it off,
`FASTBERT_CUDA_GRAPHS=0` too (read when a model first runs on CUDA).

Graphs need static shapes, while unpadded execution has a data-dependent token count, so each graph is captured for a
bucket (batch <= Bb, total tokens <= Tb, longest sequence <= Sb) and a call is laid into it: the real sequences first,
then empty sequences up to Bb, then "filler" sequences of at most Sb tokens covering rows T..Tb (pad token ids,
discarded after replay). The layout lives in a static `cu_seqlens`, so replay needs no host sync and every kernel sees a
valid varlen batch. Token buckets: powers of two to 256, then steps of 256 to 2048, then steps of 1024 (vLLM's rule,
coarser above): at most ~2x padding on tiny batches, under 12.5% above 2K tokens. A batch larger than the largest
bucket (`max_tokens`, `max_batch`) is split into consecutive groups of sequences, one replay each.

Memory: graphs share one pool; each bucket keeps its static inputs and output, and the pool holds the largest bucket's
activations. `memory_limit` (bytes, default 2 GiB) bounds the estimate of both (`bucket_bytes`); a bucket that would
pass it is not captured and that call runs eagerly, said in explain(). Captured graphs hold the weights' addresses: any
parameter change drops them all and the next call recaptures. One lock per model: two threads never share the static
buffers at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from fastbert.padding import Packing

MAX_TOKENS, MAX_BATCH = 16384, 256  # the largest bucket; a larger batch is split into replays
MEMORY_LIMIT = 2 << 30  # bytes the graphs' buffers and activations may take (estimated)
Capture = Callable[[Callable[[], torch.Tensor], object], tuple[Callable[[], None], torch.Tensor]]


def bucket_tokens(total: int) -> int:
    """The token bucket of a call: powers of two to 256 (at least 16), steps of 256 to 2048, then steps of 1024."""
    if total <= 256:
        return max(16, 1 << (total - 1).bit_length())
    step = 256 if total <= 2048 else 1024
    return math.ceil(total / step) * step


def bucket_key(batch: int, total: int, max_seqlen: int) -> tuple[int, int, int]:
    """(sequences, tokens, longest sequence) a call is laid into: powers of two, and `bucket_tokens`."""
    return 1 << (batch - 1).bit_length(), bucket_tokens(total), max(16, 1 << (max_seqlen - 1).bit_length())


def split(lengths: list[int], max_tokens: int, max_batch: int) -> list[tuple[int, int]]:
    """Consecutive groups [b0, b1) of sequences, each at most `max_batch` sequences and `max_tokens` tokens."""
    groups, start, tokens = [], 0, 0
    for b, n in enumerate(lengths):
        if b > start and (tokens + n > max_tokens or b - start >= max_batch):
            groups.append((start, b))
            start, tokens = b, 0
        tokens += n
    groups.append((start, len(lengths)))
    return groups


class _Graph:
    """One captured bucket: static inputs, the static output, and the replay that links them."""

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
        self.replay: Callable[[], None] | None = None
        self.out: torch.Tensor | None = None  # [Tb, H]
        self.fill = torch.arange(1, self.fillers + 1, dtype=torch.int32, device=device) * seqlen  # [F]

    def load(self, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor, packing: Packing) -> None:
        """Copy one packed batch into the static buffers (device copies only, no host sync)."""
        total, batch = ids.shape[0], packing.batch
        for static, value in ((self.ids, ids), (self.types, types), (self.positions, positions)):
            static[:total].copy_(value, non_blocking=True)
            static[total:].zero_()
        self.cu_seqlens[: batch + 1].copy_(packing.cu_seqlens, non_blocking=True)
        self.cu_seqlens[batch + 1 : self.batch + 1].fill_(total)  # empty sequences up to the bucket's batch
        torch.add(self.fill, total, out=self.cu_seqlens[self.batch + 1 :]).clamp_(max=self.tokens)  # rows T..Tb


def cuda_capture(run: Callable[[], torch.Tensor], pool: object) -> tuple[Callable[[], None], torch.Tensor]:
    """Warm up on a side stream (kernel selection, Triton compiles, caches), capture into `pool`; (replay, output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # a server's other threads go on
        out = run()
    graph.replay()
    return graph.replay, out


class CudaGraphs:
    """Per-bucket CUDA graphs of a BertModel's embeddings + encoder; `model.cuda_graphs = CudaGraphs(model)`.

    `capture` and `device_type` are the only CUDA-specific parts: tests put a capture that replays by running the
    function again, on CPU, to check the bucket logic (layout, splitting, memory bound, recapture) anywhere."""

    capture: Capture = staticmethod(cuda_capture)
    device_type = "cuda"

    def __init__(
        self,
        model: nn.Module,
        max_tokens: int = MAX_TOKENS,
        max_batch: int = MAX_BATCH,
        memory_limit: int = MEMORY_LIMIT,
        max_graphs: int = 64,
    ) -> None:
        positions = model.config.max_position_embeddings
        if max_tokens < positions or max_batch < 1:
            raise ValueError(f"max_tokens must be at least max_position_embeddings ({positions}), max_batch >= 1")
        self.model, self.max_tokens, self.max_batch = model, max_tokens, max_batch
        self.memory_limit, self.max_graphs = memory_limit, max_graphs
        self.graphs: OrderedDict[tuple[int, int, int], _Graph] = OrderedDict()  # least recently used first
        self.pool = None
        self.refused: dict[tuple[int, int, int], str] = {}  # buckets not captured, and why (explain())
        self.reference = weakref.ref(self)  # what a plan keeps for explain(): never the model alive
        self._modules: list[nn.Module] | None = None  # every module, found again when the structure changes
        self._stamp: list | None = None
        self._mode: object = None  # the plan mode the graphs were captured in
        self._done: torch.cuda.Event | None = None  # the last call's copy-out, which the next call's stream waits on
        self._lock = threading.Lock()
        cfg = model.config
        self._token_width = cfg.hidden_size * 6 + cfg.intermediate_size  # QKV, context, two residuals, FFN inner

    def __deepcopy__(self, memo: dict) -> None:
        """A copy of the model starts without graphs (the default on CUDA; enable() again for other limits): graphs,
        their pool and lock belong to this model's tensors."""
        return None

    def __reduce__(self) -> tuple:
        return _no_graphs, ()

    def reset(self) -> None:
        """Drop every graph and its pool (the model moved or changed dtype): the next call captures again."""
        with self._lock:
            self.graphs.clear()
            self.refused.clear()
            self.pool, self._modules, self._stamp, self._done = None, None, None, None

    def takes(self, packing: Packing, device: torch.device, mode: object) -> bool:
        """Whether this call can replay graphs (this device type, eval, no autograd, not already capturing)."""
        if device.type != self.device_type or mode.training or mode.grad or mode.autocast is not None:
            return False
        if packing.total == 0:
            return False
        return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()

    @property
    def _token_bytes(self) -> int:
        """Activation bytes per token at the model's dtype now."""
        return self._token_width * self.model.embeddings.word_embeddings.weight.element_size()

    def bucket_bytes(self, key: tuple[int, int, int]) -> int:
        """Estimated bytes of one bucket: its activations (the pool's high-water mark) and its static output."""
        return key[1] * self._token_bytes + key[1] * self.model.config.hidden_size * 8

    def _changed(self, mode: object) -> bool:
        """Whether the graphs are stale: another plan mode (a forced or excluded backend, TF32), a weight updated in
        place or replaced, or a module swapped in (every module's parameter and child tables are compared)."""
        if self._modules is None:
            self._modules = list(self.model.modules())
        now = _snapshot(self._modules)
        if now == self._stamp and mode == self._mode:
            return False
        modules = list(self.model.modules())
        if modules != self._modules:  # a module swapped in somewhere: watch the new structure
            self._modules, now = modules, _snapshot(modules)
        self._stamp, self._mode = now, mode
        return True

    def run(
        self, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor, packing: Packing, mode: object = None
    ) -> torch.Tensor:
        """Packed ids/types/positions [T] -> the encoder's output [T, H], by replay (split when beyond a bucket).
        `mode`: the plan mode of the call; graphs captured in another are dropped."""
        with self._lock, _on_device(ids.device):
            if self._changed(mode):  # the graphs read stale addresses or run another mode's kernels
                self.graphs.clear()
                self.refused.clear()
            if self.device_type == "cuda":  # one call at a time on the GPU too, whatever stream each caller uses
                if self._done is not None:
                    torch.cuda.current_stream().wait_event(self._done)
                self._done = torch.cuda.Event()
            out = self._split(ids, types, positions, packing)
            if self._done is not None:
                self._done.record()
            return out

    def _split(self, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor, packing: Packing) -> torch.Tensor:
        if packing.total <= self.max_tokens and packing.batch <= self.max_batch:
            return self._one(ids, types, positions, packing)
        cu = packing.cu_seqlens.tolist()  # a larger batch: split by sequence (one more host read)
        lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
        outs = []
        for b0, b1 in split(lengths, self.max_tokens, self.max_batch):
            rows = slice(cu[b0], cu[b1])
            part = Packing(b1 - b0, packing.seqlen, packing.cu_seqlens[b0 : b1 + 1] - cu[b0],
                           max(lengths[b0:b1]), None)  # fmt: skip
            if cu[b1] > cu[b0]:
                outs.append(self._one(ids[rows], types[rows], positions[rows], part, total=cu[b1] - cu[b0]))
        return torch.cat(outs)

    def _one(
        self, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor, packing: Packing, total: int = -1
    ) -> torch.Tensor:
        total = ids.shape[0] if total < 0 else total
        key = bucket_key(packing.batch, total, packing.max_seqlen)
        graph = self.graphs.get(key)
        if graph is None:
            if (why := self._admit(key)) is not None:
                self.refused[key] = why
                return self._eager(ids, types, positions, packing)
            try:
                graph = self._capture(key, ids, types, positions, packing)
            except RuntimeError as error:  # a kernel that cannot be captured: this bucket runs eagerly from now on
                self.refused[key] = f"capture failed ({type(error).__name__}: {str(error)[:120]})"
                return self._eager(ids, types, positions, packing)
        else:
            self.graphs.move_to_end(key)
            graph.load(ids, types, positions, packing)
            graph.replay()
        return graph.out[:total].clone()

    def _admit(self, key: tuple[int, int, int]) -> str | None:
        """Why a new bucket is not captured (memory bound), or None; the least recently used graph beyond
        `max_graphs` is dropped."""
        largest = max((k[1] for k in self.graphs), default=0)
        outputs = sum(self.bucket_bytes(k) - k[1] * self._token_bytes for k in self.graphs)
        need = outputs + self.bucket_bytes(key) + max(largest - key[1], 0) * self._token_bytes
        if need > self.memory_limit:
            return f"{need / 2**20:.0f} MiB estimated > memory_limit {self.memory_limit / 2**20:.0f} MiB"
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        return None

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
        with torch.inference_mode(False):  # normal tensors: later calls may copy into them outside inference mode
            graph = _Graph(*key, device=ids.device)
        graph.load(ids, types, positions, packing)
        if self.pool is None and self.device_type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        graph.replay, graph.out = type(self).capture(
            lambda: self._eager(graph.ids, graph.types, graph.positions, graph.packing), self.pool
        )
        self.graphs[key] = graph
        return graph

    def describe(self) -> str:
        """explain()'s words: the buckets captured, their estimated memory, and what was refused."""
        used = sum(self.bucket_bytes(k) for k in self.graphs)
        said = (f"CUDA graphs: {len(self.graphs)} buckets captured (~{used / 2**20:.0f} MiB estimated of "
                f"{self.memory_limit / 2**20:.0f} MiB), up to {self.max_batch} sequences / {self.max_tokens} tokens "
                "a replay, larger batches split")  # fmt: skip
        refused = "; ".join(f"{k}: {why}" for k, why in self.refused.items())
        return said + (f"; eager for {refused}" if refused else "")


def _snapshot(modules: list[nn.Module]) -> list:
    """Every parameter's (identity, version, address) and every child's identity: what a captured graph relies on."""
    now = [(id(t), -1 if t.is_inference() else t._version, t.data_ptr())
           for m in modules for t in m._parameters.values() if t is not None]  # fmt: skip
    return now + [id(child) for m in modules for child in m._modules.values()]


def _no_graphs() -> None:
    """What a pickled CudaGraphs loads as: no graphs (the default on CUDA)."""
    return None


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Capture and replay on the model's GPU, whichever is current (a model on cuda:1 without set_device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _base(model: nn.Module) -> nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    if not hasattr(base, "cuda_graphs"):
        raise TypeError(f"{type(model).__name__} is not a fastbert BertModel or head")
    return base


def enable(model: nn.Module, **limits: int) -> nn.Module:
    """Turn on CUDA graphs for `model` (a BertModel or any head around one) with these limits (max_tokens, max_batch,
    memory_limit in bytes, max_graphs); returns the model."""
    base = _base(model)
    base.cuda_graphs = CudaGraphs(base, **limits)
    return model


def disable(model: nn.Module) -> nn.Module:
    """Turn CUDA graphs off for `model` (every forward runs eagerly); returns the model."""
    _base(model).cuda_graphs = False
    return model


def default_on() -> bool:
    """Whether a CUDA model in eval mode gets graphs without asking (FASTBERT_CUDA_GRAPHS=0 says no)."""
    return os.environ.get("FASTBERT_CUDA_GRAPHS", "1") != "0"


def warmup(model: nn.Module, shapes: list[tuple[int, int]], vocab_id: int = 1000) -> int:
    """Pay a model's first-request costs before traffic (`fastbert.warmup`): forwards of full-length sequences at each
    (batch, seqlen), twice, in the model's current mode. The plan is bound; on a GPU the kernels are compiled and the
    token buckets those shapes fall in captured (ragged traffic falls in other buckets: warm up with batches like it);
    on a CPU the weights are packed and each GEMM's size class timed (one shape under 128 tokens and one over cover
    both). Returns how many CUDA-graph buckets are captured after (0 on a CPU)."""
    base = _base(model)
    device = next(base.parameters()).device
    with torch.inference_mode():
        for batch, seqlen in shapes:
            ids = torch.full((batch, seqlen), min(vocab_id, base.config.vocab_size - 1), device=device)
            for _ in range(2):  # the first binds the plan, the second captures
                base(ids, attention_mask=torch.ones_like(ids))
    graphs = base.cuda_graphs
    return len(graphs.graphs) if isinstance(graphs, CudaGraphs) else 0
