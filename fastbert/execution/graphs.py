"""The 'graphs' executor: the plan's loop captured as a CUDA graph once per bucket and replayed.

A BERT forward is a few hundred kernels; at small and medium batches the GPU waits on the host to launch them, and a
graph replays them all with one launch. On by default for a CUDA model in eval mode without autograd (a plain
forward: input_ids, no output_hidden_states/attentions); `enable(model, ...)` sets the limits, `disable(model)` turns
it off, `FASTBERT_CUDA_GRAPHS=0` too (read when a model first runs on CUDA).

What is captured is the loop executor with the plan's forward-only launchers, the Q, K and V weights concatenated
inside the graph: a replay reads every weight where it lies, so a weight changed in place by any route (an optimizer,
`load_state_dict`, `.data`, a NumPy view) is read by the next replay. What a graph cannot follow is a weight moved to
new memory or a module swapped in: before the host sync of each call, the weights' addresses are compared with the
capture's (one C-level scan, `weight_stamp.addresses`) and the model's structure with the one it was captured for
(fastbert.execution.structure); either change, or another plan mode, drops the graphs and the next call captures.

Graphs need static shapes, while unpadded execution has a data-dependent token count, so each graph is captured for a
bucket (batch <= Bb, total tokens <= Tb, longest sequence <= Sb) and a call is laid into it: its sequences first, then
empty sequences up to Bb, then "filler" sequences of at most Sb tokens covering rows T..Tb (discarded after replay),
all in a static `cu_seqlens`, so replay needs no host sync and every kernel sees a valid varlen batch. A bucket has as
few fillers as its smallest call needs (a call lands in bucket Tb only above the bucket below it), because a kernel
that pads (fp32 attention without TF32 runs torch's SDPA over [sequences, Sb]) pays for every sequence slot.
Token buckets: powers of two to 256, then steps of 256 to 2048, then steps of 1024 (vLLM's rule, coarser above): at
most ~2x padding on tiny batches, under 12.5% above 2K tokens. A batch larger than the largest bucket (`max_tokens`,
`max_batch`) is split into consecutive groups of sequences, one replay each.

Memory: graphs share one pool; each bucket keeps its static inputs and output, and the pool holds the largest bucket's
activations. `memory_limit` (bytes, default 2 GiB) bounds the estimate of both (`bucket_bytes`); a bucket that would
pass it is not captured and that call runs in the loop, said in explain(). One lock per model: two threads never share
the static buffers at once.
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
import torch.nn.functional as F
from torch import nn

from fastbert.execution import loop
from fastbert.execution.mode import Mode
from fastbert.execution.plan import Call, Plan
from fastbert.execution.structure import Structure, fused
from fastbert.padding import Packing
from fastbert.weight_stamp import addresses

MAX_TOKENS, MAX_BATCH = 16384, 256  # the largest bucket; a larger batch is split into replays
MEMORY_LIMIT = 2 << 30  # bytes the graphs' buffers and activations may take (estimated)
Capture = Callable[[Callable[[], torch.Tensor], object], tuple[Callable[[], None], torch.Tensor]]
Key = tuple[int, int, int]


def bucket_tokens(total: int) -> int:
    """The token bucket of a call: powers of two to 256 (at least 16), steps of 256 to 2048, then steps of 1024."""
    if total <= 256:
        return max(16, 1 << (total - 1).bit_length())
    step = 256 if total <= 2048 else 1024
    return math.ceil(total / step) * step


def bucket_key(batch: int, total: int, max_seqlen: int) -> Key:
    """(sequences, tokens, longest sequence) a call is laid into: powers of two, and `bucket_tokens`."""
    return 1 << (batch - 1).bit_length(), bucket_tokens(total), max(16, 1 << (max_seqlen - 1).bit_length())


def bucket_floor(tokens: int) -> int:
    """The most tokens a call can have and still land in the bucket below `tokens` (a bucket's calls have more)."""
    if tokens <= 16:
        return 0
    if tokens <= 256:
        return tokens // 2
    return tokens - (256 if tokens <= 2048 else 1024)


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
        self.fillers = math.ceil((tokens - bucket_floor(tokens)) / seqlen)
        self.ids = torch.zeros(tokens, dtype=torch.long, device=device)  # [Tb]
        self.types = torch.zeros(tokens, dtype=torch.long, device=device)  # [Tb]
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)  # [Tb]
        self.cu_seqlens = torch.zeros(batch + self.fillers + 1, dtype=torch.int32, device=device)  # [Bb + F + 1]
        self.packing = Packing(batch + self.fillers, seqlen, self.cu_seqlens, seqlen,
                               torch.arange(tokens, device=device))  # fmt: skip
        self.fill = torch.arange(1, self.fillers + 1, dtype=torch.int32, device=device) * seqlen  # [F]
        self._tails: dict[int, torch.Tensor] = {}  # a call's batch -> [Bb - batch + F]: its empties, then fillers
        self.replay: Callable[[], None] | None = None
        self.out: torch.Tensor | None = None  # [Tb, H]

    def load(self, inputs: tuple[torch.Tensor, ...], packing: Packing, rows: slice, total: int) -> None:
        """Pack one call's [B, S] ids, types and positions into the static buffers (rows `rows` of the packed call),
        and its sequences into the static cu_seqlens: device work only, no host sync. Rows past `total` keep what
        the last call left there (ids and positions of an earlier call: valid table rows; the fillers' output is
        discarded)."""
        for static, value in zip((self.ids, self.types, self.positions), inputs, strict=True):
            flat = value.reshape(-1) if value.dtype == torch.long else value.reshape(-1).long()  # int32 ids too
            if packing.indices is None:
                static[:total].copy_(flat[rows], non_blocking=True)
            else:
                torch.index_select(flat, 0, packing.indices[rows], out=static[:total])
        batch = packing.batch
        self.cu_seqlens[: batch + 1].copy_(packing.cu_seqlens, non_blocking=True)
        tail = self._tails.get(batch)
        if tail is None:  # empty sequences up to the bucket's batch (+0), then the fillers (+Sb each)
            tail = self._tails[batch] = F.pad(self.fill, (self.batch - batch, 0))
        torch.add(tail, total, out=self.cu_seqlens[batch + 1 :]).clamp_(max=self.tokens)  # rows T..Tb


