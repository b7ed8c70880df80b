"""The native kernels' parallel regions (csrc/cpu/pool.h): every job once, on slots below the region's threads; results
that do not depend on the thread count; the thread count capped by the process's CPU affinity; a forked child and
several calling threads that run kernels correctly; each busy-host policy (csrc/cpu/workers.cpp for pool) alike."""

from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from fastbert.backends import gemm, native
from tests.conftest import busy_spell

EXT, EXT_REASON = native.load("_native_cpu")
pytestmark = pytest.mark.skipif(EXT is None, reason=f"native CPU extension unavailable: {EXT_REASON}")


@pytest.mark.parametrize("jobs", [0, 1, 2, 7, 1000, 100_003])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_every_job_runs_once_on_a_slot_below_threads(jobs: int, threads: int) -> None:
    once, slots_ok, slots = EXT.pool_cover(jobs, threads)
    assert once and slots_ok
    assert 1 <= slots <= threads if jobs else slots == 0


def _kernels(threads: int | None = None) -> dict[str, torch.Tensor]:
    """Three kernels on fixed operands, on `threads` torch threads (None: as set)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        g = torch.Generator().manual_seed(0)
        tokens, hidden, heads = 300, 96, 4
        x, res, w = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, hidden, generator=g), \
            torch.randn(3 * hidden, hidden, generator=g)  # fmt: skip
        bias, lw = torch.randn(3 * hidden, generator=g), torch.rand(hidden, generator=g)
        lb = torch.randn(hidden, generator=g)
        qkv = torch.randn(tokens, 3, heads, hidden // heads, generator=g)
        cu = torch.tensor([0, 5, 5, 130, 131, tokens], dtype=torch.int32)  # ragged, an empty sequence
        return {
            "fp32_linear": EXT.fp32_linear(x, gemm.packed(w), 3 * hidden, bias, "gelu"),
            "attention": EXT.attention(qkv, cu, 169, 1 / math.sqrt(hidden // heads)),
            "bias_residual_layernorm": EXT.bias_residual_layernorm(x, bias[:hidden], res, lw, lb, 1e-12),
        }
    finally:
        torch.set_num_threads(before)


def test_results_do_not_depend_on_the_thread_count() -> None:
    """Each output element is one job's: the same bits on 1, 2 and 3 threads."""
    one = _kernels(1)
    for threads in (2, 3):
        for name, out in _kernels(threads).items():
            assert torch.equal(out, one[name]), (name, threads)


def test_threads_follow_torch_and_say_why() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert EXT.threading()[0] == 1
        torch.set_num_threads(max(before, 1))
        threads, why, late, *_ = EXT.threading()
        assert 1 <= threads <= torch.get_num_threads() and why and late >= 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs this process may run on")  # fmt: skip
