"""Fine-tuning: data readers and their errors, metrics, QA windows and span post-processing, tiny end-to-end runs
whose saved models load in transformers with the same outputs."""

import json
import shutil

import numpy as np
import pytest
import torch

from fastbert import BertConfig, BertModel
from fastbert.finetune import finetune, make_task
from fastbert.finetune.data import DataError, QAExample, read_conll, read_squad, read_table
from fastbert.finetune.metrics import entity_f1, entity_spans, pearson_spearman, squad_scores
from fastbert.finetune.qa import best_answers, make_windows
from fastbert.tokenization import WordPieceTokenizer

CONTEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower in Paris. It was designed by the company of Gustave Eiffel "
    "and built from 1887 to 1889. It is 330 metres tall and was the tallest structure in the world for 41 years."
)


@pytest.fixture(scope="module")
def tok(minilm_dir):
    return WordPieceTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, minilm_dir):
    """A 2-layer random BERT with the MiniLM vocabulary, saved with its tokenizer files."""
    path = tmp_path_factory.mktemp("tiny")
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(path)
    shutil.copy(minilm_dir / "vocab.txt", path / "vocab.txt")
    return path


# ----------------------------------------------------------------------------------------------- bad input
def test_table_errors_are_clear(tmp_path):
    good = tmp_path / "good.csv"
    good.write_text("premise,hypothesis,label\na cat,a dog,no\ntwo men,men,yes\n")
    with pytest.raises(DataError, match="no column 'sentence2'.*premise"):
        read_table(good, ["premise", "sentence2"], "label")
    with pytest.raises(DataError, match="no column 'score'"):
        read_table(good, ["premise"], "score")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataError, match="empty"):
        read_table(tmp_path / "empty.csv", ["premise"], "label")
    (tmp_path / "header_only.csv").write_text("premise,label\n")
    with pytest.raises(DataError, match="no data rows"):
        read_table(tmp_path / "header_only.csv", ["premise"], "label")
    with pytest.raises(DataError, match="not a number"):
        read_table(good, ["premise", "hypothesis"], "label", regression=True)
    short = tmp_path / "short.tsv"
    short.write_text("a\tb\t1\nc\td\n")
    with pytest.raises(DataError, match=r"short.tsv:2: 2 fields"):
        read_table(short, ["0", "1"], "2", header=False)
    with pytest.raises(DataError, match="no such file"):
        read_table(tmp_path / "missing.csv", ["premise"], "label")


def test_labels_outside_the_label_set(tmp_path, tok):
    train, dev = tmp_path / "train.csv", tmp_path / "dev.csv"
    train.write_text("text,label\ngood,pos\nbad,neg\n")
    dev.write_text("text,label\nfine,pos\nmeh,neutral\n")
    task = make_task("sequence", tok, {"text_columns": ["text"], "label_column": "label"})
    task.read(str(train), train=True)
    assert task.labels == ["neg", "pos"]
    with pytest.raises(DataError, match="'neutral'.*not in the label set"):
        task.read(str(dev))
    fixed = make_task("sequence", tok, {"text_columns": ["text"], "label_column": "label", "labels": ["pos"]})
    with pytest.raises(DataError, match="neg"):
        fixed.read(str(train), train=True)


def test_conll_and_squad_errors(tmp_path):
    bad_tag = tmp_path / "bad.conll"
    bad_tag.write_text("John B-PER\nlives O\nin O\nParis LOC\n")
    with pytest.raises(DataError, match="'LOC' is not BIO"):
        read_conll(bad_tag)
    no_tag = tmp_path / "no_tag.conll"
    no_tag.write_text("John B-PER\nlives\n")
    with pytest.raises(DataError, match=":2: expected"):
        read_conll(no_tag)
    (tmp_path / "empty.conll").write_text("")
    with pytest.raises(DataError, match="empty"):
        read_conll(tmp_path / "empty.conll")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="not SQuAD JSON"):
        read_squad(tmp_path / "list.json")
    wrong = {
        "data": [
            {
                "paragraphs": [
                    {
                        "context": "abc def",
                        "qas": [{"id": "q", "question": "?", "answers": [{"text": "def", "answer_start": 1}]}],
                    }
                ]
            }
        ]
    }
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    with pytest.raises(DataError, match="'def' is not at 1"):
        read_squad(tmp_path / "wrong.json")


