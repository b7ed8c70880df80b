"""Rotary positions and sliding windows in the attention op (`rotary` [2, T, R/2], `window`): the reference against
transformers' own rotation and an explicit per-sequence loop, the native CPU kernel against the fp64 reference once per
ISA (ragged batches with an empty sequence and a 1-token one, head dims that are not whole vectors, rotation of every
dim and of part of them, windows of 0, narrower than a key chunk, wider than the sequence), the dispatch, and bad
inputs. Bounds: tests/kernel_checks.py's assert_close (DESIGN.md's rule)."""

from __future__ import annotations

import math

import pytest
import torch

from fastbert import ops, reference
from fastbert.backends import native
from fastbert.backends.spec import BackendUnavailable
from fastbert.rotary import inverse_frequencies, rotary_rows
from tests.kernel_checks import assert_close

modernbert = pytest.importorskip("transformers.models.modernbert.modeling_modernbert")
LENGTHS = [[70, 0, 17, 1, 33], [33]]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _positions(lengths: list[int], offset: int = 0) -> torch.Tensor:
    return torch.cat([torch.arange(n) + offset for n in lengths]) if lengths else torch.zeros(0)


def _qkv(total: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed QKV [T, 3, nH, D], non-contiguous: a slice of a wider buffer."""
    return torch.randn(total, 3, heads, dim + 5).to(dtype)[..., 2 : 2 + dim]


def _loop(qkv: torch.Tensor, cu: torch.Tensor, rotary: torch.Tensor, window: int | None) -> torch.Tensor:
    """Attention spelled out one sequence at a time with transformers' rotation (fp64 inputs)."""
    half, outs = rotary.shape[-1], []
    for b in range(cu.numel() - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        if s == e:
            continue
        q, k, v = qkv[s:e].unbind(1)  # [L, nH, D]
        emb = torch.cat((rotary[:, s:e], rotary[:, s:e]), dim=-1)  # transformers' cos/sin: [L, R]
        cos, sin = emb[0][:, None], emb[1][:, None]  # transformers' formula in fp64 (its function rounds to fp32)
        q_r, k_r = (x * cos + modernbert.rotate_half(x) * sin for x in (q[..., : 2 * half], k[..., : 2 * half]))
        q, k = torch.cat((q_r, q[..., 2 * half :]), -1), torch.cat((k_r, k[..., 2 * half :]), -1)
        scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1])
        if window is not None:
            i = torch.arange(e - s)
            scores = scores.masked_fill((i[None] - i[:, None]).abs()[None] > window, -math.inf)
        outs.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), v))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 0, 5, 100])
@pytest.mark.parametrize("rotated", ["all", "part"])
def test_reference_matches_transformers_rotation_and_a_loop(window: int | None, rotated: str) -> None:
    lengths, heads, dim = LENGTHS[0], 2, 24
    cu = _cu(lengths)
    qkv = _qkv(sum(lengths), heads, dim, torch.float64)
    rotary = rotary_rows(_positions(lengths, offset=3), inverse_frequencies(dim if rotated == "all" else 8, 1e4))
    out = reference.attention(qkv, cu, max(lengths), rotary=rotary.double(), window=window)
    assert (out - _loop(qkv, cu, rotary.double(), window)).abs().max().item() < 1e-12  # both fp64


def test_the_window_changes_the_output_and_a_wide_one_does_not() -> None:
    """A window narrower than a sequence leaves keys out; one at least as wide as it is full attention."""
    lengths = [40]
    cu, qkv = _cu(lengths), _qkv(40, 2, 16, torch.float32)
    full = reference.attention(qkv, cu, 40)
    assert torch.equal(reference.attention(qkv, cu, 40, window=39), full)
    assert (reference.attention(qkv, cu, 40, window=4) - full).abs().max() > 1e-3


def test_rotation_depends_on_position_differences_only() -> None:
    """Shifting every position by the same amount leaves attention unchanged (what lets packed positions stand in
    for transformers' padded ones)."""
    lengths = [30, 7]
    cu, qkv, freqs = _cu(lengths), _qkv(37, 2, 32, torch.float64), inverse_frequencies(32, 1e4)
    a = reference.attention(qkv, cu, 30, rotary=rotary_rows(_positions(lengths), freqs).double())
    b = reference.attention(qkv, cu, 30, rotary=rotary_rows(_positions(lengths, offset=11), freqs).double())
    assert (a - b).abs().max() < 1e-5  # the tables are fp32: DESIGN.md's fp32 bound
    assert (a - reference.attention(qkv, cu, 30)).abs().max() > 1e-3  # and rotation does change it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim, rotary_dim", [(26, 26), (64, 64), (80, 32), (64, None)])
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("window", [None, 0, 6, 20, 200])
def test_native_matches_the_reference(
    ext, dtype: torch.dtype, dim: int, rotary_dim: int | None, lengths: list[int], window: int | None
) -> None:
    heads, cu, longest = 3, _cu(lengths), max(lengths)
    qkv = _qkv(sum(lengths), heads, dim, dtype)
    rotary = rotary_rows(_positions(lengths, 2), inverse_frequencies(rotary_dim, 1e4)) if rotary_dim else None
    out = ext.attention(qkv, cu, longest, 1 / math.sqrt(dim), None, None, None, rotary, window,
                        out=torch.full((sum(lengths), heads, dim), float("nan"), dtype=dtype))  # fmt: skip
    wide = rotary.double() if rotary is not None else None
    ref = reference.attention(qkv.double(), cu, longest, rotary=wide, window=window)
    low = reference.attention(qkv, cu, longest, rotary=rotary, window=window) if dtype != torch.float32 else None
    assert_close("native attention rotary/window", out, ref, low)


def test_the_dispatch_takes_rotary_and_window_on_cpu() -> None:
    lengths = [9, 4]
    cu, qkv = _cu(lengths), _qkv(13, 2, 16, torch.float32)
    rotary = rotary_rows(_positions(lengths), inverse_frequencies(16, 1e4))
    out = ops.attention(qkv, cu, 9, rotary=rotary, window=2)
    assert_close("dispatched", out, reference.attention(qkv.double(), cu, 9, rotary=rotary.double(), window=2))
    if native.load("_native_cpu")[0] is not None:
        assert ops.decisions()["attention"].startswith("native")
    with ops.use_backend("onednn"), pytest.raises(BackendUnavailable, match="rotary"):
        ops.attention(qkv, cu, 9, rotary=rotary)


def test_bad_rotary_and_window_raise_clearly() -> None:
    cu, qkv = _cu([5]), _qkv(5, 2, 8, torch.float32)
    for bad in (torch.zeros(2, 4, 2), torch.zeros(2, 5, 5), torch.zeros(5, 2)):
        with pytest.raises(ValueError, match="rotary must be"):
            reference.attention(qkv, cu, 5, rotary=bad)
    with pytest.raises(ValueError, match="window must be >= 0"):
        reference.attention(qkv, cu, 5, window=-1)
    ext, _ = native.load("_native_cpu")
    if ext is None:
        return
    for bad in (torch.zeros(2, 4, 2), torch.zeros(2, 5, 5)):
        with pytest.raises(ValueError, match="rotary must be"):
            ext.attention(qkv, cu, 5, 0.5, None, None, None, bad, None)
    with pytest.raises(TypeError, match="rotary must be float32"):
        ext.attention(qkv, cu, 5, 0.5, None, None, None, torch.zeros(2, 5, 2, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="window must be >= 0"):
        ext.attention(qkv, cu, 5, 0.5, None, None, None, None, -1)
