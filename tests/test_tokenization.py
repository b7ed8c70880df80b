"""fastbert's WordPiece tokenisation gives exactly transformers' BertTokenizerFast ids on the MiniLM vocabulary."""

import random
import shutil
from pathlib import Path

import pytest
import torch

from fastbert.tokenization import WordPieceTokenizer

transformers = pytest.importorskip("transformers")

SINGLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Unbelievably, tokenisation handles naïve café déjà-vu and 3.14159 numbers",
    "",
    "a " * 200,
]
PAIRS = [
    ("A man is playing a flute.", "A man is playing a large flute."),
    ("short", "a much longer second sentence that will need cutting when the budget is small " * 3),
    ("a long first segment that goes on and on " * 4, "tiny"),
]


def vocab_only(directory, vocab: Path) -> Path:
    """A folder holding just vocab.txt, so transformers builds its tokenizer from the vocabulary alone."""
    directory.mkdir(exist_ok=True)
    shutil.copy(vocab, directory / "vocab.txt")
    return directory


@pytest.fixture(scope="module")
def tokenizers_pair(minilm_dir, tmp_path_factory):
    ours = WordPieceTokenizer.from_pretrained(minilm_dir / "vocab.txt")
    from_json = WordPieceTokenizer.from_pretrained(minilm_dir)
    folder = vocab_only(tmp_path_factory.mktemp("vocab"), minilm_dir / "vocab.txt")
    theirs = transformers.BertTokenizerFast.from_pretrained(folder)
    return ours, from_json, theirs


def reference(theirs, texts, pairs, max_length):
    args = (texts, pairs) if pairs is not None else (texts,)
    out = theirs(*args, truncation="longest_first", max_length=max_length, padding=True, return_tensors="pt")
    return {k: out[k] for k in ("input_ids", "token_type_ids", "attention_mask")}


@pytest.mark.parametrize("max_length", [512, 16, 7])
def test_singles_match_transformers(tokenizers_pair, max_length):
    ours, from_json, theirs = tokenizers_pair
    expected = reference(theirs, SINGLES, None, max_length)
    for tok in (ours, from_json):
        got = tok(SINGLES, max_length=max_length)
        for key, value in expected.items():
            assert torch.equal(got[key], value), key


@pytest.mark.parametrize("max_length", [512, 20, 9])
def test_pairs_match_transformers(tokenizers_pair, max_length):
    ours, from_json, theirs = tokenizers_pair
    first, second = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    expected = reference(theirs, first, second, max_length)
    for tok in (ours, from_json):
        got = tok(first, second, max_length=max_length)
        for key, value in expected.items():
            assert torch.equal(got[key], value), key


def test_sliding_windows_cover_the_context_and_match_transformers_overflow(tokenizers_pair):
    """Windows: the question whole, context slices of the room left overlapping by `stride`, the last one ending at
    the context's end. tokenizers 0.23.2's pair overflow (and transformers' through it) kept 2 of 7 here."""
    import tokenizers

    ours, _, theirs = tokenizers_pair
    question, context = "Where is it?", " ".join(f"word{i}" for i in range(60))
    windows = ours.windows([question], [context], max_length=32, stride=8)[0]
    q, c = ours.encode_ids([question])[0], ours.encode_ids([context])[0]
    room, start, expected = 32 - len(q) - 3, 0, []
    while not expected or start - (room - 8) + room < len(c):
        expected.append([ours.cls_id, *q, ours.sep_id, *c[start:start + room], ours.sep_id])
        start += room - 8
    assert [w.ids for w in windows] == expected and len(expected) > 2
    assert all(w.type_ids == [0] * (len(q) + 2) + [1] * (len(w.ids) - len(q) - 2) for w in windows)
    if tokenizers.__version__ != "0.23.2":  # that version's overflow drops windows: nothing to compare with
        overflow = theirs(
            question, context, truncation="only_second", max_length=32, stride=8, return_overflowing_tokens=True
        )
        assert [w.ids for w in windows] == overflow["input_ids"]


def test_windows_refuse_a_stride_the_room_cannot_hold(tokenizers_pair):
    """A clear error, where tokenizers' own overflow panics in Rust."""
    ours = tokenizers_pair[0]
    context = " ".join(f"word{i}" for i in range(60))
    with pytest.raises(ValueError, match="stride 30 must be smaller than the 25 context tokens"):
        ours.windows(["Where is it?"], [context], max_length=32, stride=30)
    with pytest.raises(ValueError, match="leaves no room for the context"):
        ours.windows(["Where is it? " * 20], [context], max_length=32, stride=8)
    assert len(ours.windows(["Where is it?"], ["word1 word2"], max_length=32, stride=20)[0]) == 1  # fits: one


def test_trained_vocabulary_round_trips_through_transformers(tmp_path):
    corpus = ["the cat sat on the mat", "the dog sat on the log", "cats and dogs are animals"] * 20
    tok = WordPieceTokenizer.train(corpus, vocab_size=120, min_frequency=1)
    tok.save(tmp_path / "saved")
    theirs = transformers.BertTokenizerFast.from_pretrained(
        vocab_only(tmp_path / "ref", tmp_path / "saved" / "vocab.txt")
    )
    texts = ["the cat and the dog", "unseen zebra words"]
    assert torch.equal(tok(texts)["input_ids"], reference(theirs, texts, None, 64)["input_ids"])


def test_bad_calls():
    tok = WordPieceTokenizer.train(["a b c"] * 5, vocab_size=40, min_frequency=1)
    with pytest.raises(TypeError, match="list of texts"):
        tok("a single string")
    with pytest.raises(ValueError, match="pair texts"):
        tok(["a", "b"], ["c"])


def test_learnt_vocabulary_is_the_same_every_time():
    """The `tokenizers` trainer alone numbers pieces in hash-map order (ids, even the piece set, differ run to run):
    a resumed run or another DDP rank would read the embeddings under another mapping."""
    rng = random.Random(0)
    words = "the a cat dog sat ran on under mat log house river big small red blue quickly slowly and then".split()
    texts = [" ".join(rng.choices(words, k=rng.randint(4, 10))).capitalize() + "." for _ in range(150)]
    vocabularies = [
        WordPieceTokenizer.train(texts, vocab_size=80, min_frequency=1).backend.get_vocab() for _ in range(6)
    ]
    assert all(v == vocabularies[0] for v in vocabularies[1:])
    tok = WordPieceTokenizer.train(texts, vocab_size=80, min_frequency=1)
    assert tok.backend.encode("the ##cat").tokens[:3] == ["[CLS]", "the", "[UNK]"]  # '##x' pieces are not special
