"""The encoder's layers after the first in one native call (CPU inference): the kernels of the per-op path, in its
order, without a return to Python between them.

Why: between two kernels the per-op path runs Python (module calls, dispatch, views), and right after a GEMM that
Python runs several times slower than warm (a dispatch took 35-130 us after a 444 x 384 x 1536 GEMM, 10 us back to
back). On MiniLM-L6 with 2 threads (`python -m benchmarks.bench_layer_stack`) stacking made one 16-token sentence
1.11-1.22x faster, a batch of 8 x 24 tokens 1.03-1.08x, and 32 x 14 tokens 0.96-1.05x (noise-sized).

The first layer still runs op by op, so every decision is made as always: each op's backend, the GEMMs' first-use
timing on real inputs, what explain() reports. When each of its ops ran on a kernel the native call has (a `gemm` or
`int8` GEMM, `native` attention), the layers after it go to the extension's `encoder_layers`, each GEMM on the backend
the first layer's ran on, provided each runs fastbert's own forwards without hooks, in eval mode, with plain weights
and biases of the first layer's shapes, dtypes and device.
The output is bitwise that of the per-op path (tests/test_layer_stack.py). `FASTBERT_LAYER_STACK=0` turns it off
(every layer op by op, as when profiling per op).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from fastbert import ops
from fastbert.backends import gemm, int8, native
from fastbert.padding import Packing

# a layer's ops, in the order its forward dispatches them
PLAN = ("linear", "attention", "dense_residual_layernorm", "linear", "dense_residual_layernorm")
GEMMS = ("QKV", "attention out", "FFN in", "FFN out")  # a layer's GEMMs, in order
OPERANDS = {"gemm": gemm.operands, "int8": int8.operands}  # GEMM backend -> weight -> (pack, per-channel scales)

_status = {"tried": 0, "stacked": 0, "last": ""}  # for explain(): forwards that tried, that stacked, the last outcome


def run(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    packing: Packing,
    first: list[tuple[str, str]],
    forwards: tuple[Callable, ...],
) -> torch.Tensor | None:
    """The layers after the first applied to x (the first's output, [T, H]) in one native call; None, with the reason
    kept for explain(), when they must run op by op. `first`: the (op, backend) pairs the first layer dispatched;
    `forwards`: the forward methods the native call reproduces (fastbert.modeling's), in the order of _Parts.modules."""
    reason, gemms, parts = _refusal(layers, first, forwards)
    _status["tried"] += 1
    if reason is not None:
        _status["last"] = f"op by op, because {reason}"
        return None
    weights: list[torch.Tensor] = []
    eps: list[float] = []
    for p in parts[1:]:
        linears = (p.self_attention.qkv_weight(), _params(p.out_dense), _params(p.inter_dense), _params(p.ffn_dense))
        for (weight, bias), backend, norm in zip(linears, gemms, (None, p.out_norm, None, p.ffn_norm), strict=True):
            weights += [*OPERANDS[backend](weight), bias]
            if norm is not None:  # an output projection, followed by its LayerNorm
                weights += [*_params(norm)]
                eps.append(norm.eps)
    attention = parts[0].self_attention
    cpu, _ = native.load("_native_cpu")
    x = cpu.encoder_layers(x, packing.cu_seqlens, int(packing.max_seqlen), attention.num_heads,
                           1.0 / math.sqrt(attention.head_dim), weights, parts[0].modules[4].act, eps)  # fmt: skip
    _status["stacked"] += 1
    on = (f"every GEMM on {gemms[0]}" if len(set(gemms)) == 1
          else ", ".join(f"{what} on {name}" for what, name in zip(GEMMS, gemms, strict=True)))  # fmt: skip
    _status["last"] = f"layers 2-{len(layers)} in one native call ({on}, attention on native)"
    return x


class _Parts(NamedTuple):
    """A layer's modules, read once per forward. Children and parameters are read from the module's own dicts: this
    runs every forward, and nn.Module.__getattr__ costs ~0.4 us a lookup, ~100 of them per layer."""

    modules: tuple[nn.Module, ...]  # those whose forward the layer's forward calls, the layer first
    self_attention: nn.Module
    out_dense: nn.Module
    out_norm: nn.Module
    inter_dense: nn.Module
    ffn_dense: nn.Module
    ffn_norm: nn.Module

    def tensors(self) -> tuple[nn.Module, ...]:
        """The modules whose weight and bias the layer reads: Q, K, V, the projections and LayerNorms."""
        qkv = self.self_attention._modules
        return (qkv["query"], qkv["key"], qkv["value"], self.out_dense, self.out_norm, self.inter_dense,
                self.ffn_dense, self.ffn_norm)  # fmt: skip

    def signature(self) -> tuple | None:
        """What the first layer's decisions depend on besides the call: heads, activation, and every weight's and
        bias's shape, dtype and whether it is on the CPU (None for a parametrized or missing one, which the native call
        cannot take)."""
        described = []
        for module in self.tensors():
            weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
            if weight is None or bias is None:
                return None
            described += [(t.shape, t.dtype, t.is_cpu) for t in (weight, bias)]
        return self.self_attention.num_heads, self.modules[4].act, *described

    def differs(self, forwards: tuple[Callable, ...]) -> str | None:
        """Why this layer would not compute what the native call does, or None: another forward than fastbert's (a
        subclass's, or one set on the instance as accelerate's hooks do), forward hooks, or training mode (dropout)."""
        for module, forward in zip(self.modules, forwards, strict=True):
            if type(module).forward is not forward or "forward" in module.__dict__:
                return f"{type(module).__name__} runs another forward than fastbert's"
            if module._forward_hooks or module._forward_pre_hooks:
                return f"{type(module).__name__} has forward hooks"
            if module.training:
                return f"{type(module).__name__} is in training mode"
        return None


def _parts(layer: nn.Module) -> _Parts | None:
    """The layer's parts, None if it is not built as a BERT layer (BertLayer's children, by name)."""
    try:
        attention, inter, ffn = (layer._modules[n] for n in ("attention", "intermediate", "output"))
        self_attention, out = attention._modules["self"], attention._modules["output"]
        return _Parts((layer, attention, self_attention, out, inter, ffn), self_attention, out._modules["dense"],
                      out._modules["LayerNorm"], inter._modules["dense"], ffn._modules["dense"],
                      ffn._modules["LayerNorm"])  # fmt: skip
    except (KeyError, AttributeError):
        return None


def _params(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of a Linear or LayerNorm (both present and unparametrized: _Parts.signature checked)."""
    return module._parameters["weight"], module._parameters["bias"]


def _refusal(
    layers: Sequence[nn.Module], first: list[tuple[str, str]], forwards: tuple[Callable, ...]
) -> tuple[str | None, tuple[str, ...], list[_Parts]]:
    """(why the layers cannot run in one native call or None, the backend of each of a layer's four GEMMs, the
    layers' parts)."""
    if os.environ.get("FASTBERT_LAYER_STACK", "1") == "0":
        return "FASTBERT_LAYER_STACK=0", (), []
    elsewhere = [(op, name) for op, name in first if name not in (*OPERANDS, "native")]
    if elsewhere:
        return f"the first layer ran {elsewhere[0][0]} on {elsewhere[0][1]} (this call has the gemm/int8 GEMMs and " \
               "native attention)", (), []  # fmt: skip
    names, backends = tuple(op for op, _ in first), tuple(name for _, name in first)
    gemms = backends[:1] + backends[2:]
    if names != PLAN or backends[1] != "native" or "native" in gemms:
        return f"the first layer ran {', '.join(names) or 'no op'}, not a BERT layer's five fused ops", (), []
    if torch.is_grad_enabled() and any(p.requires_grad for layer in layers[1:] for p in layer.parameters()):
        return "later layers' weights require grad (the native call records no autograd graph)", (), []
    cpu, why = native.load("_native_cpu")
    if cpu is None or not hasattr(cpu, "encoder_layers"):
        return why or "the native CPU extension predates encoder_layers: rebuild it", (), []
    if _global_hooks():
        return "global module forward hooks are registered", (), []
    parts = [_parts(layer) for layer in layers]
    template = parts[0].signature() if parts[0] is not None else None
    if template is None:
        return "the first layer is not a BERT layer with a plain weight and bias in every Linear and LayerNorm", (), []
    for i, p in enumerate(parts[1:], start=2):
        if p is None or p.signature() != template:
            return f"layer {i} is not built like layer 1 (weights' shapes, dtypes or devices, biases)", (), []
        if (why := p.differs(forwards)) is not None:
            return f"layer {i}'s {why}", (), []
    return None, gemms, parts


def _global_hooks() -> bool:
    """Whether forward hooks are registered for every module (torch's module-level registries)."""
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def describe() -> str | None:
    """explain()'s line: how the encoder's later layers ran in the last forward that tried, None before any did."""
    if not _status["last"]:
        return None
    return (f"encoder layers after the first, in the last forward: {_status['last']} (stacked in {_status['stacked']} "
            f"of {_status['tried']} forwards so far)")


ops.register_explainer(describe)
