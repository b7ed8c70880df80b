"""First-use GEMM timings kept per machine across processes (fastbert/backends/timing_store.py): a quietly settled
verdict is read back instead of timed, by a new process too; nothing else is kept, and a bad file is never an error."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from memory_cap import run_capped

from fastbert.backends import timing, timing_store

NAMES = ("gemm", "oneDNN/torch")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(timing_store.ENV_SWITCH, "1")
    monkeypatch.setenv(timing_store.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(timing, "cpu_clock", lambda: None)  # cannot tell who else ran: kept (as on a quiet machine)
    monkeypatch.setattr(timing, "_pending", [])  # no verdict of another test waits to be kept here
    timing_store.forget()
    yield tmp_path
    timing_store.forget()


def _judge(samples: list[list[float]], monkeypatch: pytest.MonkeyPatch, key: tuple = (768, 768, "small")):
    """A first-use verdict whose timing returns `samples` (mine, other); how many times it timed (a probe of a kept
    verdict, PROBE_REPEATS samples, is not counted)."""
    timed = []

    def fake(*fns: object, repeats: int = timing.REPEATS) -> list[list[float]]:
        timed.extend([1] if repeats == timing.REPEATS else [])
        return [s[:repeats] for s in samples]

    monkeypatch.setattr(timing, "samples", fake)
    verdict = timing.judge({}, key, lambda: None, lambda: None, NAMES, "[8, 768] x [768, 768]")
    return verdict, len(timed)


QUIET = [[1.0e-3] * 9, [2.0e-3] * 9]  # mine twice as fast, both quiet
BUSY = [[1.0e-3] * 4 + [5.0e-3] * 5, [2.0e-3] * 9]  # mine's median 5x its best: disturbed


def test_a_settled_verdict_is_read_back_instead_of_timed(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, timed = _judge(QUIET, monkeypatch)
    assert timed == 1 and first[0] is True
    timing_store.forget()  # as a new process: nothing in memory, the file on disk
    again, timed = _judge(QUIET, monkeypatch)
    assert timed == 0 and again[0] is True and "timed in an earlier run" in again[1]
    assert "confirmed by a probe" in again[1]
    assert "1 read" in timing_store.describe()
    (entry,) = json.loads(timing_store.path().read_text())["verdicts"].values()
    assert entry[2] == {"mine_s": 1.0e-3, "other_s": 2.0e-3, "checks": 1, "others_share": None}  # what it rests on


def test_nothing_timed_on_a_busy_machine_is_kept(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples a steady load slowed alike look quiet; the CPU time other processes used during the check says the
    machine was busy: the verdict holds in this process and is not written."""
    clocks = iter([(0.0, 0.0, 0.0), (1.0, 1.6, 0.2)])  # 1.4 CPU-seconds of others' work in 1 s on 2 CPUs
    monkeypatch.setattr(timing, "cpu_clock", lambda: next(clocks))
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 2)
    verdict, timed = _judge(QUIET, monkeypatch)
    assert timed == 1 and verdict[0] is True and verdict.evidence is None
    assert not list(store.glob("*.json"))
    assert "1 timed while other processes took up to 70% of the CPUs" in timing_store.describe()


@pytest.mark.parametrize("others", [0.1, 1.2], ids=["quiet", "busy"])
def test_short_checks_wait_for_a_window_that_can_tell(store: Path, monkeypatch: pytest.MonkeyPatch, others: float
                                                      ) -> None:  # fmt: skip
    """Two checks of 10 ms each cannot tell who else ran; the window from the first to the end of the second (0.31 s)
    can: both verdicts are kept if others took little of the CPUs over it, neither if they took much."""
    readings = iter([(0.0, 0.0, 0.0), (0.01, 0.02, 0.02), (0.011, 0.022, 0.022),  # first check, then a flush try
                     (0.3, 0.3, 0.3), (0.31, 0.31 + others, 0.31)])  # fmt: skip
    clock = {"last": None}

    def reading() -> tuple[float, float, float]:
        clock["last"] = next(readings, clock["last"])
        return clock["last"]

    monkeypatch.setattr(timing, "cpu_clock", reading)
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 2)
    _judge(QUIET, monkeypatch, key=(768, 768, "small"))
    assert not list(store.glob("*.json")) and len(timing._pending) == 1  # waiting, not kept, not dropped
    _judge(QUIET, monkeypatch, key=(768, 3072, "small"))
    assert not timing._pending
    kept = list(store.glob("*.json"))
    if others > 0.5:  # 1.2 CPU-seconds of others' in 0.31 s on 2 CPUs
        assert not kept and "2 timed while other processes took up to" in timing_store.describe()
    else:
        entries = json.loads(kept[0].read_text())["verdicts"].values()
        assert len(entries) == 2 and all(e[2]["others_share"] == pytest.approx(0.1 / 0.62) for e in entries)


