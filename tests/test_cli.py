"""The `fastbert` command: `python -m fastbert`, one-line errors with exit codes (2 usage, 1 data), option ranges."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fastbert.cli import main
from fastbert.distill.trainer import DistillConfig
from fastbert.errors import DataError, UsageError
from fastbert.train import LoopConfig

ROOT = Path(__file__).resolve().parents[1]


def test_python_m_fastbert_runs_the_cli() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "fastbert", "--help"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "pretrain" in done.stdout and "export-onnx" in done.stdout


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of `fastbert ARGV` run in this process."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("A first line.\nCaf\xe9 au lait.\n".encode("latin-1"))
    (tmp_path / "binary.bin").write_bytes(b"PK\x03\x04\x00\x00\x01\x02" * 8)
    (tmp_path / "corpus.txt").write_text("The cat sat.\n\nThe dog ran.\n")
    (tmp_path / "scores.csv").write_text("sentence,score\na cat,4.5\na dog,five\n")
    return tmp_path


PRETRAIN = ["pretrain", "--train", "{d}/corpus.txt", "--output-dir", "{d}/out"]


@pytest.mark.parametrize(
    "argv,code,message",
    [
        (["pretrain", "--train", "{d}/missing.txt", "--output-dir", "{d}/out"], 1, r"missing.txt: no such file"),
        (["pretrain", "--train", "{d}/empty.txt", "--output-dir", "{d}/out"], 1, r"empty.txt: the file is empty"),
        (["pretrain", "--train", "{d}/latin1.txt", "--output-dir", "{d}/out"], 1, r"latin1.txt:2: not UTF-8 text"),
        (["pretrain", "--train", "{d}/binary.bin", "--output-dir", "{d}/out"], 1, r"binary.bin:1: .*binary file"),
        ([*PRETRAIN, "--hidden", "30", "--heads", "4"], 2, r"hidden_size \(30\) must be divisible"),
        ([*PRETRAIN, "--batch-size", "0"], 2, r"argument --batch-size: must be >= 1, got 0"),
        ([*PRETRAIN, "--max-length", "4"], 2, r"argument --max-length: must be >= 5, got 4"),
        ([*PRETRAIN, "--max-length", "64", "--max-position", "32"], 2, r"max_length 64 > .*max_position_embeddings"),
        ([*PRETRAIN, "--vocab-size", "0"], 2, r"argument --vocab-size: must be >= 6, got 0"),
        ([*PRETRAIN, "--max-steps", "-5"], 2, r"argument --max-steps: must be >= 1, got -5"),
        ([*PRETRAIN, "--warmup-ratio", "1.5"], 2, r"argument --warmup-ratio: must be >= 0 and < 1, got 1.5"),
        ([*PRETRAIN, "--lr", "nan"], 2, r"argument --lr: must be > 0, got nan"),
        ([*PRETRAIN, "--epochs", "two"], 2, r"argument --epochs: expected a number, got 'two'"),
        ([*PRETRAIN, "--device", "gpu"], 2, r"--device 'gpu' is not a device name"),
        (
            ["distill", "{d}/teacher", "{d}/corpus.txt", "--output", "{d}/o", "--layers", "0"],
            2,
            r"--layers: must be >= 1",
        ),
        (["distill", "{d}/teacher", "{d}/corpus.txt", "--output", "{d}/o", "--max-steps", "-5"], 2, r"--max-steps"),
        (["distill", "{d}/teacher", "{d}/corpus.txt", "--output", "{d}/o"], 1, r"teacher .* is not a checkpoint"),
        (
            [
                "finetune",
                "sequence",
                "--model",
                "{d}",
                "--train",
                "{d}/t.csv",
                "--output-dir",
                "{d}/o",
                "--batch-size",
                "0",
            ],
            2,
            r"--batch-size: must be >= 1",
        ),
    ],
    ids=lambda v: None if isinstance(v, list) else str(v),
)
def test_ordinary_mistakes_are_one_line_with_exit_code(files: Path, capsys, argv: list[str], code: int, message: str):
    got, err = run_cli([a.format(d=files) for a in argv], capsys)
    assert got == code, err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_finetune_data_errors_name_file_and_line(files: Path, minilm_dir: Path, capsys) -> None:
    base = ["finetune", "regression", "--model", str(minilm_dir), "--train", str(files / "scores.csv")]
    base += ["--output-dir", str(files / "out"), "--text-columns", "sentence"]
    code, err = run_cli([*base, "--label-column", "score"], capsys)
    assert code == 1 and re.search(r"scores.csv:3: regression label 'five' is not a number", err), err
    code, err = run_cli([*base, "--label-column", "label"], capsys)
    assert code == 1 and re.search(r"scores.csv: no column 'label'", err), err
    assert "Traceback" not in err


def test_debug_keeps_the_traceback(files: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        main(["pretrain", "--train", str(files / "missing.txt"), "--output-dir", str(files / "out"), "--debug"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("command", [["explain"], PRETRAIN])
def test_cuda_device_without_cuda_is_a_usage_error(files: Path, capsys, command: list[str]) -> None:
    code, err = run_cli([*(a.format(d=files) for a in command), "--device", "cuda"], capsys)
    assert code == 2 and "--device cuda: CUDA is not available here" in err and "Traceback" not in err, err


def test_loop_and_distill_configs_reject_nonsense_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="max_steps must be >= 1, got -5"):
        LoopConfig(str(tmp_path), max_steps=-5)
    with pytest.raises(UsageError, match="warmup_ratio must be in"):
        LoopConfig(str(tmp_path), warmup_ratio=1.0)
    with pytest.raises(UsageError, match="num_layers must be >= 1, got 0"):
        DistillConfig(str(tmp_path), num_layers=0)
    with pytest.raises(UsageError, match="max_steps must be >= 1, got -5"):
        DistillConfig(str(tmp_path), max_steps=-5)


@pytest.mark.parametrize(
    "argv",
    [
        ["pretrain", "--train", "{d}/missing.txt", "--output-dir", "{d}/out"],
        ["finetune", "sequence", "--model", "{d}", "--train", "{d}/missing.csv", "--output-dir", "{d}/o"],
        ["distill", "{d}/teacher", "{d}/missing.txt", "--output", "{d}/o"],
    ],
    ids=["pretrain", "finetune", "distill"],
)
def test_a_misspelt_compile_backend_is_one_line_before_any_data(files: Path, capsys, argv: list[str]) -> None:
    """Checked against torch's own list up front: the data, the teacher and the model are not even looked at (their
    files do not exist here), where a typo used to end in a traceback at the first forward."""
    code, err = run_cli([*(a.format(d=files) for a in argv), "--compile", "--compile-backend", "inductr"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(r"--compile-backend 'inductr' is not a torch.compile backend: choose one of .*\binductor\b", err)
    assert "aot_eager" in err and "TESTING" not in err


def test_configs_check_the_compile_backend_when_compiling(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--compile-backend 'inductr' is not a torch.compile backend"):
        LoopConfig(str(tmp_path), compile=True, compile_backend="inductr")
    with pytest.raises(UsageError, match="--compile-backend 'inductr' is not a torch.compile backend"):
        DistillConfig(str(tmp_path), compile=True, compile_backend="inductr")
    LoopConfig(str(tmp_path), compile=True, compile_backend="aot_eager")  # debug backends are backends too
    LoopConfig(str(tmp_path), compile_backend="inductr")  # not compiling: not used, not imported


@pytest.mark.parametrize(
    "argv",
    [
        [*PRETRAIN[:-1], "{d}/corpus.txt/out"],
        ["finetune", "sequence", "--model", "{d}", "--train", "{d}/scores.csv", "--output-dir", "{d}/corpus.txt/out"],
        ["distill", "{d}/teacher", "{d}/corpus.txt", "--output", "{d}/corpus.txt/out"],
    ],
    ids=["pretrain", "finetune", "distill"],
)
def test_unwritable_output_folder_fails_before_any_work(files: Path, capsys, argv: list[str]) -> None:
    """The output folder is checked first: before the model, the tokenizer or the data are read (or trained on)."""
    code, err = run_cli([a.format(d=files) for a in argv], capsys)
    assert code == 1 and re.search(r"output folder .*corpus.txt/out is not writable", err), err


def test_explain_runs_every_op_and_warns_nothing(capsys) -> None:
    from fastbert.ops import OPS

    for seed in range(30):  # its random demo batch, whatever it draws, must not trip the input checks users see
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert main(["explain"]) == 0
    out = capsys.readouterr().out.split("CPU: ")[-1]
    assert "fast precision here:" in out
    assert all(f"\n{op}: " in out for op in OPS), out
