"""Triton attention with DeBERTa's disentangled position scores (`position_scores` [2, nH, T, W] gathered through
`position_columns` [2R + 1]): forward, the grads of qkv and of the scores vs the fp64 reference, clamping, dropout,
the MPNet table alongside, the inference launcher, torch.compile, bad inputs."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DEVICE, LOW, check_inference, check_op, gpu, nan_poisoned_empty, requires_triton, row_strided
from test_kernel_attention import BIASED, _cu, _keep_mask, _table

from fastbert import ops, reference, relative_positions
from fastbert.kernels.limits import MAX_POSITION_COLUMNS

pytestmark = requires_triton


def _deberta_columns(seqlen: int, buckets: int = 8, max_relative: int = 16, device=DEVICE) -> tuple[torch.Tensor, int]:
    """(position_columns [2 seqlen - 1], W) as DeBERTa-v3 builds them (log buckets: several distances share a column,
    non-increasing in the distance), for sequences up to `seqlen` long (R = seqlen - 1)."""
    _, width, columns = relative_positions.deberta_rows(seqlen, buckets, max_relative, device)
    return columns, width


def _random_columns(radius: int, width: int, device=DEVICE) -> torch.Tensor:
    """[2R + 1] columns in no order, repeats scattered: the contract's general case."""
    return torch.randint(0, width, (2 * radius + 1,), dtype=torch.int32, device=device)


def _scores(heads: int, total: int, width: int, device=DEVICE) -> torch.Tensor:
    """Random [2, nH, T, W] scores, std 2: they move every probability."""
    return 2 * torch.randn(2, heads, total, width, dtype=torch.float64, device=device)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp32 for a 16-bit tensor, as is for fp32 / fp64: the contract's other scores dtype, and the reference's."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _check_scored(
    dim: int,
    dtype: torch.dtype,
    lengths: list[int],
    columns: torch.Tensor,
    width: int,
    heads: int = 2,
    wide_scores: bool = False,
    bias_radius: int | None = None,
    bias_grad: bool = True,
    scale: float | None = None,
    device=DEVICE,
) -> None:
    """check_op with the scores (and the table of `bias_radius`, unless not `bias_grad`) as inputs: the forward and
    the grads of qkv, the scores (and the table) vs the reference's fp64 autograd. The kernel gets the scores in
    `dtype`, or in fp32 with `wide_scores` (their grad then flows back through the cast); its table is fp32, as the
    contract says."""
    from fastbert import kernels

    total, longest = sum(lengths), max(lengths)
    cu = _cu(lengths, device)
    qkv = torch.randn(total, 3, heads, dim, dtype=torch.float64, device=device)
    inputs = [qkv, _scores(heads, total, width, device)]
    table = _table(heads, bias_radius, device).float() if bias_radius is not None else None
    if table is not None and bias_grad:
        inputs.append(table)
    cast = _wide if wide_scores else (lambda s: s)

    def kernel(x, s, t=table):
        return kernels.attention(x, cu, longest, scale=scale, position_bias=None if t is None else t.float(),
                                 position_scores=cast(s), position_columns=columns)  # fmt: skip

    def ref(x, s, t=table):
        return reference.attention(x, cu, longest, scale=scale, position_bias=None if t is None else t.float(),
                                   position_scores=_wide(s), position_columns=columns)  # fmt: skip

    name = f"attention+scores[d={dim}, R={(columns.numel() - 1) // 2}, W={width}{', fp32 scores' * wide_scores}]"
    check_op(name, kernel, ref, inputs, dtype, lambda t: row_strided(t) if t.dim() == 4 else t)


@pytest.mark.parametrize("dim", [26, 64, 96])  # 96: 64 x 32 tiles (non-square diagonals in both backward kernels)
def test_scores_fp32_clamped_deberta_columns(dim: int) -> None:
    """R = 8 < max_seqlen - 1 = 69: most pairs clamp to the end columns; 70 spans 2 query blocks (3 key blocks at
    d = 96); an empty sequence and a single token."""
    columns, width = _deberta_columns(9)
    _check_scored(dim, torch.float32, BIASED, columns, width)


