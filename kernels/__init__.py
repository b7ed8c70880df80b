"""Triton kernels for fastbert's fused ops, installed as `fastbert.kernels`. They know nothing of models."""

from __future__ import annotations


def unavailable_reason() -> str | None:
    """Why the Triton backend cannot run here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    return "no Triton kernels are built into this version yet"
