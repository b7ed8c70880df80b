"""Task LoRA adapters in a checkpoint, merged into the weights of one task as the checkpoint loads.

jina-embeddings-v3's original files keep each adapted nn.Linear and nn.Embedding as a torch parametrization: the base
weight under `<module>.parametrizations.weight.original` and one low-rank pair per task under
`<module>.parametrizations.weight.0.lora_A` / `.lora_B`, the tasks named in config.json's `lora_adaptations`. For task
t, a linear's weight is W + (lora_alpha / lora_rank) B[t] A[t] (A [tasks, rank, in], B [tasks, out, rank]) and an
embedding's W + (lora_alpha / lora_rank) A[t] B[t] (A [tasks, V, rank], B [tasks, rank, E]). fastbert merges the
chosen task's update into the weights (`from_pretrained(path, lora_task=...)`), so every fast path (fused GEMMs, int8,
graphs, export) runs that task at the base model's cost; without a task the base weights run, as jina's
`encode(task=None)`. Another task is another load: the update is not applied per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

ORIGINAL = ".parametrizations.weight.original"
LORA_A, LORA_B = ".parametrizations.weight.0.lora_A", ".parametrizations.weight.0.lora_B"


def present(state: Mapping[str, Any]) -> bool:
    """Whether a checkpoint holds parametrized weights (jina's adapters)."""
    return any(key.endswith(ORIGINAL) for key in state)


def merged(state: Mapping[str, torch.Tensor], task: str | None, config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state with each parametrized weight under `<module>.weight`: its base weight plus, for `task`, that task's
    low-rank update (in fp32, cast back to the weight's dtype); the adapter tensors dropped. `config`: config.json's
    fields (`lora_adaptations`, `lora_rank`, `lora_alpha`). ValueError for a task the checkpoint does not have."""
    tasks: Sequence[str] = config.get("lora_adaptations") or ()
    if task is not None and not present(state):
        raise ValueError(f"lora_task={task!r}, but the checkpoint has no task adapters")
    if task is not None and task not in tasks:
        raise ValueError(f"lora_task={task!r} is not one of the checkpoint's tasks {list(tasks)} (lora_adaptations)")
    index = None if task is None else list(tasks).index(task)
    scale = float(config.get("lora_alpha", 1)) / float(config.get("lora_rank", 4))
    out = {}
    for key, value in state.items():
        if key.endswith((LORA_A, LORA_B)):
            continue
        if not key.endswith(ORIGINAL):
            out[key] = value
            continue
        module = key.removesuffix(ORIGINAL)
        if index is not None:
            value = value + scale * _update(value, state[module + LORA_A][index], state[module + LORA_B][index], module)
        out[module + ".weight"] = value
    return out


def _update(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, module: str) -> torch.Tensor:
    """One task's low-rank update of `weight`, shaped like it: B A for a linear, A B for an embedding."""
    a, b = a.float(), b.float()
    if b.shape[-1] == a.shape[0] and (b.shape[0], a.shape[-1]) == tuple(weight.shape):
        return (b @ a).to(weight.dtype)
    if a.shape[-1] == b.shape[0] and (a.shape[0], b.shape[-1]) == tuple(weight.shape):
        return (a @ b).to(weight.dtype)
    raise ValueError(f"{module}: adapter shapes {tuple(a.shape)} and {tuple(b.shape)} do not update a weight of "
                     f"shape {tuple(weight.shape)}")  # fmt: skip
