"""Bounds checking for Triton kernels run by the interpreter (TRITON_INTERPRET=1, the CPU test runs).

The interpreter reads and writes raw addresses, so an access past a tensor reads a neighbour's bytes or faults the
test process, as the same kernel would on a GPU. With `install()`, every masked-in address a launch loads or stores
must fall inside the storage of one of that launch's tensor arguments; one that does not raises, naming the kernel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

_launch = threading.local()  # .kernel: the running kernel's name; .ranges: [(first byte, end byte)] of its storages


def _storage_ranges(args: Iterable[Any]) -> list[tuple[int, int]]:
    ranges = []
    for arg in args:
        if isinstance(arg, tuple):
            ranges += _storage_ranges(arg)
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return ranges


def _check(access: str, addresses: np.ndarray, mask: np.ndarray | None, itemsize: int) -> None:
    """Raise when an address the mask lets through is outside every argument storage."""
    live = (addresses[mask.astype(bool)] if mask is not None else addresses.ravel()).astype(np.uint64)
    inside = np.zeros(live.shape, dtype=bool)
    for first, end in getattr(_launch, "ranges", ()):
        inside |= (live >= first) & (live + itemsize <= end)
    if not inside.all():
        outside = live[~inside]
        raise IndexError(
            f"{getattr(_launch, 'kernel', '?')}: {access} of {outside.size} element(s) outside every tensor argument "
            f"(first at {hex(int(outside[0]))})"
        )


def install() -> str | None:
    """Wrap the interpreter's launch, load and store once; None when installed, else why it could not be."""
    try:
        from triton.runtime import interpreter
    except ImportError as e:
        return f"triton not importable: {e}"
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    hooks = (executor, "_init_args_hst"), (builder, "create_masked_load"), (builder, "create_masked_store")
    missing = [name for owner, name in hooks if not callable(getattr(owner, name, None))]
    if missing or not hasattr(interpreter, "_get_np_dtype"):
        return f"this triton's interpreter has no {', '.join(missing) or '_get_np_dtype'}"
    if getattr(executor, "_fastbert_bounds", False):
        return None
    init_args, load, store = (getattr(owner, name) for owner, name in hooks)

    def checked_init_args(self: Any, args_dev: Any, kwargs: dict) -> Any:
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _launch.kernel = getattr(self.fn, "__name__", repr(self.fn))
        _launch.ranges = _storage_ranges([*args_hst, *kwargs_hst.values()])
        return args_hst, kwargs_hst

    def checked_load(self: Any, ptrs: Any, mask: Any, *rest: Any) -> Any:
        itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        _check("load", ptrs.data, mask.data, itemsize)
        return load(self, ptrs, mask, *rest)

    def checked_store(self: Any, ptrs: Any, value: Any, mask: Any, *rest: Any) -> Any:
        _check("store", ptrs.data, mask.data, value.data.dtype.itemsize)
        return store(self, ptrs, value, mask, *rest)

    wrappers: tuple[Callable, ...] = (checked_init_args, checked_load, checked_store)
    for (owner, name), wrapper in zip(hooks, wrappers, strict=True):
        setattr(owner, name, wrapper)
    executor._fastbert_bounds = True
    return None
