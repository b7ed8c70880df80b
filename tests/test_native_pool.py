"""The native kernels' parallel regions (csrc/cpu/pool.h): every job once, on slots below the region's threads; results
that do not depend on the thread count; the thread count capped by the process's CPU affinity; a forked child and
several calling threads that run kernels correctly."""

from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch

from fastbert.backends import gemm, native

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
        threads, why, late, _ = EXT.threading()
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
    queue.put({name: out.numpy() for name, out in _kernels(2).items()})  # by value: the child exits before the read


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_forked_child_runs_kernels() -> None:
    """A child forked after the parent's regions ran (a DataLoader worker) has none of its threads: it must neither
    hang nor differ."""
    parent = _kernels(2)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_kernels, args=(queue,))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    for name, out in got.items():
        assert torch.equal(torch.from_numpy(out), parent[name]), name


def test_calling_threads_at_once_get_their_own_results() -> None:
    """Three Python threads in kernels at once (a threaded server): each region its own jobs and scratch."""
    expected = _kernels()
    failures: list[str] = []

    def call() -> None:
        for _ in range(20):
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


def test_a_late_team_sends_regions_solo_and_a_prompt_one_ends_it() -> None:
    """The busy-machine policy on its own (pool.h), in a process with it on: a region whose team came late makes the
    next regions run on the calling thread alone for a while, each late probe a longer while, and keeps fp32 GEMMs off
    their first-use timing; a prompt team ends it."""
    code = (
        "from fastbert.backends import native\n"
        "ext = native.load('_native_cpu')[0]\n"
        "assert ext.threading()[3]\n"
        "ext.pool_judge(2_000_000)\n"  # a team thread that started 2 ms late
        "first = ext.pool_solo_remaining_ns()\n"
        "assert first > 0 and native.oversubscribed()\n"
        "assert ext.pool_cover(1000, 2)[2] == 1, 'a region ran on several threads during a solo period'\n"
        "ext.pool_judge(2_000_000)\n"
        "assert ext.pool_solo_remaining_ns() > first\n"  # backed off further
        "ext.pool_judge(10_000)\n"  # a prompt team (tens of microseconds)
        "assert ext.pool_solo_remaining_ns() == 0 and not native.oversubscribed()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "FASTBERT_BUSY_SOLO": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


def test_the_policy_is_off_unless_asked_for() -> None:
    """Without FASTBERT_BUSY_SOLO=1 (this suite sets 0) a late region starts no solo period."""
    assert not EXT.threading()[3]
    late = EXT.threading()[2]
    EXT.pool_judge(2_000_000)
    assert EXT.pool_solo_remaining_ns() == 0 and not native.oversubscribed()
    assert EXT.threading()[2] == late + 1  # still counted, for explain()
