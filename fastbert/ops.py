"""The dispatch layer: one function per fused op, each sent to the first backend that takes the call.

What a backend supports is data (`Backend`: devices, dtypes, a loader, per-op limits), so a fallback can say why
it happened: `fastbert.explain()` lists the last decision per op, and the `fastbert.ops` logger records each new
one at DEBUG. `FASTBERT_BACKEND=triton|native|cpu|torch` (or `use_backend(...)`, or `BertConfig.backend`) forces one
backend for the ops it implements (the others keep the automatic choice, and explain() says so); a forced backend
that cannot take a call raises `BackendUnavailable`, it never silently degrades.
Triton takes CUDA tensors automatically, CPU tensors (its interpreter, TRITON_INTERPRET=1) only when forced.

Importing this module never needs a GPU, Triton or the native extension: backends load lazily, and a failed load
is recorded as the reason to fall back.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from fastbert import capabilities, reference

log = logging.getLogger("fastbert.ops")

KERNEL_OPS = ("embedding_layernorm", "bias_act", "bias_residual_layernorm", "attention")
OPS = KERNEL_OPS + ("linear",)
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class BackendUnavailable(RuntimeError):
    """A forced backend cannot run this call (the message says why)."""


# A per-op limit check: (the call's arguments by parameter name, forced by name?) -> why not, or None.
LimitCheck = Callable[[dict[str, Any], bool], "str | None"]


@dataclass
class Backend:
    """A backend as data: what it takes, how to load it, and per-op limits (each returns a reason or None)."""

    name: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    module: str  # imported on first use; must define a function per op it lists in `ops`
    ops: tuple[str, ...] = OPS
    limits: dict[str, LimitCheck] = field(default_factory=dict)
    device_check: Callable[[str], str | None] | None = None  # e.g. Triton on CPU only under TRITON_INTERPRET=1
    auto_devices: tuple[str, ...] | None = None  # devices automatic dispatch sends here (None: all of `devices`)
    _loaded: ModuleType | None = field(default=None, repr=False)
    _load_error: str | None = field(default=None, repr=False)

    def load(self) -> tuple[ModuleType | None, str | None]:
        if self._loaded is None and self._load_error is None:
            try:
                self._loaded = importlib.import_module(self.module)
                ready = getattr(self._loaded, "unavailable_reason", None)
                if callable(ready) and (reason := ready()):
                    self._loaded, self._load_error = None, reason
            except Exception as exc:  # ImportError, a stale .so, a missing driver: all are reasons, not crashes
                self._load_error = f"{type(exc).__name__}: {exc}"
        return self._loaded, self._load_error

    def refuses(
        self, op: str, device: torch.device, dtype: torch.dtype, args: tuple, kwargs: dict, forced: bool = False
    ) -> str | None:
        """Why this backend cannot take the call, or None if it can (`forced`: chosen by name, not automatically)."""
        if op not in self.ops:
            return f"does not implement {op}"
        if device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not {device.type}"
        if not forced and self.auto_devices is not None and device.type not in self.auto_devices:
            return f"takes {device.type} tensors only when forced"
        if self.device_check is not None and (reason := self.device_check(device.type)):
            return reason
        if dtype not in self.dtypes:
            return f"does not take {dtype}"
        module, error = self.load()
        if module is None:
            return f"unavailable ({error})"
        check = self.limits.get(op)
        return check(_SIGNATURES[op].bind(*args, **kwargs).arguments, forced) if check is not None else None


def _triton_device_check(device_type: str) -> str | None:
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "runs on CPU tensors only under TRITON_INTERPRET=1"
    return None


TRITON_MAX_FEATURE = 16384  # row kernels hold a whole feature row in registers (kernels/_common.py MAX_FEATURE)
TRITON_MAX_HEAD_DIM = 128  # kernels/attention.py MAX_HEAD_DIM
TRITON_MAX_SEQLEN_DROPOUT = 46340  # attention dropout's int32 Philox offsets (kernels/attention.py)


def _feature_limit(n: int) -> str | None:
    return f"feature dim {n} > {TRITON_MAX_FEATURE}" if n > TRITON_MAX_FEATURE else None


def _triton_attention_limit(call: dict[str, Any], forced: bool) -> str | None:
    qkv, max_seqlen = call["qkv"], call["max_seqlen"]
    if qkv.shape[-1] > TRITON_MAX_HEAD_DIM:
        return f"head dim {qkv.shape[-1]} > {TRITON_MAX_HEAD_DIM}"
    if call.get("training") and call.get("dropout_p", 0.0) > 0 and max_seqlen > TRITON_MAX_SEQLEN_DROPOUT:
        return f"attention dropout with max_seqlen {max_seqlen} > {TRITON_MAX_SEQLEN_DROPOUT}"
    return None


_TRITON_LIMITS: dict[str, LimitCheck] = {
    "embedding_layernorm": lambda call, forced: _feature_limit(call["word_weight"].shape[-1]),
    "bias_residual_layernorm": lambda call, forced: _feature_limit(call["x"].shape[-1]),
    "attention": _triton_attention_limit,
}


def _native_limits(call: dict[str, Any], forced: bool, op: str) -> str | None:
    # fastbert.native is already imported here: Backend.refuses loads the module before it checks limits.
    return importlib.import_module("fastbert.native").refuses(op, call, forced)


def _cpu_linear_limits(call: dict[str, Any], forced: bool) -> str | None:
    return importlib.import_module("fastbert.cpu").refuses_linear(**call, forced=forced)


def _cpu_attention_limits(call: dict[str, Any], forced: bool) -> str | None:
    # a loop over cu_seqlens read on the host: torch.compile/export trace the reference instead
    return "under torch.compile/export tracing" if torch.compiler.is_compiling() else None


_BACKENDS: dict[str, Backend] = {
    "triton": Backend(
        "triton",
        devices=("cuda", "cpu"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        module="fastbert.kernels",
        ops=KERNEL_OPS,
        limits=_TRITON_LIMITS,
        device_check=_triton_device_check,
        auto_devices=("cuda",),  # CPU (interpreter) only when forced: tests, never a silent slow path
    ),
    "native": Backend(
        "native",
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        module="fastbert.native",
        ops=KERNEL_OPS,
        limits={op: functools.partial(_native_limits, op=op) for op in KERNEL_OPS},
    ),
    "cpu": Backend(
        "cpu",
        devices=("cpu",),
        dtypes=(torch.float32, torch.bfloat16),
        module="fastbert.cpu",
        ops=("linear", "attention"),
        limits={"linear": _cpu_linear_limits, "attention": _cpu_attention_limits},
    ),
    "torch": Backend("torch", devices=("cpu", "cuda", "mps", "meta"), dtypes=FLOATS, module="fastbert.reference"),
}
_AUTO_ORDER = ("triton", "native", "cpu", "torch")

_state = threading.local()
_decisions: dict[str, str] = {}


def register_backend(backend: Backend, before: str | None = "torch") -> None:
    """Add or replace a backend; it is tried before `before` in automatic mode."""
    global _AUTO_ORDER
    _BACKENDS[backend.name] = backend
    order = [n for n in _AUTO_ORDER if n != backend.name]
    order.insert(order.index(before) if before in order else len(order), backend.name)
    _AUTO_ORDER = tuple(order)


def backends() -> dict[str, Backend]:
    return dict(_BACKENDS)


def forced_backend() -> str | None:
    """The backend forced by `use_backend` or FASTBERT_BACKEND, if any ('auto' means none)."""
    name = getattr(_state, "forced", None) or os.environ.get("FASTBERT_BACKEND") or None
    if name in (None, "auto"):
        return None
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_BACKENDS)} or 'auto'")
    return name


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force a backend inside a block (`None`/'auto' restores automatic choice)."""
    previous = getattr(_state, "forced", None)
    if name not in (None, "auto") and name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_BACKENDS)} or 'auto'")
    _state.forced = name
    try:
        yield
    finally:
        _state.forced = previous


