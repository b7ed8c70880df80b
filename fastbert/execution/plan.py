"""Decide once, run many: per mode, each fused op bound to its backend's function and the forward bound to the
executors that take it, each with the reason, as data.

On a GPU a fused op's kernel takes 10-30 us while choosing it per call (fastbert.ops' dispatch) and calling it through
nn.Module cost more: an eager BERT-base forward ran ~5,000 Python calls. So the first forward in a mode (device,
dtype, autocast, grad, training, the forced / excluded / opted-in backends) runs module by module through the dispatch,
which records the backend each op took; the plan then binds every op that always took one backend to that backend's
function (its forward-only launcher when nothing needs a gradient; under autocast wrapped in the op's own casts, the
ones its dispatching function makes). An op stays dispatched per call where the choice can change from call to call:
a backend that times shapes at first use (`Backend.decides_per_call`), an op seen on two backends.

The executors, in the order a plan tries them, each saying whether it takes a mode as a backend says whether it takes
a call: CUDA-graph replay (fastbert.execution.graphs), the CPU layer stack (.stack), one loop over the layers' tensors
(.loop), and module by module (fastbert.modeling's forwards, which take everything). A forward runs on the first bound
executor that does not decline the call; a model that would compute something else fused (hooks, another forward, a
module swapped in: fastbert.execution.structure) runs module by module. explain() prints every plan and why.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fastbert import capabilities, ops
from fastbert.execution.mode import Mode, current_mode, words
from fastbert.execution.structure import PRE_NORM, Structure
from fastbert.kernels import tuning
from fastbert.padding import Packing

FusedOp = Callable[..., torch.Tensor]
_described: list[Plan] = []  # the newest plan of each of the last 8 models (a plan keeps no model alive)
_lock = threading.Lock()
_numbers = itertools.count(1)


class Inputs(NamedTuple):
    """A forward's inputs as the model checked them, unpacked: [B, S] ids, types and positions, or [B, S, E] embeds."""

    ids: torch.Tensor | None
    types: torch.Tensor
    positions: torch.Tensor
    embeds: torch.Tensor | None


class Call(NamedTuple):
    """One forward as an executor sees it."""

    model: nn.Module
    structure: Structure
    inputs: Inputs
    hidden: list[torch.Tensor] | None  # each layer's output wanted (output_hidden_states), filled by the executor


class Executor(Protocol):
    """How a forward runs: bound per plan when `takes` has no objection, then asked every call."""

    name: str

    def takes(self, plan: Plan, model: nn.Module, structure: Structure) -> str | None:
        """Why this executor cannot run any forward of the plan's mode and model, or None."""

    def declines(self, plan: Plan, call: Call) -> str | None:
        """Why it will not run this call (checked before the host sync), or None."""

    def run(self, plan: Plan, call: Call, packing: Packing) -> torch.Tensor | str:
        """The encoder's output [T, H] for the packed call, or why it declined after all (then the next runs it)."""

    def note(self, plan: Plan) -> str:
        """How the last forward it ran went, for explain()."""


