"""Triton kernels for fastbert's fused ops, installed as `fastbert.kernels`. They know nothing of models.

One file per op (forward and backward kernels, launcher, autograd Function); the functions here have exactly the
signatures of `fastbert.ops`' public functions. Importing this package tries to import Triton; without it the
package still imports and `unavailable_reason()` says why, so `import fastbert` never needs it. On CPU tensors the
kernels run under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

from . import limits  # plain Python: what the kernels take, readable without Triton

_IMPORT_ERROR: str | None = None
try:
    from .attention import attention
    from .bias_act import bias_act
    from .bias_residual_layernorm import bias_residual_layernorm
    from .embedding import embedding_layernorm
    from .linear_act import linear_act  # an extra: GEMM + bias + activation, not a dispatch op
except ImportError as exc:  # triton missing or too old: a reason to fall back, reported by unavailable_reason()
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = [
    "limits",
    "attention", "bias_act", "bias_residual_layernorm", "embedding_layernorm", "linear_act", "unavailable_reason",
]


def unavailable_reason() -> str | None:
    """Why the Triton backend cannot run here, or None."""
    return _IMPORT_ERROR
