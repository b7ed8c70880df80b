"""The 'stack' executor (CPU inference): the encoder's layers in one native call, on the kernels the loop would run, in
its order, without a return to Python between them.

Why: between two kernels the loop runs Python, and right after a GEMM that Python runs several times slower than warm
(a dispatch took 35-130 us after a 444 x 384 x 1536 GEMM, 10 us back to back). On MiniLM-L6 with 2 threads
(`python -m benchmarks.bench_layer_stack`) stacking made one 16-token sentence 1.11-1.22x faster, a batch of 8 x 24
tokens 1.03-1.08x, and 32 x 14 tokens 0.96-1.05x (noise-sized) in fp32; in bf16, whose oneDNN GEMMs on AMX leave the
Python a larger share, the STS-B dev batches (32 sentences each, sorted by length) took 17% less time stacked.

The plan binds it where attention is bound to the native kernel, without grad or training, when every layer is built
like the first (`LayerParts.signature`). On CPU the GEMMs stay dispatched per call (fastbert's and oneDNN's GEMMs are
timed per shape and size class at first use): each forward asks the dispatch which backend takes each of the first
layer's GEMMs (or takes the backend the plan bound, where it did), from the verdicts as they stand. When all four go to
a GEMM the native call has (`gemm`, `int8`, or `onednn`'s prepacked weights, which it calls through torch's operator
registry), every layer goes to the extension's `encoder_layers`, each GEMM on the backend the first layer's takes.
Where a GEMM would be timed first (a shape's first use, a due re-check), the first layer runs in the loop, which times
it on the layer's real inputs, and the layers after it go to the native call. The output is bitwise the loop's
(tests/test_layer_stack.py). `FASTBERT_LAYER_STACK=0` turns it off (every layer in the loop, as when profiling per
op). The first layer in the native call, against in the loop, on all-MiniLM-L6-v2's shape: one 128-token sequence
1.02x faster in fp32 and 1.03x in int8, one of 16 tokens 1.06x (fp32), 8 x 24 tokens 1.10x (int8: its chunks take the
first layer too).

With fastbert's own GEMMs, the native call cuts the batch into a chunk of whole sequences per thread, each chunk through
every layer on its thread alone (`FASTBERT_STACK_CHUNKS`: another count; 1 keeps the batch whole, each kernel parallel
on its own). A layer's parallel regions (seven to nine: GEMMs, their quantising or splitting, attention, LayerNorms)
become one a forward, and each thread keeps its layer's weights in its own L2: on 2 vCPUs of a Xeon with AMX, MiniLM-L6
at 32 x 40 tokens ran 1.21x (fp32), 1.10x (int8) and 1.21x (bf16) faster than with the batch whole
(`python -m benchmarks.bench_layer_stack`; benchmarks/results/layer_stack_cpu-avx512-amx.md). On a busy machine a
thread the OS preempted holds up the other only at the end of the call, not at every region; in a busy spell (the
busy-host pool, csrc/cpu/pool.h) the batch is cut into up to four chunks a thread, claimed as threads come free, so
the call waits at its end for one small chunk, not for half the batch on a thread the OS runs a third of the time.
Layers on oneDNN's GEMMs (parallel on torch's team) keep the batch whole, except in a busy spell, where each chunk's
GEMMs are one oneDNN call of its rows on its own thread (MiniLM bf16 beside two torch workers: 204 -> 262 sentences/s).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastbert import ops
from fastbert.backends import gemm, int8, native, onednn, timing
from fastbert.execution import loop, rows
from fastbert.execution.plan import Call, Plan
from fastbert.execution.structure import Structure, same_layers
from fastbert.padding import Packing

GEMMS = ("QKV", "attention out", "FFN in", "FFN out")  # a layer's GEMMs, in order
MIN_CHUNK_TOKENS = 48  # the native call's kChunkTokens: no chunk shorter (a GEMM of a few rows runs slowly)
# GEMM backend -> (weight, bias, rows, fp32 mode) -> its three operands as the native call takes them: (pack,
# per-channel scales, bias), oneDNN's (pack, the rows of each call, bias)
OPERANDS: dict[str, Callable[[torch.Tensor, torch.Tensor, int, str], tuple[torch.Tensor, ...]]] = {
    "gemm": gemm.operands,
    "int8": lambda w, b, rows, fp32: int8.operands(w, b),
    "onednn": lambda w, b, rows, fp32: onednn.operands(w, b, rows),
}

CHUNKS_ENV = "FASTBERT_STACK_CHUNKS"
_status = {"tried": 0, "stacked": 0, "last": ""}  # for explain(): forwards that tried, that stacked, the last outcome


def chunks() -> int:
    """How many chunks of whole sequences the native call cuts a batch into, each through every layer on one thread
    (encoder_layers, csrc/cpu/layer_stack.inc): 0, one per thread (four a thread in a busy spell), unless
    FASTBERT_STACK_CHUNKS gives a count (1: the batch whole, each kernel parallel on its own)."""
    value = os.environ.get(CHUNKS_ENV, "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"{CHUNKS_ENV}={value!r}: a count of chunks, 0 for one per thread, 1 for the batch whole")
    return int(value)


def chunking(used: int, asked: int, own_gemms: bool, threads: int) -> str:
    """explain()'s words for a native call on `threads` threads that ran `used` chunks, asked for `asked` (chunks())."""
    if used > 1:
        why = (f" ({CHUNKS_ENV}={asked})" if asked
               else ", claimed as threads come free (a busy spell: up to four a thread)" if used > threads else "")
        return f"the batch in {used} chunks of whole sequences, each through every layer on one thread{why}"
    if not own_gemms:
        why = "oneDNN's GEMMs run on torch's threads outside a busy spell"
    elif asked == 1:
        why = f"{CHUNKS_ENV}=1"
    else:
        why = f"too few threads, sequences or tokens to cut: {MIN_CHUNK_TOKENS}+ tokens a chunk"
    return f"the batch whole, each kernel parallel on its own ({why})"