class Plan:
    """One model's ops and executors in one mode, each with the reason for it."""

    def __init__(
        self, mode: Mode, seen: Sequence[tuple[str, str]], model_name: str, executors: Sequence[Executor],
        model: nn.Module, structure: Structure,
    ) -> None:  # fmt: skip
        self.mode, self.model_name = mode, model_name
        self.functions: dict[str, FusedOp] = {}
        self.backends: dict[str, str | None] = {}  # op -> the backend it is bound to, None where dispatched per call
        self.how: dict[str, str] = {}  # op -> "bound to <backend> (<launcher>)" or "dispatched per call: <why>"
        ran: dict[str, set[str]] = {}
        for op, name in seen:
            ran.setdefault(op, set()).add(name)
        for op in ops.OPS:
            self.functions[op], self.how[op], self.backends[op] = self._bind(op, ran.get(op, set()))
        self.ran = {op: frozenset(names) for op, names in ran.items()}  # op -> the backends its first forward took
        # the Triton kernels' launch settings: the device's measured table where it has one (read here, at bind time)
        self.launches = tuning.note(mode.device) if "triton" in self.backends.values() else None
        self.executors: list[Executor] = []
        self.skipped: list[tuple[str, str]] = []  # (executor, why it does not take this mode)
        for executor in executors:
            why = executor.takes(self, model, structure)
            if why is None:
                self.executors.append(executor)
            else:
                self.skipped.append((executor.name, why))
        self.note = "bound after its first forward, which ran module by module"  # how the last forward ran, and why
        self.provisional = False  # bound from a forward whose ops did not all go through the dispatch
        self.details: Callable[[], str | None] = lambda: None  # an executor's own line for explain() (graphs)
        self.row_buckets: tuple[bool, str] | None = None  # whether the loop rounds token counts up, and why (.rows)

    def _bind(self, op: str, names: set[str]) -> tuple[FusedOp, str, str | None]:
        dispatched = getattr(ops, op)
        if len(names) != 1:
            why = "not run yet" if not names else f"ran on {' and '.join(sorted(names))}"
            return dispatched, f"dispatched per call: {why}", None
        (name,) = names
        backend = ops.backends()[name]
        if backend.decides_per_call:
            return dispatched, f"dispatched per call: {name} {backend.decides_per_call}", None
        if self.mode.grad and backend.forward_only:
            why = f"{name} is forward only (whether inputs require grad can change)"
            return dispatched, f"dispatched per call: {why}", None
        if name == "torch" and op in ops.COMPOUND_OPS:
            function, how = self._compose(op)
            return function, how, name
        inference = not (self.mode.grad or self.mode.training)
        launcher = backend.inference_function(op) if inference else None
        function, how = (launcher, f"bound to {name} (forward-only launcher)") if launcher else (
            backend.function(op), f"bound to {name}")  # fmt: skip
        if self.mode.autocast is not None and op in ops.CASTS:
            function, how = ops.casting(op, function), how + " with the op's autocast casts"
        return function, how, name

    def _compose(self, op: str) -> tuple[FusedOp, str]:
        """torch's GEMM with the bound epilogue op: what ops' torch backend composes per call."""
        mode = self.mode
        via_fp32 = torch.bfloat16 in (mode.dtype, mode.autocast) and capabilities.bf16_via_fp32(mode.device)
        if op == "linear":
            how = f"bound to torch: F.linear + bias_act ({self.how['bias_act']})"
            return ops.composed_linear(self.functions["bias_act"], via_fp32), how + (
                ", bf16 GEMMs as fp32 on this CPU" if via_fp32 else "")  # fmt: skip
        if op == "gated_linear":
            return ops.composed_gated_linear(self.functions["linear"], self.functions["gated_act"]), (
                f"bound to torch: linear ({self.how['linear']}) + gated_act ({self.how['gated_act']})"
            )
        gemm = self.functions["linear"] if via_fp32 else F.linear  # without bias or activation: F.linear's own
        return ops.composed_dense_residual_layernorm(gemm, self.functions["bias_residual_layernorm"]), (
            f"bound to torch: linear + bias_residual_layernorm ({self.how['bias_residual_layernorm']})"
        )

    def describe(self) -> str:
        lines = [f"plan of {self.model_name} on {words(self.mode)}: {self.note}"]
        order = ", ".join(e.name for e in self.executors) + ", modules"
        skipped = "; ".join(f"{name}: {why}" for name, why in self.skipped)
        lines.append(f"  executors, in order: {order}" + (f" (not bound: {skipped})" if skipped else ""))
        if (details := self.details()) is not None:
            lines.append(f"  {details}")
        if self.launches is not None:
            lines.append(f"  {self.launches}")
        if self.row_buckets is not None:
            lines.append(f"  token rows {'bucketed' if self.row_buckets[0] else 'not bucketed'}: {self.row_buckets[1]}")
        return "\n".join(lines + [f"  {op} -> {self.how[op]}" for op in ops.OPS])


def _module_note(why: str) -> str:
    """How a forward that must run module by module ran, and why."""
    if why == PRE_NORM:
        return f"module by module, because {why}"
    return f"module by module, because {why} (what is hooked or wrapped runs its own forward)"


def _modules(call: Call, packing: Packing, attentions: list | None) -> torch.Tensor:
    """The encoder module by module (fastbert.modeling's forwards): what takes every forward."""
    model, i = call.model, call.inputs
    pack, embeddings = packing.pack, model.embeddings
    if getattr(embeddings, "fused", lambda: True)():
        x = embeddings(*(pack(t) if t is not None else None for t in (i.ids, i.types, i.positions, i.embeds)))
    else:  # a hooked or wrapped table sees what it sees in transformers: [B, S] ids, [B, S, E] out
        x = pack(embeddings(i.ids, i.types, i.positions, i.embeds))
    x, hidden, probs = model.encoder(x, packing, call.hidden is not None, attentions is not None)
    if call.hidden is not None:
        call.hidden.extend(hidden)
    if attentions is not None:
        attentions.extend(probs)
    return x


Run = Callable[[Inputs, Packing], tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]


