"""Training under bad conditions and bad input (issue 29): a full disk, `--resume` against another run's checkpoint
or with a larger budget, a tiny NSP corpus, a corrupt training state, an occupied output folder, SQuAD without ids
and a BOM-prefixed CSV. Each ends in one clear line (or a run that works), never a traceback or lost work."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from fastbert import BertForPreTraining
from fastbert.cli import main
from fastbert.errors import DataError, UsageError
from fastbert.finetune.data import read_squad, read_table
from fastbert.pretrain import pretrain
from fastbert.tokenization import WordPieceTokenizer
from fastbert.train import loop as train_loop

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = "the a cat dog sat ran on under mat log house river big small red blue quickly slowly and then".split()
TINY = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


def write_corpus(path: Path, documents: int, seed: int = 0) -> Path:
    """A blank-line-separated corpus of `documents` documents of 12 short sentences."""
    rng = random.Random(seed)
    docs = [
        " ".join(" ".join(rng.choices(WORDS, k=rng.randint(4, 10))).capitalize() + "." for _ in range(12))
        for _ in range(documents)
    ]
    path.write_text("\n\n".join(docs) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """12 documents and a WordPiece vocabulary learnt from them."""
    root = tmp_path_factory.mktemp("corpus")
    text = write_corpus(root / "corpus.txt", 12)
    WordPieceTokenizer.train(text.read_text().split("\n\n"), vocab_size=120, min_frequency=1).save(root / "tok")
    return text, root / "tok"


def run(corpus, out, seed: int = 0, text: Path | None = None, heldout_fraction: float = 0.2, **loop):
    """A tiny pretraining run (2 layers, width 32, 32 tokens, batches of 4) with loop options `loop`."""
    return pretrain(
        [str(text or corpus[0])],
        str(out),
        tokenizer=str(corpus[1]),
        max_length=32,
        batch_size=4,
        heldout_fraction=heldout_fraction,
        model_options=TINY,
        seed=seed,
        loop={"log_every": 1, "precision": "fp32", **loop},
    )


def lrs(result: dict) -> dict[int, float]:
    return {h["step"]: h["lr"] for h in result["history"] if "lr" in h}


# ------------------------------------------------------------------------------------------------ full disk
@pytest.mark.parametrize(
    "error",
    [RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"), SafetensorError("I/O")],
)
def test_a_checkpoint_write_that_raises_what_writers_raise_is_a_warning(tmp_path, corpus, monkeypatch, capsys, error):
    """torch.save raises RuntimeError on a full disk, safetensors SafetensorError: not only OSError is a failure."""
    import safetensors.torch

    real_save, calls = safetensors.torch.save_file, []

    def full_once(*args, **kwargs):  # the second checkpoint's weights hit a full disk
        calls.append(args)
        if len(calls) == 2:
            raise error
        return real_save(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full_once)
    result = run(corpus, tmp_path, max_steps=3, save_every=1)
    assert result["step"] == 3 and (tmp_path / "final" / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-1"]  # step-2 failed: no folder, not even a .tmp
    assert re.search(
        r"warning: checkpoint step-2 not written .*last good checkpoint is .*step-1", capsys.readouterr().out
    )


def test_a_failed_final_save_keeps_the_trained_model_in_a_fallback_folder(tmp_path, corpus, monkeypatch):
    real = BertForPreTraining.save_pretrained
    out = tmp_path / "out"

    def full_under_out(self, directory, *args, **kwargs):
        if str(directory).startswith(str(out)):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        real(self, directory, *args, **kwargs)

    monkeypatch.setattr(BertForPreTraining, "save_pretrained", full_under_out)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "spare"))
    (tmp_path / "spare").mkdir()
    with pytest.raises(OSError, match=r"could not be written to .*final .*unexpected pos.*; it was saved to .*spare"):
        run(corpus, out, max_steps=2)
    assert not (out / "final").exists() and not (out / "final.tmp").exists()
    kept = [p for p in (tmp_path / "spare").rglob("model.safetensors")]
    assert len(kept) == 1
    BertForPreTraining.from_pretrained(kept[0].parent)  # a complete, loadable model


@pytest.fixture
def small_disk(tmp_path):
    """A real 5 MB tmpfs, filled to about 100 kB free (enough for the start-up write probe, not for a checkpoint)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(bytes(free - 100_000))
        yield disk / "run"
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_real_full_disk(tmp_path, corpus, small_disk, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "spare"))
    (tmp_path / "spare").mkdir()
    with pytest.raises(OSError, match=r"could not be written to .*final .*; it was saved to .*spare"):
        run(corpus, small_disk, max_steps=3, save_every=1)
    assert "warning: checkpoint step-1 not written" in capsys.readouterr().out  # and training went on
    assert os.listdir(small_disk / "checkpoints") == []  # no partial checkpoint that looks complete
    assert not (small_disk / "final").exists() and not (small_disk / "final.tmp").exists()
    (kept,) = list((tmp_path / "spare").rglob("model.safetensors"))
    BertForPreTraining.from_pretrained(kept.parent)


