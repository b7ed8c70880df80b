"""First-use GEMM verdicts on a busy machine, with a fake clock: a neighbour's load at start-up is a burst of slow,
uneven samples on one path. The verdict must never pick a path slower than the one it replaces from such evidence,
and must reach the right path once the burst has passed. No real time is measured here."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from fastbert.backends import timing

SEEDS = range(20)  # each test's verdicts hold for every draw of the neighbour's slow samples, not one lucky draw


class FakeClock:
    """Seconds that pass only when a fake GEMM runs (its cost, 0-1% of jitter, and while the neighbour's burst lasts,
    2-30x its cost on the path the burst hits: its threads wait on the one the neighbour descheduled) or when the test
    lets time pass between calls."""

    def __init__(self, seed: int = 0, burst_s: float = 2.0) -> None:
        self.now = 0.0
        self.burst_s = burst_s  # the neighbour runs for the first two seconds of the process
        self.noise = random.Random(seed)

    def perf_counter(self) -> float:
        return self.now

    def path(self, cost_s: float, burst: bool) -> timing.Callable[[], None]:
        """A fake GEMM of `cost_s` seconds; with `burst`, the neighbour's time slices land on it at start-up."""

        def run() -> None:
            slowed = burst and self.now < self.burst_s
            self.now += cost_s * (self.noise.uniform(2.0, 30.0) if slowed else self.noise.uniform(1.0, 1.01))

        return run


def fake_clock(monkeypatch: pytest.MonkeyPatch, seed: int = 0, burst_s: float = 2.0) -> FakeClock:
    """timing's timer replaced by a fake clock."""
    fake = FakeClock(seed, burst_s)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    return fake_clock(monkeypatch)


def serve(clock: FakeClock, mine_s: float, other_s: float, burst_on: str, calls: int = 60) -> list[tuple[bool, str]]:
    """int8 (mine) against fp32 (other), one verdict per call of a server that gets a request every half second."""
    verdicts: dict[tuple, tuple[bool, str]] = {}
    mine, other = clock.path(mine_s, burst_on == "int8"), clock.path(other_s, burst_on == "fp32")
    seen = []
    for _ in range(calls):
        seen.append(timing.judge(verdicts, ("shape",), mine, other, ("int8", "fp32"), "[T, K] x [K, N]"))
        clock.now += 0.5
    return seen


