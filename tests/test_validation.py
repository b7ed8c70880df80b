"""The input checks (fastbert/validation.py) add no host-to-device copy: every value they leave on the device is
computed from the inputs alone. A tensor made from Python data (an index list, torch.tensor) shows up as
aten.lift_fresh, and advanced indexing as aten.index.Tensor; on CUDA either means a blocking copy of the index from the
host, a second sync next to the one that reads the results."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastbert import BertConfig, ops
from fastbert.validation import check_inputs

CONFIG = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
HOST_MADE = ("lift_fresh", "lift_fresh_copy", "index")  # aten ops that build or take an index from the host


class OpNames(TorchDispatchMode):
    """Records the name of every aten op that runs (packet name: aten.index.Tensor is `index`)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _inputs(case: str) -> dict[str, torch.Tensor | None]:
    ids = torch.randint(1, 50, (3, 7))
    inputs: dict[str, torch.Tensor | None] = dict(input_ids=ids, attention_mask=None, token_type_ids=None,
                                                  position_ids=None, inputs_embeds=None)  # fmt: skip
    if case == "mask":
        inputs["attention_mask"] = torch.ones(3, 7, dtype=torch.long)
    elif case == "everything":
        inputs.update(attention_mask=torch.ones(3, 7, dtype=torch.bool), token_type_ids=torch.zeros_like(ids),
                      position_ids=torch.arange(7))  # fmt: skip
    return inputs


@pytest.mark.parametrize("case", ["ids only", "mask", "everything"])
def test_checks_make_no_index_on_the_host(case: str) -> None:
    """'ids only' is the pad-id test at a row's ends (no attention_mask), which indexed with a Python list. Torch's
    formulation, as every device but the CPU runs it (a CPU forward reads them in the extension: test_input_reads)."""
    config, inputs = BertConfig(**CONFIG), _inputs(case)
    with ops.exclude_backends("native"), OpNames() as seen:
        check_inputs(config, **inputs)
    assert seen.names and not [n for n in seen.names if n in HOST_MADE], f"ops from host data in {seen.names}"


@pytest.mark.parametrize(("column", "flagged"), [(0, True), (6, True), (3, False)])
def test_pad_id_is_flagged_at_either_end_of_a_row_only(column: int, flagged: bool) -> None:
    ids = torch.randint(1, 50, (3, 7))
    ids[1, column] = 0  # pad_token_id
    _, _, check = check_inputs(BertConfig(**CONFIG), ids, None, None, None, None)
    assert check is not None and check.pad_id == 0 and check.values[-1].item() == flagged
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check.read_and_check()
    assert bool(caught) == flagged
