"""Model outputs readable the three ways transformers users expect: `out.logits`, `out["logits"]`, `out[0]`.

Fields left as None are absent, exactly as in transformers, so `out[0]` is the first field that was computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch


class ModelOutput(OrderedDict):
    """An ordered mapping of the non-None fields, with attribute access and integer indexing."""

    fields: tuple[str, ...] = ()

    def __init__(self, pairs: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), /, **values: Any) -> None:
        """Fields by keyword, as a mapping or (name, value) pairs (the form Accelerate and DataParallel rebuild an
        output with, `type(out)(pairs)`), or a tensor given first: the first field, as in transformers."""
        first = isinstance(pairs, torch.Tensor)
        values = {**({self.fields[0]: pairs} if first else dict(pairs)), **values}
        unknown = set(values) - set(self.fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}")
        super().__init__((k, values[k]) for k in self.fields if values.get(k) is not None)

    def __getattr__(self, name: str) -> Any:
        if name in type(self).fields:
            return self.get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __getitem__(self, key: str | int | slice) -> Any:
        if isinstance(key, str):
            return super().__getitem__(key)
        return self.to_tuple()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        """Set a field, in its declared place among those present (so `out[0]` stays the first); None removes it."""
        fields = type(self).fields
        if key not in fields:
            raise KeyError(f"{type(self).__name__} has no field {key!r}; its fields: {', '.join(fields)}")
        if value is None:
            self.pop(key, None)
            return
        super().__setitem__(key, value)
        for later in fields[fields.index(key) + 1 :]:
            if later in self:
                self.move_to_end(later)

    def __setattr__(self, name: str, value: Any) -> None:
        """`out.logits = x` writes the field, so attribute, key and index access keep agreeing (as in transformers)."""
        if name in type(self).fields:
            self[name] = value
        else:
            super().__setattr__(name, value)

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self.values())


def return_dict_of(config: object, return_dict: bool | None) -> bool:
    """transformers' rule: `return_dict` left None takes the config's field (absent: True)."""
    return bool(getattr(config, "return_dict", True)) if return_dict is None else return_dict


def output_flags(config: object, attentions: bool | None, hidden_states: bool | None) -> tuple[bool, bool]:
    """(output_attentions, output_hidden_states): an argument left None takes the config's field (absent: False)."""
    return (
        bool(getattr(config, "output_attentions", False)) if attentions is None else attentions,
        bool(getattr(config, "output_hidden_states", False)) if hidden_states is None else hidden_states,
    )


def _output(name: str, *fields: str) -> type[ModelOutput]:
    return type(name, (ModelOutput,), {"fields": fields, "__doc__": f"Fields: {', '.join(fields)}."})


BaseModelOutputWithPooling = _output(
    "BaseModelOutputWithPooling", "last_hidden_state", "pooler_output", "hidden_states", "attentions"
)
MaskedLMOutput = _output("MaskedLMOutput", "loss", "logits", "hidden_states", "attentions")
PreTrainingOutput = _output(
    "PreTrainingOutput", "loss", "prediction_logits", "seq_relationship_logits", "hidden_states", "attentions"
)
NextSentencePredictorOutput = _output("NextSentencePredictorOutput", "loss", "logits", "hidden_states", "attentions")
SequenceClassifierOutput = _output("SequenceClassifierOutput", "loss", "logits", "hidden_states", "attentions")
TokenClassifierOutput = _output("TokenClassifierOutput", "loss", "logits", "hidden_states", "attentions")
MultipleChoiceModelOutput = _output("MultipleChoiceModelOutput", "loss", "logits", "hidden_states", "attentions")
QuestionAnsweringModelOutput = _output(
    "QuestionAnsweringModelOutput", "loss", "start_logits", "end_logits", "hidden_states", "attentions"
)
