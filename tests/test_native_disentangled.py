"""The native CPU attention with DeBERTa's disentangled position scores (`position_scores` [2, nH, T, W] gathered
through `position_columns` [2R + 1]) against the fp64 reference, once per ISA the CPU runs: ragged batches with an
empty sequence, a batch of 1, awkward head dims, clamped and unclamped distances, DeBERTa's own columns and columns
in no order, fp32 scores with bf16 qkv, MPNet's table alongside, strided scores, the public wrapper, the dispatch and
the custom op, bad inputs. Bounds: tests/kernel_checks.py's assert_close (fp32 within 1e-5 of fp64 relative to
max(1, max|ref|); bf16 within 2x plain torch's bf16 error plus one rounding).
"""

from __future__ import annotations

import math

import pytest
import torch

from fastbert import ops, reference, relative_positions
from fastbert.backends import contract, native
from tests.kernel_checks import assert_close

EXT, EXT_REASON = native.load("_native_cpu")
needs_ext = pytest.mark.skipif(EXT is None, reason=f"native CPU extension unavailable: {EXT_REASON}")
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
LENGTHS = [[70, 0, 17, 1, 33], [33]]  # 70: past the 32 exact buckets of _columns("deberta"); 33: whole vectors + 1


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _qkv(total: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed QKV [T, 3, nH, D], non-contiguous: a slice of a wider buffer."""
    return torch.randn(total, 3, heads, dim + 5).to(dtype)[..., 2 : 2 + dim]


def _columns(kind: str, longest: int) -> tuple[torch.Tensor, int]:
    """(position_columns, W): DeBERTa-v3's (64 log buckets up to 128: exact, then several distances to a column,
    R = longest - 1), or columns in no order with R below longest - 1 (clamped) or above it."""
    if kind == "deberta":
        _, width, columns = relative_positions.deberta_rows(longest, 64, 128, torch.device("cpu"))
        return columns, width
    radius, width = {"clamped": (7, 13), "wide": (longest + 5, 37)}[kind]
    return torch.randint(0, width, (2 * radius + 1,), dtype=torch.int32), width


def _check(out: torch.Tensor, qkv: torch.Tensor, cu: torch.Tensor, longest: int, **terms: torch.Tensor | float) -> None:
    """`out` vs the reference in fp64 (and, for bf16, vs plain torch's own error in bf16)."""
    wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in terms.items()}
    wide["position_bias"] = terms.get("position_bias")  # the reference takes its table in fp32 only
    ref = reference.attention(qkv.double(), cu, longest, **wide)
    low = reference.attention(qkv, cu, longest, **terms) if qkv.dtype != torch.float32 else None
    assert_close("native attention+scores", out, ref, low)


@pytest.mark.parametrize("dtype, scores_dtype", DTYPES)
@pytest.mark.parametrize("dim", [26, 64, 80])
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("kind", ["deberta", "clamped", "wide"])
def test_scores(ext, dtype: torch.dtype, scores_dtype: torch.dtype, dim: int, lengths: list[int], kind: str) -> None:
    heads, cu, longest = 3, _cu(lengths), max(lengths)
    qkv = _qkv(sum(lengths), heads, dim, dtype)
    columns, width = _columns(kind, longest)
    scores = (2 * torch.randn(2, heads, sum(lengths), width)).to(scores_dtype)  # std 2: they move every probability
    scale = 1 / math.sqrt(3 * dim)
    out = ext.attention(qkv, cu, longest, scale, None, scores, columns,
                        out=torch.full((sum(lengths), heads, dim), float("nan"), dtype=dtype))  # fmt: skip
    _check(out, qkv, cu, longest, scale=scale, position_scores=scores, position_columns=columns)


@pytest.mark.parametrize("dtype, scores_dtype", DTYPES)
@pytest.mark.parametrize("dim", [48, 64])  # 64: AMX's bf16 tiles where the CPU has them
def test_scores_with_position_bias(ext, dtype: torch.dtype, scores_dtype: torch.dtype, dim: int) -> None:
    """MPNet's table and DeBERTa's scores together: both add to every score."""
    lengths, heads = [70, 0, 17, 1, 33], 2
    cu, longest = _cu(lengths), max(lengths)
    qkv = _qkv(sum(lengths), heads, dim, dtype)
    columns, width = _columns("clamped", longest)
    scores = (2 * torch.randn(2, heads, sum(lengths), width)).to(scores_dtype)
    table = torch.randn(heads, 2 * 20 + 1)
    out = ext.attention(qkv, cu, longest, 0.2, table, scores, columns)
    _check(out, qkv, cu, longest, scale=0.2, position_bias=table, position_scores=scores, position_columns=columns)