def test_threads_capped_by_cpu_affinity() -> None:
    """A process pinned to one CPU (taskset, a container's cpuset) gets one kernel thread, whatever torch was told."""
    code = (
        "import os, torch\n"
        "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "torch.set_num_threads(4)\n"
        "from fastbert.backends import native\n"
        "print(native.load('_native_cpu')[0].threading())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "(1, \"this process's CPU affinity\"" in out.stdout, out.stdout + out.stderr


def _child_kernels(queue: multiprocessing.Queue) -> None:
    busy_spell()
    queue.put({name: out.numpy() for name, out in _kernels(2).items()})  # by value: the child exits before the read


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
@pytest.mark.parametrize("policy", ["off", "pool"], indirect=True)
def test_forked_child_runs_kernels(policy: str) -> None:
    """A child forked after the parent's regions ran (a DataLoader worker) has none of its threads, the team's or the
    pool's: it must neither hang nor differ."""
    busy_spell()
    parent = _kernels(2)
    assert EXT.threading()[5] >= 1 or policy == "off"
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_kernels, args=(queue,))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    for name, out in got.items():
        assert torch.equal(torch.from_numpy(out), parent[name]), name


@pytest.mark.parametrize("policy", ["off", "pool"], indirect=True)
def test_calling_threads_at_once_get_their_own_results(policy: str) -> None:
    """Three Python threads in kernels at once (a threaded server): each region its own jobs and scratch; in a busy
    spell one holds the pool's threads and the others run on their own."""
    expected = _kernels()
    failures: list[str] = []

    def call() -> None:
        for _ in range(20):
            busy_spell()
            for name, out in _kernels().items():
                if not torch.equal(out, expected[name]):
                    failures.append(name)

    workers = [threading.Thread(target=call) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a kernel call did not return (deadlock?)"
    assert not failures


def _prompt_probe(late_at: int | None = None) -> None:
    """Eight regions as a probe's, the last more than 10 ms after the first (the `late_at`-th late). A probe ends at
    its 8th region past 10 ms, so one may end inside this call and the regions after it begin the next."""
    for i in range(8):
        if i == 7:
            time.sleep(0.011)
        EXT.pool_judge(2_000_000 if i == late_at else 10_000)


@pytest.mark.parametrize("policy", ["pool", "solo"], indirect=True)
def test_late_teams_start_a_busy_spell_that_three_prompt_probes_end(policy: str) -> None:
    """One late region is no sign (a VM's idle vCPU wakes that slowly); three of the last 32 begin a busy spell, which
    keeps fp32 GEMMs off their first-use timing; a late probe puts the next one further off; three prompt probes in a
    row end it, a late one among them starts the count again. A probe is 10 ms of regions, not one: the first region
    after a pause is prompt on a busy machine too (a woken thread preempts the neighbour)."""
    spells = EXT.threading()[4]
    for _ in range(2):
        EXT.pool_judge(2_000_000)
        assert not EXT.pool_busy() and not native.oversubscribed()
    EXT.pool_judge(2_000_000)
    first = EXT.pool_probe_in_ns()
    assert EXT.pool_busy() and native.oversubscribed() and 0 < first <= 50_000_000 and EXT.threading()[4] == spells + 1
    EXT.pool_judge(2_000_000)  # a late probe
    assert EXT.pool_probe_in_ns() > first
    for _ in range(20):  # prompt regions, but all within one probe's 10 ms: no verdict yet
        EXT.pool_judge(10_000)
    assert EXT.pool_busy()
    for late_at in (None, 5, None, None):  # prompt, late (the count starts again), prompt, prompt
        _prompt_probe(late_at)
        assert EXT.pool_busy(), late_at
    _prompt_probe()  # the third prompt probe in a row
    assert not EXT.pool_busy() and not native.oversubscribed() and EXT.pool_probe_in_ns() == 0


@pytest.mark.parametrize("policy", ["pool", "solo"], indirect=True)
@pytest.mark.parametrize("jobs", [1, 7, 1000, 100_003])
def test_busy_regions_run_every_job_once(policy: str, jobs: int) -> None:
    busy_spell()
    once, slots_ok, slots = EXT.pool_cover(jobs, 2)
    assert once and slots_ok and (slots == 1 if policy == "solo" else 1 <= slots <= 2)
    assert EXT.pool_probe_in_ns() > 0  # no probe came due: the region followed the policy


@pytest.mark.parametrize("policy", ["pool"], indirect=True)
def test_the_pools_own_thread_takes_jobs(policy: str) -> None:
    """Its worker joins a region with jobs left: in 20 regions of a million jobs at least one ran on two slots."""
    used = []
    for _ in range(20):
        busy_spell()
        used.append(EXT.pool_cover(1_000_000, 2)[2])
    assert max(used) == 2 and EXT.threading()[5] >= 1, used


@pytest.mark.parametrize("policy", ["pool", "solo"], indirect=True)
def test_busy_regions_give_the_teams_bits(policy: str) -> None:
    """The kernels in a busy spell, on one thread or on the pool's, give the team's results bit for bit."""
    quiet = _kernels(2)
    for _ in range(3):
        busy_spell()
        busy = _kernels(2)
        assert EXT.pool_probe_in_ns() > 0
        for name, out in busy.items():
            assert torch.equal(out, quiet[name]), name


def test_the_policy_comes_from_the_environment_and_a_bad_one_is_refused() -> None:
    code = "from fastbert.backends import native\nnative.load('_native_cpu')\nprint(native.describe())\n"
    for value, expected in (("solo", "busy-host policy solo"), ("", "busy-host policy pool")):
        env = {**os.environ, "FASTBERT_BUSY_HOST": value}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0 and expected in out.stdout, out.stdout + out.stderr
    env = {**os.environ, "FASTBERT_BUSY_HOST": "sometimes"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and "FASTBERT_BUSY_HOST='sometimes'" in out.stderr and "pool, solo or off" in out.stderr
    with pytest.raises(ValueError, match="pool, solo or off"):
        native.set_busy_host_policy("sometimes")


def test_with_the_policy_off_late_regions_are_counted_and_nothing_else() -> None:
    """This suite runs with it off (conftest): late regions begin no busy spell."""
    assert EXT.threading()[3] == "off"
    late = EXT.threading()[2]
    busy_spell()
    assert not EXT.pool_busy() and not native.oversubscribed()
    assert EXT.threading()[2] == late + 3  # still counted, for explain()