def _choosing(plan: Plan, op: str, chosen: list[str]) -> Callable[..., torch.Tensor]:
    """`op` as the loop runs it, keeping the backend each call took: the plan's function where the op is bound to one
    backend (not the dispatch, whose choice can differ from the bound one's), else the dispatch."""
    if (bound := plan.backends[op]) is not None:
        function = plan.functions[op]

        def run_bound(*args: Any) -> torch.Tensor:
            chosen.append(bound)
            return function(*args)

        return run_bound

    def run(*args: Any) -> torch.Tensor:
        function, name = ops.select(op, args, {})
        chosen.append(name)
        return function(*args)

    return run


def first_layer_backends(plan: Plan, s: Structure, x: torch.Tensor, layer: tuple) -> tuple[str, ...] | None:
    """The backend each of the first layer's GEMMs takes in this forward (QKV, attention out, FFN in, FFN out), from
    the plan's bound ops or the dispatch's verdicts as they stand, asked with inputs of the calls' shapes (x's own,
    and a broadcast one for FFN out's [T, I]: nothing runs on them); None where the dispatch would time a GEMM now (a
    first use, a due re-check) or oneDNN its cut into row parts, which take the layer's real inputs: the loop runs
    that forward's first layer."""
    qkv_w, qkv_b, o_w, o_b, n1_w, n1_b, eps1, i_w, i_b, act, f_w, f_b, n2_w, n2_b, eps2, _ = layer
    p_hidden, training = s.layers[0].modules[3].dropout_p, plan.mode.training
    inner = x[:1, :1].expand(x.shape[0], i_w.shape[0])  # FFN out's x: [T, I]
    calls = (("linear", (x, qkv_w, qkv_b, None)),
             ("dense_residual_layernorm", (x, o_w, o_b, x, n1_w, n1_b, eps1, p_hidden, training)),
             ("linear", (x, i_w, i_b, act)),
             ("dense_residual_layernorm", (inner, f_w, f_b, x, n2_w, n2_b, eps2, p_hidden, training)))  # fmt: skip
    try:
        with timing.peeking():
            chosen = tuple(plan.backends[op] or ops.select(op, args, {})[1] for op, args in calls)
    except timing.WouldTime:
        return None
    weights = (qkv_w, o_w, i_w, f_w)
    cuts = [onednn.parts_settled(w, x.shape[0]) for name, w in zip(chosen, weights, strict=True) if name == "onednn"]
    return chosen if all(cuts) else None


