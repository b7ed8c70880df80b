"""The README's layout block names every top-level folder and every module and package of fastbert/; the modules
that moved still import, for one release, with a warning."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

import fastbert.train

ROOT = Path(__file__).resolve().parents[1]


def layout_block() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Layout", 1)[1]
    return section.split("```", 2)[1]


def test_the_layout_block_names_every_module_package_and_folder() -> None:
    named = set(re.findall(r"[\w.]+/?", layout_block()))
    package = ROOT / "fastbert"
    modules = {p.name for p in package.glob("*.py")} - {"__init__.py"}
    packages = {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    folders = {f"{p.name}/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    folders -= {"build/", "fastbert_kernels.egg-info/"}  # build outputs, not the layout
    missing = sorted((modules | packages | folders) - named)
    assert not missing, f"README.md's layout block does not name {missing}"


def test_the_old_training_modules_are_deprecated_aliases_of_fastbert_train() -> None:
    for name in ("fastbert.trainer", "fastbert.training"):
        sys.modules.pop(name, None)
        with pytest.warns(DeprecationWarning, match="fastbert.train"):
            old = importlib.import_module(name)
        assert old.fit is fastbert.train.fit
        assert old.LengthGroupedBatchSampler is fastbert.train.LengthGroupedBatchSampler
