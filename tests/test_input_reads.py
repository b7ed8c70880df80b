"""A CPU forward reads its inputs in the native extension (csrc/cpu/inputs.cpp: the range checks' values, the mask's
packing), one pass each; the values and the packing are torch's formulation's (what every other device runs), for
every mask dtype the checks accept, any layout, masks that are not 0/1, ids at their extremes."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastbert import BertConfig, ops
from fastbert.padding import unpad_and_read
from fastbert.validation import _MASK_DTYPES, check_inputs
from tests.conftest import NATIVE_CPU, NATIVE_CPU_REASON

pytestmark = pytest.mark.skipif(NATIVE_CPU is None, reason=f"native CPU extension unavailable: {NATIVE_CPU_REASON}")

CONFIG = BertConfig(vocab_size=1000, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, type_vocab_size=3, max_position_embeddings=64)  # fmt: skip
CPU = torch.device("cpu")
REDUCTIONS = {"min", "max", "sum", "cumsum", "any", "nonzero_static", "cat"}  # torch's formulation's ops


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN201
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def both(read):  # noqa: ANN001, ANN201
    """read() in the extension and with torch's ops (the native backend left out), with the ops each ran."""
    with OpNames() as native_ops:
        native = read()
    with ops.exclude_backends("native"), OpNames() as torch_ops:
        formulation = read()
    assert not native_ops.names & REDUCTIONS, f"the extension was not used: {native_ops.names}"
    assert torch_ops.names & REDUCTIONS, "the native backend was left out, yet no torch op ran"
    return native, formulation


def mask_of(dtype: torch.dtype, layout: str, gen: torch.Generator) -> torch.Tensor:
    """A [5, 9] mask: 'right'/'left' padded (a fully padded row among them), 'holes', 'full', 'none' (all padding),
    'strided' (a transposed view), 'bad' (a 2, and a NaN where the dtype has one)."""
    lengths = torch.tensor([9, 3, 0, 7, 1])
    mask = {
        "right": torch.arange(9)[None] < lengths[:, None],
        "left": torch.arange(9)[None] >= (9 - lengths)[:, None],
        "holes": torch.rand(5, 9, generator=gen) < 0.5,
        "full": torch.ones(5, 9, dtype=torch.bool),
        "none": torch.zeros(5, 9, dtype=torch.bool),
        "strided": (torch.rand(9, 5, generator=gen) < 0.6).t(),
        "bad": torch.rand(5, 9, generator=gen) < 0.5,
    }[layout].to(dtype)
    if layout == "bad" and dtype != torch.bool:
        mask[1, 2] = 2
        if dtype.is_floating_point:
            mask[3, 4] = float("nan")
    return mask


@pytest.mark.parametrize("layout", ["right", "left", "holes", "full", "none", "strided", "bad"])
@pytest.mark.parametrize("dtype", _MASK_DTYPES, ids=str)
def test_the_packing_is_torchs(dtype: torch.dtype, layout: str) -> None:
    mask = mask_of(dtype, layout, torch.Generator().manual_seed(3))
    extra = torch.tensor([-5, 1 << 41])
    (packing, values), (expected, expected_values) = both(lambda: unpad_and_read(mask, 5, 9, CPU, extra))
    assert values == expected_values == [-5, 1 << 41]
    assert (packing.batch, packing.seqlen, packing.max_seqlen) == (expected.batch, expected.seqlen, expected.max_seqlen)
    assert packing.cu_seqlens.dtype == torch.int32 and torch.equal(packing.cu_seqlens, expected.cu_seqlens)
    assert (packing.indices is None) == (expected.indices is None) == (layout == "full")
    if packing.indices is not None:
        assert packing.indices.dtype == torch.int64 and torch.equal(packing.indices, expected.indices)


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("mask_dtype", [None, *_MASK_DTYPES], ids=str)
def test_the_range_checks_values_are_torchs(id_dtype: torch.dtype, mask_dtype: torch.dtype | None) -> None:
    gen = torch.Generator().manual_seed(5)
    top = torch.iinfo(id_dtype).max
    ids = torch.randint(1, 1000, (5, 9), generator=gen, dtype=id_dtype)
    ids[2, 4], ids[0, 0] = top, -top  # the extremes survive the pass
    ids[3, 8] = CONFIG.pad_token_id  # at a row's end: flagged where no mask is given
    types = torch.randint(0, 5, (9, 5), generator=gen, dtype=id_dtype).t()  # strided
    for positions in (torch.arange(9, dtype=id_dtype), torch.arange(9, dtype=id_dtype)[None] - 3, None):
        mask = None if mask_dtype is None else mask_of(mask_dtype, "bad", gen)
        native, formulation = both(lambda: check_inputs(CONFIG, ids, mask, types, positions, None)[2])  # noqa: B023
        assert native.values.dtype == torch.int64 and torch.equal(native.values, formulation.values)
        assert (native.limits, native.has_mask_flag, native.pad_id) == (
            formulation.limits, formulation.has_mask_flag, formulation.pad_id)  # fmt: skip


def test_off_the_cpu_and_under_an_exclusion_torch_reads_them() -> None:
    from fastbert.backends import native

    cpu = torch.ones(2, 3)
    assert native.input_reader(cpu, None) is NATIVE_CPU
    assert native.input_reader(cpu, torch.ones(2, device="meta")) is None
    with ops.exclude_backends("native"):
        assert native.input_reader(cpu) is None


def test_the_extensions_reads_refuse_what_the_checks_never_pass() -> None:
    with pytest.raises(ValueError, match="empty"):
        NATIVE_CPU.input_ranges([torch.zeros(0, dtype=torch.long)], None, None, 0)
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        NATIVE_CPU.mask_packing(torch.ones(3))
    with pytest.raises(TypeError):
        NATIVE_CPU.input_ranges([torch.ones(2)], None, None, 0)  # float ids