# ------------------------------------------------------------------------------------------------- metrics
def test_correlations_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 6, 200).astype(float)  # many ties
    pred = gold + rng.normal(0, 2, 200)
    got = pearson_spearman(pred, gold)
    assert got["pearson"] == pytest.approx(100 * stats.pearsonr(pred, gold)[0], abs=1e-9)
    assert got["spearman"] == pytest.approx(100 * stats.spearmanr(pred, gold)[0], abs=1e-9)


def test_entity_level_f1():
    assert entity_spans(["B-PER", "I-PER", "O", "B-LOC", "I-LOC", "I-LOC"]) == {("PER", 0, 1), ("LOC", 3, 5)}
    assert entity_spans(["I-PER", "I-LOC", "O"]) == {("PER", 0, 0), ("LOC", 1, 1)}  # stray I- opens an entity
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O"]]  # 2 of 3 right, one wrong type
    scores = entity_f1(pred, gold)
    assert scores["precision"] == pytest.approx(200 / 3) and scores["recall"] == pytest.approx(200 / 3)
    assert entity_f1([["B-PER", "O"]], [["B-PER", "I-PER"]])["f1"] == 0.0  # boundaries must match exactly


def test_squad_scores():
    preds = {"a": "the Eiffel Tower!", "b": "1887", "c": ""}
    gold = {"a": ["Eiffel Tower"], "b": ["from 1887 to 1889", "1887 to 1889"], "c": []}
    scores = squad_scores(preds, gold)
    assert scores["exact_match"] == pytest.approx(200 / 3)  # a (normalised) and c (unanswerable, empty) exact
    assert scores["f1"] == pytest.approx(100 * (1 + 2 * (1 * 1 / 3) / (1 + 1 / 3) + 1) / 3)


# ------------------------------------------------------------------------------------------ QA windows/spans
def test_windows_locate_the_answer_and_round_trip(tok):
    begin = CONTEXT.index("Gustave Eiffel")
    example = QAExample("q1", "Who designed the tower?", CONTEXT, [("Gustave Eiffel", begin)])
    windows = make_windows(tok, [example], max_length=24, stride=6)
    assert len(windows) > 3
    holding = [w for w in windows if w.start]
    assert holding and len(holding) < len(windows)  # some windows hold the answer, others point at [CLS]
    for w in windows:
        assert len(w.input_ids) <= 24
        if w.start:
            assert CONTEXT[w.offsets[w.start][0] : w.offsets[w.end][1]] == "Gustave Eiffel"
        else:
            assert w.end == 0


def test_best_answer_post_processing_on_hand_made_logits(tok):
    ex = [QAExample("q1", "How tall is it?", CONTEXT), QAExample("q2", "When was it built?", CONTEXT)]
    windows = make_windows(tok, ex, max_length=32, stride=8)

    def logits_for(example, text, score):
        """Logits that peak on `text` in the first window holding it (and a tempting invalid span)."""
        begin = CONTEXT.index(text)
        out = []
        for w in windows:
            s, e = np.zeros(len(w.input_ids)), np.zeros(len(w.input_ids))
            s[0] = e[0] = 50.0  # [CLS] is never a valid answer span
            s[2] = e[1] = 60.0  # question tokens: invalid, and end before start
            if w.example == example:
                span = [i for i, o in enumerate(w.offsets) if o and begin <= o[0] and o[1] <= begin + len(text)]
                if span and w.offsets[span[0]][0] == begin and w.offsets[span[-1]][1] == begin + len(text):
                    s[span[0]], e[span[-1]] = score, score
                    score -= 1  # later windows holding it score lower: the best one must win
            out.append((s, e))
        return out

    first = logits_for(0, "330 metres", 10.0)
    second = logits_for(1, "1887 to 1889", 10.0)
    starts = [a[0] if w.example == 0 else b[0] for w, a, b in zip(windows, first, second, strict=True)]
    ends = [a[1] if w.example == 0 else b[1] for w, a, b in zip(windows, first, second, strict=True)]
    assert best_answers(ex, windows, starts, ends) == {"q1": "330 metres", "q2": "1887 to 1889"}
    assert best_answers(ex, windows, starts, ends, max_answer_tokens=2)["q2"] != "1887 to 1889"


# ------------------------------------------------------------------------------------- end to end, tiny
def check_loads_in_transformers(final, fastbert_class, auto_class, batch):
    transformers = pytest.importorskip("transformers")
    ours = fastbert_class.from_pretrained(final)
    theirs = getattr(transformers, auto_class).from_pretrained(final).eval()
    with torch.no_grad():
        a, b = ours(**batch), theirs(**batch)
    for key in a.keys():
        if key.endswith("logits"):
            assert torch.allclose(a[key], b[key], atol=1e-5), key
    assert transformers.BertTokenizerFast.from_pretrained(final)("a b")["input_ids"]


