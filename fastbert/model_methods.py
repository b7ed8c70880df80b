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
        """The encoder's input requires grad even where the embeddings are frozen (peft: adapters trained under
        reentrant checkpointing need a graph from the first layer on). A flag the fused path reads, not transformers'
        hook on the embeddings, which would send the embeddings module by module."""
        self.base_model.encoder.inputs_require_grad = True

    def disable_input_require_grads(self) -> None:
        self.base_model.encoder.inputs_require_grad = False

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """Grow or shrink the vocabulary (tokens added to a tokenizer), as transformers does: the same modules and
        Parameters, their data resized (hooks and optimizer references stay), rows kept up to the smaller size; new
        rows the old rows' mean where `mean_resizing` (transformers samples close around it), else drawn as at
        initialisation; an untied MLM decoder resized alike, its bias padded with zeros. A size that would cut the
        padding token is refused. Returns the word embeddings."""
        embeddings = self.get_input_embeddings()
        count = embeddings.num_embeddings if new_num_tokens is None else new_num_tokens
        for name, value in (("new_num_tokens", count), ("pad_to_multiple_of", pad_to_multiple_of)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if pad_to_multiple_of is not None:
            count = -(-count // pad_to_multiple_of) * pad_to_multiple_of
        if count == embeddings.num_embeddings:
            return embeddings
        pad = self.config.pad_token_id
        if pad is not None and pad >= count:
            raise ValueError(f"{count} tokens would cut the padding token (pad_token_id={pad})")
        decoder = getattr(self, "get_output_embeddings", lambda: None)()
        tied = decoder is not None and decoder.weight is embeddings.weight
        std = None if mean_resizing else self.config.initializer_range
        _resize(embeddings.weight, count, std)
        embeddings.num_embeddings = count
        if decoder is not None:
            if not tied:
                _resize(decoder.weight, count, std)
            if decoder.bias is not None:
                _resize(decoder.bias, count, None, fill=0.0)
            decoder.out_features = count
        self.config.vocab_size = count
        weights_changed = getattr(self.base_model, "weights_changed", None)
        if weights_changed is not None:  # .data was swapped: the copies kept of the weights are stale
            weights_changed()
        return embeddings


def _resize(param: nn.Parameter, count: int, std: float | None, fill: float | None = None) -> None:
    """`param.data` cut or grown to `count` rows in place; new rows `fill`, else N(0, std), else the old rows' mean."""
    with torch.no_grad():
        rows = param.data
        out = rows.new_empty(count, *rows.shape[1:])
        kept = min(count, rows.shape[0])
        out[:kept] = rows[:kept]
        if fill is not None:
            out[kept:] = fill
        elif std is not None:
            out[kept:].normal_(0.0, std)
        else:
            out[kept:] = rows.float().mean(0).to(rows.dtype)
        param.data = out