@contextlib.contextmanager
def exclude_backends(*names: str) -> Iterator[None]:
    """Leave these backends out of the automatic choice inside a block (to measure a path with and without one)."""
    unknown = set(names) - set(_BACKENDS)
    if unknown:
        raise ValueError(f"unknown backend(s) {sorted(unknown)}; expected names from {sorted(_BACKENDS)}")
    previous = getattr(_state, "excluded", frozenset())
    _state.excluded = previous | frozenset(names)
    try:
        yield
    finally:
        _state.excluded = previous


def _first_tensor(args: tuple) -> torch.Tensor:
    return next(a for a in args if isinstance(a, torch.Tensor))


def select(op: str, args: tuple, kwargs: dict) -> tuple[Callable, str]:
    """Pick the implementation for one call; returns (function, backend name)."""
    lead = _first_tensor(args)
    device, dtype = lead.device, (lead.dtype if lead.is_floating_point() else _first_float(args))
    forced, note = forced_backend(), ""
    if forced is not None and op not in _BACKENDS[forced].ops:  # forcing covers the ops a backend implements
        forced, note = None, f" (forced {forced} implements no {op}: automatic choice)"
    if forced is not None:
        backend = _BACKENDS[forced]
        reason = backend.refuses(op, device, dtype, args, kwargs, forced=True)
        if reason:
            raise BackendUnavailable(f"{op}: forced backend {forced!r} cannot run on {device.type}/{dtype}: {reason}")
        _record(op, f"{forced} (forced)")
        return getattr(backend.load()[0], op), forced
    why = []
    excluded = getattr(_state, "excluded", frozenset())
    for name in _AUTO_ORDER:
        backend = _BACKENDS[name]
        reason = "excluded" if name in excluded else backend.refuses(op, device, dtype, args, kwargs)
        if reason is None:
            _record(op, name + note + (f" (skipped {'; '.join(why)})" if why else ""))
            return getattr(backend.load()[0], op), name
        why.append(f"{name}: {reason}")
    raise BackendUnavailable(f"{op}: no backend takes {device.type}/{dtype}: {'; '.join(why)}")


