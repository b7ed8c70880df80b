"""The distillation recipes on tiny runs: the MiniLM recipe writes under --output only, the committed docs/ only with
--docs, and a budget too small for its corpus cuts training short; the all-mpnet-base-v2 recipe's student folder loads
in transformers and sentence-transformers unchanged, with fastbert's embeddings, and a killed run resumes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from fastbert.distill.recipes import minilm_sts, mpnet_sts

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


def test_mpnet_recipe_student_loads_in_sentence_transformers_with_fastberts_embeddings(
    mpnet_dir, minilm_dir, shared_data, tmp_path
):
    st = pytest.importorskip("sentence_transformers")
    transformers = pytest.importorskip("transformers")
    from fastbert import BertModel
    from fastbert.distill.recipes.sts import encode, read_sts
    from fastbert.tokenization import WordPieceTokenizer

    out = tmp_path / "run"
    args = ["--output", str(out), "--data", str(shared_data), "--teacher", str(mpnet_dir), "--max-length", "32"]
    args += ["--max-sentences", "96", "--batch-size", "16", "--max-steps", "2", "--eval-every", "0", "--passes", "1"]
    assert mpnet_sts.main([*args, "--dev-pairs", "24", "--threads", "1", "--gold-steps", "2"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 2 and results["gold_stage"]["steps"] == 2
    scored = {"all-mpnet-base-v2 (teacher)", "student fp32", "student fp32, distilled only"}
    assert set(results["dev_spearman"]) >= scored
    distilled = BertModel.from_pretrained(str(out / "student.distilled")).state_dict()
    tuned = BertModel.from_pretrained(str(out / "student")).state_dict()
    assert not torch.equal(distilled["encoder.layer.0.intermediate.dense.weight"],
                           tuned["encoder.layer.0.intermediate.dense.weight"])  # the gold stage moved the weights
    assert torch.equal(distilled["embeddings.word_embeddings.weight"], tuned["embeddings.word_embeddings.weight"])
    assert results["encode_speed"]["student fp32"]["sentences_per_s"] > 0
    student_dir = str(out / "student")
    sentences = [*read_sts(str(shared_data / "stsb" / "sts-dev.csv"))[0][:16], "x"]
    theirs = st.SentenceTransformer(student_dir, device="cpu").encode(sentences, convert_to_tensor=True)
    tok = WordPieceTokenizer.from_pretrained(student_dir)
    with torch.no_grad():
        mine = encode(BertModel.from_pretrained(student_dir), tok, sentences)
        assert torch.cosine_similarity(mine, theirs.float()).min() >= 0.99999  # normalised by its 2_Normalize
        enc = transformers.AutoTokenizer.from_pretrained(student_dir)(sentences[:2], padding=True, return_tensors="pt")
        hf = transformers.BertModel.from_pretrained(student_dir).eval()(**enc).last_hidden_state
        ours = BertModel.from_pretrained(student_dir)(**enc).last_hidden_state
    real = enc["attention_mask"].bool()  # padded positions are not outputs
    torch.testing.assert_close(ours[real], hf[real], atol=1e-5, rtol=0)


def test_mpnet_recipe_resumes_a_killed_run_with_the_labels_it_kept(mpnet_dir, minilm_dir, shared_data, tmp_path):
    out = tmp_path / "run"
    args = ["--output", str(out), "--data", str(shared_data), "--teacher", str(mpnet_dir), "--max-length", "32"]
    args += ["--max-sentences", "64", "--batch-size", "16", "--eval-every", "0", "--skip-eval", "--threads", "1"]
    args += ["--checkpoint-every", "1", "--gold-steps", "1"]

    def killed(step, record):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        original = mpnet_sts.distill
        mp.setattr(mpnet_sts, "distill", lambda *a, **k: original(*a, **k, on_step=killed))
        with pytest.raises(KeyboardInterrupt):
            mpnet_sts.main([*args, "--max-steps", "4"])
    labelled = sorted((out / "teacher_cache").glob("*.safetensors"))
    assert labelled  # the teacher's labels survived the kill
    stamps = [p.stat().st_mtime_ns for p in labelled]
    assert mpnet_sts.main([*args, "--max-steps", "4", "--resume", "latest"]) == 0
    assert json.loads((out / "results.json").read_text())["steps"] == 4
    assert [p.stat().st_mtime_ns for p in labelled] == stamps  # not relabelled
