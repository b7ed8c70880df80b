"""MLM masking: 80/10/10 statistics within binomial bounds, special tokens and padding never touched, whole words."""

import math

import pytest
import torch

from fastbert.masking import IGNORE_INDEX, MLMMasker

SPECIAL = (0, 1, 2, 3, 4)  # [PAD] [UNK] [CLS] [SEP] [MASK]
MASK, VOCAB = 4, 1000


def within_binomial(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


def batch(gen: torch.Generator, b: int = 64, s: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, VOCAB, (b, s), generator=gen)
    lengths = torch.randint(s // 4, s + 1, (b,), generator=gen)
    mask = (torch.arange(s)[None] < lengths[:, None]).long()
    ids[:, 0] = 2
    ids[torch.arange(b), lengths - 1] = 3
    ids[mask == 0] = 0
    return ids, mask


def test_80_10_10_statistics():
    gen = torch.Generator().manual_seed(0)
    ids, attn = batch(gen)
    masker = MLMMasker(MASK, VOCAB, SPECIAL, probability=0.15)
    out, labels = masker(ids, attn, generator=torch.Generator().manual_seed(1))
    eligible = (attn == 1) & (ids > 4)
    selected = labels != IGNORE_INDEX
    n_eligible, n_sel = int(eligible.sum()), int(selected.sum())
    assert within_binomial(n_sel, n_eligible, 0.15)
    assert torch.equal(labels[selected], ids[selected])
    masked = int((out[selected] == MASK).sum())
    kept = int((out[selected] == ids[selected]).sum())
    randomised = n_sel - masked - kept
    assert within_binomial(masked, n_sel, 0.8)
    assert within_binomial(randomised, n_sel, 0.1 * (1 - 1 / (VOCAB - 5)))
    assert within_binomial(kept, n_sel, 0.1 + 0.1 / (VOCAB - 5))
    assert torch.equal(out[~selected], ids[~selected])  # unselected tokens untouched
    assert int((out[selected] < 4).sum()) == 0  # random replacements are never special tokens


def test_special_tokens_and_padding_never_masked():
    gen = torch.Generator().manual_seed(2)
    ids, attn = batch(gen, b=32, s=32)
    ids[:, 5] = 1  # [UNK] inside the text
    attn_pad = attn.clone()
    ids[:, -1] = torch.where(attn[:, -1] == 0, 7, ids[:, -1])  # a real-looking id in a padded slot
    masker = MLMMasker(MASK, VOCAB, SPECIAL, probability=0.9)
    for seed in range(5):
        out, labels = masker(ids, attn_pad, generator=torch.Generator().manual_seed(seed))
        protected = (ids <= 4) | (attn_pad == 0)
        assert torch.equal(out[protected], ids[protected])
        assert bool((labels[protected] == IGNORE_INDEX).all())
        assert int((labels != IGNORE_INDEX).sum()) > 0


def test_dynamic_and_reproducible():
    ids, attn = batch(torch.Generator().manual_seed(3), b=8, s=64)
    masker = MLMMasker(MASK, VOCAB, SPECIAL)
    a = masker(ids, attn, generator=torch.Generator().manual_seed(5))
    b = masker(ids, attn, generator=torch.Generator().manual_seed(5))
    c = masker(ids, attn, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_whole_word_masks_every_piece_of_a_word():
    gen = torch.Generator().manual_seed(4)
    ids, attn = batch(gen, b=64, s=64)
    continuation = range(500, VOCAB)  # ids >= 500 play the role of "##" pieces
    masker = MLMMasker(MASK, VOCAB, SPECIAL, probability=0.2, continuation_ids=continuation)
    _, labels = masker(ids, attn, generator=torch.Generator().manual_seed(7))
    selected = labels != IGNORE_INDEX
    eligible = (attn == 1) & (ids > 4)
    words = words_selected = 0
    for row in range(ids.shape[0]):
        start = None
        for j in range(ids.shape[1]):
            if not eligible[row, j]:
                start = None
                continue
            if ids[row, j] < 500 or start is None:  # a word's first piece (or a "##" piece after [CLS])
                start = j
                words += 1
                words_selected += int(selected[row, j])
            assert selected[row, j] == selected[row, start], (row, j, start)
    assert within_binomial(words_selected, words, 0.2)


def test_from_tokenizer_whole_word():
    pytest.importorskip("tokenizers")
    from fastbert.tokenization import WordPieceTokenizer

    texts = ["the unbelievable tokenisation of extraordinarily long words"] * 20 + ["short words here"] * 20
    tok = WordPieceTokenizer.train(texts, vocab_size=60, min_frequency=1)
    masker = MLMMasker.from_tokenizer(tok, whole_word=True, probability=0.5)
    assert masker.continuation is not None and bool(masker.continuation.any())
    enc = tok(texts[:4])
    out, labels = masker(enc["input_ids"], enc["attention_mask"], generator=torch.Generator().manual_seed(0))
    specials = torch.tensor(sorted(tok.special_ids))
    protected = torch.isin(enc["input_ids"], specials)
    assert torch.equal(out[protected], enc["input_ids"][protected])


def test_bad_arguments():
    with pytest.raises(ValueError, match="probability"):
        MLMMasker(MASK, VOCAB, SPECIAL, probability=0.0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        MLMMasker(MASK, VOCAB, SPECIAL)(torch.tensor([[2, VOCAB, 3]]))
