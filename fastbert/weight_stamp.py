"""The one rule for "have these weights changed?".

A cache built from weights (the fused QKV weight, oneDNN's prepacked weights, the gemm backend's packed panels, the
int8 backend's quantized copies) is stale when a weight was updated in place (its version) or given new memory (its
address): `stamp`. A CUDA graph reads the weights where they lie, so it sees in-place updates by itself and is stale
only when a weight's memory moved: `addresses`. Both are safe for inference tensors, which have no version counter.
Updates that bypass the version counter (`param.data.mul_(...)`, a NumPy view, a `load_state_dict` into inference
tensors) are not seen by a stamp: `forget` drops what was built from given weights (BertModel.weights_changed, and
every `load_state_dict`, call it)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

_caches: weakref.WeakSet[WeightCache] = weakref.WeakSet()


def forget(weights: Iterable[torch.Tensor]) -> None:
    """Drop every cached value built from these weights, in every WeightCache: the next use builds it again."""
    ids = {id(w) for w in weights}
    for cache in list(_caches):
        cache.forget(ids)


def stamp(*tensors: torch.Tensor | None) -> tuple:
    """(version, address) per tensor: it changes with an in-place update (version) or new storage (address).
    Inference tensors (made under `torch.inference_mode()`) have no version counter and can only be updated in place
    inside inference mode; for them the address alone counts."""
    # a list comprehension, not a generator: this runs per layer per forward, and each generator step is a frame
    return tuple([None if t is None else (-1 if t.is_inference() else t._version, t.data_ptr()) for t in tensors])


def addresses(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """Each tensor's data address: one C-level scan (no Python frame per tensor), for a model's whole weight list."""
    return tuple(map(torch.Tensor.data_ptr, tensors))


class WeightCache:
    """Values built from a weight (a prepacked layout, a quantised copy), built once and rebuilt when the weight or
    any tensor built with it changes; an entry is dropped when its weight is freed, or forgotten (`forget`)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[weakref.ref, tuple, Any]] = {}
        _caches.add(self)

    def forget(self, weights: set[int]) -> None:
        """Drop the entries built from the weights whose ids are in `weights`."""
        for key in [k for k in self._entries if k[0] in weights]:
            del self._entries[key]

    def get(self, weight: torch.Tensor, variant: tuple, inputs: tuple, build: Callable[[], Any]) -> Any:
        """The value for (`weight`, `variant`), from `build()` when missing or when `weight`/`inputs` changed."""
        key = (id(weight), *variant)
        now = stamp(weight, *inputs)
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not weight or entry[1] != now:
            with torch.inference_mode(False), torch.no_grad():  # normal tensors: a later forward may need grad
                value = build()
            if entry is None:
                weakref.finalize(weight, self._entries.pop, key, None)
            self._entries[key] = entry = (weakref.ref(weight), now, value)
        return entry[2]

    def __len__(self) -> int:
        return len(self._entries)