def _first_float(args: tuple) -> torch.dtype:
    return next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), torch.float32)


def _record(op: str, decision: str) -> None:
    if _decisions.get(op) != decision:
        _decisions[op] = decision
        log.debug("%s -> %s", op, decision)


def decisions() -> dict[str, str]:
    """op -> the backend it last ran on and why the ones before it were skipped (explain()'s last part, as data)."""
    return dict(_decisions)


def explain() -> str:
    """What this machine can do (probed once), what each loaded backend runs, the backend each op last ran on, and
    why the ones before it were skipped."""
    lines = capabilities.report()
    for backend in _BACKENDS.values():
        describe = getattr(backend._loaded, "describe", None)
        if callable(describe) and (said := describe()):
            lines.append(f"{backend.name}: {said}")
    lines.append("")
    if not _decisions:
        return "\n".join(lines + ["no fused op has run yet"])
    return "\n".join(lines + [f"{op}: {decision}" for op, decision in sorted(_decisions.items())])


def _dispatch(op: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    fn, _ = select(op, args, kwargs)
    return fn(*args, **kwargs)


# One public function per op; the signatures are the references' (see fastbert/reference.py), without `upcast`.
def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None
) -> torch.Tensor:
    """act(x @ weight^T + bias). A backend that fuses the whole layer (the cpu backend's oneDNN) takes it in one
    call; on the torch backend the GEMM is F.linear and the bias + activation epilogue goes to the `bias_act` op."""
    fn, name = select("linear", (x, weight, bias, act), {})
    return (_torch_linear if name == "torch" else fn)(x, weight, bias, act)


