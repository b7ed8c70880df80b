"""The dispatch layer: one function per fused op, each sent to the first backend that takes the call.

What a backend supports is data (`fastbert.backends.spec.Backend`: devices, dtypes, the ops it implements, per-op
limits), each backend module exporting its own SPEC, so a fallback can say why it happened: `fastbert.explain()`
lists the last decision per op, and the `fastbert.ops` logger records each new one at DEBUG. The GEMMs with their
epilogues (`linear`: GEMM + bias + activation; `dense_residual_layernorm`: GEMM + bias + residual + LayerNorm) are
ops like the others, taken whole by a backend that fuses them (oneDNN) or composed from the `bias_act` and
`bias_residual_layernorm` ops by the torch backend.

`FASTBERT_BACKEND=triton|native|int8|gemm|onednn|torch` (or `use_backend(...)`, or `BertConfig.backend`) forces one
backend for the ops it implements (the others keep the automatic choice, and explain() says so); a forced backend that
cannot take a call raises `BackendUnavailable`, it never silently degrades. This thread's scope (the backend forced,
those excluded or opted in) lives in `fastbert.backends.scope`, which the backends may read; its public entries are
here, checked against the registry.
Importing this module never needs a GPU, Triton or the native extension: a backend that cannot run says why.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from fastbert import capabilities, reference
from fastbert.backends import contract, gemm, int8, native, onednn, scope, timing_store
from fastbert.backends import triton as triton_backend
from fastbert.backends.spec import COMPOUND_OPS, FLOATS, KERNEL_OPS, OPS, Backend, BackendUnavailable

__all__ = [
    "COMPOUND_OPS", "KERNEL_OPS", "OPS", "Backend", "BackendUnavailable", "backends", "decisions", "dispatch_scope",
    "exclude_backends", "explain", "forced_backend", "opt_in", "register_backend", "register_explainer",
    "select", "settle", "team_scope", "use_backend", "watching",
    "attention", "bias_act", "bias_residual_layernorm", "dense_residual_layernorm", "embedding_layernorm", "gated_act",
    "gated_linear", "linear",
]  # fmt: skip

log = logging.getLogger("fastbert.ops")


class _State(threading.local):
    """This thread's watchers (its backend scope is fastbert.backends.scope's). Every field has a class default, so it
    always exists: a torch.compile guard on it reads one value and never flips between 'absent' and None."""

    seen: list | None = None  # watching()'s list


_state = _State()
_decisions: dict[str, str] = {}  # op -> its last decision
_decisions_by_dtype: dict[tuple[str, str], str] = {}  # (op, dtype) -> the last decision at that dtype
_last_facts: dict[str, tuple] = {}  # op -> (dtype, backend, note, refusals) of its last decision
_explainers: list[Callable[[], str | None]] = []  # explain()'s lines from the layers above the dispatch


def register_backend(backend: Backend, before: str | None = "torch") -> None:
    """Add or replace a backend; it is tried before `before` in automatic mode."""
    global _AUTO_ORDER
    _BACKENDS[backend.name] = backend
    order = [n for n in _AUTO_ORDER if n != backend.name]
    order.insert(order.index(before) if before in order else len(order), backend.name)
    _AUTO_ORDER = tuple(order)


def backends() -> dict[str, Backend]:
    return dict(_BACKENDS)


def canonical(name: str | None) -> str | None:
    """A backend name the registry knows, None for automatic (None or 'auto'); ValueError if unknown."""
    if name in (None, "auto"):
        return None
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_BACKENDS)} or 'auto'")
    return name


def forced_backend() -> str | None:
    """The backend forced by `use_backend` or FASTBERT_BACKEND, if any ('auto' means none)."""
    return canonical(scope.current.forced or os.environ.get("FASTBERT_BACKEND") or None)


team_scope = native.team_scope


def use_backend(name: str | None) -> contextlib.AbstractContextManager:
    """Force a backend inside a block (`None`/'auto' restores automatic choice); ValueError for an unknown name."""
    return scope.forcing(canonical(name))


def exclude_backends(*names: str) -> contextlib.AbstractContextManager:
    """Leave these backends out of the automatic choice inside a block (to measure a path with and without one)."""
    return scope.excluding(*(canonical(n) for n in names))


def opt_in(*names: str) -> contextlib.AbstractContextManager:
    """Let automatic dispatch use these opt-in backends inside a block (a model quantized to int8 runs in one)."""
    return scope.opting_in(*(canonical(n) for n in names))


excluded_backends = scope.excluded_backends  # the backends this thread's `exclude_backends` blocks leave out now


def _first_tensor(args: tuple) -> torch.Tensor:
    return next(a for a in args if isinstance(a, torch.Tensor))


def select(op: str, args: tuple, kwargs: dict) -> tuple[Callable, str]:
    """Pick the implementation for one call; returns (function, backend name)."""
    lead = _first_tensor(args)
    device, dtype = lead.device, (lead.dtype if lead.is_floating_point() else _first_float(args))
    call = dict(zip(_PARAMS[op], args, strict=False), **kwargs)  # by parameter name; trailing defaults may be absent
    forced, note = forced_backend(), ""
    if forced is not None and op not in _BACKENDS[forced].ops:  # forcing covers the ops a backend implements
        forced, note = None, f" (forced {forced} implements no {op}: automatic choice)"
    if forced is not None:
        backend = _BACKENDS[forced]
        reason = backend.refuses(op, device, dtype, call, forced=True)
        if reason:
            raise BackendUnavailable(f"{op}: forced backend {forced!r} cannot run on {device.type}/{dtype}: {reason}")
        _record(op, dtype, forced, " (forced)")
        return backend.function(op), forced
    why: list[tuple[str, str]] = []  # (backend, why it refused), formatted only when the decision changes
    excluded, opted_in = scope.current.excluded, scope.current.opted_in
    for name in _AUTO_ORDER:
        backend = _BACKENDS[name]
        if op not in backend.ops:
            continue  # explain() names only the backends that could have taken the op
        if name in excluded:
            reason = "excluded"
        elif backend.opt_in and name not in opted_in:
            reason = backend.opt_in
        else:
            reason = backend.refuses(op, device, dtype, call)
        if reason is None:
            _record(op, dtype, name, note, tuple(why))
            return backend.function(op), name
        why.append((name, reason))
    raise BackendUnavailable(f"{op}: no backend takes {device.type}/{dtype}: {_reasons(why)}")


@torch.compiler.assume_constant_result  # torch.compile runs it untraced, before its trace's first dispatch
def settle(device_type: str) -> bool:
    """Fill every backend's per-(op, device, dtype) refusals for `device_type` now, so a torch.compile trace reads
    them settled: a cache filled inside a trace leaves a guard that fails on the next call (a recompile)."""
    for backend in _BACKENDS.values():
        backend.settle(device_type)
    return True


def dispatch_scope() -> tuple[str | None, frozenset, frozenset]:
    """This thread's dispatch state now: (forced backend, excluded backends, opted-in backends); a plan is bound to it
    (fastbert.execution), so FASTBERT_BACKEND and the scopes are read once per forward, not once per op."""
    return forced_backend(), scope.current.excluded, scope.current.opted_in


@contextlib.contextmanager
def watching() -> Iterator[list[tuple[str, str]]]:
    """Inside the block, every dispatch decision this thread makes, nested ones included (a composed op's parts, a
    first-use timing's rivals), is appended to the list it gives as (op, backend): what a plan binds from."""
    previous = getattr(_state, "seen", None)
    _state.seen = seen = []
    try:
        yield seen
    finally:
        _state.seen = previous


def _first_float(args: tuple) -> torch.dtype:
    return next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), torch.float32)


