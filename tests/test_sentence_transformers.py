"""fastbert.optimize on sentence-transformers models: the encoder is swapped in place, fastbert's module is the one
that runs, and embeddings (SentenceTransformer) and scores (CrossEncoder) stay the same, with the real MiniLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastbert

st = pytest.importorskip("sentence_transformers")
# a submodule: `st.models` exists only once something imported it (the test failed when run alone)
st_models = pytest.importorskip("sentence_transformers.models")

SENTENCES = [
    "A man is playing a guitar.",
    "The cat sits on the mat, quietly watching the birds outside.",
    "short",
    "A very long sentence that keeps going on and on " * 6,
]


def calls_of(module: torch.nn.Module) -> list[int]:
    """A counter of `module`'s forward calls (sentence-transformers calls `model.forward` itself: hooks never fire)."""
    calls: list[int] = []
    forward = module.forward

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return forward(*args, **kwargs)

    module.forward = counted
    return calls


def test_sentence_transformer_embeddings_through_fastbert(minilm_dir: Path) -> None:
    model = st.SentenceTransformer(str(minilm_dir), device="cpu")
    before = model.encode(SENTENCES, convert_to_tensor=True)
    assert fastbert.optimize(model) is model  # in place, as the docs' two lines use it
    encoder = model[0].model
    assert isinstance(encoder, fastbert.BertModel)
    calls = calls_of(encoder)
    after = model.encode(SENTENCES, convert_to_tensor=True)
    assert calls, "fastbert's encoder did not run"
    assert torch.nn.functional.cosine_similarity(before, after).min().item() >= 0.99999


def test_cross_encoder_scores_through_fastbert(minilm_dir: Path) -> None:
    torch.manual_seed(0)
    model = st.CrossEncoder(str(minilm_dir), num_labels=1, device="cpu")  # a fresh one-logit head on MiniLM
    pairs = [("a man plays guitar", "someone is making music"), ("the cat sleeps", "stock prices fell sharply")]
    before = model.predict(pairs, convert_to_tensor=True)
    fastbert.optimize(model)
    assert isinstance(model[0].model, fastbert.BertForSequenceClassification)
    calls = calls_of(model[0].model)
    after = model.predict(pairs, convert_to_tensor=True)
    assert calls and (after - before).abs().max().item() <= 1e-5


def test_a_sentence_transformers_model_without_an_encoder_is_refused_clearly() -> None:
    pooling_only = st.SentenceTransformer(modules=[st_models.Pooling(8)], device="cpu")
    with pytest.raises(TypeError, match="holds no transformers encoder"):
        fastbert.optimize(pooling_only)


def test_sentence_transformer_on_a_roberta_encoder(tiny_roberta_dir: Path) -> None:
    model = st.SentenceTransformer(str(tiny_roberta_dir), device="cpu")
    before = model.encode(SENTENCES, convert_to_tensor=True)
    fastbert.optimize(model)
    assert isinstance(model[0].model, fastbert.RobertaModel)
    calls = calls_of(model[0].model)
    after = model.encode(SENTENCES, convert_to_tensor=True)
    assert calls and (after - before).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["ModernBert", "Gte", "NomicBert", "JinaEmbeddingsV3", "EuroBert"])
def test_sentence_transformer_on_a_rotary_encoder(family: str, tiny_roberta_dir: Path, tmp_path: Path) -> None:
    """A sentence-transformers model on a ModernBERT, GTE, NomicBERT, Jina-v3 or EuroBERT encoder (random weights, the
    tiny RoBERTa's BPE tokenizer): optimize swaps fastbert's class in and the embeddings stay within 1e-5."""
    import shutil

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, family + "Model"):
        pytest.skip(f"this transformers has no {family}Model")
    path = tmp_path / family
    shutil.copytree(tiny_roberta_dir, path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.model_input_names = ["input_ids", "attention_mask"]  # as these models' own tokenizers: no token types
    tok.save_pretrained(path)
    ids = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2)
    extra = dict(cls_token_id=0, sep_token_id=2, local_attention=8) if family == "ModernBert" else {}
    config = getattr(transformers, family + "Config")(vocab_size=tok.vocab_size, hidden_size=56, num_attention_heads=4,
                                                      num_hidden_layers=2, intermediate_size=40,
                                                      max_position_embeddings=66, **ids, **extra)  # fmt: skip
    torch.manual_seed(0)
    getattr(transformers, family + "Model")(config).save_pretrained(path)
    model = st.SentenceTransformer(str(path), device="cpu")
    before = model.encode(SENTENCES, convert_to_tensor=True)
    fastbert.optimize(model)
    assert type(model[0].model).__name__ == family + "Model"
    calls = calls_of(model[0].model)
    after = model.encode(SENTENCES, convert_to_tensor=True)
    assert calls and (after - before).abs().max().item() <= 1e-5


