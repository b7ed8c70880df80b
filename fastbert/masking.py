"""Dynamic MLM masking (BERT's 80/10/10), shared by pretraining and distillation.

Each call draws a fresh mask, so a corpus seen for several epochs is masked differently each time. Special tokens
and padding are never selected. With whole-word masking a word's WordPiece continuations ("##...") are selected
together with its first piece. Labels hold the original id at selected positions and -100 (ignored) elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

IGNORE_INDEX = -100


def word_starts(continuation: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: for each token, the position of the first piece of its word (itself unless a continuation).

    A continuation piece only joins the previous token when both are eligible (a "##" piece after [CLS] or a
    padding slot starts a word of its own).
    """
    cont = continuation & eligible
    cont[:, 0] = False
    cont[:, 1:] &= eligible[:, :-1]
    pos = torch.arange(continuation.shape[1], device=continuation.device).expand_as(continuation)
    return torch.where(cont, torch.zeros_like(pos), pos).cummax(dim=1).values


class MLMMasker:
    """Select `probability` of the eligible tokens; replace 80% by [MASK], 10% by a random token, keep 10%.

    `continuation_ids` (the ids of "##" pieces) enables whole-word masking; `MLMMasker.from_tokenizer` fills it in.
    """

    def __init__(
        self,
        mask_id: int,
        vocab_size: int,
        special_ids: Iterable[int],
        probability: float = 0.15,
        mask_fraction: float = 0.8,
        random_fraction: float = 0.1,
        continuation_ids: Iterable[int] | None = None,
    ) -> None:
        if not 0.0 < probability < 1.0:
            raise ValueError(f"masking probability must be in (0, 1), got {probability}")
        if mask_fraction < 0 or random_fraction < 0 or mask_fraction + random_fraction > 1:
            raise ValueError(
                f"need mask and random fractions >= 0 summing to <= 1, got {mask_fraction}, {random_fraction}"
            )
        self.mask_id, self.vocab_size, self.probability = mask_id, vocab_size, probability
        self.mask_fraction, self.random_fraction = mask_fraction, random_fraction
        self.special = torch.zeros(vocab_size, dtype=torch.bool)
        self.special[torch.tensor(sorted(set(special_ids) | {mask_id}), dtype=torch.long)] = True
        self.replacements = (~self.special).nonzero().squeeze(1)  # random replacements are never special tokens
        self.continuation = None
        if continuation_ids is not None:
            self.continuation = torch.zeros(vocab_size, dtype=torch.bool)
            self.continuation[torch.tensor(sorted(set(continuation_ids)), dtype=torch.long)] = True

    @classmethod
    def from_tokenizer(cls, tokenizer, whole_word: bool = False, **kwargs) -> MLMMasker:
        """From a `fastbert.tokenization.WordPieceTokenizer`; whole_word marks its "##" pieces as continuations."""
        cont = None
        if whole_word:
            prefix = getattr(tokenizer.backend.model, "continuing_subword_prefix", "##") or "##"
            cont = [i for t, i in tokenizer.backend.get_vocab().items() if t.startswith(prefix)]
        return cls(tokenizer.mask_id, tokenizer.vocab_size, tokenizer.special_ids, continuation_ids=cont, **kwargs)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [B, S] int64
        attention_mask: torch.Tensor | None = None,  # [B, S] 1 = real token
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # masked input_ids [B, S], labels [B, S]
        """Return (masked inputs, labels); the input tensor is not modified."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seqlen], got shape {tuple(input_ids.shape)}")
        if input_ids.numel() and int(input_ids.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(input_ids.max())} is outside the vocabulary ({self.vocab_size})")
        device = input_ids.device
        cpu_ids = input_ids.cpu()
        eligible = ~self.special[cpu_ids]
        if attention_mask is not None:
            eligible &= attention_mask.cpu().bool()
        draw = torch.rand(cpu_ids.shape, generator=generator)
        if self.continuation is not None:
            draw = draw.gather(1, word_starts(self.continuation[cpu_ids], eligible))
        selected = eligible & (draw < self.probability)
        kind = torch.rand(cpu_ids.shape, generator=generator)
        to_mask = selected & (kind < self.mask_fraction)
        to_random = selected & (kind >= self.mask_fraction) & (kind < self.mask_fraction + self.random_fraction)
        picks = torch.randint(len(self.replacements), cpu_ids.shape, generator=generator)
        masked = torch.where(to_mask, torch.full_like(cpu_ids, self.mask_id), cpu_ids)
        masked = torch.where(to_random, self.replacements[picks], masked)
        labels = torch.where(selected, cpu_ids, torch.full_like(cpu_ids, IGNORE_INDEX))
        return masked.to(device), labels.to(device)
