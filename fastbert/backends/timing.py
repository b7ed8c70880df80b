"""Timing a fast path against the path it would replace, on the call's own input, for the backends that choose by
measurement (oneDNN's GEMMs, fastbert's fp32 and int8 GEMMs).

Verdicts survive a busy machine. A neighbour's load only adds time, to whichever path it hits: each check takes
interleaved samples of both paths and keeps each one's best. A check whose samples were disturbed (a path's median
well above its best) gives a provisional verdict: the path that runs without the fast one (fp32, the next path) keeps
the calls, and the shape is checked again later, spaced out in time, until a quiet check settles it on the best times
seen over every check (or, still disturbed after `CHECKS` checks, on the path without it). A settled verdict never
changes again: every later call of its shape runs the same path.

Only what was timed on a quiet machine is kept for later processes (fastbert.backends.timing_store): a load that slows
both paths alike leaves no trace in the samples, so the CPU time other processes used during the check (the machine's,
from /proc/stat, less this process's own) must be small too, over a window long enough to tell: a short check waits
for the checks after it (or the process's exit) to make one. A verdict
read back from the store is confirmed by a short probe of both paths at first use; one the probe contradicts is timed
again as at first use, so a store written under load never makes a quiet process slower than no store.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from fastbert.backends import timing_store

# calibration size classes: a few rows (M <= FEW_M: a GEMM waits on its weight; fastbert's fp32 GEMMs take vector FMA
# there, fastbert.backends.gemm.FMA_ROWS), latency-sized (M < SMALL_M) and throughput-sized inputs
FEW_M = 32  # a row bucket's bound (fastbert.execution.rows): a bucketed batch stays in its real rows' class
SMALL_M = 128
REPEATS = 9  # interleaved samples of each path per check
NOISY = 1.5  # a path whose median sample is this far above its best was disturbed while timed (quiet: 1.0-1.1x)
NOISE_FLOOR_S = 50e-6  # ...by at least this much per call: below it a wrong pick costs too little to check again
CHECKS = 4  # a verdict settles after at most this many checks
RECHECK_CALLS = 8  # a provisional verdict is checked again after this many calls of its shape...
RECHECK_AFTER_S = 3.0  # ...and this long after its last check (3x longer after each), so a start-up burst has passed

BUSY_SHARE = 0.25  # other processes' share of every CPU during a check above which its verdict is not kept
MIN_WINDOW_S = 0.25  # a shorter window cannot tell (the kernel counts CPU time in 10 ms ticks): its verdicts wait
PROBE_REPEATS = 2  # interleaved samples of each path confirming a verdict read from the store
CONTRADICTED = 1.25  # a probe contradicts a stored verdict when the path it turned down is this much faster

_recheck = threading.Lock()  # one re-check at a time; other threads meanwhile run the provisional verdict's path
_held = [0]  # > 0 inside held(): provisional verdicts are not re-checked
_peek = threading.local()  # .on inside peeking(), on this thread


CPU_GEMM_MODES = ("auto", "gemm", "onednn", "torch")


def cpu_gemm_mode() -> str:
    """FASTBERT_CPU_GEMM (default auto: timed at first use); a value that is not a mode is a ValueError listing the
    accepted ones, not a silent auto."""
    mode = os.environ.get("FASTBERT_CPU_GEMM", "auto")
    if mode not in CPU_GEMM_MODES:
        raise ValueError(f"FASTBERT_CPU_GEMM={mode!r} is not one of {', '.join(CPU_GEMM_MODES)}")
    return mode


def size_class(rows: int) -> str:
    """The size class a GEMM of `rows` rows is judged in: one verdict per class and weight shape."""
    return "few" if rows <= FEW_M else "small" if rows < SMALL_M else "large"


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Inside the block (process-wide) a provisional verdict keeps its path (a re-check that falls due waits for the
    block's end), so forwards compared bitwise run the same GEMMs in every layer; a new shape is still timed."""
    _held[0] += 1
    try:
        yield
    finally:
        _held[0] -= 1


class WouldTime(Exception):
    """judge() inside peeking(): the verdict asked for would be timed now (a first use, or a re-check that fell due)."""


@contextlib.contextmanager
def peeking() -> Iterator[None]:
    """Inside the block (this thread) judge() answers from the verdicts it holds and runs nothing; one it would time
    raises WouldTime. The CPU layer stack asks so which backend each of its first layer's GEMMs takes before it runs."""
    before, _peek.on = getattr(_peek, "on", False), True
    try:
        yield
    finally:
        _peek.on = before


