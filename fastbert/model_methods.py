"""transformers' model methods beyond loading and saving, which training code and libraries call on any model:
`base_model`, `main_input_name`, the input embeddings' getter and setter, `resize_token_embeddings`, gradient
checkpointing (Trainer's `gradient_checkpointing=True`) and `enable_input_require_grads` (peft).

Every family keeps its encoder at `bert` (fastbert.checkpoint renames the keys), so the head's base model, its word
embeddings and its MLM decoder sit at the same paths in every family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ModelMethods:
    """Mixed into PreTrainedModel; `self` is the model (an nn.Module with a `config`)."""

    main_input_name = "input_ids"
    # Trainer passes num_items_in_batch to a forward that takes **kwargs unless this says no: fastbert's losses are
    # means over the batch, so Trainer scales them for gradient accumulation itself
    accepts_loss_kwargs = False

    @property
    def base_model(self) -> nn.Module:
        """The encoder: the model itself for BertModel, `model.bert` for a head."""
        return getattr(self, "bert", self)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.base_model.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        """Use `value` as the word embeddings (an MLM decoder tied to them follows); `config.vocab_size` becomes its
        row count, so the input check and the MLM loss read the new size."""
        if not isinstance(value, nn.Embedding):
            raise TypeError(f"set_input_embeddings takes an nn.Embedding, got {type(value).__name__}")
        if value.embedding_dim != self.config.embedding_dim:
            raise ValueError(
                f"the new embeddings are {value.embedding_dim} wide; this model's are {self.config.embedding_dim}"
            )
        self.base_model.embeddings.word_embeddings = value
        self.config.vocab_size = value.num_embeddings
        self.tie_weights()

    supports_gradient_checkpointing = True

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs: dict | None = None, every_n_layers: int = 1, offload: bool = False
    ) -> None:
        """In training, recompute every `every_n_layers`-th encoder layer in the backward instead of keeping its
        activations: memory for up to one more forward's time (Trainer's `activation_checkpointing=True`).
        `activation_checkpointing_kwargs`: torch.utils.checkpoint's own arguments (default use_reentrant=False)."""
        options = activation_checkpointing_kwargs
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"activation_checkpointing_kwargs must be a dict, got {options!r:.60}")
        if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive integer, got {every_n_layers!r}")
        if offload:
            raise ValueError("offload=True: fastbert keeps a checkpointed layer's input where it lies; pass False")
        encoder = self.base_model.encoder
        encoder.checkpoint_kwargs, encoder.checkpoint_every = dict(options or {}), every_n_layers
        encoder.gradient_checkpointing = True

    def activation_checkpointing_disable(self) -> None:
        self.base_model.encoder.gradient_checkpointing = False

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs: Any) -> None:
        """transformers' older name (Trainer's `gradient_checkpointing=True`)."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(self.base_model.encoder.gradient_checkpointing)

    def enable_input_require_grads(self) -> None:
        """The word embeddings' output requires grad even where they are frozen (peft: adapters trained under
        reentrant checkpointing need a graph from the first layer on). The embeddings then run module by module."""
        self.disable_input_require_grads()
        hook = self.get_input_embeddings().register_forward_hook(lambda module, args, out: out.requires_grad_(True))
        self.__dict__["_input_grads_hook"] = hook

    def disable_input_require_grads(self) -> None:
        hook = self.__dict__.pop("_input_grads_hook", None)
        if hook is not None:
            hook.remove()

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None
    ) -> nn.Embedding:
        """Grow or shrink the vocabulary (new tokens added to a tokenizer): rows kept up to the smaller size, new rows
        set to the mean of the old ones (transformers' default samples around that mean), as are an untied MLM
        decoder's; its bias gets zeros. Returns the new word embeddings; None keeps the size."""
        old = self.get_input_embeddings()
        if new_num_tokens is None:
            return old
        for name, value in (("new_num_tokens", new_num_tokens), ("pad_to_multiple_of", pad_to_multiple_of)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if pad_to_multiple_of is not None:
            new_num_tokens = -(-new_num_tokens // pad_to_multiple_of) * pad_to_multiple_of
        decoder = getattr(self, "get_output_embeddings", lambda: None)()
        tied = decoder is not None and decoder.weight is old.weight
        padding = old.padding_idx if old.padding_idx is not None and old.padding_idx < new_num_tokens else None
        new = nn.Embedding(new_num_tokens, old.embedding_dim, padding_idx=padding, device=old.weight.device,
                           dtype=old.weight.dtype)  # fmt: skip
        new.weight = _resized(old.weight, new_num_tokens)
        if decoder is not None:
            if not tied:
                decoder.weight = _resized(decoder.weight, new_num_tokens)
            predictions = self.cls.predictions
            if predictions.bias is not None:
                predictions.bias = _resized(predictions.bias, new_num_tokens, fill=0.0)
            decoder.out_features = new_num_tokens
        self.set_input_embeddings(new)
        return new


def _resized(rows: nn.Parameter, count: int, fill: float | None = None) -> nn.Parameter:
    """`rows` cut or grown to `count` along dim 0; new rows `fill`, or the mean of the old rows."""
    with torch.no_grad():
        out = rows.new_empty(count, *rows.shape[1:])
        kept = min(count, rows.shape[0])
        out[:kept] = rows[:kept]
        out[kept:] = rows.mean(0) if fill is None else fill
    return nn.Parameter(out, requires_grad=rows.requires_grad)
