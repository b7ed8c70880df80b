"""Smoke test of the model throughput suite's code path on a tiny config: every system builds and runs, the outputs
(JSON, Markdown, PNG) are written, errors are measured, the extra-row hook works. No timing assertions."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
pytest.importorskip("matplotlib")

from benchmarks import model_report, model_systems, run_model  # noqa: E402


def test_tiny_suite_writes_every_output(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = types.ModuleType("fake_extra_row")
    extra.NAME = "extra system"
    extra.build = lambda hf, dtype, device: (
        (lambda ids, mask, tt: hf(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state)
        if dtype == torch.float32
        else None
    )
    broken = types.ModuleType("fake_broken_row")  # builds, then fails at its first call (a compile, a capture)
    broken.NAME = "broken system"
    broken.build = lambda hf, dtype, device: lambda ids, mask, tt: (_ for _ in ()).throw(
        RuntimeError("capture") if dtype == torch.float32 else AssertionError()  # a message, and none
    )
    monkeypatch.setitem(sys.modules, "fake_extra_row", extra)
    monkeypatch.setitem(sys.modules, "fake_broken_row", broken)
    monkeypatch.setattr(model_systems, "EXTRA_SYSTEMS", ("fake_extra_row", "fake_broken_row", "no_such_module_here"))
    load = run_model.load_model

    def load_or_absent(name: str) -> torch.nn.Module:
        if name == "absent":
            raise ImportError("No module named 'absent_checkpoint'")
        return load(name)

    monkeypatch.setattr(run_model, "load_model", load_or_absent)
    suite = run_model.suite_for(torch.device("cpu"), "tiny")
    suite.systems = tuple(s for s in suite.systems if "compile" not in s)  # compile takes a minute on 2 cores
    suite.models, suite.shapes["absent"] = ("absent", "tiny"), suite.shapes["tiny"]
    saved_after_each_model = []
    doc = run_model.run_suite(suite, torch.device("cpu"), save=lambda partial: saved_after_each_model.append(partial))
    assert [len(partial["rows"]) for partial in saved_after_each_model] == [
        len(suite.systems) * 2,  # the absent model: skipped rows only, kept all the same
        len(doc["rows"]),
    ]
    absent = [r for r in doc["rows"] if r["model"] == "absent"]
    assert absent and all("checkpoint not installed" in r["skipped"] for r in absent)
    paths = model_report.write(doc, str(tmp_path))

    stem = f"model_cpu-{doc['cpu_kind']}"
    saved = json.loads((tmp_path / f"{stem}.json").read_text())
    assert saved["commit"] and saved["versions"]["torch"] == torch.__version__
    rows = {(r["dtype"], r["system"]): r for r in saved["rows"] if r["model"] == "tiny"}
    expected = {*suite.systems, "extra system", "broken system"}
    assert {system for _, system in rows} == expected
    assert rows[("fp32", "broken system")]["skipped"] == "failed: RuntimeError: capture"
    assert rows[("bf16", "broken system")]["skipped"] == "failed: AssertionError: no message"
    fast = rows[("fp32", "fastbert")]
    assert fast["max_abs_err"] <= 1e-4 and fast["tok_per_s"] > 0 and fast["speedup_vs_sdpa"] > 0
    assert fast["real_tokens"] < fast["batch"] * fast["seqlen"]  # the tiny shape is ragged
    assert rows[("fp32", "onnxruntime")]["max_abs_err"] <= 1e-4
    assert rows[("bf16", "onnxruntime")]["skipped"]
    assert rows[("bf16", "extra system")]["skipped"]
    assert 0 < rows[("bf16", "fastbert")]["max_abs_err"] < 0.5
    table = (tmp_path / f"{stem}.md").read_text()
    assert "| fastbert |" in table and "onnxruntime" in table
    assert f"## tiny {run_model.dtype_label(torch.device('cpu'), 'bf16')}" in table and "bf16 GEMMs:" in table
    assert (tmp_path / f"{stem}.png").stat().st_size > 0 and len(paths) == 3


def test_a_failing_dtype_or_shape_is_a_row_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never a crashed suite: a system set that cannot be built, or a reference that fails, leaves rows saying why."""
    monkeypatch.setattr(run_model, "measure_peak", lambda device, dtype: 1e9)
    real_build = run_model.build_systems

    def build_or_fail(hf, device, dtype, names, workdir):  # noqa: ANN001, ANN202
        if dtype == torch.bfloat16:
            raise RuntimeError("no bf16 here")
        return real_build(hf, device, dtype, names, workdir)

    monkeypatch.setattr(run_model, "build_systems", build_or_fail)
    monkeypatch.setattr(run_model, "make_batch", lambda *a, **k: (_ for _ in ()).throw(MemoryError("too big")))
    suite = run_model.suite_for(torch.device("cpu"), "tiny")
    suite.systems = ("fastbert",)
    doc = run_model.run_suite(suite, torch.device("cpu"))
    reasons = {r["dtype"]: r["skipped"] for r in doc["rows"]}
    assert reasons == {"fp32": "failed: MemoryError: too big", "bf16": "failed: RuntimeError: no bf16 here"}
    assert doc["dtype_labels"]["bf16"].startswith("bf16")