_capturing = threading.Lock()  # one capture at a time in the process (torch's rule), whichever model captures


def cuda_capture(run: Callable[[], torch.Tensor], pool: object) -> tuple[Callable[[], None], torch.Tensor]:
    """Warm up on a side stream (kernel selection, Triton compiles, caches), capture into `pool` on that same stream
    (its lazily made state, cuBLAS workspaces included, exists by then); (replay, output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with _capturing, torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = run()  # thread_local: a server's other threads go on launching meanwhile
    graph.replay()
    return graph.replay, out


class CudaGraphs:
    """Per-bucket CUDA graphs of one model's embeddings + encoder; `model.cuda_graphs = CudaGraphs(model)`.

    `capture` and `device_type` are the only CUDA-specific parts: tests put a capture that replays by running the
    captured function again, on CPU, to check the bucket logic (layout, splitting, memory bound, recapture) anywhere."""

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
        self.model, self.max_tokens, self.max_batch = weakref.proxy(model), max_tokens, max_batch
        self.memory_limit, self.max_graphs = memory_limit, max_graphs
        self.graphs: OrderedDict[Key, _Graph] = OrderedDict()  # least recently used first
        self.pool = None
        self.refused: dict[Key, str] = {}  # buckets not captured, and why (explain())
        self._failed: set[Key] = set()  # buckets whose capture failed: they run in the loop from then on
        self._captured_for: tuple | None = None  # (structure, plan mode, weight addresses) the graphs hold
        self._done: torch.cuda.Event | None = None  # the last call's copy-out, which the next call's stream waits on
        self._lock = threading.Lock()
        reference = weakref.ref(self)
        self.details: Callable[[], str | None] = lambda: g.describe() if (g := reference()) is not None else None
        cfg = model.config
        self._token_width = cfg.hidden_size * 6 + cfg.intermediate_size  # QKV, context, two residuals, FFN inner

    def __deepcopy__(self, memo: dict) -> None:
        """A copy of the model starts without graphs (the default on CUDA; enable() again for other limits): graphs,
        their pool and lock belong to this model's tensors."""
        return None

    def __reduce__(self) -> tuple:
        return _no_graphs, ()

    def reset(self) -> None:
        """Drop every graph and its pool (the model moved or changed): the next call captures again."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self.graphs.clear()
        self.refused.clear()
        self._failed.clear()
        self.pool, self._captured_for, self._done = None, None, None

    def current(self, plan: Plan, structure: Structure) -> None:
        """Drop the graphs if they were captured for another structure, mode or weight memory (before the sync)."""
        now = (structure, plan.mode, addresses(structure.params()))
        if now != self._captured_for:
            with self._lock:  # another thread may be replaying them
                self._clear()
                self._captured_for = now

    @property
    def _token_bytes(self) -> int:
        """Activation bytes per token at the model's dtype now."""
        return self._token_width * self.model.embeddings.word_embeddings.weight.element_size()

    def bucket_bytes(self, key: Key) -> int:
        """Estimated bytes of one bucket: its activations (the pool's high-water mark) and its static output."""
        return key[1] * self._token_bytes + key[1] * self.model.config.hidden_size * 8

    def run(self, plan: Plan, call: Call, packing: Packing) -> torch.Tensor:
        """The encoder's output [T, H] for a packed call, by replay (split when beyond the largest bucket)."""
        inputs = call.inputs[:3]
        with self._lock, _on_device(plan.mode.device):
            captured = self._captured_for
            if captured is None or captured[0] is not call.structure or captured[1] != plan.mode:  # another thread
                self._clear()  # changed them since this call's check: its graphs are not this call's
                self._captured_for = (call.structure, plan.mode, addresses(call.structure.params()))
            if self.device_type == "cuda":  # one call at a time on the GPU too, whatever stream each caller uses
                if self._done is not None:
                    torch.cuda.current_stream().wait_event(self._done)
                self._done = torch.cuda.Event()
            if packing.total <= self.max_tokens and packing.batch <= self.max_batch:
                out = self._one(plan, call.structure, inputs, packing, slice(None), packing.total)
            else:
                out = self._split(plan, call.structure, inputs, packing)
            if self._done is not None:
                self._done.record()
            return out

    def _split(self, plan: Plan, structure: Structure, inputs: tuple, packing: Packing) -> torch.Tensor:
        cu = packing.cu_seqlens.tolist()  # a larger batch: split by sequence (one more host read)
        lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
        outs = []
        for b0, b1 in split(lengths, self.max_tokens, self.max_batch):
            if cu[b1] == cu[b0]:
                continue
            part = Packing(b1 - b0, packing.seqlen, packing.cu_seqlens[b0 : b1 + 1] - cu[b0], max(lengths[b0:b1]),
                           packing.indices)  # fmt: skip
            outs.append(self._one(plan, structure, inputs, part, slice(cu[b0], cu[b1]), cu[b1] - cu[b0]))
        return torch.cat(outs)

    def _one(
        self, plan: Plan, structure: Structure, inputs: tuple, packing: Packing, rows: slice, total: int
    ) -> torch.Tensor:
        key = bucket_key(packing.batch, total, packing.max_seqlen)
        graph = self.graphs.get(key)
        if graph is None:
            if key in self._failed:
                return self._loop(plan, structure, inputs, packing, rows)
            if (why := self._admit(key)) is not None:
                self.refused[key] = why
                return self._loop(plan, structure, inputs, packing, rows)
            try:
                graph = self._capture(plan, structure, key, inputs, packing, rows, total)
            except Exception as error:  # a kernel that cannot be captured: this bucket runs in the loop from now on
                self.refused[key] = f"capture failed ({type(error).__name__}: {str(error)[:120]})"
                self._failed.add(key)
                return self._loop(plan, structure, inputs, packing, rows)
        else:
            self.graphs.move_to_end(key)
            graph.load(inputs, packing, rows, total)
            graph.replay()
        return graph.out[:total].clone()

    def _loop(self, plan: Plan, structure: Structure, inputs: tuple, packing: Packing, rows: slice) -> torch.Tensor:
        """The rows `rows` of a call in the loop executor (their bucket was refused)."""
        index = packing.indices[rows] if packing.indices is not None else None
        packed = (t.reshape(-1)[rows] if index is None else t.reshape(-1).index_select(0, index) for t in inputs)
        x = loop.embed(plan, structure, *packed, None)
        return loop.layers(plan, structure, structure.layer_weights(False), x, packing)

    def _admit(self, key: Key) -> str | None:
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

    def _capture(
        self, plan: Plan, structure: Structure, key: Key, inputs: tuple, packing: Packing, rows: slice, total: int
    ) -> _Graph:
        with torch.inference_mode(False):  # normal tensors: later calls may copy into them outside inference mode
            graph = _Graph(*key, device=inputs[0].device)
        graph.load(inputs, packing, rows, total)
        if self.pool is None and self.device_type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()

        tables, sources = structure.embedding_weights(), structure.layer_sources()  # what the graph reads
        mode = plan.mode

        def run() -> torch.Tensor:  # Q, K and V concatenated in the graph: it reads them, not a copy
            with _autocast_uncached(mode):
                x = loop.embed(plan, structure, graph.ids, graph.types, graph.positions, None, tables)
                return loop.layers(plan, structure, fused(sources), x, graph.packing)

        graph.replay, graph.out = type(self).capture(run, self.pool)
        self.graphs[key] = graph
        return graph

    def describe(self) -> str:
        """explain()'s words: the buckets captured, their estimated memory, and what was refused."""
        used = sum(self.bucket_bytes(k) for k in self.graphs)
        said = (f"CUDA graphs: {len(self.graphs)} buckets captured (~{used / 2**20:.0f} MiB estimated of "
                f"{self.memory_limit / 2**20:.0f} MiB), up to {self.max_batch} sequences / {self.max_tokens} tokens "
                "a replay, larger batches split")  # fmt: skip
        refused = "; ".join(f"{k}: {why}" for k, why in self.refused.items())
        return said + (f"; in the loop for {refused}" if refused else "")


