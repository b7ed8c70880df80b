"""The optimizer every fastbert run trains with: AdamW (no decay on biases and LayerNorm) and a linear warmup/decay
schedule that a wall-time budget can shorten mid-run."""

from __future__ import annotations

import torch
from torch import nn


def make_optimizer(
    model: nn.Module, lr: float, total_steps: int, warmup_steps: int = 0, weight_decay: float = 0.01
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no decay on biases and LayerNorm) with linear warmup then linear decay to 0."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 or "LayerNorm" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupLinear(total_steps, warmup_steps))


class WarmupLinear:
    """LR factor: linear warmup to 1, then linear decay to 0 at `total`. An object, not a closure, so a wall-time
    budget can shorten `total` mid-run and the scheduler's state_dict (which saves it) restores it on resume.
    `retarget` moves the end of a run that has started (a resume with another --max-steps): from a knot at that
    step the factor decays linearly from its value there to 0 at the new total, so the LR never jumps."""

    def __init__(self, total: int, warmup: int = 0) -> None:
        self.total, self.warmup = total, warmup
        self.knot: tuple[int, float] | None = None  # (step, factor there): the decay restarts from it

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / max(1, self.warmup)
        if self.knot is not None and step >= self.knot[0]:
            start, factor = self.knot
            return max(0.0, factor * (self.total - step) / max(1, self.total - start))
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))

    def retarget(self, step: int, total: int) -> None:
        """End the decay at `total` instead, continuing from the factor at `step` (during warmup: the warmup is
        kept and the decay after it ends at `total`)."""
        if step >= self.warmup:
            self.knot = (step, self(step))
        self.total = total
