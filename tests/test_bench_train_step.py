"""The training-step benchmark's whole path on the tiny model, every row and system (torch.compile itself stubbed out:
dynamo takes ~8 s per model to trace even on its eager backend, the whole test's budget; `--compile-backend eager`
runs it for real in about a minute, gpu_check.sh's train stage with inductor): the rows are complete, fastbert's
first-step loss equals transformers' (same weights, same batch, fp32, no dropout), the results name the CPU, and a
system that fails is a row with its reason. No speed assertions: speed is the machine's."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import bench_train_step  # noqa: E402


@pytest.fixture
def fixed_peak(monkeypatch):
    """A stand-in for the large-matmul peak (its own measurement takes seconds; the formula is what is checked), and
    torch.compile as the identity (see above)."""
    monkeypatch.setattr(bench_train_step, "measure_peak", lambda device, dtype: 1e11)
    monkeypatch.setattr(torch, "compile", lambda model, backend=None: model)


@pytest.fixture(autouse=True)
def _keep_threads():
    """--threads 1 below (one thread is quickest for the tiny model on a shared CPU); torch's setting restored."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(tmp_path, *extra: str) -> dict:
    out = tmp_path / "out"
    args = ["--device", "cpu", "--quick", "--precision", "fp32", "--dropout", "0", "--rounds", "1", "--warmup", "1",
            "--compile-backend", "eager", "--threads", "1", "--out", str(out), *extra]  # fmt: skip
    assert bench_train_step.main(args) == 0
    doc = json.loads(next(out.glob("train_step_cpu-*.json")).read_text())
    doc["markdown"] = next(out.glob("train_step_cpu-*.md")).read_text()
    return doc


def test_every_row_runs_and_fastbert_matches_transformers_at_step_0(tmp_path, fixed_peak) -> None:
    doc = _run(tmp_path)
    tasks = [t.label for t in bench_train_step.tasks_for(quick=True, tiny=True)]
    assert [(r["task"], r["system"]) for r in doc["rows"]] == [(t, s) for t in tasks for s in bench_train_step.SYSTEMS]
    for row in doc["rows"]:
        assert row["skipped"] is None, row
        assert all(row[k] > 0 for k in ("ms", "host_ms", "seq_per_s", "tok_per_s", "useful_tflops", "pct_peak")), row
        assert 0 < row["real_tokens"] <= row["batch"] * row["seqlen"]
    by = {(r["task"], r["system"]): r for r in doc["rows"]}
    for task in tasks:
        base = by[task, "transformers sdpa"]
        assert base["ratio_vs_sdpa"] == pytest.approx(1.0)
        for system in bench_train_step.SYSTEMS[1:]:
            assert by[task, system]["loss0"] == pytest.approx(base["loss0"], rel=1e-5, abs=1e-6), (task, system)
    assert doc["cpu"] and doc["cpu"] in doc["device"] and doc["commit"] and doc["versions"]["torch"]
    assert doc["device"] in doc["markdown"]


def test_a_failing_system_is_a_row_with_its_reason(tmp_path, fixed_peak, monkeypatch) -> None:
    real = bench_train_step.make_step

    def broken(task, system, *args, **kwargs):
        if system == "fastbert":
            raise RuntimeError("boom in fastbert")
        return real(task, system, *args, **kwargs)

    monkeypatch.setattr(bench_train_step, "make_step", broken)
    doc = _run(tmp_path, "--systems", "transformers sdpa", "fastbert")
    fb = [r for r in doc["rows"] if r["system"] == "fastbert"]
    assert fb and all("boom in fastbert" in r["skipped"] and r["ms"] is None for r in fb)
    assert all(r["ms"] > 0 for r in doc["rows"] if r["system"] != "fastbert")
    assert "did not run: RuntimeError: boom in fastbert" in doc["markdown"]


def test_rows_past_the_time_budget_say_so(tmp_path, fixed_peak) -> None:
    doc = _run(tmp_path, "--systems", "transformers sdpa", "fastbert", "--max-minutes", "1e-9")
    assert doc["rows"] and all("--max-minutes" in r["skipped"] and r["ms"] is None for r in doc["rows"])


def test_useful_flops_formula() -> None:
    lengths = torch.tensor([3, 5])
    # 6 * P * tokens + 12 * L * sum(s^2) * d; a forward without grad is a third
    assert bench_train_step.useful_flops(10, 2, 4, lengths) == 6 * 10 * 8 + 12 * 2 * (9 + 25) * 4
    assert bench_train_step.useful_flops(10, 2, 4, lengths, train=False) * 3 == pytest.approx(
        bench_train_step.useful_flops(10, 2, 4, lengths))