# ------------------------------------------------------------------------------------------------- resume
def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, corpus):
    run(corpus, tmp_path, seed=0, max_steps=2, save_every=1)
    with pytest.raises(UsageError, match=r"step-1 .*another run.*seed"):
        run(corpus, tmp_path, seed=1, max_steps=2, save_every=1, resume=True)
    other = write_corpus(tmp_path / "other.txt", 12, seed=5)
    with pytest.raises(UsageError, match=r"another run.*train"):
        run(corpus, tmp_path, text=other, max_steps=2, save_every=1, resume=True)
    assert run(corpus, tmp_path, seed=0, max_steps=2, save_every=1, resume=True)["step"] == 2  # its own run: fine


def test_resume_with_a_larger_max_steps_trains_to_the_new_total(tmp_path, corpus, capsys):
    first = run(corpus, tmp_path, max_steps=4, save_every=2, warmup_ratio=0.25)
    longer = run(corpus, tmp_path, max_steps=8, save_every=2, warmup_ratio=0.25, resume=True)
    assert longer["step"] == 8
    old, new = lrs(first), lrs(longer)
    assert new[2] == old[2]  # the history up to the checkpoint is the first run's
    # from the checkpoint on, the LR decays linearly from where it was to 0 at the new total: no jump
    assert [round(new[s], 12) for s in range(3, 9)] == [round(old[2] * (8 - s) / 6, 12) for s in range(3, 9)]
    assert "the learning rate decays linearly from" in capsys.readouterr().out
    shorter = run(corpus, tmp_path, max_steps=7, save_every=2, warmup_ratio=0.25, resume=True)  # from step-6
    assert shorter["step"] == 7 and lrs(shorter)[7] == 0.0 and lrs(shorter)[6] == new[6]
    with pytest.raises(UsageError, match=r"step-6 is at step 6, not before the 5 steps asked for"):
        run(corpus, tmp_path, max_steps=5, save_every=2, warmup_ratio=0.25, resume=True)


def test_resume_without_a_checkpoint_says_it_starts_fresh(tmp_path, corpus, capsys):
    assert run(corpus, tmp_path, max_steps=1, resume=True)["step"] == 1
    assert re.search(r"--resume: no checkpoint in .*checkpoints; starting a fresh run", capsys.readouterr().out)


def killed_after_checkpoint(monkeypatch, at: int) -> None:
    """The next run dies (as if killed) right after writing its checkpoint `step-<at>`."""
    write = train_loop.save_resumable

    def save(directory, step, *args, **kwargs):
        write(directory, step, *args, **kwargs)
        if step == at:
            raise KeyboardInterrupt(f"killed after step {at}")

    monkeypatch.setattr(train_loop, "save_resumable", save)


def test_overwrite_moves_the_old_run_aside_and_resume_continues_this_run_only(tmp_path, corpus, monkeypatch, capsys):
    """Run A leaves step-2 and step-4; run B (another lr, --overwrite) is killed after its step-2: resuming B must
    continue B from its own step-2, never A's step-4, and end where an uninterrupted B ends."""
    out = tmp_path / "out"
    run(corpus, out, max_steps=6, save_every=2)
    b = dict(lr=1e-3, max_steps=6, save_every=1)
    with monkeypatch.context() as m:
        killed_after_checkpoint(m, 2)
        with pytest.raises(KeyboardInterrupt):
            run(corpus, out, overwrite=True, **b)
    assert sorted(os.listdir(out / "checkpoints")) == ["step-1", "step-2"]  # none of A's left to resume
    (replaced,) = [p for p in out.iterdir() if p.name.startswith(".replaced-")]
    assert sorted(os.listdir(replaced / "checkpoints")) == ["step-2", "step-4"] and (replaced / "final").is_dir()
    assert str(replaced) in capsys.readouterr().out  # --overwrite says where the old run went
    resumed = run(corpus, out, resume=True, **b)
    said = capsys.readouterr().out
    assert re.search(r"resumed from \S*step-2 at step 2: its run identity .* matches this run", said), said
    whole = run(corpus, tmp_path / "whole", **b)
    assert resumed["step"] == whole["step"] == 6
    a, z = (load_file(d / "final" / "model.safetensors") for d in (out, tmp_path / "whole"))
    assert all(torch.equal(a[k], z[k]) for k in z)


