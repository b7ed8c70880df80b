"""Smoke test of the model throughput suite's code path on a tiny config: every system builds and runs, the outputs
(JSON, Markdown, PNG) are written, errors are measured, the extra-row hook works. No timing assertions."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
from collections.abc import Callable

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


def test_error_column_is_the_last_timed_calls() -> None:
    """fastbert's first call binds its plan module by module; the timed calls replay a CUDA graph or run the plan's
    loop. The error column must be the timed path's: here call n is off by n / 8, so the last timed call of 2 warm-up
    calls and 3 rounds is off by 5 / 8 (the first by 1 / 8), and a system whose first call alone is wrong shows 0."""
    from tqdm import tqdm

    reference = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    calls = {"drifting": 0, "settling": 0}

    def runner(name: str, off: Callable[[int], float]) -> model_systems.Runner:
        def run(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            calls[name] += 1
            return reference + off(calls[name])

        return run

    systems = [
        model_systems.System("drifting", "fp32", runner("drifting", lambda n: n / 8)),
        model_systems.System("settling", "fp32", runner("settling", lambda n: 1.0 if n == 1 else 0.0)),
    ]
    batch = (torch.ones(2, 5, dtype=torch.long), mask, torch.zeros(2, 5, dtype=torch.long))
    with tqdm(disable=True) as progress:
        results, failed = run_model.bench_shape(systems, batch, reference, 3, torch.device("cpu"), progress)
    assert not failed and calls == {"drifting": 5, "settling": 5}
    assert results["drifting"][1] == pytest.approx(5 / 8, abs=1e-6)
    assert results["settling"][1] == 0.0


def test_gpu_suite_has_a_graphs_off_fastbert_row(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the drop-in row runs with its default CUDA graphs; 'fastbert (no graphs)' is the same model with them
    turned off (cuda_graphs.disable), so the table shows what the graphs buy. Off CUDA it says why it has no row."""
    assert "fastbert (no graphs)" in run_model.GPU_SYSTEMS
    hf = run_model.load_model("tiny").eval()
    cpu_row = model_systems._build("fastbert (no graphs)", hf, torch.device("cpu"), torch.float32, str(tmp_path))
    assert cpu_row.run is None and cpu_row.skipped.startswith("CUDA only")

    built = []
    with monkeypatch.context() as patch:  # the CUDA row's wiring, without a GPU
        patch.setattr(model_systems, "fastbert_dropin_runner", lambda *args, **kwargs: built.append(kwargs))
        row = model_systems._build("fastbert (no graphs)", hf, torch.device("cuda"), torch.float16, str(tmp_path))
    assert built == [{"graphs": False}] and row.mode == "weights; drop-in, CUDA graphs off"

    disabled = []
    disable = model_systems.cuda_graphs.disable
    monkeypatch.setattr(model_systems.cuda_graphs, "disable", lambda model: disabled.append(disable(model)) or model)
    run = model_systems.fastbert_dropin_runner(hf, torch.device("cpu"), torch.float32, str(tmp_path), graphs=False)
    assert len(disabled) == 1 and disabled[0].cuda_graphs is False
    ids = torch.randint(1, hf.config.vocab_size, (2, 6))
    mask, types = torch.ones_like(ids), torch.zeros_like(ids)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    torch.testing.assert_close(run(ids, mask, types), expected, atol=1e-4, rtol=0)


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



def test_weights_line_is_the_time_to_read_the_encoders_weights_once() -> None:
    """1 GB of weights at 10 GB/s is 0.1 s a forward: 16 real tokens a forward make 160 tok/s, 2x sdpa's 80; a shape
    with no row that knows its weights (an older run's file) gets no bound, and no bandwidth gives no line."""
    base = dict(shape="b1 s16", real_tokens=16, skipped=None, weight_bytes=10**9)
    rows = [dict(base, system="transformers sdpa", tok_per_s=80.0), dict(base, system="fastbert", tok_per_s=120.0),
            dict(base, shape="b8 s128", weight_bytes=None, system="fastbert", tok_per_s=1.0)]  # fmt: skip
    line = model_report._weights_line(rows, 10e9, "fp32")
    assert line.startswith("Bound by reading the encoder's 1,000 MB of fp32 weights once a forward")
    assert "b1 s16 160 real tok/s = 2.00x sdpa" in line and "b8 s128" not in line
    assert model_report._weights_line(rows, None, "fp32") == ""


