"""WordPiece tokenisation through the `tokenizers` library: load a checkpoint's vocabulary or train a new one.

`WordPieceTokenizer` produces BERT's `[CLS] A [SEP] B [SEP]` layout with segment ids and pair truncation, as
torch tensors ready for `BertModel`. No hand-written tokeniser: the `tokenizers` Rust core does the work.
A RoBERTa checkpoint's tokenizer.json (byte-level BPE, `<s> A </s></s> B </s>`) loads too: its specials take the
same roles and its segment ids are all 0, as RoBERTa has one token type.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from fastbert.errors import require

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
ROBERTA_SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>", "<mask>")  # the same roles, in the same order


def _require_tokenizers():
    """The `tokenizers` package (the training extra; inference never needs it), or MissingExtraError saying so."""
    return require("tokenizers", "train", "tokenisation")


@dataclass(frozen=True)
class Window:
    """One (question, context slice) pair as the model reads it: the attributes a `tokenizers.Encoding` has."""

    ids: list[int]
    type_ids: list[int]
    offsets: list[tuple[int, int]]  # per token, in its own text
    sequence_ids: list[int | None]  # 0 question, 1 context, None special


class WordPieceTokenizer:
    """A BERT WordPiece tokenizer (or a RoBERTa BPE one): ids, segment ids and attention masks for texts or pairs."""

    def __init__(self, tokenizer) -> None:  # a tokenizers.Tokenizer
        self._tok = tokenizer
        vocab = tokenizer.get_vocab()
        missing = [t for t in SPECIAL_TOKENS if t not in vocab]
        self.wordpiece = not missing
        if missing and any(t not in vocab for t in ROBERTA_SPECIAL_TOKENS):
            raise ValueError(f"vocabulary lacks BERT special tokens {missing} (and RoBERTa's {ROBERTA_SPECIAL_TOKENS})")
        # whether batches carry token_type_ids: not for RoBERTa's vocabulary (one token type), nor for a model that
        # has none (DistilBERT; fine-tuning sets it)
        self.token_types = self.wordpiece
        specials = SPECIAL_TOKENS if self.wordpiece else ROBERTA_SPECIAL_TOKENS
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (vocab[t] for t in specials)
        self.special_ids = frozenset((self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, lowercase: bool | None = None) -> WordPieceTokenizer:
        """A directory holding tokenizer.json or vocab.txt, or either file itself."""
        tokenizers = _require_tokenizers()
        path = os.fspath(path)
        candidates = (
            [path] if os.path.isfile(path) else [os.path.join(path, n) for n in ("tokenizer.json", "vocab.txt")]
        )
        for file in candidates:
            if not os.path.isfile(file):
                continue
            if file.endswith(".json"):
                try:
                    backend = tokenizers.Tokenizer.from_file(file)
                except Exception as exc:  # tokenizers raises a bare Exception for a malformed or truncated file
                    raise ValueError(
                        f"{file} is not a tokenizer file tokenizers can read (truncated or corrupted?): {exc}; "
                        "save the tokenizer again, or point at a vocab.txt"
                    ) from None
                return cls(backend)
            from tokenizers.implementations import BertWordPieceTokenizer

            return cls(BertWordPieceTokenizer(file, lowercase=True if lowercase is None else lowercase)._tokenizer)
        raise FileNotFoundError(f"no tokenizer.json or vocab.txt at {path}")

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int = 8000, min_frequency: int = 2, lowercase: bool = True
    ) -> WordPieceTokenizer:
        """Learn a new WordPiece vocabulary from an iterable of texts; the same texts give the same vocabulary, ids
        included, in every process (every DDP rank, a resumed run).

        The `tokenizers` trainer numbers the word-internal pieces ('##x') in hash-map order, which varies from one
        training to the next and changes how merge ties break. Here they are numbered first, sorted, as reserved
        tokens after BERT's special ones; the learnt vocabulary then backs a plain WordPiece tokenizer.
        """
        _require_tokenizers()
        from tokenizers.implementations import BertWordPieceTokenizer

        texts = list(texts)
        tok = BertWordPieceTokenizer(lowercase=lowercase)
        backend = tok._tokenizer
        inner: set[str] = set()  # characters seen inside a word, after BERT's normalisation and pre-tokenisation
        for text in texts:
            for word, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(text)):
                inner.update(word[1:])
        reserved = [*SPECIAL_TOKENS, *sorted("##" + c for c in inner)]
        tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=reserved)
        # rebuilt from the vocabulary: the '##x' are ordinary pieces again, and BERT's [CLS]/[SEP] processor is set
        return cls(BertWordPieceTokenizer(tok.get_vocab(), lowercase=lowercase)._tokenizer)

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json, and for WordPiece vocab.txt (what transformers' BertTokenizerFast reads)."""
        os.makedirs(directory, exist_ok=True)
        self._tok.save(os.path.join(directory, "tokenizer.json"))
        if not self.wordpiece:  # BPE: tokenizer.json is the whole tokenizer
            return
        vocab = sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1])
        with open(os.path.join(directory, "vocab.txt"), "w", encoding="utf-8") as f:
            f.writelines(token + "\n" for token, _ in vocab)

    # ----------------------------------------------------------------- encoding
    def encode_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Word-piece ids of each text with no special tokens and no truncation (for building pretraining pairs)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode(
        self,
        texts: Sequence,
        pairs: Sequence[str] | None = None,
        max_length: int = 128,
        strategy: str = "longest_first",
        stride: int = 0,
        is_pretokenized: bool = False,
    ) -> list:
        """Raw `tokenizers.Encoding`s with special tokens, truncated to max_length (offsets, word ids, overflow).

        `is_pretokenized` takes word lists. For sliding windows over long contexts use `windows` (tokenizers' own pair
        overflow, `strategy="only_second"` with `stride`, drops windows in tokenizers 0.23.2).
        """
        if isinstance(texts, str):
            raise TypeError("pass a list of texts, not a single string")
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(pairs)} pair texts")
        self._tok.enable_truncation(max_length=max_length, strategy=strategy, stride=stride)
        self._tok.no_padding()
        inputs = list(zip(texts, pairs, strict=True)) if pairs is not None else list(texts)
        return self._tok.encode_batch(inputs, is_pretokenized=is_pretokenized)

    def windows(
        self, questions: Sequence[str], contexts: Sequence[str], max_length: int, stride: int
    ) -> list[list[Window]]:
        """Each (question, context) pair as windows of at most `max_length` tokens: the whole question, and the context
        in slices of the room left, each starting `room - stride` tokens after the last, until one ends at its end.

        Cut here from one untruncated encoding of the pair, not by tokenizers' pair overflow: tokenizers 0.23.2
        silently keeps only the first windows (2 of 7 of a 128-token context); the windows are those of 0.23.3.
        """
        if len(questions) != len(contexts):
            raise ValueError(f"{len(questions)} questions but {len(contexts)} contexts")
        if stride < 0:
            raise ValueError(f"stride must be >= 0, got {stride}")
        self._tok.no_truncation()
        self._tok.no_padding()
        pairs = list(zip(questions, contexts, strict=True))
        return [self._cut(e, max_length, stride) for e in self._tok.encode_batch(pairs)]

    @staticmethod
    def _cut(enc, max_length: int, stride: int) -> list[Window]:
        """One pair's encoding cut into windows (its context tokens are contiguous: the template wraps them)."""
        seq = enc.sequence_ids
        context = [i for i, s in enumerate(seq) if s == 1]
        fields = (enc.ids, enc.type_ids, enc.offsets, seq)
        if len(seq) <= max_length:
            return [Window(*(list(f) for f in fields))]
        begin, end = (context[0], context[-1] + 1) if context else (0, 0)
        room = max_length - (len(seq) - (end - begin))
        if room <= 0:
            raise ValueError(
                f"the question and special tokens take {len(seq) - (end - begin)} tokens: max_length {max_length} "
                "leaves no room for the context"
            )
        if stride >= room:
            raise ValueError(f"stride {stride} must be smaller than the {room} context tokens a window holds here")
        out, start = [], begin
        while True:
            stop = min(start + room, end)
            out.append(Window(*(list(f[:begin]) + list(f[start:stop]) + list(f[end:]) for f in fields)))
            if stop == end:
                return out
            start += room - stride

    def pad(
        self, ids: Sequence[Sequence[int]], type_ids: Sequence[Sequence[int]] | None = None, pad_to: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Right-pad id lists into `input_ids`, `token_type_ids` (if `token_types`), `attention_mask` tensors [B, S]."""
        width = pad_to or max((len(x) for x in ids), default=0)
        out_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        types = torch.zeros_like(out_ids)
        mask = torch.zeros_like(out_ids)
        for i, row in enumerate(ids):
            n = len(row)
            out_ids[i, :n] = torch.as_tensor(row, dtype=torch.long)
            if type_ids is not None:
                types[i, :n] = torch.as_tensor(type_ids[i], dtype=torch.long)
            mask[i, :n] = 1
        if not self.token_types:
            return {"input_ids": out_ids, "attention_mask": mask}
        return {"input_ids": out_ids, "token_type_ids": types, "attention_mask": mask}

    def __call__(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        max_length: int = 128,
        pad_to: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Encode a batch: `[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]`, pairs truncated longest-first to max_length."""
        encodings = self.encode(texts, pairs, max_length)
        return self.pad([e.ids for e in encodings], [e.type_ids for e in encodings], pad_to)
