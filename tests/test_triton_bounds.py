"""The interpreter bounds check (tests/triton_bounds.py) that every CPU run of the Triton kernels goes through."""

from __future__ import annotations

import pytest
import torch
from conftest import BOUNDS_CHECK_REASON

if BOUNDS_CHECK_REASON is not None:
    pytest.skip(f"bounds check off: {BOUNDS_CHECK_REASON}", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _copy(src_ptr, dst_ptr, n, load_extra, store_extra, BLOCK: tl.constexpr):  # src, dst: [n]
    offsets = tl.arange(0, BLOCK)
    values = tl.load(src_ptr + offsets, mask=offsets < n + load_extra, other=0.0)
    tl.store(dst_ptr + offsets, values, mask=offsets < n + store_extra)


def _run(load_extra: int, store_extra: int) -> torch.Tensor:
    src, dst = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    _copy[(1,)](src, dst, 8, load_extra, store_extra, BLOCK=16)
    return dst


def test_a_masked_tail_passes() -> None:
    torch.testing.assert_close(_run(0, 0), torch.arange(8, dtype=torch.float32))


@pytest.mark.parametrize(("load_extra", "store_extra", "access"), [(1, 0, "load"), (0, 1, "store")])
def test_one_element_past_a_tensor_raises(load_extra: int, store_extra: int, access: str) -> None:
    """One element past the end: on a GPU a silent read of a neighbour's bytes (or a write into them)."""
    with pytest.raises(Exception, match=f"_copy: {access} of 1 element\\(s\\) outside every tensor argument"):
        _run(load_extra, store_extra)


def test_a_view_may_read_its_whole_storage() -> None:
    """The bound is the storage, not the view: a kernel given a slice may address the rest of its buffer (strided
    rows), as the model's kernels do with packed QKV."""
    base = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(8)
    _copy[(1,)](base[4:12], dst, 8, 4, 0, BLOCK=16)
    torch.testing.assert_close(dst, base[4:12])
