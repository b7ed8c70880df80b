"""Task LoRA adapters (fastbert.adapters): a checkpoint in jina-embeddings-v3's original parametrized layout (every
linear and embedding weight as `parametrizations.weight.original` with per-task `lora_A` / `lora_B`, as its remote
code writes them; no such checkpoint is packaged, so one is built here from transformers' model) loads with a task's
update merged into the weights, within 1e-5 of transformers running the same merged weights; without a task, the base
weights; an unknown task and a task without adapters are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastbert
from fastbert import adapters
from tests.test_modernbert import ATOL, ragged
from tests.test_mpnet import hidden_states_error

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "JinaEmbeddingsV3Model"):
    pytest.skip("this transformers has no native Jina-embeddings-v3 class", allow_module_level=True)

TASKS = ["retrieval.query", "text-matching", "classification"]
RANK, ALPHA = 4, 2.0


def original_layout(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], torch.nn.Module]:
    """(directory of the parametrized checkpoint, the plain state it was made from (tmp_path/plain), the transformers
    model that wrote it)."""
    config = transformers.JinaEmbeddingsV3Config(
        vocab_size=101, hidden_size=56, intermediate_size=44, num_hidden_layers=2, num_attention_heads=4,
        type_vocab_size=2, pad_token_id=0, max_position_embeddings=128, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.JinaEmbeddingsV3Model(config).eval()
    hf.save_pretrained(tmp_path / "plain")
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    state = {}
    for key, value in plain.items():
        if value.dim() != 2:  # norms and biases stay as they are
            state[key] = value
            continue
        module, rows, cols = key.removesuffix(".weight"), *value.shape
        state[module + adapters.ORIGINAL] = value
        if "embeddings" in key:  # A [tasks, V, rank], B [tasks, rank, E]
            a, b = torch.randn(3, rows, RANK, generator=g), torch.randn(3, RANK, cols, generator=g)
        else:  # A [tasks, rank, in], B [tasks, out, rank]
            a, b = torch.randn(3, RANK, cols, generator=g), torch.randn(3, rows, RANK, generator=g)
        state[module + adapters.LORA_A], state[module + adapters.LORA_B] = a * 0.1, b * 0.1
    (tmp_path / "lora").mkdir()
    save_file(state, tmp_path / "lora" / "model.safetensors", metadata={"format": "pt"})
    fields = json.loads((tmp_path / "plain" / "config.json").read_text())
    fields.update(lora_adaptations=TASKS, lora_rank=RANK, lora_alpha=ALPHA)
    (tmp_path / "lora" / "config.json").write_text(json.dumps(fields))
    return tmp_path / "lora", plain, hf


def test_a_task_is_merged_into_the_weights(tmp_path: Path) -> None:
    directory, plain, _ = original_layout(tmp_path)
    lora = load_file(directory / "model.safetensors")
    task = TASKS.index("text-matching")
    merged = {}
    for key, value in plain.items():  # the formula written out: linear W + s B A, embedding W + s A B
        module = key.removesuffix(".weight")
        if module + adapters.LORA_A not in lora:
            merged[key] = value
            continue
        a, b = lora[module + adapters.LORA_A][task], lora[module + adapters.LORA_B][task]
        merged[key] = value + ALPHA / RANK * (a @ b if "embeddings" in key else b @ a)
    shutil.copytree(tmp_path / "plain", tmp_path / "merged")
    save_file(merged, tmp_path / "merged" / "model.safetensors", metadata={"format": "pt"})
    want = transformers.JinaEmbeddingsV3Model.from_pretrained(tmp_path / "merged").eval()
    fast = fastbert.JinaEmbeddingsV3Model.from_pretrained(directory, lora_task="text-matching")
    ids, mask = ragged([23, 0, 1, 9])
    assert hidden_states_error(fast, want, ids, mask) <= ATOL
    base = fastbert.JinaEmbeddingsV3Model.from_pretrained(directory)  # no task: the base weights
    plain_hf = transformers.JinaEmbeddingsV3Model.from_pretrained(tmp_path / "plain").eval()
    assert hidden_states_error(base, plain_hf, ids, mask) <= ATOL
    assert hidden_states_error(fast, plain_hf, ids, mask) > 100 * ATOL  # the update changed something


def test_unknown_tasks_and_missing_adapters_are_refused(tmp_path: Path) -> None:
    directory, _, _ = original_layout(tmp_path)
    with pytest.raises(ValueError, match=r"lora_task='separation' is not one of .*text-matching"):
        fastbert.JinaEmbeddingsV3Model.from_pretrained(directory, lora_task="separation")
    with pytest.raises(ValueError, match="no task adapters"):
        fastbert.JinaEmbeddingsV3Model.from_pretrained(tmp_path / "plain", lora_task="text-matching")


def test_an_update_of_the_wrong_shape_is_named() -> None:
    weight = torch.zeros(6, 5)
    state = {"x" + adapters.ORIGINAL: weight, "x" + adapters.LORA_A: torch.zeros(1, 4, 3),
             "x" + adapters.LORA_B: torch.zeros(1, 6, 4)}  # fmt: skip
    with pytest.raises(ValueError, match=r"x: adapter shapes \(4, 3\) and \(6, 4\) do not update a weight of shape"):
        adapters.merged(state, "t", {"lora_adaptations": ["t"]})
