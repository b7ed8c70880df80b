"""What a plan is bound to: a forward in another mode gets (or binds) another plan."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from fastbert import kernels, ops


class Mode(NamedTuple):
    """Everything a plan's choices depend on besides the model: where, in what precision, for what, and how the
    thread's dispatch is scoped. Read once per forward."""

    device: torch.device
    dtype: torch.dtype
    autocast: torch.dtype | None  # the autocast dtype on that device, None when off
    grad: bool  # autograd records this forward (grad enabled and some weight or input requires grad)
    training: bool
    forced: str | None
    excluded: frozenset
    opted_in: frozenset
    tf32: bool  # fp32 on CUDA: whether torch allows TF32 (which fp32 attention kernel is exact enough follows it)


def current_mode(model: nn.Module, device: torch.device, dtype: torch.dtype, grad: bool) -> Mode:
    """The mode of a forward now (environment variables and the thread's dispatch scopes are read here, once)."""
    try:
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    except RuntimeError:  # a device type autocast does not know (meta): no autocast there
        autocast = None
    tf32 = dtype == torch.float32 and device.type == "cuda" and kernels.limits.tf32_allowed()
    return Mode(device, dtype, autocast, grad, model.training, *ops.dispatch_scope(), tf32)


def words(mode: Mode) -> str:
    """A mode as explain() prints it: "cpu/float32 (eval, no grad)"."""
    where = f"{mode.device.type}/{str(mode.dtype).removeprefix('torch.')}"
    flags = [f"autocast {str(mode.autocast).removeprefix('torch.')}" if mode.autocast else "",
             "training" if mode.training else "eval", "with grad" if mode.grad else "no grad",
             f"forced {mode.forced}" if mode.forced else "",
             f"without {', '.join(sorted(mode.excluded))}" if mode.excluded else ""]  # fmt: skip
    return f"{where} ({', '.join(f for f in flags if f)})"