def samples(*fns: Callable[[], object], repeats: int = REPEATS) -> list[list[float]]:
    """`repeats` wall-time samples (seconds) per function, interleaved so that cache noise and a neighbour's load hit
    all alike. Not process CPU time: Linux adds the worker threads' CPU time at scheduler ticks (4 ms), so a 2 ms
    multi-threaded GEMM reads 2 or 6 ms, and with two functions interleaved the tick can land on the same one every
    time (seen: fastbert's GEMM judged 3x slower than torch's, and the slow path chosen)."""
    for fn in fns:
        fn()  # warm-up: packing, oneDNN primitive creation, page faults
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def cpu_clock() -> tuple[float, float, float] | None:
    """(wall seconds, CPU seconds every process on the machine used, CPU seconds this process used), None where
    /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    own = os.times()
    return time.perf_counter(), busy, own.user + own.system


def others_share(start: tuple[float, float, float] | None, end: tuple[float, float, float] | None) -> float | None:
    """Other processes' share of every CPU between two `cpu_clock` readings; None where it cannot tell."""
    if start is None or end is None or end[0] - start[0] < MIN_WINDOW_S:
        return None
    others = (end[1] - start[1]) - (end[2] - start[2])
    return max(0.0, others) / ((end[0] - start[0]) * (os.cpu_count() or 1))


def _contradicted(wins: bool, mine: Callable[[], object], other: Callable[[], object], margin: float) -> bool:
    """Whether a short probe of both paths (best of PROBE_REPEATS interleaved samples) finds the path a stored verdict
    turned down faster by CONTRADICTED, beyond the verdict's margin."""
    with torch.no_grad():
        fast, plain = (min(t) for t in samples(mine, other, repeats=PROBE_REPEATS))
    return plain * CONTRADICTED < fast * margin if wins else fast * margin * CONTRADICTED < plain