class Stack:
    name = "stack"

    def takes(self, plan: Plan, model: nn.Module, structure: Structure) -> str | None:
        mode = plan.mode
        if mode.device.type != "cpu":
            return "runs on CPU tensors only"
        if mode.grad or mode.training:
            return "forward only: the native call records no autograd graph and has no dropout"
        if plan.backends["attention"] != "native":
            return f"attention is not bound to the native kernel ({plan.how['attention']})"
        cpu, why = native.load("_native_cpu")
        if cpu is None or not hasattr(cpu, "encoder_layers"):
            return why or "the native CPU extension predates encoder_layers: rebuild it"
        if len(structure.layers) < 2:
            return "one layer: nothing to stack"
        if structure.rows is not None:
            return "DeBERTa's disentangled attention: the native layer stack computes no position scores"
        if structure.rotary or structure.layers[0].gate is not None:
            return "rotary positions and gated feed-forwards are not in the native layer stack (the loop runs them)"
        if structure.layers[0].signature() is None:
            return "the first layer is not a BERT layer with a plain weight and bias in every Linear and LayerNorm"
        if (i := same_layers(structure.layers)) is not None:
            return f"layer {i} is not built like layer 1 (weights' shapes, dtypes or devices, biases)"
        return None

    def declines(self, plan: Plan, call: Call) -> str | None:
        if os.environ.get("FASTBERT_LAYER_STACK", "1") == "0":
            return "FASTBERT_LAYER_STACK=0"
        if call.hidden is not None:
            return "output_hidden_states asks for every layer's output"
        chunks()  # a bad FASTBERT_STACK_CHUNKS raises before the first layer runs
        return None

    def run(self, plan: Plan, call: Call, packing: Packing) -> torch.Tensor | str:
        s = call.structure
        x = loop.embed(plan, s, *loop.packed(call.inputs, packing))
        total = x.shape[0]
        x, packing = rows.lay(plan, x, packing)
        weights = s.layer_weights(False)
        gemms = first_layer_backends(plan, s, x, weights[0])
        if gemms is None or any(name not in OPERANDS for name in gemms):  # the first layer runs in the loop, which
            chosen: list[str] = []  # times what is to be timed and runs what the native call has no kernel of
            x = loop.layers(plan, s, weights[:1], x, packing, None, _choosing(plan, "linear", chosen),
                            _choosing(plan, "dense_residual_layernorm", chosen))  # fmt: skip
            gemms, weights = (chosen[0], chosen[1], chosen[2], chosen[3]), weights[1:]  # in call order
        _status["tried"] += 1
        if elsewhere := [(what, name) for what, name in zip(GEMMS, gemms, strict=True) if name not in OPERANDS]:
            _status["last"] = (f"the rest in the loop, because the first layer ran its {elsewhere[0][0]} GEMM on "
                               f"{elsewhere[0][1]} (the native call has the gemm/int8/onednn GEMMs)")  # fmt: skip
            return rows.cut(loop.layers(plan, s, weights, x, packing), total, None)
        operands: list[torch.Tensor] = []
        eps: list[float] = []
        fp32 = gemm.fp32_mode() if "gemm" in gemms else ""  # read once for every layer's packs
        for qkv_w, qkv_b, o_w, o_b, n1_w, n1_b, eps1, i_w, i_b, _, f_w, f_b, n2_w, n2_b, eps2, _ in weights:
            linears = ((qkv_w, qkv_b), (o_w, o_b), (i_w, i_b), (f_w, f_b))
            norms = (None, (n1_w, n1_b, eps1), None, (n2_w, n2_b, eps2))
            for (w, b), backend, norm in zip(linears, gemms, norms, strict=True):
                operands += OPERANDS[backend](w, b, x.shape[0], fp32)
                if norm is not None:  # an output projection, followed by its LayerNorm
                    operands += [norm[0], norm[1]]
                    eps.append(norm[2])
        first = s.layers[0].self_attention
        cpu, _ = native.load("_native_cpu")
        scale = first.scale if first.scale is not None else 1.0 / math.sqrt(first.head_dim)  # DeBERTa's 1/sqrt(3D)
        own_gemms, asked = "onednn" not in gemms, chunks()
        x = cpu.encoder_layers(x, packing.cu_seqlens, int(packing.max_seqlen), first.num_heads, scale, operands,
                               s.layers[0].act, eps, s.position_bias(), bf16_products=native.bf16_products(),
                               chunks=asked)[:total]  # fmt: skip
        _status["stacked"] += 1
        on = (f"every GEMM on {gemms[0]}" if len(set(gemms)) == 1
              else ", ".join(f"{what} on {name}" for what, name in zip(GEMMS, gemms, strict=True)))  # fmt: skip
        how = chunking(cpu.encoder_layers_chunks(), asked, own_gemms, cpu.threading()[0])
        layers = len(s.layers)
        _status["last"] = (f"layers {layers - len(weights) + 1}-{layers} in one native call ({on}, attention on "
                           f"native; {how})")  # fmt: skip
        return x

    def note(self, plan: Plan) -> str:
        return f"the CPU layer stack: {_status['last']}"

    def __reduce__(self) -> str:
        return "STACK"


STACK = Stack()


def describe() -> str | None:
    """explain()'s line: how the encoder's layers ran in the last forward that tried, None before any did."""
    if not _status["last"]:
        return None
    return (f"the encoder's layers in the last forward: {_status['last']} (stacked in {_status['stacked']} of "
            f"{_status['tried']} forwards so far)")


ops.register_explainer(describe)
