"""The Triton kernels' limits, in plain Python (no Triton import): read by the kernels, the dispatch and the tests."""

import torch

MAX_FEATURE = 16384  # a row kernel keeps one feature row in registers
MAX_HEAD_DIM = 128  # attention keeps a [block, head dim] tile of Q, K and V
MAX_SEQLEN_DROPOUT = 46340  # attention dropout: row * max_seqlen + col must fit the int32 Philox offset


def fp32_dot_precision() -> str:
    """How a Triton kernel multiplies fp32 inputs, decided from torch's own switch: "tf32" (tensor cores) where torch
    allows TF32 (`torch.backends.cuda.matmul.allow_tf32`, or a float32 matmul precision other than "highest"),
    "ieee" (exact, no tensor cores) where it does not. Read at each launch, so a change of the setting takes effect."""
    allowed = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if allowed else "ieee"