@pytest.mark.parametrize(
    "option, value",
    [("lr", 1e-3), ("warmup_ratio", 0.5), ("weight_decay", 0.1), ("max_grad_norm", 0.5), ("precision", "bf16")],
)
def test_resume_refuses_a_changed_trajectory_option_naming_it(tmp_path, corpus, option, value):
    run(corpus, tmp_path, max_steps=3, save_every=1)
    with pytest.raises(UsageError, match=rf"step-2 is a checkpoint of another run \({option}: "):
        run(corpus, tmp_path, max_steps=3, save_every=1, resume=True, **{option: value})


def test_resume_may_change_what_only_reports(tmp_path, corpus):
    run(corpus, tmp_path, max_steps=3, save_every=1)
    again = run(corpus, tmp_path, max_steps=4, save_every=0, log_every=2, eval_every=1, keep_checkpoints=1, resume=True)
    assert again["step"] == 4


def test_rerunning_an_interrupted_run_without_resume_suggests_resume(tmp_path, corpus, monkeypatch):
    with monkeypatch.context() as m:
        killed_after_checkpoint(m, 1)
        with pytest.raises(KeyboardInterrupt):
            run(corpus, tmp_path, max_steps=3, save_every=1)
    with pytest.raises(UsageError, match=r"an interrupted run of these options .*step-1.*pass --resume to continue"):
        run(corpus, tmp_path, max_steps=3, save_every=1)
    with pytest.raises(UsageError, match=r"holds another run \(checkpoints; lr: 0.0005 there, 0.001 now\)"):
        run(corpus, tmp_path, max_steps=3, save_every=1, lr=1e-3)
    assert run(corpus, tmp_path, max_steps=3, save_every=1, resume=True)["step"] == 3


def test_a_corrupt_trainer_state_is_one_clear_error(tmp_path, corpus):
    run(corpus, tmp_path, max_steps=2, save_every=1)
    (tmp_path / "checkpoints" / "step-1" / "trainer_state.pt").write_bytes(b"not a torch file")
    with pytest.raises(DataError, match=r"step-1.trainer_state.pt is not a readable training state"):
        run(corpus, tmp_path, max_steps=2, save_every=1, resume=True)


# ------------------------------------------------------------------------------------------- output folder
def test_an_output_folder_holding_another_run_is_refused_unless_overwrite(tmp_path, corpus):
    run(corpus, tmp_path, max_steps=1)
    with pytest.raises(UsageError, match=r"holds another run .*final.*--overwrite"):
        run(corpus, tmp_path, max_steps=1)
    assert run(corpus, tmp_path, max_steps=1, overwrite=True)["step"] == 1
    with pytest.raises(UsageError, match="--overwrite and --resume"):
        run(corpus, tmp_path, max_steps=1, overwrite=True, resume=True)
    (tmp_path / "unrelated").mkdir()
    run(corpus, tmp_path / "unrelated", max_steps=1)  # an empty folder is fine


