"""benchmarks/busy_summary.py: fastbert against the best other system of each precision at every load, each system's
busy/quiet ratio, and clear refusals for a folder it cannot summarise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import busy_summary


def _run(folder: Path, name: str, counts: dict[str, int], speeds: dict[str, float], kind: str = "avx512-amx") -> None:
    rows = [{"system": s, "sentences_per_s": v} for s, v in speeds.items()]
    rows.append({"system": "OpenVINO fp32", "failed": "not installed"})
    doc = {"workload": "w", "device": "d", "cpu_kind": kind, "commit": "abcdef0123", "load_average": [1.0, 2.5],
           "neighbour_counts": counts, "rows": rows}  # fmt: skip
    (folder / f"{name}.json").write_text(json.dumps(doc))


QUIET = {"fastbert fp32": 400.0, "onnxruntime fp32 (plain export)": 300.0, "fastbert int8": 1000.0,
         "onnxruntime dynamic int8": 700.0, "OpenVINO int8 (NNCF)": 800.0}  # fmt: skip
BUSY = {"fastbert fp32": 200.0, "onnxruntime fp32 (plain export)": 250.0, "fastbert int8": 600.0,
        "onnxruntime dynamic int8": 350.0, "OpenVINO int8 (NNCF)": 500.0}  # fmt: skip


def test_each_precision_against_its_best_other_system_and_busy_over_quiet(tmp_path: Path) -> None:
    _run(tmp_path, "b", {"spin": 1}, BUSY)
    _run(tmp_path, "a", {}, QUIET)
    assert busy_summary.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary_cpu-avx512-amx.json").read_text())
    quiet, busy = summary["rows"]  # quiet first, whatever the file names
    assert quiet["load"] == "none (quiet)" and busy["load"] == "1 busy loop" and busy["load_average"] == 2.5
    assert quiet["precisions"]["int8"] == {"fastbert": 1000.0, "best_other": "OpenVINO int8 (NNCF)", "other": 800.0,
                                           "ratio": 1.25}  # fmt: skip
    assert busy["precisions"]["fp32"]["ratio"] == pytest.approx(0.8)  # behind: onnxruntime is the best other
    assert "bf16" not in busy["precisions"]  # no bf16 rows: no bf16 column
    ratios = busy["busy_over_quiet"]
    assert ratios["fastbert fp32"] == 0.5 and ratios["onnxruntime dynamic int8"] == 0.5
    table = (tmp_path / "summary_cpu-avx512-amx.md").read_text()
    assert "**0.80x**" in table and "**1.25x**" in table and "bf16" not in table
    (tmp_path / "torch2").mkdir()
    _run(tmp_path / "torch2", "c", {"torch": 2}, BUSY)  # a folder per load (make bench-busy); the summary is no run
    assert busy_summary.main([str(tmp_path)]) == 0
    assert [r["load"] for r in json.loads((tmp_path / "summary_cpu-avx512-amx.json").read_text())["rows"]] == [
        "none (quiet)", "1 busy loop", "2 torch workers"]


def test_a_folder_without_runs_or_mixing_cpus_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no bench_encode runs"):
        busy_summary.main([str(tmp_path)])
    _run(tmp_path, "a", {}, QUIET)
    _run(tmp_path, "b", {"spin": 1}, BUSY, kind="avx2")
    with pytest.raises(SystemExit, match="different CPU kinds"):
        busy_summary.main([str(tmp_path)])
    _run(tmp_path, "b", {"spin": 1}, BUSY)
    _run(tmp_path, "c", {"spin": 1}, BUSY)  # two runs of one load: which is meant?
    with pytest.raises(SystemExit, match="more than one run of a load"):
        busy_summary.main([str(tmp_path)])