def test_weight_bytes_and_read_bandwidth() -> None:
    """BERT-base's encoder, not its embeddings: 12 layers of 7,087,872 parameters, 4 bytes each in fp32, 2 in bf16; a
    finite bandwidth on CPU, None elsewhere."""
    import transformers

    with torch.device("meta"):
        model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=12))
    assert run_model.weight_bytes(model, "fp32") == 4 * 12 * 7_087_872
    assert run_model.weight_bytes(model, "bf16") == 2 * 12 * 7_087_872
    bandwidth = run_model.measure_read_bandwidth(torch.device("cpu"))
    assert bandwidth is not None and math.isfinite(bandwidth) and bandwidth > 0
    assert run_model.measure_read_bandwidth(torch.device("meta")) is None


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


# The published config.json of each checkpoint the suite builds from random weights (bert-base-uncased, roberta-base)
REAL_CONFIGS = {
    "bert-base": dict(vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0,
                      layer_norm_eps=1e-12, hidden_size=768, num_hidden_layers=12, intermediate_size=3072),
    "roberta-base": dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                         bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5, hidden_size=768, num_hidden_layers=12,
                         intermediate_size=3072),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_model_configs_are_the_real_checkpoints(name: str) -> None:
    """roberta-base has 514 positions (RobertaConfig() has 512: transformers' RoBERTa device-asserts at length 512)."""
    config = run_model.model_config(name)
    assert {key: getattr(config, key) for key in REAL_CONFIGS[name]} == REAL_CONFIGS[name]


def test_every_suite_shape_fits_its_model() -> None:
    """No shape of any suite (GPU default and full, CPU default) goes past a model's positions, vocabulary or types."""
    seen = set()
    for device, kind in (("cuda", "default"), ("cuda", "full"), ("cpu", "default"), ("cpu", "tiny")):
        suite = run_model.suite_for(torch.device(device), kind)
        for model in suite.models:
            try:
                config = run_model.model_config(model)
            except ImportError:  # the MiniLM checkpoint package is not installed here
                continue
            for shape in suite.shapes[model]:
                if (model, shape) not in seen:
                    seen.add((model, shape))
                    cpu = torch.device("cpu")
                    batch = run_model.make_batch(shape, config.vocab_size, cpu, pad_id=config.pad_token_id)
                    assert run_model.input_problem(config, *batch) is None, (model, shape)
    assert ("roberta-base", run_model.Shape(16, 512, True, 0.2)) in seen


def test_input_past_a_models_limits_is_a_row_not_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch longer than the model's positions is refused before any system runs (on CUDA the index error is a
    device-side assert that would lose the process's CUDA context): its rows say why."""
    monkeypatch.setattr(run_model, "measure_peak", lambda device, dtype: 1e9)
    config = run_model.model_config

    def short_roberta(name: str) -> object:
        short = config(name)
        short.max_position_embeddings = 17  # 16 tokens need 18 with RoBERTa's offset (pad_token_id + 1)
        return short

    monkeypatch.setattr(run_model, "model_config", short_roberta)
    suite = run_model.suite_for(torch.device("cpu"), "tiny")
    suite.models, suite.dtypes, suite.systems = ("tiny-roberta",), ("fp32",), ("transformers sdpa", "fastbert")
    doc = run_model.run_suite(suite, torch.device("cpu"))
    assert {r["skipped"] for r in doc["rows"]} == {
        "not run: length 16 needs 18 position embeddings (RoBERTa counts from pad_token_id + 1); the model has 17"
    }


def _fake_rows(suite: run_model.Suite, model: str, dtype: str) -> list[run_model.Row]:
    shape = suite.shapes[model][0]
    return [
        run_model.Row(model, dtype, shape.label(), shape.batch, shape.seqlen, 20, system, "fp32", ms=1.0, host_ms=0.5)
        for system in suite.systems
    ]


