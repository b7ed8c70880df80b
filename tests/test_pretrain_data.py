"""Pretraining data: WikiText reading, sentence splitting, NSP/SOP pairs (labels correct and balanced), batching."""

import math

import pytest
import torch

from fastbert.masking import IGNORE_INDEX, MLMMasker
from fastbert.pretrain.data import encode_pairs, make_pairs, read_documents, split_sentences
from fastbert.pretrain.objective import PretrainCollator
from fastbert.tokenization import WordPieceTokenizer
from fastbert.train import LengthGroupedBatchSampler


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_dir):
    return WordPieceTokenizer.from_pretrained(minilm_dir)


def synthetic_documents(n_docs: int = 120, n_sentences: int = 30, seed: int = 0) -> list[list[list[int]]]:
    """Every sentence is a run of one id that encodes (document, sentence): 1000 * (d + 1) + s."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 25, (n_docs, n_sentences), generator=gen).tolist()
    return [[[1000 * (d + 1) + s] * lengths[d][s] for s in range(n_sentences)] for d in range(n_docs)]


def origin(ids: list[int]) -> list[tuple[int, int]]:
    return [(t // 1000 - 1, t % 1000) for t in ids]


@pytest.mark.parametrize("objective", ["nsp", "sop"])
def test_pair_labels_are_correct_and_balanced(objective):
    docs = synthetic_documents()
    pairs = make_pairs(docs, max_length=64, objective=objective, seed=1)
    assert len(pairs) > 600
    positives = 0
    for a, b, label in pairs:
        assert 1 <= len(a) and 1 <= len(b) and len(a) + len(b) <= 64 - 3
        da, db = origin(a), origin(b)
        doc_a = {d for d, _ in da}
        assert len(doc_a) == 1  # a segment never mixes documents
        if objective == "nsp" and label == 1:
            assert {d for d, _ in db} != doc_a  # B from another document
            continue
        assert {d for d, _ in db} == doc_a
        if label == 0:  # B follows A in the same document (trimming may drop a sentence at the seam)
            assert min(s for _, s in db) > max(s for _, s in da)
            positives += 1
        else:  # SOP: the two segments swapped, so A comes after B
            assert min(s for _, s in da) > max(s for _, s in db)
    share = 1 - positives / len(pairs)
    assert abs(share - 0.5) <= 5 * math.sqrt(0.25 / len(pairs)) + 0.02, share


def test_make_pairs_is_deterministic_and_rejects_bad_input():
    docs = synthetic_documents(5, 10)
    assert make_pairs(docs, 32, "nsp", seed=3) == make_pairs(docs, 32, "nsp", seed=3)
    assert make_pairs(docs, 32, "nsp", seed=3) != make_pairs(docs, 32, "nsp", seed=4)
    with pytest.raises(ValueError, match="objective"):
        make_pairs(docs, 32, "mlm")
    with pytest.raises(ValueError, match="two documents"):
        make_pairs(docs[:1], 32, "nsp")


def test_encode_pairs_layout(minilm_tokenizer):
    tok = minilm_tokenizer
    (feat,) = encode_pairs(tok, [([10, 11], [12, 13, 14], 1)])
    assert feat["input_ids"] == [tok.cls_id, 10, 11, tok.sep_id, 12, 13, 14, tok.sep_id]
    assert feat["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert feat["next_sentence_label"] == 1


def test_read_wikitext_documents(tmp_path):
    text = (
        " \n = First = \n \n Alpha is 3 @.@ 5 m long . It has a <unk> tail ! Why ?\n \n = = Section = = \n"
        " Beta follows .\n \n = Second = \n \n Gamma .\n"
    )
    path = tmp_path / "wiki.txt"
    path.write_text(text)
    docs = read_documents(path)
    assert docs == [["Alpha is 3 @.@ 5 m long .", "It has a [UNK] tail !", "Why ?", "Beta follows ."], ["Gamma ."]]
    assert split_sentences("One. Two? Three") == ["One.", "Two?", "Three"]
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="empty"):
        read_documents(tmp_path / "empty.txt")


def test_collator_masks_dynamically_and_never_special_tokens(minilm_tokenizer):
    tok = minilm_tokenizer
    docs = [[tok.encode_ids([f"sentence number {i} of document {d} is here ."])[0] for i in range(8)] for d in range(6)]
    feats = encode_pairs(tok, make_pairs(docs, 48, "nsp", seed=0))
    collate = PretrainCollator(tok, MLMMasker.from_tokenizer(tok))
    torch.manual_seed(0)
    first, second = collate(feats), collate(feats)
    original = tok.pad([f["input_ids"] for f in feats])["input_ids"]
    assert not torch.equal(first["labels"], second["labels"])  # a new mask on every pass
    for batch in (first, second):
        selected = batch["labels"] != IGNORE_INDEX
        assert torch.equal(batch["labels"][selected], original[selected])
        special = torch.isin(original, torch.tensor(sorted(tok.special_ids)))
        assert not (selected & special).any()
        assert torch.equal(batch["input_ids"][special], original[special])


def test_length_grouped_sampler():
    lengths = torch.randint(5, 128, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    sampler = LengthGroupedBatchSampler(lengths, 16, seed=1, group=10)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    assert len(epoch0) == len(sampler) and sorted(i for b in epoch0 for i in b) == list(range(1000))
    assert epoch0 == list(sampler)  # deterministic given (seed, epoch)
    sampler.set_epoch(1)
    assert list(sampler) != epoch0
    sampler.set_epoch(0, start=5)
    assert list(sampler) == epoch0[5:]

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(2)).tolist()
    assert padding(epoch0) < 0.5 * padding([shuffled[i : i + 16] for i in range(0, 1000, 16)])
    ranks = [LengthGroupedBatchSampler(lengths, 16, seed=1, group=10, rank=r, world_size=2) for r in (0, 1)]
    seen = [{i for b in r for i in b} for r in ranks]
    assert len(ranks[0]) == len(list(ranks[1])) and not seen[0] & seen[1]
