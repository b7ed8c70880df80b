"""The Triton kernels' limits, in plain Python (no Triton import): read by the kernels, the dispatch and the tests."""

import torch

MAX_FEATURE = 16384  # a row kernel keeps one feature row in registers
MAX_HEAD_DIM = 128  # attention keeps a [block, head dim] tile of Q, K and V
MAX_SEQLEN_DROPOUT = 46340  # attention dropout: row * max_seqlen + col must fit the int32 Philox offset
MAX_DIAGONALS = 128  # attention's tiles span at most this many diagonals (BLOCK_M + BLOCK_N: kernels/attention.py)
MAX_POSITION_COLUMNS = 2**31 // MAX_DIAGONALS  # position_scores' W: its gradient ranks column * 128 + diagonal in int32


def tf32_allowed() -> bool:
    """Whether torch allows TF32 in fp32 CUDA matmuls. Where torch has them (>= 2.9) the new switches decide:
    `torch.backends.cuda.matmul.fp32_precision` ("tf32" or "ieee"; "none" inherits the global
    `torch.backends.fp32_precision`), since torch raises RuntimeError on a read of the legacy ones once a caller set a
    new one. Otherwise the legacy switches: `allow_tf32`, or a float32 matmul precision other than "highest". Never
    raises; read at each call, so a change of the setting takes effect."""
    for owner in (torch.backends.cuda.matmul, torch.backends):
        try:
            precision = getattr(owner, "fp32_precision", None)
        except RuntimeError:
            precision = None
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return False


def fp32_dot_precision() -> str:
    """How a Triton kernel multiplies fp32 inputs, decided from torch's own switch (tf32_allowed()): "tf32" (tensor
    cores) where torch allows TF32, "ieee" (exact, no tensor cores) where it does not."""
    return "tf32" if tf32_allowed() else "ieee"
