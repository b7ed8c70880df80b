"""Triton kernels for fastbert's fused ops (fastbert.kernels). They know nothing of models.

One file per op (forward and backward kernels, launcher, autograd Function, and the custom ops torch.compile traces);
the functions here have exactly the signatures of `fastbert.ops`' public functions. `INFERENCE` maps each op to its
forward-only launcher (no autograd Function, no statistics for a backward, dropout ignored), for grad-free plans.
Importing this package tries to import Triton; without it the
package still imports and `unavailable_reason()` says why, so `import fastbert` never needs it. On CPU tensors the
kernels run under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

from . import limits, tuning  # plain Python: what the kernels take and their measured launch settings

_IMPORT_ERROR: str | None = None
try:
    from .attention import attention, attention_inference
    from .bias_act import bias_act, bias_act_inference
    from .bias_residual_layernorm import bias_residual_layernorm, bias_residual_layernorm_inference
    from .embedding import embedding_layernorm, embedding_layernorm_inference
    from .gated_act import gated_act, gated_act_inference

    INFERENCE = {
        "embedding_layernorm": embedding_layernorm_inference,
        "bias_act": bias_act_inference,
        "bias_residual_layernorm": bias_residual_layernorm_inference,
        "attention": attention_inference,
        "gated_act": gated_act_inference,
    }
except ImportError as exc:  # triton missing or too old: a reason to fall back, reported by unavailable_reason()
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    INFERENCE = {}

__all__ = [
    "INFERENCE", "limits",
    "attention", "attention_inference", "bias_act_inference", "bias_residual_layernorm_inference",
    "embedding_layernorm_inference", "bias_act", "bias_residual_layernorm", "embedding_layernorm", "gated_act",
    "gated_act_inference", "tuning", "unavailable_reason", "describe",
]


def unavailable_reason() -> str | None:
    """Why the Triton backend cannot run here, or None."""
    return _IMPORT_ERROR


def describe() -> str | None:
    """explain()'s line: the launch settings each kernel launch used (a measured table's entry or the rule)."""
    return tuning.describe()