@pytest.mark.parametrize(
    "layout",
    [
        lambda s: torch.randn(*s.shape[:3], s.shape[3] + 9).to(s.dtype)[..., 4 : 4 + s.shape[3]].copy_(s),  # rows
        lambda s: s.transpose(2, 3).contiguous().transpose(2, 3),  # W not contiguous: copied
        lambda s: s.transpose(1, 2).contiguous().transpose(1, 2),  # heads inside tokens
        lambda s: s[:1].expand(2, -1, -1, -1),  # both sides one tensor (stride 0): copied
    ],
    ids=["row_strided", "column_major", "token_major", "expanded"],
)
@pytest.mark.parametrize("scores_dtype", [torch.float32, torch.bfloat16])
def test_strided_scores(ext, layout, scores_dtype: torch.dtype) -> None:
    lengths, heads, dim = [40, 3, 25], 2, 32
    cu, longest = _cu(lengths), max(lengths)
    qkv = _qkv(sum(lengths), heads, dim, scores_dtype)
    columns, width = _columns("deberta", longest)
    scores = layout((2 * torch.randn(2, heads, sum(lengths), width)).to(scores_dtype))
    out = ext.attention(qkv, cu, longest, 0.25, None, scores, columns)
    _check(out, qkv, cu, longest, scale=0.25, position_scores=scores, position_columns=columns)


@needs_ext
def test_empty_batch_and_empty_sequences() -> None:
    columns = torch.zeros(3, dtype=torch.int32)
    for lengths in ([0], [0, 0]):
        qkv = torch.randn(0, 3, 2, 8)
        out = EXT.attention(qkv, _cu(lengths), 4, 0.5, None, torch.randn(2, 2, 0, 5), columns)
        assert out.shape == (0, 2, 8)


@needs_ext
def test_public_wrapper_dispatch_and_custom_op() -> None:
    """native.attention, the dispatch (native takes the call, no refusal) and the custom op torch.compile traces all
    pass the scores through."""
    lengths, heads, dim = [20, 0, 9], 2, 16
    cu, longest = _cu(lengths), max(lengths)
    qkv = _qkv(sum(lengths), heads, dim, torch.float32)
    columns, width = _columns("deberta", longest)
    scores = torch.randn(2, heads, sum(lengths), width)
    terms = dict(position_scores=scores, position_columns=columns)
    ref = reference.attention(qkv.double(), cu, longest, scale=0.3, position_scores=scores.double(),
                              position_columns=columns)  # fmt: skip
    assert_close("native.attention", native.attention(qkv, cu, longest, scale=0.3, **terms), ref)
    args = (qkv, cu, longest, 0.0, False, 0.3, None, scores, columns)
    assert native.refuses("attention", contract.ATTENTION.by_name(args, {})) is None
    with ops.use_backend("native"):
        assert ops.select("attention", args, {})[1] == "native"
        assert_close("ops.attention", ops.attention(*args), ref)
    custom = torch.ops.fastbert.native_attention(qkv, cu, longest, 0.3, None, scores, columns)
    assert_close("torch.ops.fastbert.native_attention", custom, ref)


@needs_ext
def test_scores_the_kernels_do_not_take_fall_back_with_a_reason() -> None:
    lengths = [6, 4]
    qkv, cu = _qkv(10, 2, 16, torch.float32), _cu(lengths)
    scores, columns = torch.randn(2, 2, 10, 5).bfloat16(), torch.zeros(3, dtype=torch.int32)
    call = contract.ATTENTION.by_name((qkv, cu, 6), dict(position_scores=scores, position_columns=columns))
    assert "position_scores must be float32 or qkv's dtype" in native.refuses("attention", call)


@needs_ext
def test_bad_scores_raise_clearly() -> None:
    lengths, heads = [6, 4], 2
    qkv, cu = _qkv(10, heads, 16, torch.float32), _cu(lengths)
    scores, columns = torch.randn(2, heads, 10, 5), torch.tensor([4, 0, 1], dtype=torch.int32)
    run = EXT.attention
    with pytest.raises(ValueError, match="position_scores and position_columns come together"):
        run(qkv, cu, 6, 0.25, None, scores, None)
    with pytest.raises(ValueError, match="position_scores and position_columns come together"):
        run(qkv, cu, 6, 0.25, None, None, columns)
    for shape in [(1, heads, 10, 5), (2, heads + 1, 10, 5), (2, heads, 9, 5), (2, heads, 10, 0), (2, heads, 10)]:
        with pytest.raises(ValueError, match=r"position_scores must be \[2, nH = 2, T = 10, W > 0\]"):
            run(qkv, cu, 6, 0.25, None, torch.randn(shape), columns)
    with pytest.raises(TypeError, match="position_scores must be float32 or qkv's dtype"):
        run(qkv, cu, 6, 0.25, None, scores.bfloat16(), columns)
    with pytest.raises(TypeError, match="position_columns must be \\[2R \\+ 1\\] int32"):
        run(qkv, cu, 6, 0.25, None, scores, columns.long())
    with pytest.raises(TypeError, match="position_columns must be \\[2R \\+ 1\\] int32"):
        run(qkv, cu, 6, 0.25, None, scores, columns[:2])
    for bad in (5, -1):
        with pytest.raises(IndexError, match=rf"position_columns\[1\] = {bad} is outside \[0, W = 5\)"):
            run(qkv, cu, 6, 0.25, None, scores, torch.tensor([4, bad, 1], dtype=torch.int32))