def disturbance(times: list[float]) -> float:
    """How far a path's samples were pushed above its best: median / best when the median is at least
    `NOISE_FLOOR_S` above the best, else 1.0 (quiet, or too small a GEMM to matter)."""
    ordered = sorted(times)
    best, median = ordered[0], ordered[len(ordered) // 2]
    return median / best if best > 0 and median - best >= NOISE_FLOOR_S else 1.0


@dataclass
class Evidence:
    """What a verdict rests on: each path's best seconds over every check so far, and the last check's disturbance."""

    mine: float
    other: float
    checks: int
    disturbed: float
    last_check: float  # time.perf_counter() at the end of the last check
    calls: int = 0  # calls of the shape since the last check

    def add(self, mine: list[float], other: list[float]) -> None:
        """One more check's samples."""
        self.mine, self.other = min(self.mine, *mine), min(self.other, *other)
        self.checks += 1
        self.disturbed = max(disturbance(mine), disturbance(other))
        self.last_check, self.calls = time.perf_counter(), 0

    def due(self) -> bool:
        """Whether this call should check again (counts the call)."""
        self.calls += 1
        wait = RECHECK_AFTER_S * 3 ** (self.checks - 1)
        return self.calls >= RECHECK_CALLS and time.perf_counter() - self.last_check >= wait


class Verdict(tuple):
    """(wins, why) as the backends store and read it, with the `evidence` behind it while it is provisional (None once
    settled: it never changes again)."""

    evidence: Evidence | None

    def __new__(cls, wins: bool, why: str, evidence: Evidence | None) -> Verdict:
        verdict = super().__new__(cls, (wins, why))
        verdict.evidence = evidence
        return verdict


def _margin_words(names: tuple[str, str], margin: float) -> str:
    if margin == 1.0:
        return f"{names[0]} must be faster"
    if margin > 1.0:
        return f"{names[0]} must be {margin - 1:.0%} faster"
    return f"{names[0]} unless {names[1]} is {1 / margin - 1:.0%} faster"


def decide(evidence: Evidence, names: tuple[str, str], what: str, margin: float) -> Verdict:
    """The verdict `evidence` supports, in explain()'s words: how many samples and checks, both best times, the margin,
    and whether it is settled. Disturbed evidence never picks `names[0]`: the path without it keeps the calls."""
    fast, plain = evidence.mine, evidence.other
    noisy = evidence.disturbed >= NOISY
    settled = not noisy or evidence.checks >= CHECKS
    wins = fast * margin < plain and not noisy
    how = f"best of {REPEATS * evidence.checks} interleaved samples each over {evidence.checks} check(s), " + (
        _margin_words(names, margin) + (" (within the tie margin)" if wins and fast > plain else ""))  # fmt: skip
    if noisy:
        state = (f"samples disturbed (median {evidence.disturbed:.1f}x best): {names[1]} kept, "
                 + ("settled after the last check" if settled else "provisional until a quieter re-check"))  # fmt: skip
    else:
        state = "settled"
    why = (f"{names[0] if wins else names[1]} for {what}: {names[0]} {fast * 1e3:.2f} ms vs {names[1]} "
           f"{plain * 1e3:.2f} ms; {how}; {state}")  # fmt: skip
    return Verdict(wins, why, None if settled else evidence)


def judge(
    verdicts: dict[tuple, tuple[bool, str]],
    key: tuple,
    mine: Callable[[], object],
    other: Callable[[], object],
    names: tuple[str, str],
    what: str,
    margin: float = 1.0,
) -> tuple[bool, str]:
    """The verdict for `key`: whether `mine` beats `other` (the path that runs without it) on the call's own input by
    `margin` (1.1: by 10%; 1 / 1.1: unless `other` is 10% faster), and why in explain()'s words; timed at first use
    and again while provisional (see the module's docstring). `names`: (mine, other) in words; `what`: the work
    timed, e.g. "[T, K] x [K, N] + gelu". Threads that time the same key at once all take the first verdict stored,
    so every call of a key runs the same path (same output) until a re-check settles it."""
    verdict, peeking = verdicts.get(key), getattr(_peek, "on", False)
    if verdict is None and not peeking and (kept := timing_store.lookup("|".join(names), key)) is not None:
        if not _contradicted(kept[0], mine, other, margin):
            return verdicts.setdefault(key, Verdict(kept[0], f"{kept[1]}, confirmed by a probe", None))
        timing_store.note(f"a kept verdict was contradicted by a probe and timed again ({what})")
    evidence = getattr(verdict, "evidence", None)
    if verdict is not None and (evidence is None or _held[0] or not evidence.due()):
        return verdict
    if peeking:
        raise WouldTime(what)
    if verdict is not None and not _recheck.acquire(blocking=False):
        return verdict  # another thread is re-checking it
    try:
        clock = cpu_clock()
        with torch.no_grad():
            fast, plain = samples(mine, other)
        share = others_share(clock, cpu_clock())
        if evidence is None:
            evidence = Evidence(float("inf"), float("inf"), 0, 1.0, 0.0)
        evidence.add(fast, plain)
        decided = decide(evidence, names, what, margin)
        if verdict is None:
            kept = verdicts.setdefault(key, decided)
        elif verdicts.get(key) is verdict:
            kept = verdicts[key] = decided
        else:
            kept = verdicts[key]
        if kept is decided and decided.evidence is None and evidence.disturbed < NOISY:  # settled quietly
            _keep(clock, share, ("|".join(names), key, *decided),
                  {"mine_s": evidence.mine, "other_s": evidence.other, "checks": evidence.checks})  # fmt: skip
        else:
            flush_pending()
        return kept
    finally:
        if verdict is not None:
            _recheck.release()


_pending: list[tuple[tuple[float, float, float], tuple, dict]] = []  # settled in checks too short to tell who else ran
_pending_lock = threading.Lock()


def _keep(clock: tuple[float, float, float] | None, share: float | None, entry: tuple, evidence: dict) -> None:
    """Keep a quietly settled verdict for the next process if others took less than BUSY_SHARE of the CPUs while it
    was timed. A check too short to tell waits with the others like it until the window from the first of them is long
    enough (a later check, a timer where none comes, or the process's exit), and is judged on that window's share."""
    if clock is None or share is not None:  # can tell now, or never (no /proc/stat): kept as on a quiet machine
        _store([(entry, {**evidence, "others_share": share})], share)
        return
    with _pending_lock:
        _pending.append((clock, entry, evidence))
        first = len(_pending) == 1
    if first:  # judged once the window can tell, also where no later check comes (a server past its warm-up)
        timer = threading.Timer(MIN_WINDOW_S * 1.2, flush_pending)
        timer.daemon = True
        timer.start()
    flush_pending()


def flush_pending(final: bool = False) -> None:
    """Judge the waiting verdicts once the window since the first of them can tell; `final` (at exit): whatever the
    window, kept where it cannot tell (a store read back is confirmed by a probe)."""
    with _pending_lock:
        if not _pending:
            return
        share = others_share(_pending[0][0], cpu_clock())
        if share is None and not final:
            return
        waiting = [(entry, {**evidence, "others_share": share}) for _, entry, evidence in _pending]
        _pending.clear()
    _store(waiting, share)


def _store(entries: list[tuple[tuple, dict]], share: float | None) -> None:
    if share is not None and share >= BUSY_SHARE:
        for _ in entries:
            timing_store.unkept(share)
        return
    for (store, key, wins, why), evidence in entries:
        timing_store.remember(store, key, wins, why, evidence)


atexit.register(flush_pending, final=True)


def _forget_pending_in_child() -> None:
    """A forked child judges nothing its parent was waiting to, and gets a lock no parent thread can hold."""
    global _pending_lock
    _pending_lock = threading.Lock()
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pending_in_child)


def gemm_words(rows: int, weight: torch.Tensor, epilogue: str = "") -> str:
    """A GEMM as explain() names it: "[rows, K] x [K, N]" and its fused epilogue."""
    return f"[{rows}, {weight.shape[1]}] x [{weight.shape[1]}, {weight.shape[0]}]{epilogue}"