def test_cli_errors_are_one_line(tmp_path, corpus, capsys):
    args = ["pretrain", "--train", str(corpus[0]), "--tokenizer", str(corpus[1]), "--output-dir", str(tmp_path)]
    args += ["--layers", "1", "--hidden", "32", "--heads", "2", "--intermediate", "64", "--max-length", "32"]
    args += ["--batch-size", "4", "--max-steps", "1", "--threads", "1", "--precision", "fp32"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds another run" in err
    assert main([*args, "--overwrite"]) == 0


# ------------------------------------------------------------------------------------------------- corpora
@pytest.mark.parametrize("documents", [2, 3, 5, 29])
def test_nsp_on_a_small_corpus(tmp_path, corpus, capsys, documents):
    """NSP needs two documents on each side of the held-out split: from 4 documents there is one, below it the run
    trains on every document and says it has no held-out set (at the default 5% it failed for 2 to 29 documents)."""
    text = write_corpus(tmp_path / "small.txt", documents)
    result = run(corpus, tmp_path / "out", text=text, heldout_fraction=0.05, max_steps=1)
    assert result["step"] == 1
    if documents < 4:
        assert "no held-out evaluation" in capsys.readouterr().out
    else:
        assert "sentence_accuracy" in result["metrics"]


def test_nsp_on_a_single_document_says_why(tmp_path, corpus):
    with pytest.raises(ValueError, match="NSP needs at least two documents.*1"):
        run(corpus, tmp_path / "out", text=write_corpus(tmp_path / "one.txt", 1), max_steps=1)


def test_squad_without_an_id_is_a_data_error(tmp_path):
    data = {"data": [{"paragraphs": [{"context": "abc def", "qas": [{"question": "?", "answers": []}]}]}]}
    (tmp_path / "noid.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"noid.json: article 0, paragraph 0, question 0: no 'id'"):
        read_squad(tmp_path / "noid.json")


def test_a_bom_prefixed_csv_header_is_read(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes("text,label\na cat,pos\n".encode("utf-8-sig"))
    (example,) = read_table(path, ["text"], "label")
    assert example.text == "a cat" and example.label == "pos"


# ------------------------------------------------------------------------------------------------ distill
def test_distill_refuses_another_runs_folder_and_checkpoint(tmp_path):
    from distill_tiny import corpus as texts
    from distill_tiny import make_teacher

    from fastbert.distill import DistillConfig, distill

    teacher = make_teacher(str(tmp_path / "teacher"))

    def tiny(**kw) -> DistillConfig:
        base = dict(num_layers=2, batch_size=8, max_steps=4, checkpoint_every=2, log_every=1, max_eval=16)
        return DistillConfig(str(tmp_path / "out"), **{**base, **kw})

    distill(teacher, texts(48), tiny())
    with pytest.raises(UsageError, match=r"holds another run .*student"):
        distill(teacher, texts(48), tiny())
    with pytest.raises(UsageError, match=r"step-2 is a checkpoint of another run .*seed: 0 there, 1 now"):
        distill(teacher, texts(48), tiny(seed=1, resume="latest"))
    longer = distill(teacher, texts(48), tiny(max_steps=6, resume="latest"))  # the same run, a larger budget
    assert [r["step"] for r in longer.history if "loss" in r][-1] == 6


def test_distill_overwrite_and_resume_latest_continue_this_run_only(tmp_path):
    from distill_tiny import corpus as texts
    from distill_tiny import make_teacher

    from fastbert.distill import DistillConfig, distill

    teacher = make_teacher(str(tmp_path / "teacher"))

    def tiny(**kw) -> DistillConfig:
        base = dict(num_layers=2, batch_size=8, max_steps=4, checkpoint_every=1, log_every=1, max_eval=16)
        return DistillConfig(str(tmp_path / "out"), **{**base, **kw})

    def killed(step: int, record: dict) -> None:
        if step == 2:
            raise KeyboardInterrupt("killed after step 2")

    distill(teacher, texts(48), tiny(checkpoint_every=2, keep_checkpoints=3, max_steps=6))  # step-2, step-4
    with pytest.raises(KeyboardInterrupt):
        distill(teacher, texts(48), tiny(lr=1e-3, overwrite=True), on_step=killed)
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["step-1", "step-2"]
    with pytest.raises(UsageError, match=r"interrupted run of these options .*step-2.*pass --resume latest"):
        distill(teacher, texts(48), tiny(lr=1e-3))
    for changed in ({}, {"teacher_precision": "bf16"}, {"max_grad_norm": 0.5}):  # lr: 1e-4 by default
        with pytest.raises(UsageError, match=r"step-2 is a checkpoint of another run \((lr|max_grad|teacher_pr)"):
            distill(teacher, texts(48), tiny(lr=1e-3 if changed else 1e-4, resume="latest", **changed))
    resumed = distill(teacher, texts(48), tiny(lr=1e-3, resume="latest"))
    assert [r["step"] for r in resumed.history if "loss" in r] == [1, 2, 3, 4]