def test_waiting_verdicts_are_judged_without_a_later_check(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server past its warm-up times nothing more: a timer judges what waits once the window can tell."""
    readings = iter([(0.0, 0.0, 0.0), (0.01, 0.02, 0.02), (0.011, 0.022, 0.022)])
    monkeypatch.setattr(timing, "cpu_clock", lambda: next(readings, (0.4, 0.45, 0.4)))  # 0.05 CPU-s of others'
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 2)
    _judge(QUIET, monkeypatch)
    assert not list(store.glob("*.json"))
    for _ in range(100):  # the timer fires 0.3 s after the first verdict began to wait
        if list(store.glob("*.json")):
            break
        time.sleep(0.05)
    (entry,) = json.loads(timing_store.path().read_text())["verdicts"].values()
    assert entry[2]["others_share"] == pytest.approx(0.05 / 0.8) and not timing._pending


def test_a_short_check_at_exit_is_kept_as_before(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that ends before any window could tell keeps its verdicts (a probe confirms them when read back)."""
    readings = iter([(0.0, 0.0, 0.0), (0.01, 0.02, 0.02)])
    monkeypatch.setattr(timing, "cpu_clock", lambda: next(readings, (0.02, 0.03, 0.03)))
    _judge(QUIET, monkeypatch)
    assert not list(store.glob("*.json"))
    timing.flush_pending(final=True)  # what the exit does
    (entry,) = json.loads(timing_store.path().read_text())["verdicts"].values()
    assert entry[0] is True and entry[2]["others_share"] is None


@pytest.mark.parametrize("poisoned", [False, True], ids=["mine turned down", "mine picked"])
def test_a_poisoned_store_cannot_slow_a_quiet_process(store: Path, monkeypatch: pytest.MonkeyPatch, poisoned: bool
                                                      ) -> None:  # fmt: skip
    """A kept verdict the machine contradicts now (written under load, or by hand) is probed at first use, timed again
    and rewritten: a quiet process runs the path it would have picked with the store off."""
    truth = QUIET if not poisoned else [[2.0e-3] * 9, [1.0e-3] * 9]  # which path is faster now
    timing_store.remember("|".join(NAMES), (768, 768, "small"), poisoned, "written while busy")
    timing_store.forget()
    verdict, timed = _judge(truth, monkeypatch)
    with_store_off = not poisoned
    assert verdict[0] is with_store_off and timed == 1 and "written while busy" not in verdict[1]
    assert "contradicted by a probe" in timing_store.describe()
    (entry,) = json.loads(timing_store.path().read_text())["verdicts"].values()
    assert entry[0] is with_store_off


def test_a_provisional_verdict_is_not_kept(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict, _ = _judge(BUSY, monkeypatch)
    assert verdict.evidence is not None  # provisional: checked again later in this process
    assert not list(store.glob("*.json"))


def test_another_thread_count_times_again(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _judge(QUIET, monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        _, timed = _judge(QUIET, monkeypatch)
    finally:
        torch.set_num_threads(threads)
    assert timed == 1 and len(list(store.glob("*.json"))) == 2


def test_an_unreadable_file_is_timed_again_and_rewritten(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timing_store.path().parent.mkdir(parents=True, exist_ok=True)
    timing_store.path().write_text("{not json")
    _, timed = _judge(QUIET, monkeypatch)
    assert timed == 1 and "unreadable" in timing_store.describe()
    assert len(json.loads(timing_store.path().read_text())["verdicts"]) == 1


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_keeps_timings_in_the_process(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store.chmod(0o500)
    try:
        verdict, timed = _judge(QUIET, monkeypatch)
    finally:
        store.chmod(0o700)
    assert timed == 1 and verdict[0] is True and "cannot write" in timing_store.describe()


def test_a_file_where_the_directory_should_be_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "taken").write_text("")
    monkeypatch.setenv(timing_store.ENV_SWITCH, "1")
    monkeypatch.setenv(timing_store.ENV_DIR, str(tmp_path / "taken"))
    monkeypatch.setattr(timing, "cpu_clock", lambda: None)
    timing_store.forget()
    try:
        verdict, timed = _judge(QUIET, monkeypatch)
        assert timed == 1 and verdict[0] is True and "cannot write" in timing_store.describe()
    finally:
        timing_store.forget()


def test_switched_off_nothing_is_written(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(timing_store.ENV_SWITCH, "0")
    _judge(QUIET, monkeypatch)
    assert not list(store.glob("*.json")) and "this process only" in timing_store.describe()


def test_no_home_directory_keeps_timings_in_the_process(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container running as a uid without a passwd entry and without HOME: no file, no error."""
    monkeypatch.delenv(timing_store.ENV_DIR)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", no_home)
    verdict, timed = _judge(QUIET, monkeypatch)
    assert timed == 1 and verdict[0] is True and "no directory" in timing_store.describe()


@pytest.mark.parametrize(
    "content",
    ["[" * 100_000 + "]" * 100_000, '{"verdicts": []}', '{"verdicts": {"K": ["false", {"a": 1}]}}', "null"],
    ids=["nested too deep", "verdicts not a dict", "entry of the wrong types", "null"],
)
def test_a_malformed_file_is_never_trusted_nor_an_error(
    store: Path, monkeypatch: pytest.MonkeyPatch, content: str
) -> None:
    _judge(QUIET, monkeypatch)  # the file exists with its one verdict; now replace it and read it as a new process
    key = next(iter(json.loads(timing_store.path().read_text())["verdicts"]))
    timing_store.path().write_text(content.replace('"K"', json.dumps(key)))
    timing_store.forget()
    _, timed = _judge(QUIET, monkeypatch)
    assert timed == 1


def test_the_gemm_mode_is_part_of_the_key(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 is timed against the fp32 path FASTBERT_CPU_GEMM picks: a verdict under one mode says nothing of another."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "torch")
    _judge(QUIET, monkeypatch)
    timing_store.forget()
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "auto")
    _, timed = _judge(QUIET, monkeypatch)
    assert timed == 1


def test_another_processs_verdicts_are_kept_when_writing(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _judge(QUIET, monkeypatch, key=(1, "mine"))
    file = timing_store.path()
    data = json.loads(file.read_text())
    data["verdicts"]["another process's key"] = [False, "theirs"]
    file.write_text(json.dumps(data))  # written by another worker after this process read the file
    _judge(QUIET, monkeypatch, key=(2, "mine"))
    kept = json.loads(file.read_text())["verdicts"]
    assert len(kept) == 3 and kept["another process's key"] == [False, "theirs"]


def test_a_failed_write_leaves_no_temporary_file(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(timing_store.os, "replace", full)  # the final rename fails
    _judge(QUIET, monkeypatch)
    assert "cannot write" in timing_store.describe()
    assert list(store.iterdir()) == []


def test_a_directory_at_the_store_path_is_passed_over(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timing_store.path().mkdir(parents=True)
    verdict, timed = _judge(QUIET, monkeypatch)
    assert timed == 1 and verdict[0] is True and "not a regular file" in timing_store.describe()
    assert [p.name for p in store.iterdir()] == [timing_store.path().name] and timing_store.path().is_dir()


def _released(thread: threading.Thread, fifo: Path) -> bool:
    """Wait for `thread`; if it is stuck opening `fifo` (a hang, whatever the time), open its other end until it
    goes on. True if it had to be released."""
    thread.join(60)
    stuck = thread.is_alive()
    for _ in range(20):
        if not thread.is_alive():
            break
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked reader's open returns, then EOF
        thread.join(1)
    return stuck


def test_a_fifo_at_the_store_path_is_passed_over(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a FIFO for reading blocks until a writer comes: the first forward hung. It is never opened."""
    file = timing_store.path()
    file.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(file)
    judged = []
    worker = threading.Thread(target=lambda: judged.append(_judge(QUIET, monkeypatch)), daemon=True)
    worker.start()
    assert not _released(worker, file), "a FIFO at the store's path hung the lookup"
    (verdict, timed) = judged[0]
    assert timed == 1 and verdict[0] is True
    assert re.search(r"not a regular file.*passed over", timing_store.describe()), timing_store.describe()
    assert stat.S_ISFIFO(os.lstat(file).st_mode)  # left alone: not the store's to replace


def test_a_link_to_dev_zero_is_passed_over(store: Path) -> None:
    """Reading /dev/zero never ends (memory grew until the process was killed); capped here, in a child."""
    imports = "import os\nfrom fastbert.backends import timing_store\n"
    body = """
file = timing_store.path()
file.parent.mkdir(parents=True, exist_ok=True)
os.symlink("/dev/zero", file)
print(timing_store.lookup("gemm", (768, 768, "small")))
timing_store.remember("gemm", (768, 768, "small"), True, "faster")
print(timing_store.describe())
print(os.path.islink(file))
"""
    done = run_capped(imports, body)
    assert done.returncode == 0, done.stderr[-2000:]
    found, said, still_a_link = done.stdout.strip().splitlines()[-3:]
    assert found == "None" and re.search(r"not a regular file.*passed over", said), said
    assert still_a_link == "True"


def test_a_file_over_the_size_cap_is_not_read(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _judge(QUIET, monkeypatch)
    monkeypatch.setattr(timing_store, "MAX_FILE_BYTES", 64)
    timing_store.forget()  # as a new process, whose file has grown past the cap
    _, timed = _judge(QUIET, monkeypatch)
    assert timed == 1 and re.search(r"larger than 64 bytes.*passed over", timing_store.describe())


def test_the_store_keeps_at_most_max_entries(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing_store, "MAX_ENTRIES", 2)
    for n in range(3):
        _judge(QUIET, monkeypatch, key=(n, "shape"))
    assert len(json.loads(timing_store.path().read_text())["verdicts"]) == 2
    assert "holds 2 verdicts, its most" in timing_store.describe()


CHILD = """
import json, sys, torch
from fastbert import BertConfig, BertModel, explain
from fastbert.backends import timing
timed = []
real = timing.samples
timing.samples = lambda *fns, **kw: timed.extend([1] if "repeats" not in kw else []) or real(*fns, **kw)
torch.manual_seed(0)
model = BertModel(BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=128)).eval()
with torch.no_grad():
    out = model(input_ids=torch.randint(1, 100, (2, 12))).last_hidden_state
from fastbert.backends import timing_store
print(json.dumps({"timed": len(timed), "sum": out.double().sum().item(), "explain": explain(),
                  "read": timing_store._state["read"], "written": timing_store._state["written"]}))
"""


def test_a_new_process_reads_the_verdicts_of_the_last(tmp_path: Path) -> None:
    """End to end, two processes: the second finds the first's file (the fingerprint is stable across processes) and
    takes its verdicts instead of timing them; where it times nothing, it runs the same paths (the same output to the
    last bit)."""
    env = {**os.environ, timing_store.ENV_SWITCH: "1", timing_store.ENV_DIR: str(tmp_path), "FASTBERT_CPU_GEMM": "auto"}
    runs, kept = [], None
    for _ in range(2):
        child = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
        assert child.returncode == 0, child.stderr[-3000:]
        runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
        if kept is None:  # a short process's checks wait for a window that can tell: kept at its exit, after it printed
            kept = sum(len(json.loads(f.read_text())["verdicts"]) for f in tmp_path.glob("*.json"))
    first, second = runs
    if first["timed"] == 0:
        pytest.skip("no GEMM here is chosen by timing (no native build): nothing to keep")
    if kept == 0:
        pytest.skip("every timing of the first process was disturbed (a busy machine): nothing settled to keep")
    # a verdict it read runs untimed ("timed in an earlier run") unless its probe contradicts it; under load the first
    # process keeps only what a quiet window backs, so the second may time the rest, more often if disturbed
    taken = "timed in an earlier run" in second["explain"] or "contradicted by a probe" in second["explain"]
    assert second["read"] >= 1 and taken, second["explain"]
    if second["timed"] == 0:  # every path as the first process settled it: the same output to the last bit
        assert second["sum"] == first["sum"]


def test_others_share_excludes_this_process_and_short_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 2)
    assert timing.others_share((0.0, 10.0, 5.0), (0.5, 11.0, 6.0)) == 0.0  # all of it this process's own threads
    assert timing.others_share((0.0, 10.0, 5.0), (0.5, 11.0, 5.5)) == 0.5  # half a CPU-second of others' in 0.5 s
    assert timing.others_share((0.0, 10.0, 5.0), (0.1, 11.0, 5.0)) is None  # 100 ms: too short to tell
    if os.path.exists("/proc/stat"):
        wall, machine, own = timing.cpu_clock()
        assert machine >= 0 and own >= 0 and wall > 0