def _torch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None
) -> torch.Tensor:
    """The torch backend's GEMM: F.linear with the bias + activation epilogue on the `bias_act` op. A bf16 GEMM on a
    CPU without bf16 dot products runs as an fp32 GEMM on the bf16 operands upcast, rounded once to bf16: the same
    arithmetic (fastbert.capabilities), at fp32 speed instead of emulated bf16's."""
    dtype = torch.get_autocast_dtype("cpu") if x.dtype == torch.float32 and _cpu_autocast(x) else x.dtype
    if dtype == torch.bfloat16 and capabilities.bf16_via_fp32(x.device):
        with reference.no_autocast(x.device):
            x32, w32, b32 = (t.to(dtype).float() if t is not None else None for t in (x, weight, bias))
            return reference.linear(x32, w32, b32, act).to(dtype)
    if act is not None and bias is not None:
        return bias_act(F.linear(x, weight), bias, act)
    return reference.linear(x, weight, bias, act)


def _cpu_autocast(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and torch.is_autocast_enabled("cpu")


def dense_residual_layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """LayerNorm(dropout(x @ weight^T + bias) + residual): a sub-layer's output projection and its epilogue.

    Where the cpu backend takes the GEMM (inference, one dtype throughout) bias and residual ride in its epilogue;
    otherwise the GEMM is `linear` and the epilogue the `bias_residual_layernorm` op (a GPU kernel)."""
    fn, name = select("linear", (x, weight, None, None), {})
    same_dtype = x.dtype == residual.dtype == weight.dtype and not torch.is_autocast_enabled(x.device.type)
    if name == "cpu" and same_dtype and not (training and dropout_p > 0):
        return importlib.import_module("fastbert.cpu").linear_residual_layernorm(
            x, weight, bias, residual, ln_weight, ln_bias, eps
        )
    gemm = _torch_linear if name == "torch" else fn
    return bias_residual_layernorm(gemm(x, weight), bias, residual, ln_weight, ln_bias, eps, dropout_p, training)


def embedding_layernorm(
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor,
    position_ids: torch.Tensor,
    word_weight: torch.Tensor,
    position_weight: torch.Tensor,
    type_weight: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm(word[ids] + position[pos] + type[tt]) then dropout, in one pass where a kernel exists."""
    return _dispatch(
        "embedding_layernorm",
        input_ids,
        token_type_ids,
        position_ids,
        word_weight,
        position_weight,
        type_weight,
        ln_weight,
        ln_bias,
        eps,
        dropout_p=dropout_p,
        training=training,
        inputs_embeds=inputs_embeds,
    )


def bias_act(x: torch.Tensor, bias: torch.Tensor, kind: str = reference.ACT_GELU) -> torch.Tensor:
    """act(x + bias) for act in gelu (erf), gelu_tanh, relu."""
    if bias.dtype != x.dtype:  # autocast: x is the GEMM's low-precision output; F.linear adds its bias in that dtype
        bias = bias.to(x.dtype)
    return _dispatch("bias_act", x, bias, kind)


def bias_residual_layernorm(
    x: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor,
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """LayerNorm(dropout(x + bias) + residual)."""
    if x.dtype != residual.dtype:  # autocast: the residual stream keeps the model's dtype, as fp32 LayerNorm does
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(dtype), residual.to(dtype)
    return _dispatch("bias_residual_layernorm", x, bias, residual, ln_weight, ln_bias, eps, dropout_p, training)


def attention(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Varlen bidirectional attention over packed QKV `[T, 3, nH, D]` -> `[T, nH, D]`."""
    return _dispatch("attention", qkv, cu_seqlens, max_seqlen, dropout_p, training, scale)


# Every op's parameters by name, so that limit checks read a call by name whatever mix of positions and keywords it used
_SIGNATURES = {op: inspect.signature(globals()[op]) for op in OPS}
