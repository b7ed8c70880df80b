"""A CPU forward's team scope (csrc/cpu/pool.h, team_enter): in a busy spell torch's own ops in a forward (padding,
the pooler, sentence-transformers' pooling) run on one thread fewer, the kernels keep their threads, GEMMs are not
timed, and the thread gets its team back at the end, also when the forward raises or an interrupt skips a hook;
outside a spell nothing changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastbert
from fastbert import ops
from fastbert.backends import native
from tests.conftest import NATIVE_CPU, busy_spell, tiny_bert

pytestmark = pytest.mark.skipif(NATIVE_CPU is None, reason="native CPU extension unavailable")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def two_threads():
    """At least two torch threads, so there is one to narrow by (a test before may have left this worker at one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    yield
    torch.set_num_threads(before)


def _threads_inside(module: torch.nn.Module) -> list[tuple[int, int]]:
    """(torch's threads, the kernels' threads) each time `module`'s forward ends."""
    seen: list[tuple[int, int]] = []
    module.register_forward_hook(lambda *_: seen.append((torch.get_num_threads(), NATIVE_CPU.threading()[0])))
    return seen


@pytest.mark.parametrize("policy", ["pool", "solo"], indirect=True)
def test_in_a_busy_spell_torch_runs_on_one_thread_and_the_kernels_keep_theirs(policy: str) -> None:
    team, kernels = torch.get_num_threads(), NATIVE_CPU.threading()[0]
    busy_spell()
    with ops.team_scope(CPU):
        assert torch.get_num_threads() == team - 1 and NATIVE_CPU.threading()[0] == kernels
        native.set_busy_host_policy(policy)  # the spell ends mid-forward (as a prompt probe would end it)
        assert native.oversubscribed(), "a narrowed team must keep GEMMs off their timing"
    assert torch.get_num_threads() == team and not native.oversubscribed()


@pytest.mark.parametrize("policy", ["pool", "off"], indirect=True)
def test_outside_a_spell_with_the_policy_off_or_off_the_cpu_nothing_changes(policy: str) -> None:
    team = torch.get_num_threads()
    with ops.team_scope(CPU):  # no spell yet
        assert torch.get_num_threads() == team
    busy_spell()  # begins one unless the policy is off
    for device in (CPU if policy == "off" else None, torch.device("meta")):
        with ops.team_scope(device):
            assert torch.get_num_threads() == team


@pytest.mark.parametrize("policy", ["pool"], indirect=True)
def test_nested_scopes_restore_at_the_outermost_also_on_an_exception(policy: str) -> None:
    team = torch.get_num_threads()
    busy_spell()
    with pytest.raises(RuntimeError, match="inside"):
        with ops.team_scope(CPU):
            with ops.team_scope(CPU):
                pass
            assert torch.get_num_threads() == team - 1  # the inner leave was not the outermost
            raise RuntimeError("inside")
    assert torch.get_num_threads() == team
    NATIVE_CPU.team_leave()  # a leave with no scope entered does nothing
    assert torch.get_num_threads() == team


@pytest.mark.parametrize("policy", ["pool"], indirect=True)
def test_a_forward_in_a_spell_narrows_torch_inside_and_gives_the_same_outputs(policy: str) -> None:
    model = tiny_bert()
    ids = torch.randint(0, 120, (3, 40))
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    with torch.inference_mode():
        quiet = model(ids, mask).last_hidden_state
        seen = _threads_inside(model.encoder)
        team = torch.get_num_threads()
        busy_spell()
        busy = model(ids, mask).last_hidden_state
        assert seen == [(team - 1, NATIVE_CPU.threading()[0])] and torch.get_num_threads() == team
        busy_spell()
        with pytest.raises(ValueError):
            model(ids, mask[:, :5])  # a mask of the wrong shape: the scope is left on the way out
        assert torch.get_num_threads() == team
    valid = mask.bool()
    assert (busy - quiet)[valid].abs().max().item() <= 1e-5


@pytest.mark.parametrize("policy", ["pool"], indirect=True)
def test_sentence_transformers_pooling_runs_in_the_scope(policy: str, minilm_dir: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    model = fastbert.optimize(st.SentenceTransformer(str(minilm_dir), device="cpu"))
    fastbert.optimize(model)  # twice: one scope still, not two hooks
    assert list(model._forward_pre_hooks.values()).count(native.enter_team_scope) == 1
    seen = _threads_inside(model[1])  # the Pooling module, after the encoder
    team = torch.get_num_threads()
    busy_spell()
    model.encode(["a man plays a guitar", "the cat sleeps"])
    assert seen and seen[0][0] == team - 1 and torch.get_num_threads() == team

    def fail(*_: object) -> None:
        raise RuntimeError("pooling failed")

    failing = model[1].register_forward_hook(fail)
    busy_spell()
    with pytest.raises(RuntimeError, match="pooling failed"):
        model.encode(["a man plays a guitar"])
    assert torch.get_num_threads() == team
    failing.remove()

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    interrupting = model[1].register_forward_hook(interrupt)
    busy_spell()
    with pytest.raises(KeyboardInterrupt):  # torch skips always_call hooks on it: the scope is left open...
        model.encode(["a man plays a guitar"])
    interrupting.remove()
    model.encode(["the cat sleeps"])  # ...and the next encode closes it first
    assert torch.get_num_threads() == team
    native.set_busy_host_policy(policy)  # no spell: the encode after narrows nothing and leaves nothing open
    model.encode(["the cat sleeps"])
    assert torch.get_num_threads() == team
