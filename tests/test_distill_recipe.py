"""The MiniLM recipe on a tiny run: it writes under --output only, the committed docs/ only with --docs, and a
budget too small for its corpus cuts training short."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fastbert.distill.recipes import minilm_sts

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = [ROOT / "docs" / "distill_results.json", ROOT / "docs" / "distill_curve.png"]


def digests() -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in COMMITTED]


def test_recipe_leaves_docs_alone_and_keeps_its_budget(minilm_dir, shared_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stray relative docs/ would land here
    before = digests()
    args = ["--output", str(tmp_path / "run"), "--data", str(shared_data), "--skip-eval", "--max-length", "32"]
    args += ["--batch-size", "8", "--max-sentences", "3000", "--max-minutes", "0.25"]  # 370 steps cannot fit 15 s
    assert minilm_sts.main(args) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert 1 <= results["steps"] < 3000 * 0.98 // 8
    assert digests() == before and not (tmp_path / "docs").exists()
    args = ["--output", str(tmp_path / "run2"), "--data", str(shared_data), "--skip-eval", "--max-length", "32"]
    assert minilm_sts.main([*args, "--max-sentences", "64", "--max-steps", "1", "--docs", "mydocs"]) == 0
    assert sorted(p.name for p in (tmp_path / "mydocs").iterdir()) == ["distill_curve.png", "distill_results.json"]
    assert digests() == before