def test_isolation_keeps_a_dead_childs_rows_and_names_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each (model, dtype) runs in its own process: the rows it wrote before dying are kept, every other row says the
    process died, and the next (model, dtype) runs all the same."""
    monkeypatch.setattr(run_model, "measure_peak", lambda device, dtype: 1e9)
    suite = run_model.suite_for(torch.device("cpu"), "tiny")
    suite.models, suite.systems = ("tiny",), ("transformers sdpa", "fastbert", "fastbert (drop-in)")
    calls = []

    def child(one: run_model.Suite, device: torch.device, path: str, workdir: str) -> int:
        (model,), (dtype,) = one.models, one.dtypes
        calls.append((model, dtype, str(device)))
        rows = _fake_rows(one, model, dtype)
        with open(path, "w", encoding="utf-8") as f:
            for row in rows if dtype == "bf16" else rows[:1]:  # fp32: one row, then a device-side assert kills it
                f.write(json.dumps([dataclasses.asdict(row)]) + "\n")
        return 0 if dtype == "bf16" else -6

    monkeypatch.setattr(run_model, "_spawn_child", child)
    doc = run_model.run_suite(suite, torch.device("cpu"), isolate=True)
    assert calls == [("tiny", "fp32", "cpu"), ("tiny", "bf16", "cpu")]
    rows = {(r["dtype"], r["system"]): r for r in doc["rows"]}
    assert len(rows) == len(doc["rows"]) == 6
    assert rows[("fp32", "transformers sdpa")]["ms"] == 1.0 and rows[("bf16", "fastbert")]["host_ms"] == 0.5
    assert all(rows[("bf16", s)]["skipped"] is None for s in suite.systems)
    for system in suite.systems[1:]:
        assert rows[("fp32", system)]["skipped"] == (
            "failed: its isolated process (tiny fp32) died with exit code -6 (SIGABRT) before this row"
        )


def test_isolated_child_runs_the_real_systems(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real child process (spawned: a fresh interpreter, as on CUDA) measures the rows and hands them back."""
    monkeypatch.setattr(run_model, "measure_peak", lambda device, dtype: 1e9)
    suite = run_model.suite_for(torch.device("cpu"), "tiny")
    suite.models, suite.dtypes = ("tiny-roberta",), ("fp32",)
    suite.systems = ("transformers sdpa", "fastbert (drop-in)")
    doc = run_model.run_suite(suite, torch.device("cpu"), isolate=True)
    rows = {r["system"]: r for r in doc["rows"]}
    assert set(rows) >= set(suite.systems)
    drop_in = rows["fastbert (drop-in)"]
    assert drop_in["skipped"] is None and drop_in["max_abs_err"] <= 1e-4 and drop_in["host_ms"] > 0


def test_gpu_table_shows_gpu_and_host_ms() -> None:
    """On a GPU the table puts the host's time per forward (launch side) next to the GPU's."""
    row = dict(model="bert-base", dtype="fp16", shape="b1 s128 fixed", real_tokens=128, system="fastbert.optimize",
               mode="weights", ms=2.5, cpu_ms=2.6, host_ms=0.4, seq_per_s=400.0, tok_per_s=51200.0,
               speedup_vs_sdpa=1.5, flops_per_s=1e12, pct_peak=10.0, max_abs_err=1e-3, skipped=None)  # fmt: skip
    doc = dict(device="a GPU", device_type="cuda", commit="abc", date_utc="now", load_average=None,
               peak_flops={"fp16": 1e13}, rows=[row])  # fmt: skip
    table = model_report.markdown(doc)
    assert "| mode | GPU ms | host ms | seq/s |" in table
    assert "| fastbert.optimize | weights | 2.50 | 0.40 | 400.0 |" in table


