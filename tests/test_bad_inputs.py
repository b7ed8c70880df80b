"""Defects from the bad-input sweep (issue 29): what users do with transformers idioms, damaged files and typos gets
either the transformers behaviour or one clear error naming what is wrong and what to do."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import fastbert
from fastbert.config import BertConfig
from tests.conftest import tiny_bert

TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def test_model_device_and_dtype_as_in_transformers() -> None:
    model = fastbert.BertForSequenceClassification(BertConfig(**TINY)).eval()
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    inputs = {"input_ids": torch.tensor([[2, 5, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    inputs = {k: v.to(model.device) for k, v in inputs.items()}  # the transformers idiom
    assert model(**inputs).logits.shape == (1, 2)
    assert tiny_bert().to(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "field,value",
    [
        ("is_decoder", True),  # transformers then runs a causal mask: 1.5 off when fastbert ignored it
        ("add_cross_attention", True),
        ("is_encoder_decoder", True),
        ("pruned_heads", {"0": [1]}),
        ("position_embedding_type", "relative_key"),
        ("position_embedding_type", None),  # transformers 4 then adds no position embeddings at all
    ],
)
def test_config_fields_fastbert_does_not_implement_are_refused_by_name(tmp_path: Path, field: str, value) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} is not supported")):
        BertConfig(**TINY, **{field: value})
    fastbert.BertModel(BertConfig(**TINY)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=rf"config.json: {field}=.* is not supported"):
        fastbert.BertModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["Bert", "Roberta", "XLMRoberta", "DistilBert", "Albert", "Electra"])
def test_transformers_default_configs_of_every_family_load(family: str) -> None:
    """The harmless values real checkpoints carry (is_decoder false, chunk_size_feed_forward 0, ...) are accepted."""
    transformers = pytest.importorskip("transformers")
    values = getattr(transformers, f"{family}Config")().to_dict()
    assert BertConfig.from_dict(values).model_type == values["model_type"]


def test_minilm_config_loads(minilm_dir: Path) -> None:
    assert BertConfig.from_pretrained(minilm_dir).hidden_size == 384


def test_chunked_feed_forward_is_accepted_as_it_computes_the_same(tmp_path: Path) -> None:
    """transformers' chunk_size_feed_forward splits the per-token FFN along the sequence: a memory saving with the
    same numbers, so fastbert runs such a checkpoint unchunked rather than refusing it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**TINY, chunk_size_feed_forward=3)).eval()
    hf.save_pretrained(tmp_path)
    model = fastbert.BertModel.from_pretrained(tmp_path)
    ids = torch.randint(1, 50, (2, 6))  # transformers wants the length a multiple of the chunk
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    with torch.no_grad():
        want, got = hf(ids, attention_mask=mask).last_hidden_state, model(ids, attention_mask=mask).last_hidden_state
    assert (want - got)[mask.bool()].abs().max().item() <= 1e-5


def test_optimize_refuses_a_live_transformers_decoder() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertModel(transformers.BertConfig(**TINY, is_decoder=True)).eval()
    with pytest.raises(ValueError, match="is_decoder=True is not supported"):
        fastbert.optimize(hf)


# ---------------------------------------------------------------- one clear line where a traceback was
def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """Exit code and stderr of `fastbert ARGV` run in this process."""
    from fastbert.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    return code, capsys.readouterr().err


def assert_one_line(err: str, pattern: str) -> None:
    assert len(err.strip().splitlines()) == 1 and re.search(pattern, err), err


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    path = tmp_path / "tiny"
    fastbert.BertModel(BertConfig(**TINY)).save_pretrained(path)
    return path


def test_a_corrupt_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from fastbert.tokenization import WordPieceTokenizer

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "trunc')  # cut off mid-write
    with pytest.raises(ValueError, match=r"tokenizer.json is not a tokenizer file tokenizers can read .*EOF"):
        WordPieceTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("content", [[1, 2], "a string", 3, None])
def test_a_config_json_that_is_not_an_object_names_the_file(tiny_dir: Path, content) -> None:
    (tiny_dir / "config.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"config.json: .*must hold a JSON object .*got a"):
        fastbert.BertModel.from_pretrained(tiny_dir)


@pytest.mark.parametrize("index", [{"metadata": {}}, [], {"weight_map": ["model.safetensors"]}])
def test_a_safetensors_index_without_a_weight_map_names_the_file(tiny_dir: Path, index) -> None:
    from fastbert.checkpoint import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, CheckpointError

    (tiny_dir / WEIGHTS_NAME).rename(tiny_dir / "model-00001-of-00001.safetensors")
    (tiny_dir / WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{WEIGHTS_INDEX_NAME}: .*weight_map"):
        fastbert.BertModel.from_pretrained(tiny_dir)


def test_a_fastbert_cpu_gemm_typo_is_refused_with_the_accepted_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastbert.backends import timing

    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemmm")
    message = r"FASTBERT_CPU_GEMM='gemmm' is not one of auto, gemm, onednn, torch"
    with pytest.raises(ValueError, match=message):
        timing.cpu_gemm_mode()
    model = tiny_bert()
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model(torch.randint(1, 120, (2, 8)))
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    assert timing.cpu_gemm_mode() == "gemm"


def test_export_onnx_opset_beyond_what_onnx_writes_is_a_usage_error(tiny_dir: Path, capsys) -> None:
    pytest.importorskip("onnx")
    code, err = run_cli(["export-onnx", str(tiny_dir), str(tiny_dir / "m.onnx"), "--opset", "30"], capsys)
    assert code == 2
    assert_one_line(err, r"opset 30 .* newest .* is \d+")
    assert not (tiny_dir / "m.onnx").exists()


@pytest.mark.parametrize("missing", ["onnx", "onnxruntime"])
def test_export_onnx_without_the_onnx_extra_says_what_to_install(
    tiny_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # `import onnx` now raises ImportError, as if not installed
    code, err = run_cli(["export-onnx", str(tiny_dir), str(tiny_dir / "m.onnx")], capsys)
    assert code == 2
    assert_one_line(err, rf"needs the `{missing}` package: pip install 'fastbert-kernels\[onnx\]'")


def test_pretrain_without_the_train_extra_says_what_to_install(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "corpus.txt").write_text("The cat sat.\n\nThe dog ran.\n")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    argv = ["pretrain", "--train", str(tmp_path / "corpus.txt"), "--output-dir", str(tmp_path / "out")]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_line(err, r"needs the `tokenizers` package: pip install 'fastbert-kernels\[train\]'")


def test_an_export_that_fails_mid_write_leaves_no_truncated_onnx(tmp_path: Path, monkeypatch) -> None:
    onnx = pytest.importorskip("onnx")
    from fastbert.onnx import export

    def full_disk(proto, path, *args, **kwargs) -> None:
        with open(path, "wb") as f:
            f.write(proto.SerializeToString()[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx, "save", full_disk)
    model = fastbert.BertModel(BertConfig(**TINY)).eval()
    with pytest.raises(OSError, match="No space left"):
        export(model, tmp_path / "m.onnx", check=False, progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the file nor a temporary one


def test_export_onnx_of_a_config_json_that_is_a_list_is_one_line(tiny_dir: Path, capsys) -> None:
    (tiny_dir / "config.json").write_text("[1, 2]")
    code, err = run_cli(["export-onnx", str(tiny_dir), str(tiny_dir / "m.onnx")], capsys)
    assert code == 1
    assert_one_line(err, r"config.json: a config.json must hold a JSON object of fields, got a list")
