"""Pretraining runs, tiny: 2-process torchrun (gloo DDP), exact resume from a checkpoint, ALBERT/SOP options, and
saved models that load in transformers with the same outputs."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastbert import BertConfig, BertForPreTraining, BertModel
from fastbert.errors import UsageError
from fastbert.pretrain import pretrain
from fastbert.tokenization import WordPieceTokenizer
from fastbert.train import load_checkpoint, prune_checkpoints, rng_state, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = "the a cat dog sat ran on under mat log house river big small red blue quickly slowly and then".split()
TINY = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A blank-line-separated corpus of 12 documents and a WordPiece vocabulary learnt from it."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    docs = [
        " ".join(" ".join(rng.choices(WORDS, k=rng.randint(4, 10))).capitalize() + "." for _ in range(12))
        for _ in range(12)
    ]
    (root / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    WordPieceTokenizer.train(docs, vocab_size=120, min_frequency=1).save(root / "tok")
    return root / "corpus.txt", root / "tok"


def run_api(corpus, out, **loop):
    text, tok = corpus
    return pretrain(
        [str(text)],
        str(out),
        tokenizer=str(tok),
        max_length=32,
        batch_size=4,
        heldout_fraction=0.2,
        model_options=TINY,
        loop={"log_every": 1, **loop},
    )


def check_transformers_match(final: Path, tok: Path) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.BertForPreTraining.from_pretrained(final).eval()
    ours = BertForPreTraining.from_pretrained(final)
    batch = WordPieceTokenizer.from_pretrained(tok)(["the cat sat"], ["on the mat"])
    with torch.no_grad():
        a, b = ours(**batch), theirs(**batch)
    assert torch.allclose(a.prediction_logits, b.prediction_logits, atol=1e-5)
    assert torch.allclose(a.seq_relationship_logits, b.seq_relationship_logits, atol=1e-5)


def test_resume_equals_uninterrupted_run(tmp_path, corpus):
    full = run_api(corpus, tmp_path / "full", max_steps=6, save_every=3, eval_every=2)
    assert full["step"] == 6 and (tmp_path / "full" / "checkpoints" / "step-3").is_dir()
    assert {"mlm_accuracy", "sentence_accuracy", "baseline_accuracy"} <= set(full["metrics"])
    # a run that "crashed" after its step-3 checkpoint, resumed in a fresh process state
    shutil.copytree(tmp_path / "full" / "checkpoints" / "step-3", tmp_path / "resumed" / "checkpoints" / "step-3")
    torch.manual_seed(12345)  # resume must not depend on the caller's RNG
    resumed = run_api(corpus, tmp_path / "resumed", max_steps=6, save_every=3, eval_every=2, resume=True)
    assert resumed["step"] == 6
    a = load_file(tmp_path / "full" / "final" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key

    def logged(result):  # everything but wall time: losses, learning rates, held-out metrics
        return [{k: v for k, v in h.items() if k != "elapsed_s"} for h in result["history"]]

    assert logged(full) == logged(resumed)
    check_transformers_match(tmp_path / "full" / "final", corpus[1])


def test_checkpoint_restores_each_ranks_own_rng_state(tmp_path):
    """A checkpoint holds one RNG state per rank (dropout/masking streams differ per rank); rank r resumes its own."""
    model = BertModel(BertConfig(vocab_size=50, max_position_embeddings=16, **TINY))
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        random.seed(seed)
        states.append(rng_state())
    for step in (1, 2, 3, 50):  # step-50: left by an earlier run in the same directory
        save_checkpoint(str(tmp_path), step, model, rng=states)
    prune_checkpoints(str(tmp_path), keep=2, upto=3)
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-3", "step-50"]
    for rank, seed in ((1, 2), (0, 1)):
        torch.manual_seed(99)
        random.seed(99)
        load_checkpoint(str(tmp_path / "step-3"), model, rank)
        assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(seed)))
        assert random.random() == random.Random(seed).random()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_accumulation_and_init_from(tmp_path, corpus, precision):
    result = run_api(corpus, tmp_path / "accum", max_steps=2, grad_accum=2, precision=precision)
    assert result["step"] == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in result["history"][:-1])
    first = BertForPreTraining.from_pretrained(tmp_path / "accum" / "final")
    text, tok = corpus
    pretrain(
        [str(text)],
        str(tmp_path / "more"),
        init_from=str(tmp_path / "accum" / "final"),
        max_length=32,
        batch_size=4,
        heldout_fraction=0.2,
        loop={"max_steps": 1, "lr": 0.0, "warmup_ratio": 0.0},
    )
    again = BertForPreTraining.from_pretrained(tmp_path / "more" / "final")  # lr 0: the starting weights, unchanged
    for (name, a), b in zip(first.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_albert_options_with_sop(tmp_path, corpus):
    text, tok = corpus
    out = pretrain(
        [str(text)],
        str(tmp_path / "sop"),
        tokenizer=str(tok),
        max_length=32,
        batch_size=4,
        objective="sop",
        whole_word=True,
        heldout_fraction=0.2,
        model_options={**TINY, "embedding_size": 16, "layer_sharing": "all"},
        loop={"max_steps": 2},
    )
    config = json.loads((tmp_path / "sop" / "final" / "config.json").read_text())
    assert config["embedding_size"] == 16 and config["layer_sharing"] == "all" and out["step"] == 2


def torchrun_pretrain(corpus, out: Path, *extra: str) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this python")
    text, tok = corpus
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "fastbert.cli", "pretrain"]
    cmd += ["--train", str(text), "--tokenizer", str(tok), "--output-dir", str(out), "--max-length", "32"]
    cmd += ["--batch-size", "4", "--layers", "2", "--hidden", "32", "--heads", "2", "--intermediate", "64"]
    cmd += ["--max-steps", "4", "--heldout-fraction", "0.2", "--log-every", "1", "--threads", "1", *extra]
    # fp32: DDP and FSDP are compared to 1e-5 below, an fp32 statement ('auto' is bf16 on CPUs with bf16 dot products,
    # where the two layouts round differently: 2e-4 apart after four AdamW steps on a Zen 4)
    cmd += ["--precision", "fp32", "--device", "cpu"]  # gloo: a one-GPU machine has too few GPUs for two processes
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('"mlm_accuracy"') == 1  # only rank 0 reports


def test_torchrun_two_processes_ddp_and_fsdp(tmp_path, corpus):
    torchrun_pretrain(corpus, tmp_path / "ddp", "--save-every", "2")
    history = json.loads((tmp_path / "ddp" / "history.json").read_text())
    assert history["step"] == 4 and "mlm_accuracy" in history["metrics"]
    assert (tmp_path / "ddp" / "checkpoints" / "step-2" / "trainer_state.pt").is_file()
    check_transformers_match(tmp_path / "ddp" / "final", corpus[1])
    # FSDP shards parameters over the two ranks; the saved model must be the full one, equal to DDP's result
    torchrun_pretrain(corpus, tmp_path / "fsdp", "--strategy", "fsdp")
    ddp = load_file(tmp_path / "ddp" / "final" / "model.safetensors")
    fsdp = load_file(tmp_path / "fsdp" / "final" / "model.safetensors")
    assert ddp.keys() == fsdp.keys()
    for key in ddp:
        assert torch.allclose(ddp[key], fsdp[key], atol=1e-5), (key, (ddp[key] - fsdp[key]).abs().max())


def test_failed_checkpoint_write_keeps_the_last_good_one_and_training_goes_on(tmp_path, corpus, monkeypatch, capsys):
    real_save, calls = torch.save, []

    def disk_full_once(obj, path, *args, **kwargs):  # the second checkpoint's state file hits a full disk
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_once)
    result = run_api(corpus, tmp_path, max_steps=4, save_every=1, keep_checkpoints=1)
    assert result["step"] == 4 and (tmp_path / "final" / "model.safetensors").is_file()
    # step-1 survived the failed step-2 (nothing is pruned for a write that failed), no half-written folder is left
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-3"]
    out = capsys.readouterr().out
    assert re.search(r"warning: checkpoint step-2 not written .*No space left.*last good checkpoint is .*step-1", out)


def test_failed_final_save_says_where_the_last_checkpoint_is(tmp_path, corpus, monkeypatch):
    real = BertForPreTraining.save_pretrained

    def fail_final(self, directory):
        if os.path.basename(directory) == "final.tmp":
            raise OSError(28, "No space left on device")
        real(self, directory)

    monkeypatch.setattr(BertForPreTraining, "save_pretrained", fail_final)
    with pytest.raises(OSError, match=r"could not be written to .*final .*last good checkpoint is .*step-2"):
        run_api(corpus, tmp_path, max_steps=3, save_every=1)
    assert not (tmp_path / "final").exists() and not (tmp_path / "final.tmp").exists()


def test_resume_reuses_the_learnt_vocabulary_saved_with_the_checkpoints(tmp_path, corpus, monkeypatch):
    def run(out, tokenizer=None, **loop):  # no tokenizer: the vocabulary is learnt from the corpus
        options = dict(vocab_size=100, max_length=32, batch_size=4, heldout_fraction=0.2, model_options=TINY)
        loop = {"log_every": 1, "max_steps": 4, "save_every": 2, **loop}
        return pretrain([str(corpus[0])], str(out), tokenizer=tokenizer, loop=loop, **options)

    run(tmp_path / "full")
    step2 = tmp_path / "full" / "checkpoints" / "step-2"
    assert (step2 / "tokenizer.json").is_file() and (tmp_path / "full" / "final" / "vocab.txt").is_file()
    shutil.copytree(step2, tmp_path / "resumed" / "checkpoints" / "step-2")

    def learn(*args, **kwargs):
        raise AssertionError("a resumed run must not learn a new vocabulary")

    monkeypatch.setattr(WordPieceTokenizer, "train", learn)
    run(tmp_path / "resumed", resume=True)
    a = load_file(tmp_path / "full" / "final" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "final" / "model.safetensors")
    assert all(torch.equal(a[key], b[key]) for key in a)
    full_vocab = (tmp_path / "full" / "final" / "vocab.txt").read_text()
    assert (tmp_path / "resumed" / "final" / "vocab.txt").read_text() == full_vocab
    with pytest.raises(UsageError, match="is not the vocabulary .*step-2 was trained with"):
        run(tmp_path / "resumed", resume=True, tokenizer=str(corpus[1]))
