"""This thread's backend scope: the backend forced by name, the backends left out, and the opt-in ones let in.

A leaf (it imports nothing of fastbert), so that the dispatcher (`fastbert.ops`) and what runs under it (the timing
store keys its verdicts by the backends left out) read one state and no backend imports the dispatcher. It stores
names as given: the public entries, `fastbert.ops.use_backend`, `exclude_backends` and `opt_in`, check them against
the backend registry first; FASTBERT_BACKEND is read there too (`fastbert.ops.forced_backend`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class Scope(threading.local):
    """This thread's scope. Every field has a class default, so it always exists: a torch.compile guard on it reads
    one value and never flips between 'absent' and None when an eager forward sets and restores it."""

    forced: str | None = None
    excluded: frozenset[str] = frozenset()
    opted_in: frozenset[str] = frozenset()


current = Scope()


def forced() -> str | None:
    """The backend a `forcing` block names, or None (FASTBERT_BACKEND is the dispatcher's to read)."""
    return current.forced


def excluded_backends() -> frozenset[str]:
    """The backends this thread's `excluding` blocks leave out now."""
    return current.excluded


def opted_in_backends() -> frozenset[str]:
    """The opt-in backends this thread's `opting_in` blocks let automatic dispatch use now."""
    return current.opted_in


@contextlib.contextmanager
def forcing(name: str | None) -> Iterator[None]:
    """Force the backend `name` inside a block (None: automatic choice)."""
    previous = current.forced
    current.forced = name
    try:
        yield
    finally:
        current.forced = previous


@contextlib.contextmanager
def _extended(field: str, names: tuple[str, ...]) -> Iterator[None]:
    previous = getattr(current, field)
    setattr(current, field, previous | frozenset(names))
    try:
        yield
    finally:
        setattr(current, field, previous)


def excluding(*names: str) -> contextlib.AbstractContextManager:
    """Leave these backends out of the automatic choice inside a block."""
    return _extended("excluded", names)


def opting_in(*names: str) -> contextlib.AbstractContextManager:
    """Let automatic dispatch use these opt-in backends inside a block."""
    return _extended("opted_in", names)