def test_sequence_pairs_and_regression_end_to_end(tmp_path, tiny_checkpoint, tok):
    from fastbert import BertForSequenceClassification

    rows = ["premise,hypothesis,label"] + [f"a cat {i},a dog {i},{'yes' if i % 2 else 'no'}" for i in range(12)]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    result = finetune(
        "sequence",
        str(tiny_checkpoint),
        str(tmp_path / "train.csv"),
        str(tmp_path / "cls"),
        dev=str(tmp_path / "train.csv"),
        batch_size=4,
        text_columns=["premise", "hypothesis"],
        label_column="label",
        loop={"max_steps": 3, "log_every": 1},
    )
    assert set(result["metrics"]) == {"accuracy", "macro_f1"} and result["step"] == 3
    config = json.loads((tmp_path / "cls" / "final" / "config.json").read_text())
    assert config["id2label"] == {"0": "no", "1": "yes"} and config["num_labels"] == 2
    batch = tok(["a cat 1"], ["a dog 1"])
    check_loads_in_transformers(
        tmp_path / "cls" / "final", BertForSequenceClassification, "BertForSequenceClassification", batch
    )

    tsv = "\n".join(f"g\tf\t2012\t{i}\t{i % 6}.0\ta man {i}\ta woman {i}" for i in range(12))
    (tmp_path / "sts.tsv").write_text(tsv + "\n")
    result = finetune(
        "regression",
        str(tiny_checkpoint),
        str(tmp_path / "sts.tsv"),
        str(tmp_path / "reg"),
        dev=str(tmp_path / "sts.tsv"),
        batch_size=4,
        text_columns=["5", "6"],
        label_column="4",
        header=False,
        loop={"max_steps": 2},
    )
    assert set(result["metrics"]) == {"pearson", "spearman"}
    check_loads_in_transformers(
        tmp_path / "reg" / "final",
        BertForSequenceClassification,
        "BertForSequenceClassification",
        tok(["a man 1"], ["a woman 1"]),
    )


def test_config_sizes_are_checked_against_the_checkpoint_before_building(tmp_path, tiny_checkpoint, monkeypatch):
    from fastbert.checkpoint import CheckpointError, PreTrainedModel

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100000}))
    (tmp_path / "train.csv").write_text("text,label\na cat,yes\na dog,no\n")

    def build(self, *args, **kwargs) -> None:
        raise AssertionError("the model was built before its sizes were checked")

    monkeypatch.setattr(PreTrainedModel, "__init__", build)
    with pytest.raises(CheckpointError, match=r"config.json: num_hidden_layers=100000 but model.safetensors has 2 "):
        finetune(
            "sequence", str(model), str(tmp_path / "train.csv"), str(tmp_path / "out"), text_columns=["text"],
            label_column="label", loop={"max_steps": 1},
        )  # fmt: skip


def test_regression_head_folds_standardisation(tok):
    from fastbert import BertForSequenceClassification

    task = make_task("regression", tok, {"text_columns": ["0"], "label_column": "1"})
    task.mean, task.std = 2.5, 1.5
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=1
    )
    model = BertForSequenceClassification(config).eval()
    batch = tok(["some text", "more text here"])
    with torch.no_grad():
        standardised = model(**batch).logits
        task.finish(model)
        assert torch.allclose(model(**batch).logits, standardised * 1.5 + 2.5, atol=1e-6)


def test_token_classification_end_to_end(tmp_path, tiny_checkpoint, tok):
    from fastbert import BertForTokenClassification

    sentence = "John B-PER\nSmithson I-PER\nlives O\nin O\nLondonderry B-LOC\n\n"
    (tmp_path / "train.conll").write_text("-DOCSTART- O\n\n" + sentence * 6)
    result = finetune(
        "token",
        str(tiny_checkpoint),
        str(tmp_path / "train.conll"),
        str(tmp_path / "ner"),
        dev=str(tmp_path / "train.conll"),
        batch_size=2,
        loop={"max_steps": 2},
    )
    assert set(result["metrics"]) == {"precision", "recall", "f1"}
    task = make_task("token", tok, {"labels": ["B-LOC", "B-PER", "I-PER", "O"]})
    (feat,) = task.features(read_conll(tmp_path / "train.conll")[:1])
    assert sum(label != -100 for label in feat["labels"]) == 5  # one label per word, word pieces ignored
    check_loads_in_transformers(
        tmp_path / "ner" / "final",
        BertForTokenClassification,
        "BertForTokenClassification",
        tok(["John Smithson lives in Londonderry"]),
    )


