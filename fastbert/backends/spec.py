"""What a backend is, as data: the ops the dispatch knows (declared in fastbert.backends.contract), and the `Backend`
record each backend module exports as its SPEC (devices, dtypes, the ops it implements, per-op limits). A leaf:
backends import it, never the dispatcher."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from fastbert.backends import contract

KERNEL_OPS = tuple(op.name for op in contract.KERNELS)
# GEMMs with their epilogues: act(x @ W^T + b), and LayerNorm(dropout(x @ W^T + b) + residual)
COMPOUND_OPS = tuple(op.name for op in contract.COMPOUNDS)
OPS = KERNEL_OPS + COMPOUND_OPS
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# A per-op limit check: (the call's arguments by parameter name, forced by name?) -> why not, or None.
LimitCheck = Callable[[dict[str, Any], bool], "str | None"]


class BackendUnavailable(RuntimeError):
    """A forced backend cannot run this call (the message says why)."""


@dataclass
class Backend:
    """A backend as data: what it takes, where its functions are, and per-op limits (each returns a reason or None).

    `module` holds one function per op in `ops` (named as the op) unless `impls` names another; its optional
    `unavailable_reason()` says why it cannot run here (asked once), and its optional `describe()` feeds explain()."""

    name: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    module: ModuleType
    ops: tuple[str, ...] = OPS
    limits: dict[str, LimitCheck] = field(default_factory=dict)
    impls: dict[str, Callable[..., Any]] = field(default_factory=dict)
    device_check: Callable[[str], str | None] | None = None  # e.g. Triton on CPU only under TRITON_INTERPRET=1
    auto_devices: tuple[str, ...] | None = None  # devices automatic dispatch sends here (None: all of `devices`)
    opt_in: str | None = None  # set: automatic dispatch uses it only inside ops.opt_in(name); says who asks for it
    decides_per_call: str | None = None  # set: its choice can change from call to call (says why); never bound once
    forward_only: bool = False  # refuses inputs that require grad: under autograd, its choice is made per call
    _ready: tuple[bool, str | None] | None = field(default=None, repr=False)
    _static: dict[tuple, tuple[str | None, str | None]] = field(default_factory=dict, repr=False)

    @torch.compiler.assume_constant_result  # torch.compile runs it untraced: no guard on the answer's cache
    def unavailable(self) -> str | None:
        """Why this backend cannot run here at all (a missing extension, Triton, oneDNN), or None; asked once."""
        if self._ready is None:
            check = getattr(self.module, "unavailable_reason", None)
            try:
                reason = check() if callable(check) else None
            except Exception as exc:  # a stale .so, a missing driver: reasons, not crashes
                reason = f"{type(exc).__name__}: {exc}"
            self._ready = (reason is None, reason)
        return self._ready[1]

    def function(self, op: str) -> Callable[..., Any]:
        """The function that runs `op` on this backend."""
        return self.impls.get(op) or getattr(self.module, op)

    def inference_function(self, op: str) -> Callable[..., Any] | None:
        """The forward-only launcher of `op` (no autograd, no statistics for a backward), if the backend has one: the
        module's `INFERENCE` table."""
        return getattr(self.module, "INFERENCE", {}).get(op)

    def refuses(
        self, op: str, device: torch.device, dtype: torch.dtype, call: dict[str, Any], forced: bool = False
    ) -> str | None:
        """Why this backend cannot take the call (`call`: its arguments by name), or None if it can (`forced`: chosen
        by name, not automatically)."""
        key = (op, device.type, dtype, forced)
        if key not in self._static:  # what the call's op, device and dtype alone decide: the same every call
            self._static[key] = self._static_refusal(op, device.type, dtype, forced)
        before, after = self._static[key]
        if before is not None:
            return before
        if self.device_check is not None and (reason := self.device_check(device.type)):
            return reason  # asked every call: it reads the environment (Triton's interpreter switch)
        if after is not None:
            return after
        if (error := self.unavailable()) is not None:
            return f"unavailable ({error})"
        check = self.limits.get(op)
        return check(call, forced) if check is not None else None

    def settle(self, device_type: str) -> None:
        """Decide every (op, dtype, forced) static refusal on `device_type` now (ops.settle, before a trace)."""
        for op in OPS:
            for dtype in FLOATS:
                for forced in (False, True):
                    if (key := (op, device_type, dtype, forced)) not in self._static:
                        self._static[key] = self._static_refusal(op, device_type, dtype, forced)

    def _static_refusal(
        self, op: str, device_type: str, dtype: torch.dtype, forced: bool
    ) -> tuple[str | None, str | None]:
        """The checks before and after `device_check` that depend on the op, device type and dtype only."""
        if op not in self.ops:
            return f"does not implement {op}", None
        if device_type not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not {device_type}", None
        if not forced and self.auto_devices is not None and device_type not in self.auto_devices:
            return (f"used for {device_type} tensors only when chosen by name (use_backend / FASTBERT_BACKEND): "
                    f"automatic dispatch sends it {'/'.join(self.auto_devices)} tensors only"), None
        return None, (f"does not take {dtype}" if dtype not in self.dtypes else None)