def test_commit_without_a_repository_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A working tree copied to a GPU machine has no .git: the results name the commit the sender set."""

    def no_repository(*args: object, **kwargs: object) -> None:
        raise model_report.subprocess.CalledProcessError(128, "git")

    monkeypatch.setattr(model_report.subprocess, "run", no_repository)
    monkeypatch.setenv("FASTBERT_COMMIT", "05ee3c9+dirty")
    assert model_report.git_commit() == "05ee3c9+dirty"
    monkeypatch.delenv("FASTBERT_COMMIT")
    assert model_report.git_commit() == "unknown"


@pytest.mark.parametrize("name", ["tiny-roberta", "tiny-modernbert", "tiny-gte"])
def test_onnxruntime_and_fastbert_rows_run_every_family(name: str, tmp_path) -> None:
    """The onnxruntime export traces with token type 0 (RoBERTa and GTE have one token type: a traced 1 was an
    IndexError, which skipped their rows) and feeds token types only to a model that takes them (ModernBERT does
    not); fastbert's row does the same. Each row matches transformers."""
    import transformers

    torch.manual_seed(0)
    tiny = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                max_position_embeddings=64)  # fmt: skip
    hf = {"tiny-roberta": lambda: transformers.RobertaModel(transformers.RobertaConfig(**tiny, type_vocab_size=1)),
          "tiny-modernbert": lambda: transformers.ModernBertModel(transformers.ModernBertConfig(
              **tiny, local_attention=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
              sep_token_id=2)),
          "tiny-gte": lambda: transformers.GteModel(transformers.GteConfig(**tiny, type_vocab_size=1))}[name]().eval()
    ids, mask, types = run_model.make_batch(run_model.Shape(3, 12, True), 99, torch.device("cpu"), pad_id=0)
    extra = {"token_type_ids": types} if model_systems.takes_token_types(hf) else {}
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, **extra).last_hidden_state
        ort = model_systems.onnxruntime_runner(hf, str(tmp_path))(ids, mask, types)
        fast = model_systems.fastbert_runner(hf, torch.device("cpu"), torch.float32)(ids, mask, types)
    valid = mask.bool()
    assert (ort - want)[valid].abs().max() < 1e-4 and (fast - want)[valid].abs().max() < 1e-4


def test_the_kernel_suite_builds_modernberts_attention_cases_with_kept_pair_flops() -> None:
    """bench_kernels' rotary cases (global and a 128-token window) on CPU tensors: the FLOPs are 4 nH D times the
    pairs kept, all L^2 on a global layer and fewer with the window; each variant computes the reference's output."""
    from benchmarks import bench_kernels

    built = bench_kernels.build_cases(torch.float32, 2, dev="cpu")
    cases = {c.op: c for c in built if c.shape.startswith("B=2, S<=128")}
    full, windowed = cases["attention rotary global"], cases["attention rotary window 128"]
    assert full.fwd_work == cases["attention ragged"].fwd_work and windowed.fwd_work < full.fwd_work
    assert bench_kernels.window_pairs(torch.tensor([5]), 1) == 13  # 5 + 2 * 4 pairs within distance 1
    qkv = windowed.inputs[0]
    with torch.no_grad():  # the window leaves keys out: another output than the global layer's
        assert not torch.equal(windowed.variants["torch eager"](qkv), full.variants["torch eager"](qkv))


def test_a_failed_rows_reason_keeps_the_cause_after_a_location_line() -> None:
    """OpenVINO raises 'Exception from src/inference/src/cpp/core.cpp:117:' and the cause on the lines after it."""
    where = "Exception from src/inference/src/cpp/core.cpp:117:"
    exc = RuntimeError(f"{where}\n\n[ GENERAL_ERROR ] no kernel for f32 MatMul\n")
    reason = model_systems.failure(exc)
    assert reason == ("RuntimeError: Exception from src/inference/src/cpp/core.cpp:117: / [ GENERAL_ERROR ] no kernel "
                      "for f32 MatMul")  # fmt: skip
    long = model_systems.failure(ValueError("x" * 5000))
    assert len(long) <= len("ValueError: ") + model_systems.FAILURE_CHARS and long.endswith("...")
    assert model_systems.failure(KeyError()) == "KeyError: no message"


@pytest.mark.parametrize(("median", "warned"), [(70.0, True), (95.0, False), (None, False)])
def test_an_unsteady_host_is_warned_about_though_its_load_is_low(median: float | None, warned: bool) -> None:
    """A quiet load average with a fixed GEMM's median well below its best (a shared host's other tenants) gets the
    warning every table and plot prints; a steady probe, or none recorded (older runs), does not."""
    doc = {"load_average": (0.1, 0.1, 0.1), "host_steadiness": None}
    if median is not None:
        doc["host_steadiness"] = {"best_gflops": 100.0, "median_gflops": median}
    warning = model_report.load_warning(doc)
    assert (warning is not None and "unsteady" in warning and f"{median / 100:.0%}" in warning) if warned else (
        warning is None)  # fmt: skip


def test_host_steadiness_times_a_real_gemm() -> None:
    probe = model_report.host_steadiness(seconds=0.05)
    assert 0 < probe["median_gflops"] <= probe["best_gflops"]
