"""One stamp for "have these weights changed?", shared by every cache built from weights (the fused QKV weight,
oneDNN's prepacked weights, CUDA graphs): cheap, and safe for inference tensors, which have no version counter."""

from __future__ import annotations

import torch


def stamp(*tensors: torch.Tensor | None) -> tuple:
    """(version, address) per tensor: it changes with an in-place update (version) or new storage (address).
    Inference tensors (made under `torch.inference_mode()`) have no version counter and can only be updated in place
    inside inference mode; for them the address alone counts."""
    return tuple(None if t is None else (-1 if t.is_inference() else t._version, t.data_ptr()) for t in tensors)
