"""Wall-time budgets hold, the final evaluation included, and a long eval interval still evaluates a few times: the
shared loop on a fake clock (each training step costs 1 s, each evaluation 5 s), so no test depends on this machine."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fastbert.train import LengthGroupedBatchSampler, LoopConfig, init_distributed
from fastbert.train import loop as train_loop

STEP_S, EVAL_S = 1.0, 5.0


class FakeClock:
    """Seconds that pass only when the fake model trains or evaluates."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tiny(nn.Module):
    """A linear regressor whose every training forward costs STEP_S on the fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.linear, self.clock = nn.Linear(4, 1), clock

    def forward(self, x: torch.Tensor) -> SimpleNamespace:
        self.clock.now += STEP_S if self.training else 0.0
        return SimpleNamespace(loss=self.linear(x).pow(2).mean())

    def save_pretrained(self, directory: str) -> None:
        """What fit() calls to write the final model: an empty folder."""
        os.makedirs(directory, exist_ok=True)


def run(tmp_path, monkeypatch, examples: int = 4000, eval_seconds: float | None = None, **cfg) -> tuple[dict, float]:
    """fit() on the fake clock; returns its result and the fake seconds the whole call took."""
    clock = FakeClock()
    monkeypatch.setattr(train_loop, "clock", clock)
    model = Tiny(clock)

    def evaluate(m: nn.Module) -> dict[str, float]:
        clock.now += EVAL_S
        return {"eval_loss": 0.0}

    data = torch.randn(examples, 4)
    sampler = LengthGroupedBatchSampler([4] * examples, 1, 0)
    result = train_loop.fit(
        model,
        range(examples),
        lambda rows: {"x": data[rows]},
        sampler,
        LoopConfig(str(tmp_path), epochs=1.0, log_every=1000, **cfg),
        init_distributed("cpu"),
        evaluate,
        eval_seconds=eval_seconds,
    )
    return result, clock.now


def eval_steps(result: dict) -> list[int]:
    return [r["step"] for r in result["history"] if "eval_loss" in r]


def test_budget_includes_the_final_evaluation(tmp_path, monkeypatch):
    result, spent = run(tmp_path, monkeypatch, max_minutes=0.5)  # 30 s: room for about 20 steps, not 4000
    assert spent <= 30.0
    assert 10 <= result["step"] < 30
    assert eval_steps(result)[-1] == result["step"]  # the final evaluation ran, inside the budget


def test_budget_counts_the_callers_evaluation(tmp_path, monkeypatch):
    result, spent = run(tmp_path, monkeypatch, max_minutes=0.5, eval_seconds=EVAL_S)  # as distill() passes it
    assert spent + EVAL_S <= 30.0
    assert eval_steps(result) == [result["step"]]  # no evaluation of its own before training


def test_eval_interval_beyond_the_budget_still_evaluates_three_times(tmp_path, monkeypatch):
    result, spent = run(tmp_path, monkeypatch, max_minutes=1.0, eval_every=10_000)
    assert spent <= 60.0
    assert len([s for s in eval_steps(result) if s > 0]) >= train_loop.MIN_EVALS


def test_eval_interval_is_capped_by_the_run_length(tmp_path, monkeypatch):
    result, _ = run(tmp_path, monkeypatch, max_steps=12, eval_every=100)
    assert eval_steps(result) == [4, 8, 12]
    result, _ = run(tmp_path, monkeypatch, max_steps=12, eval_every=2, overwrite=True)  # the same output folder
    assert eval_steps(result) == [2, 4, 6, 8, 10, 12]


@pytest.mark.parametrize("every, total, expected", [(100, 12, 4), (2, 12, 2), (5, 1, 1), (10, 31, 10)])
def test_eval_interval(every, total, expected):
    assert train_loop.eval_interval(every, total) == expected