def test_optimized_sentence_transformer_saves_and_loads_back_in_plain_sentence_transformers(
    minilm_dir: Path, tmp_path: Path
) -> None:
    model = st.SentenceTransformer(str(minilm_dir), device="cpu")
    before = model.encode(SENTENCES, convert_to_tensor=True)
    fastbert.optimize(model)
    model.save(str(tmp_path))  # sentence-transformers passes safe_serialization=True to the encoder's save_pretrained
    loaded = st.SentenceTransformer(str(tmp_path), device="cpu")
    assert not isinstance(loaded[0].model, fastbert.BertModel)  # transformers' own BertModel read the folder
    after = loaded.encode(SENTENCES, convert_to_tensor=True)
    assert (after - before).abs().max().item() <= 1e-5


def test_optimized_cross_encoder_saves_and_loads_back_in_plain_sentence_transformers(
    minilm_dir: Path, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = st.CrossEncoder(str(minilm_dir), num_labels=1, device="cpu")
    pairs = [("a man plays guitar", "someone is making music"), ("the cat sleeps", "stock prices fell sharply")]
    before = model.predict(pairs, convert_to_tensor=True)
    fastbert.optimize(model)
    model.save(str(tmp_path))
    loaded = st.CrossEncoder(str(tmp_path), device="cpu")
    assert type(loaded[0].model).__module__.startswith("transformers")
    after = loaded.predict(pairs, convert_to_tensor=True)
    assert (after - before).abs().max().item() <= 1e-5


STSB_PAIRS = 200  # a slice of STS-B dev: the whole set takes minutes on a 2-core machine (benchmarks.bench_encode)


def test_all_mpnet_base_v2_embeddings_and_stsb(mpnet_dir: Path, shared_data: Path) -> None:
    """The real all-mpnet-base-v2: fastbert's embeddings have cosine >= 0.99999 to sentence-transformers' own and the
    same STS-B Spearman; int8 stays within 0.5 points of it."""
    from scipy.stats import spearmanr

    from fastbert import ops
    from fastbert.distill.recipes.sts import read_sts

    a, b, gold = (column[:STSB_PAIRS] for column in read_sts(str(shared_data / "stsb" / "sts-dev.csv")))

    def spearman(model: st.SentenceTransformer) -> tuple[torch.Tensor, float]:
        emb = model.encode(a + b, batch_size=32, convert_to_tensor=True)
        cos = torch.cosine_similarity(emb[:STSB_PAIRS], emb[STSB_PAIRS:])
        return emb, 100 * spearmanr(cos.numpy(), gold).statistic

    model = st.SentenceTransformer(str(mpnet_dir), device="cpu")
    theirs, theirs_rho = spearman(model)
    fastbert.optimize(model)
    assert isinstance(model[0].model, fastbert.MPNetModel)
    ours, ours_rho = spearman(model)
    assert torch.cosine_similarity(ours, theirs).min().item() >= 0.99999
    assert abs(ours_rho - theirs_rho) <= 0.01, (ours_rho, theirs_rho)
    quantized = fastbert.optimize(st.SentenceTransformer(str(mpnet_dir), device="cpu"), quantize="int8")
    with ops.use_backend("int8"):  # every GEMM int8, whatever the timings on this CPU
        int8, int8_rho = spearman(quantized)
    assert abs(int8_rho - theirs_rho) <= 0.5, (int8_rho, theirs_rho)
    assert torch.cosine_similarity(int8, theirs).max().item() < 1.0  # int8 really ran