class Plans:
    """A model's plans, one per mode, and its structure; `prepare` is what every forward asks (before its host sync).
    A copy or a pickle of the model starts with none (they hold functions and caches of this model's tensors)."""

    def __init__(self, kind: str, forwards: Any, executors: Sequence[Executor]) -> None:
        self.kind, self.model_name = kind, f"{kind} #{next(_numbers)}"
        self.forwards, self.executors = forwards, tuple(executors)
        self.plans: dict[Mode, Plan] = {}
        self.structure: Structure | None = None

    def __deepcopy__(self, memo: dict) -> Plans:
        return Plans(self.kind, self.forwards, self.executors)

    def __reduce__(self) -> tuple:
        return Plans, (self.kind, self.forwards, self.executors)

    def lookup(self, mode: Mode) -> Plan | None:
        """The plan for this mode, None before a forward in it bound one."""
        return self.plans.get(mode)

    def clear(self) -> None:
        """Forget every plan and the structure (the next forward finds and binds again)."""
        self.plans.clear()
        self.structure = None

    def current_structure(self, model: nn.Module) -> Structure:
        """The model's structure, found again (and the plans bound again: what an executor takes may differ) when a
        module the executors read was replaced."""
        s = self.structure
        if s is None or s.stale(model):
            self.plans.clear()
            s = self.structure = Structure(model, self.forwards)
        return s

    def bind(self, mode: Mode, seen: Sequence[tuple[str, str]], model: nn.Module, structure: Structure) -> Plan:
        """Bind a plan from what one module-by-module forward in this mode dispatched (`seen`: (op, backend))."""
        plan = Plan(mode, seen, self.model_name, self.executors, model, structure)
        with _lock:
            self.plans[mode] = plan
            _described[:] = [p for p in _described if p.model_name != self.model_name][-7:] + [plan]
        return plan

    def prepare(
        self, model: nn.Module, device: torch.device, embeds: torch.Tensor | None, hidden: bool, attentions: bool
    ) -> Run:
        """How this forward will run, decided before the host sync (mode, plan, structure checks, executor), as a
        function of the packed call: (packed inputs, packing) -> (output [T, H], hidden states, attentions)."""
        if torch.compiler.is_compiling():  # traced module by module: each op decides once, at trace time
            ops.settle(device.type)
            return self._module_run(model, None, hidden, attentions)
        structure = self.current_structure(model)
        grad = torch.is_grad_enabled() and (
            (embeds is not None and embeds.requires_grad) or structure.requires_grad()
        )
        mode = current_mode(model, device, structure.dtype, grad)
        plan = self.plans.get(mode)
        why = "output_attentions materialises each layer's probabilities" if attentions else structure.refusal(
            mode.training)  # fmt: skip
        if plan is None or (plan.provisional and why is None):
            return self._binding_run(model, structure, mode, hidden, attentions, why)
        if why is not None:
            plan.note = _module_note(why)
            return self._module_run(model, structure, hidden, attentions)
        states: list[torch.Tensor] | None = [] if hidden else None
        call = Call(model, structure, Inputs(None, None, None, embeds), states)  # inputs: filled in after the sync
        executors, declined = [], []
        for executor in plan.executors:
            if (reason := executor.declines(plan, call)) is None:
                executors.append(executor)
            else:
                declined.append(f"{executor.name}: {reason}")

        def run(inputs: Inputs, packing: Packing) -> tuple[torch.Tensor, list, list]:
            now = call._replace(inputs=inputs)
            for executor in executors:
                out = executor.run(plan, now, packing)
                if not isinstance(out, str):
                    plan.note = executor.note(plan) + (f" ({'; '.join(declined)})" if declined else "")
                    return out, states or [], []
                declined.append(f"{executor.name}: {out}")
            plan.note = "module by module" + (f" ({'; '.join(declined)})" if declined else "")
            return _modules(now, packing, None), states or [], []

        return run

    def _binding_run(
        self, model: nn.Module, structure: Structure, mode: Mode, hidden: bool, attentions: bool, why: str | None
    ) -> Run:
        """The first forward in a mode: module by module, watching what each op runs on, then bind. A forward that
        must run module by module (`why`) binds a provisional plan: some of its ops ran outside the dispatch (a hooked
        leaf, attention with probabilities), so the first forward without a reason binds it again."""

        def run(inputs: Inputs, packing: Packing) -> tuple[torch.Tensor, list, list]:
            states, probs = ([] if hidden else None), ([] if attentions else None)
            with ops.watching() as seen:
                x = _modules(Call(model, structure, inputs, states), packing, probs)
            plan = self.bind(mode, seen, model, structure)
            if why is not None:
                plan.provisional = True
                plan.note = _module_note(why)
            return x, states or [], probs or []

        return run

    def _module_run(self, model: nn.Module, structure: Structure | None, hidden: bool, attentions: bool) -> Run:
        def run(inputs: Inputs, packing: Packing) -> tuple[torch.Tensor, list, list]:
            states, probs = ([] if hidden else None), ([] if attentions else None)
            return _modules(Call(model, structure, inputs, states), packing, probs), states or [], probs or []

        return run


def describe() -> str | None:
    """explain()'s lines: each model's newest plan, op by op."""
    return "\n".join(p.describe() for p in _described) if _described else None


ops.register_explainer(describe)
