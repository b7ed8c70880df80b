"""benchmarks/headline.py: each system group's fp32 and best precision from a run's folder, fastbert's lead over the
best other group, the load above the table, and a clear error for a folder with no results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import headline

COMMON = {"device": "Some CPU (2 logical CPUs)", "cpu_key": "vendor-family1-model2", "cpu_kind": "avx2",
          "commit": "0123456789abcdef", "date_utc": "2026-11-28T00:00:00Z",
          "load_average": [0.1, 0.1, 0.1]}  # fmt: skip


def _encode_row(system: str, speed: float, spearman: float = 86.0, **extra: object) -> dict:
    return {"system": system, "sentences_per_s": speed, "spearman": spearman, **extra}


def _model_row(system: str, dtype: str, speed: float, batch: int = 8, seqlen: int = 128) -> dict:
    return {"model": "bert-base", "dtype": dtype, "shape": f"b{batch} s{seqlen} ragged[0.25S,S]", "batch": batch,
            "seqlen": seqlen, "system": system, "tok_per_s": speed, "skipped": None}  # fmt: skip


def _write(folder: Path, name: str, rows: list[dict], **extra: object) -> None:
    (folder / name).write_text(json.dumps({**COMMON, **extra, "rows": rows}))


def test_best_precision_per_group_and_the_lead(tmp_path: Path) -> None:
    _write(tmp_path, "encode_cpu-avx2.json", [
        _encode_row("fastbert fp32", 700), _encode_row("fastbert int8", 1500, 86.5),
        _encode_row("onnxruntime fp32 (plain export)", 480), _encode_row("onnxruntime fp32 (fastbert export)", 500),
        _encode_row("onnxruntime dynamic int8", 800), _encode_row("OpenVINO fp32", 540),
        _encode_row("OpenVINO default", 900, note="ran bf16 here"), _encode_row("OpenVINO int8 (NNCF)", 1200),
        _encode_row("sentence-transformers", 510), {"system": "torch dynamic int8", "failed": "no"},
    ])  # fmt: skip
    _write(tmp_path, "encode_cpu-avx2-mpnet.json", [_encode_row("fastbert fp32", 1.0)])  # another model: not read
    _write(tmp_path, "model_cpu-avx2.json", [
        _model_row("fastbert", "fp32", 1600), _model_row("fastbert", "bf16", 2000),
        _model_row("fastbert int8", "fp32", 4500),
        _model_row("OpenVINO", "fp32", 1100), _model_row("OpenVINO int8 (NNCF)", "fp32", 3000),
        _model_row("onnxruntime", "fp32", 1000), _model_row("transformers sdpa", "fp32", 1000),
        _model_row("fastbert", "fp32", 9999, batch=1),  # another shape: not the headline's
    ], device_type="cpu")  # fmt: skip
    table = headline.headline(str(tmp_path))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()
            if line.startswith("| ") and "---" not in line}  # fmt: skip
    assert rows["**fastbert**"] == ["700", "1,500 (int8, STS-B 86.50)", "1,600", "4,500 (int8)"]
    assert rows["OpenVINO"] == ["540", "1,200 (int8, STS-B 86.00)", "1,100", "3,000 (int8)"]
    assert rows["onnxruntime"] == ["500", "800 (int8, STS-B 86.00)", "1,000", "1,000 (fp32)"]
    assert rows["transformers"][:2] == ["510", "510 (fp32, STS-B 86.00)"]  # the failed int8 row is not counted
    assert rows["fastbert vs the best other"] == ["1.30x", "1.25x", "1.45x", "1.50x"]
    assert "vendor-family1-model2" in table and "Load: quiet" in table


def test_a_busy_run_says_so_above_the_table(tmp_path: Path) -> None:
    _write(tmp_path, "encode_cpu-avx2.json", [_encode_row("fastbert fp32", 300)], neighbours="1 x busy loop",
           neighbour_counts={"spin": 1})  # fmt: skip
    table = headline.headline(str(tmp_path))
    assert "Busy host on purpose: 1 x busy loop" in table
    assert "| **fastbert** | 300 | 300 (fp32, STS-B 86.00) | - | - |" in table


def test_a_folder_without_results_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no encode_cpu"):
        headline.headline(str(tmp_path))


def test_a_direct_run_without_out_writes_a_fresh_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark called with no --out writes results/runs/<cpu key>/<time>/, never over the committed results."""
    from benchmarks import bench_gemm, run_folder
    from fastbert.backends import gemm
    from fastbert.capabilities import cpu_key, cpu_kind

    if (why := gemm.unavailable_reason()) is not None:
        pytest.skip(f"bench_gemm writes nothing here: {why}")
    monkeypatch.setattr(run_folder, "RESULTS", str(tmp_path))
    committed = tmp_path / f"gemm_cpu-{cpu_kind()}.json"  # the name this run writes
    committed.write_text("{}")
    assert bench_gemm.main(["--hidden", "16", "--rows", "7", "--budget", "0.01"]) == 0
    (run,) = (tmp_path / "runs" / cpu_key()).iterdir()
    assert (run / committed.name).exists() and committed.read_text() == "{}"
    assert not list(tmp_path.glob("gemm_cpu-*.md"))