def test_flops_formula_matches_the_published_bert_base_figure() -> None:
    """ANCHORS.md: BERT-base forward is 174.6 MFLOP per token at seq 128 (2 x 85M + 4*L*s*d)."""
    import transformers

    config = transformers.BertConfig(num_hidden_layers=12)
    with torch.device("meta"):
        model = transformers.BertModel(config)
    per_token = run_model.flops_per_batch(model, torch.tensor([128])) / 128
    assert abs(per_token / 1e6 - 174.6) < 1.0


def test_ragged_lengths_stay_in_range_and_have_the_law_mean() -> None:
    shape = run_model.Shape(64, 128, True)
    _, mask, _ = run_model.make_batch(shape, 1000, torch.device("cpu"))
    lengths = mask.sum(1).float()
    assert lengths.min() >= 32 and lengths.max() <= 128
    assert abs(lengths.mean().item() - 80) < 2


def test_bound_line_is_the_peak_time_of_the_useful_flops() -> None:
    """A shape whose useful work is 2 GFLOP on 1,000 real tokens: at a 100 GFLOP/s peak that is 20 ms, 50,000 tok/s;
    sdpa at 20,000 tok/s makes the bound 2.5x sdpa. Every system of a shape carries the same useful FLOPs."""
    base = dict(shape="b8 s128", real_tokens=1000, skipped=None)
    rows = [
        dict(base, system="transformers sdpa", ms=50.0, flops_per_s=2e9 / 0.05, tok_per_s=20_000.0),
        dict(base, system="fastbert", ms=25.0, flops_per_s=2e9 / 0.025, tok_per_s=40_000.0),
        dict(base, system="onnxruntime", ms=None, flops_per_s=None, tok_per_s=None, skipped="not here"),
    ]
    line = model_report._bound_line(rows, peak=100e9)
    assert "b8 s128 50,000 real tok/s = 2.50x sdpa" in line



def test_arithmetic_peak_checks_its_arguments() -> None:
    """The native FMA probe answers FLOP/s (or None without the instruction) and refuses what it cannot measure."""
    from fastbert.backends import native

    module, why = native.load("_native_cpu")
    if module is None:
        pytest.skip(why)
    peak = module.arithmetic_peak("fp32", 0.01)
    assert peak is None or (math.isfinite(peak) and peak > 0)
    with pytest.raises(ValueError, match="dtype must be"):
        module.arithmetic_peak("fp64")
    with pytest.raises(ValueError, match="seconds must be"):
        module.arithmetic_peak("fp32", 0.0)