@pytest.mark.parametrize("dim", [26, 64])
def test_scores_fp32_columns_in_no_order(dim: int) -> None:
    """Columns repeated anywhere in [-R, R] (the gradient ranks a tile's diagonals by column), R < and > max_seqlen."""
    _check_scored(dim, torch.float32, BIASED, _random_columns(12, 5), 5)
    _check_scored(dim, torch.float32, [5, 0, 9, 1], _random_columns(30, 7), 7, heads=1)


def test_scores_edges() -> None:
    """R larger than any distance (DeBERTa's rows for 41 tokens on sequences of <= 9) with a custom scale; 3 x 3 tiles
    per sequence (150 tokens) with R = 40; a batch of one; R = 0 and W = 1 (one column for every pair); sequences of
    one token (max_seqlen 1)."""
    columns, width = _deberta_columns(41, 16, 64)
    _check_scored(32, torch.float32, [5, 0, 9, 1], columns, width, scale=0.3)
    _check_scored(16, torch.float32, [150, 3], columns, width, heads=1)
    columns, width = _deberta_columns(19)
    _check_scored(32, torch.float32, [19], columns, width, heads=3)
    _check_scored(16, torch.float32, [6, 3], torch.zeros(1, dtype=torch.int32, device=DEVICE), 1)
    _check_scored(16, torch.float32, [1, 0, 1], _random_columns(3, 4), 4)


