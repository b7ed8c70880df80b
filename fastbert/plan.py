"""Decide once, run many: a model's fused ops bound to their kernels per mode, and the executors that run them.

On a GPU a fused op's kernel takes 10-30 us while choosing it per call (fastbert.ops' dispatch: the forced backend,
the backend list, the limits, the words for explain()) and calling it through nn.Module cost more: an eager BERT-base
forward ran ~5,000 Python calls (benchmarks/host_work.py). So a model gets a plan per mode: (device, dtype, autocast,
grad, training, the forced / excluded / opted-in backends). The first forward in a mode runs module by module through
the dispatch, which records the backend each op took; the plan then binds every op that always took one backend,
whose choice depends on nothing but the mode, to that backend's function (its forward-only launcher when no gradient
is needed). Later forwards in that mode run the encoder as one loop over the layers' tensors: no module calls, no
dispatch. An op stays dispatched per call where the choice can change from call to call: a backend that times
shapes at first use (`Backend.decides_per_call`), an op seen on two backends, or autocast (whose casts the dispatch
makes). explain() prints every plan and why each op got its path.

The loop reproduces fastbert.modeling's forwards; a model whose layers run any other (a subclass, a forward set on the
instance, hooks, a module in another train/eval mode than the model) runs module by module, said in explain().
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from fastbert import capabilities, ops
from fastbert.padding import Packing

FusedOp = Callable[..., torch.Tensor]
_plans_described: list[Plan] = []  # the newest plan of each model, for explain() (weakly: a plan holds no model)
_lock = threading.Lock()
_numbers = itertools.count(1)


class Mode(NamedTuple):
    """What a plan is bound to; a forward in another mode gets (or builds) another plan."""

    device: torch.device
    dtype: torch.dtype
    autocast: torch.dtype | None  # the autocast dtype on that device, None when off
    grad: bool  # autograd records this forward (grad enabled and some weight requires grad)
    training: bool
    forced: str | None
    excluded: frozenset
    opted_in: frozenset
    tf32: bool  # fp32 on CUDA: whether torch allows TF32 (which fp32 attention kernel is exact enough follows it)


class LayerParts(NamedTuple):
    """A BERT layer's leaf modules, in the order the loop reads their weights (found once, by transformers' names)."""

    layer: nn.Module
    modules: tuple[nn.Module, ...]  # every module whose forward the layer's forward runs, the layer first
    query: nn.Module
    key: nn.Module
    value: nn.Module
    out_dense: nn.Module
    out_norm: nn.Module
    inter_dense: nn.Module
    act: str
    ffn_dense: nn.Module
    ffn_norm: nn.Module


def layer_parts(layer: nn.Module) -> LayerParts | None:
    """The layer's parts, None if it is not built as fastbert's BertLayer (children by name)."""
    try:
        attention, inter, ffn = (layer._modules[n] for n in ("attention", "intermediate", "output"))
        self_attention, out = attention._modules["self"], attention._modules["output"]
        q, k, v = (self_attention._modules[n] for n in ("query", "key", "value"))
        return LayerParts(
            layer, (layer, attention, self_attention, out, inter, ffn), q, k, v, out._modules["dense"],
            out._modules["LayerNorm"], inter._modules["dense"], inter.act, ffn._modules["dense"],
            ffn._modules["LayerNorm"],
        )  # fmt: skip
    except (KeyError, AttributeError):
        return None


def current_mode(model: nn.Module, device: torch.device, dtype: torch.dtype, grad: bool) -> Mode:
    """The mode of a forward now (environment variables and the thread's dispatch scopes are read here, once)."""
    try:
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    except RuntimeError:  # a device type autocast does not know (meta): no autocast there
        autocast = None
    state = ops.dispatch_scope()
    tf32 = (
        dtype == torch.float32
        and device.type == "cuda"
        and (torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest")
    )
    return Mode(device, dtype, autocast, grad, model.training, *state, tf32)


class Plan:
    """One model's ops in one mode: each op's function (bound, or the dispatching one) and the reason for it."""

    def __init__(self, mode: Mode, seen: Sequence[tuple[str, str]], model_name: str) -> None:
        self.mode, self.model_name = mode, model_name
        self.functions: dict[str, FusedOp] = {}
        self.how: dict[str, str] = {}  # op -> "bound to <backend> (<launcher>)" or "dispatched per call: <why>"
        backends: dict[str, set[str]] = {}
        for op, name in seen:
            backends.setdefault(op, set()).add(name)
        for op in ops.OPS:
            self.functions[op], self.how[op] = self._bind(op, backends.get(op, set()))
        self.executor_note = ""
        self.graphs: Callable[[], Any] = lambda: None  # a weak reference to the model's CudaGraphs (explain())

    def _bind(self, op: str, names: set[str]) -> tuple[FusedOp, str]:
        dispatched = getattr(ops, op)
        if self.mode.autocast is not None:
            return dispatched, "dispatched per call: autocast (the dispatch makes its casts)"
        if len(names) != 1:
            return dispatched, ("dispatched per call: " + ("not run yet" if not names
                                else f"ran on {' and '.join(sorted(names))}"))  # fmt: skip
        (name,) = names
        backend = ops.backends()[name]
        if backend.decides_per_call:
            return dispatched, f"dispatched per call: {name} {backend.decides_per_call}"
        if self.mode.grad and backend.forward_only:
            return dispatched, f"dispatched per call: {name} is forward only (whether inputs require grad can change)"
        if name == "torch" and op in ops.COMPOUND_OPS:
            return self._compose(op)
        inference = not (self.mode.grad or self.mode.training)
        launcher = backend.inference_function(op) if inference else None
        if launcher is not None:
            return launcher, f"bound to {name} (forward-only launcher)"
        return backend.function(op), f"bound to {name}"

    def _compose(self, op: str) -> tuple[FusedOp, str]:
        """torch's GEMM (F.linear) with the bound epilogue op: what ops' torch backend composes per call."""
        mode = self.mode
        if mode.dtype == torch.bfloat16 and capabilities.bf16_via_fp32(mode.device):
            return getattr(ops, op), "dispatched per call: bf16 GEMMs run as fp32 on this CPU (ops' torch backend)"
        if op == "linear":
            how = self.how.get("bias_act", "dispatched")
            return ops.composed_linear(self.functions.get("bias_act") or ops.bias_act), (
                f"bound to torch: F.linear + bias_act ({how})"
            )
        brln = self.functions.get("bias_residual_layernorm") or ops.bias_residual_layernorm
        how = self.how.get("bias_residual_layernorm", "dispatched")
        return ops.composed_dense_residual_layernorm(self.functions["linear"], brln), (
            f"bound to torch: linear + bias_residual_layernorm ({how})"
        )

    def describe(self) -> str:
        m = self.mode
        where = f"{m.device.type}/{str(m.dtype).removeprefix('torch.')}"
        flags = [f"autocast {str(m.autocast).removeprefix('torch.')}" if m.autocast else "",
                 "training" if m.training else "eval", "with grad" if m.grad else "no grad",
                 f"forced {m.forced}" if m.forced else "",
                 f"without {', '.join(sorted(m.excluded))}" if m.excluded else ""]  # fmt: skip
        lines = [f"plan of {self.model_name} on {where} ({', '.join(f for f in flags if f)}): {self.executor_note}"]
        if (graphs := self.graphs()) is not None:
            lines.append(f"  {graphs.describe()}")
        return "\n".join(lines + [f"  {op} -> {self.how[op]}" for op in ops.OPS])


class Encoder:
    """The encoder's layers as one loop over their tensors, with a plan's functions (the 'layers' executor)."""

    def __init__(self, embeddings: nn.Module, layers: Sequence[nn.Module], config: Any) -> None:
        self.embeddings, self.layers = embeddings, list(layers)
        self.parts = [layer_parts(layer) for layer in layers]
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.hidden = config.hidden_size
        self.p_attention, self.p_hidden = config.attention_probs_dropout_prob, config.hidden_dropout_prob
        leaves = [m for p in self.parts if p is not None for m in (*p[2:8], p.ffn_dense, p.ffn_norm)]
        self.modules = [m for p in self.parts if p is not None for m in p.modules] + leaves + list(embeddings.modules())
        self.leaves = [(m, nn.LayerNorm if isinstance(m, nn.LayerNorm) else nn.Linear) for m in leaves]

    def refusal(self, embeddings_forward: Callable, forwards: tuple[Callable, ...], training: bool) -> str | None:
        """Why this forward must run module by module (another forward than `embeddings_forward` / `forwards`, hooks,
        a module in another train/eval mode than `training`), or None. Checked every forward: they can change."""
        e = self.embeddings
        if type(e).forward is not embeddings_forward or "forward" in e.__dict__:
            return f"the embeddings ({type(e).__name__}) run another forward than fastbert's"
        if None in self.parts:
            return "a layer is not built as fastbert's BertLayer"
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return "global module forward hooks are registered"
        for p in self.parts:
            for module, forward in zip(p.modules, forwards, strict=True):
                if type(module).forward is not forward or "forward" in module.__dict__:
                    return f"a {type(module).__name__} runs another forward than fastbert's"
        for leaf, kind in self.leaves:
            if type(leaf) is not kind:  # a parametrization or an adapter (LoRA) wraps it: its forward differs
                return f"a {type(leaf).__name__} stands where fastbert's {kind.__name__} was"
        for module in self.modules:
            if module._forward_hooks or module._forward_pre_hooks:
                return f"a {type(module).__name__} has forward hooks"
            if module.training != training:
                return f"a {type(module).__name__} is in {'training' if module.training else 'eval'} mode"
        return None

    def __call__(self, plan: Plan, x: torch.Tensor, packing: Packing) -> torch.Tensor:  # [T, H] -> [T, H]
        linear, attention = plan.functions["linear"], plan.functions["attention"]
        drl = plan.functions["dense_residual_layernorm"]
        training, grad = plan.mode.training, plan.mode.grad
        p_attn, p_hidden = self.p_attention, self.p_hidden
        cu, max_seqlen, tokens = packing.cu_seqlens, packing.max_seqlen, x.shape[0]
        qkv_shape, ctx_shape = (tokens, 3, self.heads, self.head_dim), (tokens, self.heads * self.head_dim)
        for p in self.parts:
            w, b = p.modules[2].qkv_weight(grad)
            qkv = linear(x, w, b, None).view(qkv_shape)
            ctx = attention(qkv, cu, max_seqlen, p_attn, training, None).reshape(ctx_shape)
            o, n = p.out_dense._parameters, p.out_norm
            h = drl(ctx, o["weight"], o["bias"], x, n._parameters["weight"], n._parameters["bias"], n.eps, p_hidden,
                    training)  # fmt: skip
            f, n = p.inter_dense._parameters, p.ffn_norm
            inner = linear(h, f["weight"], f["bias"], p.act)
            f = p.ffn_dense._parameters
            x = drl(inner, f["weight"], f["bias"], h, n._parameters["weight"], n._parameters["bias"], n.eps, p_hidden,
                    training)  # fmt: skip
        return x


class Plans:
    """A model's plans, one per mode, and its layers executor; `lookup` is what every forward asks. A copy or a pickle
    of the model starts with none (they hold functions and caches of this model's tensors)."""

    def __init__(self, kind: str) -> None:
        self.kind, self.model_name = kind, f"{kind} #{next(_numbers)}"
        self.plans: dict[Mode, Plan] = {}
        self.encoder: Encoder | None = None

    def __deepcopy__(self, memo: dict) -> Plans:
        return Plans(self.kind)

    def __reduce__(self) -> tuple:
        return Plans, (self.kind,)

    def lookup(self, mode: Mode) -> Plan | None:
        """The plan for this mode, or None when it has not been bound yet (the caller records a forward and binds)."""
        return self.plans.get(mode)

    def bind(self, mode: Mode, seen: Sequence[tuple[str, str]]) -> Plan:
        """Bind a plan from what one module-by-module forward in this mode dispatched (`seen`: (op, backend))."""
        plan = Plan(mode, seen, self.model_name)
        with _lock:
            self.plans[mode] = plan
            _plans_described[:] = [p for p in _plans_described if p.model_name != self.model_name][-7:] + [plan]
        return plan

    def set_encoder(self, encoder: Encoder) -> Encoder:
        self.encoder = encoder
        return encoder

    def clear(self) -> None:
        """Forget every plan (the next forward in each mode records and binds again)."""
        self.plans.clear()
        self.encoder = None


def describe() -> str | None:
    """explain()'s lines: each model's newest plan, op by op."""
    if not _plans_described:
        return None
    return "\n".join(p.describe() for p in _plans_described)


ops.register_explainer(describe)
