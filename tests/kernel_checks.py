"""Helpers for the kernel tests: devices, NaN-poisoned allocation, fp64-referenced error bounds, a GEMM layer's
reference.

Bounds (DESIGN.md): fp32 within 1e-5 of the fp64 reference, relative to max(1, max|ref|); fp16 / bf16 error at most
2x the error of plain torch at that precision (the reference run in that dtype) plus a floor of the dtype's machine
epsilon times max|ref| (one rounding of the largest value).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from fastbert import kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LOW = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, *LOW)
FP32_RTOL = 1e-5

requires_triton = pytest.mark.skipif(kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason()))
gpu = pytest.mark.gpu


@contextlib.contextmanager
def nan_poisoned_empty() -> Iterator[None]:
    """Every float torch.empty / empty_like inside the block comes back NaN-filled, so unwritten outputs show."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with (
        mock.patch.object(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k))),
        mock.patch.object(torch, "empty_like", lambda *a, **k: poison(real_like(*a, **k))),
    ):
        yield


def _record(name: str, dtype: torch.dtype, err: float, bound: float) -> None:
    """Append the observed error to $FASTBERT_KERNEL_ERRLOG (JSON lines) when set: the report's error table."""
    path = os.environ.get("FASTBERT_KERNEL_ERRLOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"check": name, "dtype": str(dtype), "err": err, "bound": bound}) + "\n")


def assert_close(name: str, out: torch.Tensor, ref64: torch.Tensor, torch_lowp: torch.Tensor | None = None) -> None:
    """`out` (kernel, any dtype) vs `ref64` (fp64 reference); low precision also vs plain torch's own error."""
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values (an unwritten NaN-poisoned element?)"
    if out.numel() == 0:
        return
    scale = ref64.abs().max().item()
    err = (out.double() - ref64).abs().max().item()
    if out.dtype == torch.float32:
        bound = FP32_RTOL * max(1.0, scale)
    else:
        assert torch_lowp is not None, f"{name}: low precision needs plain torch's result at that dtype"
        torch_err = (torch_lowp.double() - ref64).abs().max().item()
        bound = 2 * torch_err + torch.finfo(out.dtype).eps * scale
    _record(name, out.dtype, err, bound)
    assert err <= bound, f"{name} [{out.dtype}]: max error {err:.3g} > bound {bound:.3g} (max|ref| {scale:.3g})"


def _is_float(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _run(fn: Callable[..., torch.Tensor], args: Sequence, leaves: Sequence[torch.Tensor], gout: torch.Tensor | None):
    """(fn(*args), grads of `leaves` for the cotangent gout (random normal when None), the cotangent)."""
    out = fn(*args)
    gout = torch.randn(out.shape, dtype=torch.float64, device=out.device) if gout is None else gout
    return out, torch.autograd.grad(out, leaves, gout.to(out.dtype)), gout


def row_strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view whose rows are 3 elements further apart than its width (non-contiguous)."""
    return torch.nn.functional.pad(t, (0, 3))[..., : t.shape[-1]] if t.dim() > 1 else t


def check_op(
    name: str,
    kernel: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    inputs: Sequence[object],
    dtype: torch.dtype,
    view: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Forward and every float input's grad of `kernel` (into NaN-poisoned buffers) vs `reference` in fp64 on the
    same (dtype-rounded) values, and for fp16/bf16 vs plain torch's own error in `dtype`. `inputs`: float tensors
    (converted, grads taken) or anything else passed through; `view` lays out the kernel's float inputs."""
    rounded = [t.detach().to(dtype) if _is_float(t) else t for t in inputs]
    ref_in = [t.double().requires_grad_() if _is_float(t) else t for t in rounded]
    ours = [t.clone().requires_grad_() if _is_float(t) else t for t in rounded]
    ours_args = [view(t) if view is not None and _is_float(t) else t for t in ours]
    ref, ref_grads, gout = _run(reference, ref_in, [t for t in ref_in if _is_float(t)], None)
    with nan_poisoned_empty():
        out, out_grads, _ = _run(kernel, ours_args, [t for t in ours if _is_float(t)], gout)
    low, low_grads = None, [None] * len(ref_grads)
    if dtype != torch.float32:
        low_in = [t.clone().requires_grad_() if _is_float(t) else t for t in rounded]
        low, low_grads, _ = _run(reference, low_in, [t for t in low_in if _is_float(t)], gout)
    assert out.dtype == dtype, f"{name}: output dtype {out.dtype}, expected {dtype}"
    assert_close(f"{name}/fwd", out, ref, low)
    for i, (g, r, lg) in enumerate(zip(out_grads, ref_grads, low_grads, strict=True)):
        assert g.dtype == dtype, f"{name}: grad {i} dtype {g.dtype}, expected {dtype}"
        assert g.device == out.device, f"{name}: grad {i} on {g.device}, its input on {out.device}"
        assert_close(f"{name}/grad{i}", g, r, lg)


def check_inference(
    name: str,
    launcher: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    inputs: Sequence[object],
    dtype: torch.dtype,
    view: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """A forward-only launcher (kernels.INFERENCE) vs `reference` in fp64, as check_op's forward: its output is the
    one tensor it allocates (no statistics for a backward; NaN-poisoned, so every element must be written), and it
    records no autograd graph though its float inputs require grad."""
    rounded = [t.detach().to(dtype) if _is_float(t) else t for t in inputs]
    ref = reference(*[t.double() if _is_float(t) else t for t in rounded])
    args = [(view(t) if view is not None else t).requires_grad_() if _is_float(t) else t for t in rounded]
    allocated: list[tuple[tuple[int, ...], torch.dtype]] = []
    real_empty = torch.empty

    def counted(*a, **k) -> torch.Tensor:
        t = real_empty(*a, **k)
        allocated.append((tuple(t.shape), t.dtype))
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with mock.patch.object(torch, "empty", counted):
        out = launcher(*args)
    low = reference(*rounded) if dtype != torch.float32 else None
    assert out.grad_fn is None, f"{name}: the inference launcher recorded an autograd graph ({out.grad_fn})"
    assert allocated == [(tuple(out.reshape(-1, out.shape[-1]).shape), dtype)] or allocated == [
        (tuple(out.shape), dtype)
    ], f"{name}: allocated {allocated}, expected only the output"
    assert out.dtype == dtype, f"{name}: output dtype {out.dtype}, expected {dtype}"
    assert_close(f"{name}/inference", out, ref, low)


def gemm_layer(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str | None = None,
               ln: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """A GEMM with its epilogue as the CPU GEMM kernels fuse it: bias, then the activation (gelu, gelu_tanh, relu,
    silu) or residual + LayerNorm (`ln` = (residual, weight, bias, eps)), in x's dtype (fp64 for the reference, the
    kernel's dtype for plain torch's own error)."""
    out = F.linear(x, w.to(x.dtype), b.to(x.dtype) if b is not None else None)
    if ln is not None:
        residual, lw, lb, eps = ln
        return F.layer_norm(out + residual.to(x.dtype), out.shape[-1:], lw.to(x.dtype), lb.to(x.dtype), eps)
    if act in ("gelu", "gelu_tanh"):
        return F.gelu(out, approximate="tanh" if act == "gelu_tanh" else "none")
    return {"relu": F.relu, "silu": F.silu}.get(act, lambda v: v)(out)
