"""Rotary position embeddings as the attention kernels take them: per packed token, the (cos, sin) of its angle for
each rotated pair, [2, T, R/2] fp32, built once per forward and per base and read by every layer that shares it."""

from __future__ import annotations

import torch

GLOBAL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer types: every key, or a window


def inverse_frequencies(rotary_dim: int, base: float, device: torch.device | None = None) -> torch.Tensor:
    """[R/2] fp32: 1 / base^(2i / R), the default RoPE frequencies (transformers' compute_default_rope_parameters)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary dims must be a positive even number, got {rotary_dim}")
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))


def rotary_rows(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """[T] positions -> [2, T, R/2] fp32: cos and sin of position * frequency (times the rope type's scaling), the
    values transformers' rotary embedding gives each of a pair's two dims."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    return torch.stack((angles.cos() * scaling, angles.sin() * scaling))