@pytest.mark.parametrize("seed", SEEDS)
def test_a_burst_on_the_replaced_path_never_picks_the_slower_one(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 is 20% slower than fp32 here, but the neighbour slows fp32 down while the shape is first timed: the old
    verdict (best of 9 at first use, kept for ever) ran int8 on every call."""
    seen = serve(fake_clock(monkeypatch, seed), mine_s=1.2e-3, other_s=1.0e-3, burst_on="fp32")
    assert not any(wins for wins, _ in seen), seen[0][1]
    assert "provisional" in seen[0][1] and "samples disturbed" in seen[0][1]
    assert seen[-1][1].endswith("settled") and "fp32 for [T, K] x [K, N]: int8 1.20 ms vs fp32 1.00 ms" in seen[-1][1]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_burst_on_the_faster_path_is_checked_again_until_it_wins(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 is twice as fast, but the neighbour slows int8 down at start-up: the old verdict kept fp32 for ever; now
    fp32 runs while the evidence is disturbed, and int8 once a quiet re-check shows it faster."""
    seen = serve(fake_clock(monkeypatch, seed), mine_s=0.5e-3, other_s=1.0e-3, burst_on="int8")
    assert not seen[0][0] and "provisional" in seen[0][1]
    assert seen[-1][0], seen[-1][1]
    assert "int8 for [T, K] x [K, N]: int8 0.50 ms vs fp32 1.00 ms; best of 18 interleaved samples" in seen[-1][1]
    assert "each over 2 check(s), int8 must be faster; settled" in seen[-1][1]
    flips = [i for i in range(1, len(seen)) if seen[i][0] != seen[i - 1][0]]
    assert len(flips) == 1  # fp32 until the re-check, int8 for good after it


def test_a_quiet_start_settles_at_first_use_and_never_times_again(clock: FakeClock) -> None:
    timed = []
    verdicts: dict[tuple, tuple[bool, str]] = {}
    mine, other = clock.path(0.5e-3, False), clock.path(1.0e-3, False)
    for _ in range(40):
        before = clock.now
        wins, why = timing.judge(verdicts, ("shape",), mine, other, ("int8", "fp32"), "[T, K] x [K, N]")
        timed.append(clock.now > before)
        clock.now += 1.0
    assert wins and why.endswith("; settled") and "int8 must be faster" in why
    assert timed == [True] + [False] * 39


def test_a_machine_busy_at_every_check_stays_on_the_replaced_path(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = fake_clock(monkeypatch, burst_s=float("inf"))  # the neighbour never leaves
    seen = serve(clock, mine_s=0.5e-3, other_s=1.0e-3, burst_on="fp32", calls=400)
    assert not any(wins for wins, _ in seen)
    assert f"over {timing.CHECKS} check(s)" in seen[-1][1] and "settled after the last check" in seen[-1][1]


def test_small_gemms_are_not_rechecked_for_noise_below_the_floor(clock: FakeClock) -> None:
    """Up to 20 us of jitter on an 8 us GEMM (a median 2x its best) is not worth a re-check: it settles at once."""
    verdicts: dict[tuple, tuple[bool, str]] = {}

    def mine() -> None:
        clock.now += 8e-6 + clock.noise.uniform(0.0, 20e-6)

    other = clock.path(10e-6, False)
    wins, why = timing.judge(verdicts, ("shape",), mine, other, ("gemm", "oneDNN/torch"), "[5, 24] x [24, 12]")
    assert why.endswith("; settled")


def test_a_held_verdict_waits_for_the_end_of_the_block_to_be_rechecked(clock: FakeClock) -> None:
    """Two forwards compared bitwise must run the same GEMMs: a re-check that falls due inside `held()` (the burst on
    int8 has passed, so it would flip the path mid-forward) waits, and runs at the first call after the block."""
    verdicts: dict[tuple, tuple[bool, str]] = {}
    mine, other = clock.path(0.5e-3, True), clock.path(1.0e-3, False)

    def call() -> bool:
        wins, _ = timing.judge(verdicts, ("shape",), mine, other, ("int8", "fp32"), "[T, K] x [K, N]")
        return wins

    assert not call()  # timed during the burst: provisional, fp32 kept
    clock.now = clock.burst_s + 60.0  # the burst has passed and the re-check is due
    with timing.held():
        during = [call() for _ in range(3 * timing.RECHECK_CALLS)]
        timed_during = clock.now != clock.burst_s + 60.0
    after = [call() for _ in range(timing.RECHECK_CALLS)]
    assert during == [False] * len(during) and not timed_during
    assert after[-1] and verdicts[("shape",)].evidence is None  # re-checked quietly after the block: int8, settled


def test_peeking_answers_from_the_verdicts_held_and_times_nothing(clock: FakeClock) -> None:
    """What the CPU layer stack asks before its first layer runs: a held verdict is the answer; a first use or a
    re-check that fell due raises WouldTime without running either path, and the next plain call times it."""
    verdicts: dict[tuple, tuple[bool, str]] = {}
    mine, other = clock.path(0.5e-3, True), clock.path(1.0e-3, False)

    def call() -> bool:
        return timing.judge(verdicts, ("shape",), mine, other, ("int8", "fp32"), "[T, K] x [K, N]")[0]

    with timing.peeking(), pytest.raises(timing.WouldTime):
        call()  # first use
    assert clock.now == 0.0 and not verdicts
    assert not call()  # timed during the burst: provisional, fp32 kept
    with timing.peeking():
        assert not call()  # held, not due yet
    clock.now = clock.burst_s + 60.0
    for _ in range(timing.RECHECK_CALLS):
        with timing.peeking():
            try:
                call()
            except timing.WouldTime:
                break
    else:
        pytest.fail("a due re-check was answered from the provisional verdict")
    assert clock.now == clock.burst_s + 60.0  # nothing ran
    assert call() and verdicts[("shape",)].evidence is None  # the plain call re-checked it: int8, settled
    with timing.peeking():
        assert call()