@pytest.mark.parametrize("wide_scores", [False, True], ids=["scores in dtype", "fp32 scores"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("dim", [26, 64])
def test_scores_low_precision(dim: int, dtype: torch.dtype, wide_scores: bool) -> None:
    columns, width = _deberta_columns(9)
    _check_scored(dim, dtype, BIASED, columns, width, heads=1, wide_scores=wide_scores)


def test_scores_with_position_bias() -> None:
    """The MPNet table and the scores on one call: the grads of qkv, the scores and the table (fp32), and of qkv and
    the scores in bf16. The table's bf16 grad is left out here: with both terms the softmax is peaked, and the
    table's grad, a sum of dS over whole rows, carries the backward's delta = rowsum(dO * O) from the bf16 output O
    (measured: all of its error) past 2x plain torch's; tests/test_kernel_attention.py bounds it without scores."""
    columns, width = _deberta_columns(9)
    _check_scored(26, torch.float32, BIASED, columns, width, bias_radius=4)
    _check_scored(16, torch.bfloat16, [20, 0, 7], _random_columns(6, 5), 5, bias_radius=3, bias_grad=False,
                  wide_scores=True)  # fmt: skip


def test_scores_outside_the_columns_are_clamped() -> None:
    """Columns outside [0, W - 1] (the caller's error, unchecked: a device read would sync) read and write inside the
    scores: the kernel computes with them clamped, forward and the scores' grad."""
    from fastbert import kernels

    lengths, heads, width = [9, 4], 2, 5
    cu, total = _cu(lengths), sum(lengths)
    columns = torch.tensor([-7, 9, 0, 4, 5, 2, 100], dtype=torch.int32, device=DEVICE)
    x = torch.randn(total, 3, heads, 16, device=DEVICE)
    scores = _scores(heads, total, width).float().requires_grad_()
    out = kernels.attention(x, cu, 9, position_scores=scores, position_columns=columns)
    (grad,) = torch.autograd.grad(out.square().sum(), scores)
    clamped = scores.detach().clone().requires_grad_()
    expect = kernels.attention(x, cu, 9, position_scores=clamped, position_columns=columns.clamp(0, width - 1))
    (expect_grad,) = torch.autograd.grad(expect.square().sum(), clamped)
    assert torch.equal(out, expect) and torch.equal(grad, expect_grad)


def test_scores_without_grad_and_no_tokens() -> None:
    """Scores that need no grad (the backward kernels without the scores' gradient): the qkv grads still see them.
    No tokens give a scores grad of the scores' shape, written."""
    from fastbert import kernels

    lengths, heads = [9, 4], 2
    cu, total = _cu(lengths), sum(lengths)
    columns, width = _deberta_columns(9)
    scores = _scores(heads, total, width)
    x = torch.randn(total, 3, heads, 16, dtype=torch.float64, device=DEVICE)
    x32, x64 = x.float().requires_grad_(), x.clone().requires_grad_()
    with nan_poisoned_empty():
        out = kernels.attention(x32, cu, 9, position_scores=scores.float(), position_columns=columns)
        gout = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, x32, gout)
    expect = reference.attention(x64, cu, 9, position_scores=scores, position_columns=columns)
    (expect_grad,) = torch.autograd.grad(expect, x64, gout.double())
    torch.testing.assert_close(grad.double(), expect_grad, rtol=0, atol=1e-5)

    empty = torch.randn(0, 3, heads, 16, device=DEVICE, requires_grad=True)
    s = torch.randn(2, heads, 0, width, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    with nan_poisoned_empty():
        out = kernels.attention(empty.bfloat16(), _cu([0, 0]), 0, position_scores=s, position_columns=columns)
        grad_x, grad_s = torch.autograd.grad(out.sum(), (empty, s))
    assert grad_x.shape == empty.shape and grad_s.shape == s.shape and grad_s.dtype == torch.bfloat16


def _oracle(qkv: torch.Tensor, lengths: list[int], keep: torch.Tensor, p: float, scores: torch.Tensor,
            columns: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T / sqrt(d) + position terms) * keep / (1 - p) @ v per sequence, keep [B, nH, S, S]; the terms
    gathered from `scores` [2, nH, T, W] by `columns` in plain torch (any float dtype: the fp64 oracle)."""
    outs, start = [], 0
    radius = (columns.numel() - 1) // 2
    for b, n in enumerate(lengths):
        q, k, v = qkv[start : start + n].unbind(1)  # [n, nH, D] each
        pos = torch.arange(n, device=qkv.device)
        c = columns.long()[(pos[None, :] - pos[:, None]).clamp(-radius, radius) + radius]  # [i, j]
        rows = scores[:, :, start : start + n]  # [2, nH, n, W]
        terms = rows[0].gather(2, c.expand(rows.shape[1], n, n)) + rows[1].gather(2, c.t().expand(rows.shape[1], n, n)
                                                                                  ).transpose(1, 2)  # fmt: skip
        probs = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) / q.shape[-1] ** 0.5 + terms, dim=-1)
        outs.append(torch.einsum("hij,jhd->ihd", probs * keep[b, :, :n, :n] / (1 - p), v))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_scores_backward_with_dropout(p: float) -> None:
    """With dropout (the kernel's keep-mask, read off a probe run without scores: it depends on the seed and the
    position only) the output and the grads of qkv and of the scores match an fp64 oracle that applies that mask."""
    from fastbert import kernels

    lengths, heads, dim = [17, 0, 40, 1], 2, 48  # dim >= the longest: the keep-mask probe's one-hot values
    cu, longest, total = _cu(lengths), max(lengths), sum(lengths)
    columns, width = _deberta_columns(9)
    keep = _keep_mask(lengths, heads, dim, p, 7) if p else torch.ones(len(lengths), heads, longest, longest)
    x = torch.randn(total, 3, heads, dim, device=DEVICE, requires_grad=True)
    scores = _scores(heads, total, width).float().requires_grad_()
    torch.manual_seed(7)
    with nan_poisoned_empty():
        out = kernels.attention(x, cu, longest, p, training=True, position_scores=scores, position_columns=columns)
        gout = torch.randn_like(out)
        grad, grad_scores = torch.autograd.grad(out, (x, scores), gout)
    x64, s64 = x.detach().double().requires_grad_(), scores.detach().double().requires_grad_()
    expect = _oracle(x64, lengths, keep.double().to(DEVICE), p, s64, columns)
    expect_grad, expect_scores = torch.autograd.grad(expect, (x64, s64), gout.double())
    assert expect_scores.abs().max() > 0.1  # the scores' grad is not ~0
    for got, want in ((out, expect), (grad, expect_grad), (grad_scores, expect_scores)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_scores_inference_launcher(dtype: torch.dtype) -> None:
    from fastbert import kernels

    lengths, heads = BIASED, 2
    cu, longest, total = _cu(lengths), max(lengths), sum(lengths)
    columns, width = _deberta_columns(9)
    scores, table = _scores(heads, total, width).to(dtype), _table(heads, 4).float()
    check_inference(
        "attention[scores]",
        lambda x: kernels.INFERENCE["attention"](x, cu, longest, 0.1, True, position_bias=table,
                                                 position_scores=scores, position_columns=columns),
        lambda x: reference.attention(x, cu, longest, position_bias=table, position_scores=_wide(scores),
                                      position_columns=columns),
        [torch.randn(total, 3, heads, 26, dtype=torch.float64, device=DEVICE)], dtype, row_strided,
    )  # fmt: skip


def test_scores_under_torch_compile() -> None:
    """The custom ops torch.compile traces take the scores and give their gradient: compiled training and inference
    calls run the same kernels as eager (bitwise), whole-graph; the ops' schema and fakes check."""
    from fastbert import kernels

    lengths, heads, dim = [9, 0, 20], 2, 16
    cu, longest, total = _cu(lengths), max(lengths), sum(lengths)
    columns, width = _deberta_columns(9)
    x = torch.randn(total, 3, heads, dim, device=DEVICE)
    scores, table = _scores(heads, total, width).float(), _table(heads, 4).float()

    def grads(fn, needs_scores_grad: bool):
        leaves = (x.clone().requires_grad_(), scores.clone().requires_grad_(needs_scores_grad))
        out = fn(*leaves)
        wrt = leaves if needs_scores_grad else leaves[:1]
        return out, torch.autograd.grad(out, wrt, torch.ones_like(out) / out.numel())

    fn = lambda x, s: kernels.attention(x, cu, longest, position_bias=table, position_scores=s,
                                        position_columns=columns)  # fmt: skip
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for needs_scores_grad in (True, False):
        eager_out, eager_grads = grads(fn, needs_scores_grad)
        out, out_grads = grads(compiled, needs_scores_grad)
        assert torch.equal(out, eager_out)
        assert len(out_grads) == len(eager_grads) and all(map(torch.equal, out_grads, eager_grads))
    infer = torch.compile(lambda x, s: kernels.attention_inference(x, cu, longest, position_bias=table,
                                                                   position_scores=s, position_columns=columns),
                          backend="aot_eager", fullgraph=True)  # fmt: skip
    with torch.no_grad():
        assert torch.equal(infer(x, scores), eager_out)

    lib, checks = torch.ops.fastbert, ("test_schema", "test_faketensor", "test_autograd_registration")
    args = (x, cu, longest, 0.0, 0.25, table, scores, columns)
    torch.library.opcheck(lib.triton_attention.default, args, test_utils=checks)
    out, lse, seed = lib.triton_attention(*args)
    for scores_grad in (True, False):
        args = (torch.randn_like(out), x, cu, out, lse, seed, table, scores, columns, longest, 0.0, 0.25, False,
                scores_grad)  # fmt: skip
        torch.library.opcheck(lib.triton_attention_backward.default, args, test_utils=checks[:2])


def test_scores_reject_bad_inputs() -> None:
    from fastbert import kernels

    heads, total = 2, 4
    qkv, cu = torch.randn(total, 3, heads, 16, device=DEVICE), _cu([total])
    good, columns = torch.randn(2, heads, total, 5, device=DEVICE), _random_columns(3, 5)
    too_wide = torch.empty(2, heads, total, MAX_POSITION_COLUMNS + 1, device="meta")
    kernels.attention(qkv, cu, 4, position_scores=good, position_columns=columns)
    kernels.attention(qkv.half(), cu, 4, position_scores=good, position_columns=columns)  # fp32 scores, fp16 qkv
    for scores, cols, match in (
        (good, None, "come together"),
        (None, columns, "come together"),
        (good[0], columns, r"\[2, nH = 2, T = 4, W > 0\]"),
        (torch.randn(2, 3, total, 5, device=DEVICE), columns, "nH = 2"),
        (torch.randn(2, heads, total + 1, 5, device=DEVICE), columns, "T = 4"),
        (torch.randn(3, heads, total, 5, device=DEVICE), columns, r"\[2, nH"),
        (torch.randn(2, heads, total, 0, device=DEVICE), columns, "W > 0"),
        (too_wide, columns, f"> {MAX_POSITION_COLUMNS} columns"),
        (good.double(), columns, "float32 or qkv's dtype"),
        (good.half(), columns, "qkv's dtype"),
        (good.to("meta"), columns, "position_scores is on meta"),
        (good.transpose(2, 3).contiguous().transpose(2, 3), columns, "unit stride on W"),
        (good, columns.long(), "int32"),
        (good, columns[:-1], r"\[2R \+ 1\]"),
        (good, columns.view(1, -1), r"\[2R \+ 1\]"),
        (good, columns.to("meta"), "position_columns is on meta"),
        (good, torch.randint(0, 5, (14,), dtype=torch.int32, device=DEVICE)[::2], "contiguous"),
    ):
        for launcher in (kernels.attention, kernels.attention_inference):
            with pytest.raises(ValueError, match=match):
                launcher(qkv, cu, 4, position_scores=scores, position_columns=cols)
    # automatic dispatch (checked as data, without a GPU) sends a layout the kernel cannot read elsewhere
    backend, cuda = ops.backends()["triton"], torch.device("cuda")
    call = dict(qkv=qkv.half(), cu_seqlens=cu, max_seqlen=4, position_scores=good.half(), position_columns=columns)
    assert backend.refuses("attention", cuda, torch.float16, call) is None
    call["position_scores"] = good.half().transpose(2, 3).contiguous().transpose(2, 3)
    assert "unit stride on W" in str(backend.refuses("attention", cuda, torch.float16, call))
    call["position_scores"], call["position_columns"] = good.half(), torch.arange(14, dtype=torch.int32)[::2]
    assert "non-contiguous position_columns" in str(backend.refuses("attention", cuda, torch.float16, call))
    call["position_scores"], call["position_columns"] = too_wide, columns
    assert f"> {MAX_POSITION_COLUMNS} columns" in str(backend.refuses("attention", cuda, torch.float16, call))


@gpu
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_scores_gpu_deberta_v3_base_shapes(dtype: torch.dtype) -> None:
    """DeBERTa-v3-base: 12 heads of 64, buckets 256 over 512 positions: W = 511 columns for sequences of 512."""
    lengths = torch.randint(128, 513, (8,)).tolist()
    lengths[0], lengths[-1] = 512, 0
    columns, width = _deberta_columns(512, 256, 512, torch.device("cuda"))
    assert width == 511
    _check_scored(64, dtype, lengths, columns, width, heads=12, device=torch.device("cuda"))


@gpu
def test_scores_gpu_grad_is_deterministic() -> None:
    from fastbert import kernels

    lengths, heads = [512] * 8, 12
    cu, total = _cu(lengths, "cuda"), sum(lengths)
    columns, width = _deberta_columns(512, 256, 512, torch.device("cuda"))
    qkv = torch.randn(total, 3, heads, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    scores = torch.randn(2, heads, total, width, device="cuda", dtype=torch.float16, requires_grad=True)
    runs = [torch.autograd.grad(kernels.attention(qkv, cu, 512, position_scores=scores, position_columns=columns)
                                .float().square().sum(), (qkv, scores)) for _ in range(2)]  # fmt: skip
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@requires_triton
def test_every_tile_keeps_the_gradient_ranks_in_int32() -> None:
    """The scores' gradient ranks column * MAX_DIAGONALS + diagonal in int32: no tile may span more diagonals."""
    import importlib

    from fastbert.kernels import limits

    kernel = importlib.import_module("fastbert.kernels.attention")  # the module (the package exports the function)
    for dim in (16, 26, 64, 96, 128):
        block_m, block_n, _, _ = kernel._tiles(dim, 4096)
        assert block_m + block_n <= limits.MAX_DIAGONALS
    assert (limits.MAX_POSITION_COLUMNS - 1) * limits.MAX_DIAGONALS + limits.MAX_DIAGONALS - 1 < 2**31