class Graphs:
    """The executor: replays the model's CudaGraphs (`model.cuda_graphs`, made on first use where on by default)."""

    name = "graphs"

    def takes(self, plan: Plan, model: nn.Module, structure: Structure) -> str | None:
        mode, wanted = plan.mode, getattr(model, "cuda_graphs", False)
        device_type = (wanted if isinstance(wanted, CudaGraphs) else CudaGraphs).device_type
        if mode.device.type != device_type:
            return f"runs on {device_type} tensors only"
        if mode.training or mode.grad:
            return "forward only: a replay records no autograd graph and draws no new dropout masks"
        if wanted is None and not default_on():
            return "FASTBERT_CUDA_GRAPHS=0"
        if (positions := model.config.max_position_embeddings) > MAX_TOKENS and not isinstance(wanted, CudaGraphs):
            return f"{positions} positions > the largest default bucket ({MAX_TOKENS} tokens): enable() with more"
        return None

    def declines(self, plan: Plan, call: Call) -> str | None:
        graphs = call.model.cuda_graphs
        if graphs is False:
            return "turned off for this model (disable())"
        if call.inputs.embeds is not None:
            return "inputs_embeds (graphs replay token ids)"
        if call.hidden is not None:
            return "output_hidden_states asks for every layer's output"
        if plan.mode.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "called while the stream is capturing"
        if graphs is None:  # the default, made on first use: set without binding anew (the setter's is for a choice)
            graphs = call.model.__dict__["_cuda_graphs"] = CudaGraphs(call.model)
        graphs.current(plan, call.structure)
        plan.details = graphs.details
        return None

    def run(self, plan: Plan, call: Call, packing: Packing) -> torch.Tensor | str:
        if packing.total == 0:
            return "no tokens to replay"
        return call.model.cuda_graphs.run(plan, call, packing)

    def note(self, plan: Plan) -> str:
        return "CUDA graph replay by token bucket"

    def __reduce__(self) -> str:
        return "GRAPHS"


GRAPHS = Graphs()


def _autocast_uncached(mode: Mode) -> contextlib.AbstractContextManager:
    """Under autocast, autocast without its cache of weight casts: a graph must record the casts, not a cached copy
    (which would miss in-place edits, and is freed when the caller's autocast block exits)."""
    if mode.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(mode.device.type, dtype=mode.autocast, cache_enabled=False)


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
    base.cuda_graphs = CudaGraphs(base, **limits)  # the plans are bound anew (BertModel.cuda_graphs' setter)
    return model


def disable(model: nn.Module) -> nn.Module:
    """Turn CUDA graphs off for `model` (every forward runs in the loop); returns the model."""
    _base(model).cuda_graphs = False
    return model


def default_on() -> bool:
    """Whether a CUDA model in eval mode gets graphs without asking (FASTBERT_CUDA_GRAPHS=0 says no)."""
    return os.environ.get("FASTBERT_CUDA_GRAPHS", "1") != "0"