def test_question_answering_end_to_end(tmp_path, tiny_checkpoint, tok):
    from fastbert import BertForQuestionAnswering

    qas = [
        {
            "id": f"q{i}",
            "question": "Who designed it?",
            "answers": [{"text": "Gustave Eiffel", "answer_start": CONTEXT.index("Gustave Eiffel")}],
        }
        for i in range(4)
    ]
    qas.append({"id": "none", "question": "Where is Rome?", "answers": [], "is_impossible": True})
    (tmp_path / "squad.json").write_text(json.dumps({"data": [{"paragraphs": [{"context": CONTEXT, "qas": qas}]}]}))
    result = finetune(
        "qa",
        str(tiny_checkpoint),
        str(tmp_path / "squad.json"),
        str(tmp_path / "qa"),
        dev=str(tmp_path / "squad.json"),
        batch_size=4,
        max_length=32,
        stride=8,
        loop={"max_steps": 2},
    )
    assert set(result["metrics"]) == {"exact_match", "f1"}
    check_loads_in_transformers(
        tmp_path / "qa" / "final", BertForQuestionAnswering, "BertForQuestionAnswering", tok(["Who?"], [CONTEXT])
    )


def test_finetune_cli_on_a_roberta_checkpoint(tmp_path, tiny_roberta_dir):
    """`fastbert finetune` on a RoBERTa checkpoint with its byte-level BPE tokenizer.json: a RobertaFor... head is
    trained and saved under transformers' RoBERTa names, and transformers loads it with the same logits; regression
    folds its standardisation into the RoBERTa head's out_proj."""
    import transformers

    from fastbert import RobertaForSequenceClassification
    from fastbert.cli import main

    rows = ["premise,hypothesis,label"] + [f"a cat {i},a dog {i},{i % 3}" for i in range(12)]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    tok = WordPieceTokenizer.from_pretrained(tiny_roberta_dir)
    batch = tok(["a cat 1", "a cat 22"], ["a dog 1", "a dog"])
    assert tok.cls_id == 0 and "token_type_ids" not in batch
    for task in ("sequence", "regression"):
        args = ["finetune", task, "--model", str(tiny_roberta_dir), "--train", str(tmp_path / "train.csv")]
        args += ["--dev", str(tmp_path / "train.csv"), "--output-dir", str(tmp_path / task), "--text-columns"]
        args += ["premise", "hypothesis", "--label-column", "label", "--batch-size", "4", "--max-steps", "3"]
        assert main(args) == 0
        final = tmp_path / task / "final"
        config = json.loads((final / "config.json").read_text())
        assert config["architectures"] == ["RobertaForSequenceClassification"]
        ours = RobertaForSequenceClassification.from_pretrained(final)
        theirs = transformers.RobertaForSequenceClassification.from_pretrained(final).eval()
        with torch.no_grad():
            torch.testing.assert_close(ours(**batch).logits, theirs(**batch).logits, atol=1e-5, rtol=0)


def test_finetune_on_a_distilbert_checkpoint_passes_no_token_types(tmp_path, minilm_dir):
    """DistilBERT has no token types: the fine-tuning batches leave token_type_ids out."""
    from fastbert import DistilBertConfig, DistilBertForTokenClassification, DistilBertModel

    config = DistilBertConfig(
        vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64
    )
    DistilBertModel(config).save_pretrained(tmp_path / "distil")
    shutil.copy(minilm_dir / "vocab.txt", tmp_path / "distil" / "vocab.txt")
    lines = [f"the B-X\ncat{i} O\nsat I-X\n" for i in range(8)]
    (tmp_path / "train.conll").write_text("\n".join(lines))
    result = finetune(
        "token",
        str(tmp_path / "distil"),
        str(tmp_path / "train.conll"),
        str(tmp_path / "ft"),
        dev=str(tmp_path / "train.conll"),
        batch_size=4,
        loop={"max_steps": 2},
    )
    assert result["step"] == 2
    DistilBertForTokenClassification.from_pretrained(tmp_path / "ft" / "final", strict_heads=True)
