"""Model outputs behave as transformers' do: a field written by attribute or by key reads back the three ways."""

from __future__ import annotations

import pytest
import torch

from fastbert.outputs import SequenceClassifierOutput

modeling_outputs = pytest.importorskip("transformers.modeling_outputs")


def both(**values):
    return SequenceClassifierOutput(**values), modeling_outputs.SequenceClassifierOutput(**values)


def same(ours, theirs) -> None:
    assert list(ours.keys()) == list(theirs.keys())
    assert all(a is b for a, b in zip(ours.to_tuple(), theirs.to_tuple(), strict=True))
    for name in ours.keys():
        assert getattr(ours, name) is ours[name] is getattr(theirs, name)


def test_writing_a_present_field_by_attribute_or_key_reads_back_every_way() -> None:
    ours, theirs = both(loss=torch.tensor(1.0), logits=torch.zeros(2))
    new_logits, new_loss = torch.ones(2), torch.tensor(2.0)
    for out in (ours, theirs):
        out.logits = new_logits
        out["loss"] = new_loss
    same(ours, theirs)
    assert ours[0] is new_loss and ours[1] is new_logits


def test_a_field_written_late_takes_its_declared_place() -> None:
    logits, loss = torch.zeros(2), torch.tensor(1.0)
    out = SequenceClassifierOutput(logits=logits)
    out["loss"] = loss
    assert list(out.keys()) == ["loss", "logits"] and out[0] is loss
    out.loss = None
    assert list(out.keys()) == ["logits"] and out.loss is None and out[0] is logits


def test_an_unknown_field_is_refused_by_name() -> None:
    out = SequenceClassifierOutput(logits=torch.zeros(2))
    with pytest.raises(KeyError, match="has no field 'logit'; its fields: loss, logits"):
        out["logit"] = torch.zeros(2)
    out.note = "kept"  # plain attributes stay plain, outside the mapping
    assert out.note == "kept" and list(out.keys()) == ["logits"]


def test_rebuilt_from_pairs_as_accelerate_and_data_parallel_do() -> None:
    logits, loss = torch.zeros(2), torch.tensor(1.0)
    out = SequenceClassifierOutput(loss=loss, logits=logits)
    for rebuilt in (type(out)(out.items()), type(out)(out), type(out)([("logits", logits)], loss=loss)):
        assert list(rebuilt.keys()) == ["loss", "logits"] and rebuilt.loss is loss and rebuilt[1] is logits
    with pytest.raises(TypeError, match=r"has no field\(s\) \['logit'\]"):
        type(out)([("logit", logits)])
    first = type(out)(loss, logits=logits)  # a tensor given first is the first field, as in transformers
    assert list(first.keys()) == ["loss", "logits"] and first.loss is loss


def test_accelerate_moves_an_output_and_keeps_its_type() -> None:
    accelerate_utils = pytest.importorskip("accelerate.utils")
    out = SequenceClassifierOutput(loss=torch.tensor(1.0), logits=torch.zeros(2))
    moved = accelerate_utils.send_to_device(out, "cpu")
    assert type(moved) is SequenceClassifierOutput and list(moved.keys()) == ["loss", "logits"]