def _reasons(why: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> str:
    return "; ".join(f"{name}: {reason}" for name, reason in why)


def _record(op: str, dtype: torch.dtype, name: str, note: str, why: tuple[tuple[str, str], ...] = ()) -> None:
    """Note the backend `op` ran on; the words for explain() are built only when the decision changes (every call
    makes one, so this is on the dispatch's hot path). Not while torch.compile traces: its logger breaks the graph."""
    if torch.compiler.is_compiling():
        return
    seen = getattr(_state, "seen", None)
    if seen is not None:
        seen.append((op, name))
    facts = (dtype, name, note, why)
    if _last_facts.get(op) == facts:
        return
    _last_facts[op] = facts
    decision = name + note + (f" (skipped {_reasons(why)})" if why else "")
    _decisions_by_dtype[(op, str(dtype).removeprefix("torch."))] = decision
    if _decisions.get(op) != decision:
        _decisions[op] = decision
        log.debug("%s -> %s", op, decision)


def register_explainer(describe: Callable[[], str | None]) -> None:
    """Add a line to explain() from a layer above the dispatch (fastbert.execution): `describe()` gives it or None."""
    _explainers.append(describe)


def decisions() -> dict[str, str]:
    """op -> the backend it last ran on and why the ones before it were skipped (explain()'s last part, as data)."""
    return dict(_decisions)


def explain() -> str:
    """What this machine can do (probed once), what each loaded backend runs, the backend each op last ran on, and
    why the ones before it were skipped."""
    lines = capabilities.report()
    for backend in _BACKENDS.values():
        describe = getattr(backend.module, "describe", None)
        if callable(describe) and (said := describe()):
            lines.append(f"{backend.name}: {said}")
    lines += [said for describe in _explainers if (said := describe())]
    lines.append(timing_store.describe())
    lines.append("")
    if not _decisions:
        return "\n".join(lines + ["no fused op has run yet"])
    lines.append("each op, per dtype it ran in: the backend that ran it last (and why the ones before were skipped)")
    return "\n".join(lines + [f"{op}: {d} (in {dtype})" for (op, dtype), d in sorted(_decisions_by_dtype.items())])


def _dispatch(op: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    fn, _ = select(op, args, kwargs)
    return fn(*args, **kwargs)


def composed_linear(
    bias_act_op: Callable[..., torch.Tensor], via_fp32: bool | None = None
) -> Callable[..., torch.Tensor]:
    """The `linear` op as torch's GEMM (F.linear) followed by `bias_act_op` for the bias + activation epilogue: how
    the torch backend runs it, with the dispatched op here and with the bound one in a plan (fastbert.execution).

    A bf16 GEMM on a CPU without bf16 dot products runs as an fp32 GEMM on the bf16 operands upcast, rounded once to
    bf16: the same arithmetic (fastbert.capabilities), at fp32 speed instead of emulated bf16's. `via_fp32`: whether
    every call does (a plan knows from its mode), None to decide per call."""

    def linear(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None
    ) -> torch.Tensor:
        if via_fp32 or (via_fp32 is None and bf16_via_fp32(x)):
            with reference.no_autocast(x.device):
                x32, w32, b32 = (t.to(torch.bfloat16).float() if t is not None else None for t in (x, weight, bias))
                return reference.linear(x32, w32, b32, act).to(torch.bfloat16)
        if act is None:
            return F.linear(x, weight, bias)
        if bias is None:
            return reference.linear(x, weight, None, act)
        return bias_act_op(F.linear(x, weight), bias, act)

    return linear


def bf16_via_fp32(x: torch.Tensor) -> bool:
    """Whether a GEMM on `x` computes in bf16 on a CPU without bf16 dot products (then it runs as fp32)."""
    return x.device.type == "cpu" and reference.autocast_dtype(x) == torch.bfloat16 and capabilities.bf16_via_fp32(
        x.device)  # fmt: skip


def composed_dense_residual_layernorm(
    linear_op: Callable[..., torch.Tensor], bias_residual_layernorm_op: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """The `dense_residual_layernorm` op as `linear_op` (no bias), then `bias_residual_layernorm_op`: the torch
    backend's way, with the dispatched ops here and with the bound ones in a plan."""

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
        y = linear_op(x, weight)
        return bias_residual_layernorm_op(y, bias, residual, ln_weight, ln_bias, eps, dropout_p, training)

    return dense_residual_layernorm


def composed_gated_linear(
    linear_op: Callable[..., torch.Tensor], gated_act_op: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """The `gated_linear` op as `linear_op` (one GEMM for a stacked weight, two for a weight and an up_weight), then
    `gated_act_op` on the two halves: the torch backend's way, with the dispatched ops here and the bound ones in a
    plan."""

    def gated_linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        up_weight: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
        act: str = reference.ACT_GELU,
    ) -> torch.Tensor:
        if up_weight is None:
            gate, up = linear_op(x, weight, bias, None).chunk(2, dim=-1)
        else:
            gate, up = linear_op(x, weight, bias, None), linear_op(x, up_weight, up_bias, None)
        return gated_act_op(gate, up, act)

    return gated_linear


def _bias_act_casting(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`function` with bias_act's cast: under autocast x is the GEMM's low-precision output and F.linear adds its bias
    in that dtype, so does this."""

    def bias_act(x: torch.Tensor, bias: torch.Tensor, *rest: Any, **named: Any) -> torch.Tensor:
        return function(x, bias.to(x.dtype) if bias.dtype != x.dtype else bias, *rest, **named)

    return bias_act


def _bias_residual_layernorm_casting(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`function` with bias_residual_layernorm's casts: under autocast x is the GEMM's low-precision output while the
    residual stream keeps the model's dtype; both go to the wider one, as transformers' fp32 LayerNorm does."""

    def bias_residual_layernorm(
        x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, *rest: Any, **named: Any
    ) -> torch.Tensor:
        if x.dtype != residual.dtype:
            dtype = torch.promote_types(x.dtype, residual.dtype)
            x, residual = x.to(dtype), residual.to(dtype)
        return function(x, bias, residual, *rest, **named)

    return bias_residual_layernorm


# The casts an op's dispatching function makes before it dispatches (autocast mixes dtypes), for the ops that make
# any: each wraps an implementation of the op in them
CASTS: dict[str, Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]] = {
    "bias_act": _bias_act_casting,
    "bias_residual_layernorm": _bias_residual_layernorm_casting,
}


def casting(op: str, function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`function` (a backend's implementation of `op`) preceded by the casts `op`'s dispatching function makes: what a
    plan binds under autocast, so the bound op computes what the dispatched one does."""
    casts = CASTS.get(op)
    return function if casts is None else casts(function)


def _public(op: contract.Op) -> Callable[..., torch.Tensor]:
    """The op's public function, from its declaration: the dispatch, after the casts the op makes (CASTS), with the
    declared signature and words (help(), inspect)."""
    name = op.name
    if name in CASTS:
        function = CASTS[name](functools.partial(_dispatch, name))
    else:

        def function(*args: Any, **kwargs: Any) -> torch.Tensor:
            return _dispatch(name, *args, **kwargs)

    function.__name__ = function.__qualname__ = name
    function.__module__, function.__doc__, function.__signature__ = __name__, op.describe(), op.signature()
    return function


# One public function per op, each declared once in fastbert.backends.contract
embedding_layernorm = _public(contract.EMBEDDING_LAYERNORM)
bias_act = _public(contract.BIAS_ACT)
bias_residual_layernorm = _public(contract.BIAS_RESIDUAL_LAYERNORM)
attention = _public(contract.ATTENTION)
gated_act = _public(contract.GATED_ACT)
linear = _public(contract.LINEAR)
dense_residual_layernorm = _public(contract.DENSE_RESIDUAL_LAYERNORM)
gated_linear = _public(contract.GATED_LINEAR)
# every op's parameter names, so that limit checks read a call by name whatever mix of positions and keywords it used
# (a zip, not inspect's bind: select runs on every op of every layer)
_PARAMS = {name: op.names for name, op in contract.OPS.items()}

TORCH = Backend(
    "torch",
    devices=("cpu", "cuda", "mps", "meta"),
    dtypes=FLOATS,
    module=reference,
    impls={
        "linear": composed_linear(bias_act),
        "dense_residual_layernorm": composed_dense_residual_layernorm(linear, bias_residual_layernorm),
        "gated_linear": composed_gated_linear(linear, gated_act),
    },
)
_BACKENDS: dict[str, Backend] = {
    b.name: b for b in (triton_backend.SPEC, native.SPEC, int8.SPEC, gemm.SPEC, onednn.SPEC, TORCH)
}
_AUTO_ORDER = ("triton", "native", "int8", "gemm", "onednn", "torch")
onednn.fallback_bias_act = bias_act  # what oneDNN's first-use timing compares itself with


def _without(backend: str, op: str) -> Callable[..., torch.Tensor]:
    """The op as it would dispatch with `backend` left out: what a backend that chooses by first-use timing (int8,
    gemm) compares itself with."""

    def run(**call: Any) -> torch.Tensor:  # the call by name, its first argument (a tensor) first, as select builds it
        first, *rest = call
        with exclude_backends(backend):
            return _dispatch(op, call[first], **{name: call[name] for name in rest})

    return run


for _measured in (int8, gemm):
    _measured.fallback.update({op: _without(_measured.SPEC.name, op) for op in _measured.SPEC.ops})
onednn.fallback["dense_residual_layernorm"] = _without("onednn", "dense_residual_layernorm")
