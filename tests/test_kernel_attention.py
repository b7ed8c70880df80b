"""Triton varlen flash attention, forward and backward, vs the fp64 reference; dropout; empty sequences; the relative
position bias table (MPNet) and its gradient."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import (
    DEVICE,
    DTYPES,
    LOW,
    check_inference,
    check_op,
    gpu,
    nan_poisoned_empty,
    requires_triton,
    row_strided,
)

from fastbert import ops, reference, relative_positions

pytestmark = requires_triton
RAGGED = [5, 0, 17, 1]  # an empty sequence, a single token, lengths off the block size
BIASED = [17, 0, 70, 1]  # with RADIUS 4: most pairs beyond the table's reach (clamped), 70 spans 2 query blocks
RADIUS = 4


def _cu(lengths: list[int], device=DEVICE) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _check(
    dim: int,
    dtype: torch.dtype,
    lengths: list[int],
    heads: int = 2,
    view=row_strided,
    device=DEVICE,
    scale: float | None = None,
) -> None:
    from fastbert import kernels

    qkv = torch.randn(sum(lengths), 3, heads, dim, dtype=torch.float64, device=device)
    cu, longest = _cu(lengths, device), max(lengths)
    check_op(
        f"attention[d={dim}]",
        lambda x: kernels.attention(x, cu, longest, scale=scale),
        lambda x: reference.attention(x, cu, longest, scale=scale),
        [qkv],
        dtype,
        view,
    )


def _table(heads: int, radius: int, device=DEVICE) -> torch.Tensor:
    """A random [nH, 2R + 1] bias table, large enough (std 2) that the bias moves every probability."""
    return 2 * torch.randn(heads, 2 * radius + 1, dtype=torch.float64, device=device)


def _check_biased(
    dim: int,
    dtype: torch.dtype,
    lengths: list[int],
    radius: int = RADIUS,
    heads: int = 2,
    device=DEVICE,
    scale: float | None = None,
) -> None:
    """check_op with the table as a second input: the forward and the grads of qkv and of the table vs the reference's
    autograd in fp64 (its table is fp32, as the contract says; the kernel gets the table fp32 whatever qkv's dtype)."""
    from fastbert import kernels

    qkv = torch.randn(sum(lengths), 3, heads, dim, dtype=torch.float64, device=device)
    cu, longest = _cu(lengths, device), max(lengths)
    check_op(
        f"attention+bias[d={dim}, R={radius}]",
        lambda x, t: kernels.attention(x, cu, longest, scale=scale, position_bias=t.float()),
        lambda x, t: reference.attention(x, cu, longest, scale=scale, position_bias=t.float()),
        [qkv, _table(heads, radius, device)], dtype, lambda t: row_strided(t) if t.dim() == 4 else t,
    )  # fmt: skip


@pytest.mark.parametrize("dim", [16, 26, 48, 64, 80, 96, 128])
def test_attention_fp32_head_dims(dim: int) -> None:
    _check(dim, torch.float32, RAGGED)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("dim", [26, 64])
def test_attention_low_precision(dim: int, dtype: torch.dtype) -> None:
    _check(dim, dtype, RAGGED)


@pytest.mark.parametrize("dim", [64, 96])
def test_attention_several_blocks_per_sequence(dim: int) -> None:
    _check(dim, torch.float32, [70, 3, 0], heads=1)  # 2 query blocks; 2 (d=64) or 3 (d=96) key blocks


def test_attention_batch_of_one_custom_scale_and_head_major_layout() -> None:
    _check(32, torch.float32, [19], heads=3, scale=0.3)
    # qkv from a [T, nH, 3, D] projection: every stride differs from the packed layout
    _check(48, torch.float32, [6, 11], heads=2, view=lambda t: t.transpose(1, 2).contiguous().transpose(1, 2))


def test_attention_no_tokens() -> None:
    from fastbert import kernels

    qkv = torch.randn(0, 3, 2, 16, device=DEVICE, requires_grad=True)
    out = kernels.attention(qkv, _cu([0, 0]), 0)
    out.sum().backward()
    assert out.shape == (0, 2, 16) and qkv.grad.shape == qkv.shape


@pytest.mark.parametrize("dim", [26, 64, 96])  # 96: 64 x 32 tiles (the dQ kernel's skew of a non-square tile)
def test_attention_position_bias_fp32(dim: int) -> None:
    _check_biased(dim, torch.float32, BIASED)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("dim", [26, 64])
def test_attention_position_bias_low_precision(dim: int, dtype: torch.dtype) -> None:
    _check_biased(dim, dtype, BIASED, heads=1)


def test_attention_position_bias_edges() -> None:
    """A table wider than any distance (R = 40 > max_seqlen - 1: the bins past it get a zero gradient, written), a
    custom scale, 3 x 3 tiles whose corner tiles lie wholly beyond -R and +R (their dS goes to an end bin whole), R = 0
    (one bin per head) and sequences of one token (max_seqlen 1: one distance)."""
    _check_biased(32, torch.float32, [5, 0, 9, 1], radius=40, scale=0.3)
    _check_biased(16, torch.float32, [150, 3], radius=40, heads=1)
    _check_biased(16, torch.float32, [6, 3], radius=0, heads=3)
    _check_biased(16, torch.float32, [1, 0, 1], radius=3)


def test_attention_position_bias_table_without_grad_and_no_tokens() -> None:
    """A table that needs no grad (the dQ kernel without the bias gradient): the qkv grads still see the bias. No tokens
    give a table grad of zeros (written, not left as allocated)."""
    from fastbert import kernels

    lengths, heads = [9, 4], 2
    cu, table = _cu(lengths), _table(heads, 2).float()
    x = torch.randn(sum(lengths), 3, heads, 16, dtype=torch.float64, device=DEVICE)
    x32, x64 = x.float().requires_grad_(), x.clone().requires_grad_()
    out = kernels.attention(x32, cu, 9, position_bias=table)
    expect = reference.attention(x64, cu, 9, position_bias=table)
    gout = torch.randn_like(expect)
    (grad,) = torch.autograd.grad(out, x32, gout.float())
    (expect_grad,) = torch.autograd.grad(expect, x64, gout)
    torch.testing.assert_close(grad.double(), expect_grad, rtol=0, atol=1e-5)

    empty = torch.randn(0, 3, heads, 16, device=DEVICE, requires_grad=True)
    t = table.clone().requires_grad_()
    with nan_poisoned_empty():
        (grad_table,) = torch.autograd.grad(kernels.attention(empty, _cu([0, 0]), 0, position_bias=t).sum(), t)
    assert torch.equal(grad_table, torch.zeros_like(table))


def test_attention_position_bias_rejects_bad_tables() -> None:
    from fastbert import kernels

    qkv, cu = torch.randn(4, 3, 2, 16, device=DEVICE), _cu([4])
    good = torch.randn(2, 9, device=DEVICE)
    kernels.attention(qkv, cu, 4, position_bias=good)
    for table, match in (
        (torch.randn(3, 9, device=DEVICE), r"nH = 2"),  # heads
        (torch.randn(2, 8, device=DEVICE), "odd width"),
        (torch.randn(9, device=DEVICE), "odd width"),  # 1-D
        (good.double(), "float32"),
        (good.half(), "float32"),
        (good.to("meta"), "is on meta"),
        (torch.randn(9, 2, device=DEVICE).t(), "contiguous"),
    ):
        for launcher in (kernels.attention, kernels.attention_inference):
            with pytest.raises(ValueError, match=match):
                launcher(qkv, cu, 4, position_bias=table)
    # automatic dispatch (checked as data, without a GPU) sends a non-contiguous table elsewhere instead of raising
    backend, cuda = ops.backends()["triton"], torch.device("cuda")
    call = dict(qkv=qkv.half(), cu_seqlens=cu, max_seqlen=4, position_bias=good)
    assert backend.refuses("attention", cuda, torch.float16, call) is None
    call["position_bias"] = torch.randn(9, 2).t()
    assert "non-contiguous position_bias" in str(backend.refuses("attention", cuda, torch.float16, call))


def test_attention_position_bias_under_torch_compile() -> None:
    """The custom ops torch.compile traces take the table and give its gradient: a compiled training call and a
    compiled inference call run the same kernels as eager (bitwise), whole-graph; the ops' schema and fakes check."""
    from fastbert import kernels

    lengths, heads, dim = [9, 0, 20], 2, 16
    cu, longest = _cu(lengths), max(lengths)
    x = torch.randn(sum(lengths), 3, heads, dim, device=DEVICE)
    table = _table(heads, RADIUS).float()

    def grads(fn, needs_table_grad: bool):
        leaves = (x.clone().requires_grad_(), table.clone().requires_grad_(needs_table_grad))
        out = fn(*leaves)
        wrt = leaves if needs_table_grad else leaves[:1]
        return out, torch.autograd.grad(out, wrt, torch.ones_like(out) / out.numel())

    fn = lambda x, t: kernels.attention(x, cu, longest, position_bias=t)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for needs_table_grad in (True, False):
        eager_out, eager_grads = grads(fn, needs_table_grad)
        out, out_grads = grads(compiled, needs_table_grad)
        assert torch.equal(out, eager_out)
        assert len(out_grads) == len(eager_grads) and all(map(torch.equal, out_grads, eager_grads))
    infer = torch.compile(lambda x, t: kernels.attention_inference(x, cu, longest, position_bias=t),
                          backend="aot_eager", fullgraph=True)  # fmt: skip
    with torch.no_grad():
        assert torch.equal(infer(x, table), eager_out)

    lib, checks = torch.ops.fastbert, ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(lib.triton_attention.default, (x, cu, longest, 0.0, 0.25, table), test_utils=checks)
    out, lse, seed = lib.triton_attention(x, cu, longest, 0.0, 0.25, table)
    for bias_grad in (True, False):
        args = (torch.randn_like(out), x, cu, out, lse, seed, table, None, None, longest, 0.0, 0.25, bias_grad, False)
        torch.library.opcheck(lib.triton_attention_backward.default, args, test_utils=checks[:2])


def _masked_attention(
    qkv: torch.Tensor, lengths: list[int], keep: torch.Tensor, p: float, table: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) * keep / (1 - p) @ v per sequence; keep [B, nH, S, S] (the kernel's mask);
    bias from the [nH, 2R + 1] table when given (any float dtype: the fp64 oracle of the table's gradient)."""
    outs, start = [], 0
    for b, n in enumerate(lengths):
        q, k, v = qkv[start : start + n].unbind(1)  # [n, nH, D] each
        scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1])
        if table is not None:
            scores = scores + relative_positions.dense_bias(table, n)
        probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hij,jhd->ihd", probs * keep[b, :, :n, :n] / (1 - p), v))
        start += n
    return torch.cat(outs)


def _keep_mask(
    lengths: list[int], heads: int, dim: int, p: float, seed: int, table: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's dropout keep-mask Z [B, nH, S, S] for torch seed `seed`, read off a probe run with one-hot values
    (out[i, j] = P_ij * Z_ij / (1 - p)), which is also checked against _masked_attention with that Z."""
    from fastbert import kernels

    cu, longest, total = _cu(lengths), max(lengths), sum(lengths)
    qkv = torch.randn(total, 3, heads, dim, device=DEVICE)
    _, pos = reference.packed_positions(cu, total)
    qkv[:, 2] = torch.nn.functional.one_hot(pos.long(), dim).float()[:, None, :]  # v_j = e_j
    torch.manual_seed(seed)
    probe = kernels.attention(qkv, cu, longest, p, training=True, position_bias=table)
    keep = torch.zeros(len(lengths), heads, longest, longest, device=DEVICE)
    start = 0
    for b, n in enumerate(lengths):
        keep[b, :, :n, :n] = (probe[start : start + n, :, :n] != 0).permute(1, 0, 2).float()
        start += n
    torch.testing.assert_close(probe, _masked_attention(qkv, lengths, keep, p, table), rtol=0, atol=1e-5)
    return keep


def test_attention_dropout_mask_statistics_and_backward_consistency() -> None:
    """With one-hot values out[i, j] = P_ij * Z_ij / (1 - p) exposes the keep-mask Z; the same seed must give the
    same Z for real values, in the forward and in both backward kernels (checked against autograd with Z)."""
    from fastbert import kernels

    p, lengths, heads, dim = 0.2, [9, 0, 16, 5], 2, 16
    cu, longest, total = _cu(lengths), max(lengths), sum(lengths)
    keep = _keep_mask(lengths, heads, dim, p, 11)
    valid = sum(n * n for n in lengths) * heads
    frac = keep.sum().item() / valid
    assert abs(frac - (1 - p)) < 5 * (p * (1 - p) / valid) ** 0.5, f"kept fraction {frac:.3f}, p={p}"

    x = torch.randn(total, 3, heads, dim, device=DEVICE, requires_grad=True)
    torch.manual_seed(11)
    with nan_poisoned_empty():
        out = kernels.attention(x, cu, longest, p, training=True)
        gout = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, x, gout)
    x64 = x.detach().double().requires_grad_()
    expect = _masked_attention(x64, lengths, keep.double(), p)
    (expect_grad,) = torch.autograd.grad(expect, x64, gout.double())
    torch.testing.assert_close(out.double(), expect, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.double(), expect_grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_attention_position_bias_backward_vs_fp64_oracle(p: float) -> None:
    """The output and the grads of qkv and of the table against autograd through a float64 oracle (the dense bias built
    from an fp64 table, so the table's gradient is summed in fp64 too), without dropout and with it (the kernel's
    keep-mask, read off a probe run, applied in the oracle): the dropped probabilities of the biased scores reach the
    bias gradient, clamped distances included."""
    from fastbert import kernels

    lengths, heads, dim = [17, 0, 40, 1], 2, 48  # dim >= the longest: the keep-mask probe's one-hot values
    cu, longest, total = _cu(lengths), max(lengths), sum(lengths)
    table = _table(heads, RADIUS).float()
    keep = _keep_mask(lengths, heads, dim, p, 5, table) if p else torch.ones(len(lengths), heads, longest, longest)
    x = torch.randn(total, 3, heads, dim, device=DEVICE, requires_grad=True)
    t = table.clone().requires_grad_()
    torch.manual_seed(5)
    with nan_poisoned_empty():
        out = kernels.attention(x, cu, longest, p, training=True, position_bias=t)
        gout = torch.randn_like(out)
        grad, grad_table = torch.autograd.grad(out, (x, t), gout)
    x64, t64 = x.detach().double().requires_grad_(), table.double().requires_grad_()
    expect = _masked_attention(x64, lengths, keep.double(), p, t64)
    expect_grad, expect_table = torch.autograd.grad(expect, (x64, t64), gout.double())
    assert grad_table.dtype == torch.float32 and expect_table.abs().max() > 0.1  # the table's grad is not ~0
    torch.testing.assert_close(out.double(), expect, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad.double(), expect_grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad_table.double(), expect_table, rtol=0, atol=1e-5 * expect_table.abs().max().item())


def test_attention_rejects_bad_input() -> None:
    from fastbert import kernels

    with pytest.raises(ValueError, match="head dim"):
        kernels.attention(torch.randn(4, 3, 1, 160, device=DEVICE), _cu([4]), 4)
    with pytest.raises(ValueError, match=r"\[T, 3, nH, D\]"):
        kernels.attention(torch.randn(4, 2, 1, 16, device=DEVICE), _cu([4]), 4)
    with pytest.raises(ValueError, match="int32"):
        kernels.attention(torch.randn(4, 3, 1, 16, device=DEVICE), _cu([4]).long(), 4)


CUDA_GRID_LIMITS = (2**31 - 1, 65535, 65535)  # the largest grid x, y and z a CUDA launch takes


def test_attention_launch_grids_fit_cuda_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """70,000 sequences in one call (a bulk embedding job): every launch's grid, forward, both backward kernels and
    the inference launcher, stays within CUDA's grid limits (the interpreter has none). Launches are recorded and run
    nothing."""
    from triton.runtime import interpreter

    from fastbert import kernels

    grids: list[tuple[str, tuple[int, ...]]] = []

    def record(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN002, ANN003
        grids.append((self.fn.__name__, tuple(grid)))

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", record)
    batch, heads = 70_000, 2
    qkv = torch.randn(batch, 3, heads, 16, requires_grad=True)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    kernels.attention(qkv, cu, 1).sum().backward()
    kernels.INFERENCE["attention"](qkv.detach(), cu, 1)
    table = torch.randn(heads, 9, requires_grad=True)  # the bias and its gradient launch on the same grids
    kernels.attention(qkv, cu, 1, position_bias=table).sum().backward()
    training = ["_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"]
    assert [name for name, _ in grids] == [*training, "_attn_fwd", *training]
    for name, grid in grids:
        xyz = (*grid, 1, 1)[:3]
        assert all(n <= limit for n, limit in zip(xyz, CUDA_GRID_LIMITS, strict=True)), f"{name} grid {grid}"
        assert math.prod(grid) >= batch * heads, f"{name} grid {grid} has a program per (sequence, head)"


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [26, 64, 80, 128])
@pytest.mark.parametrize("longest", [128, 512])
def test_attention_gpu_bert_shapes(dim: int, dtype: torch.dtype, longest: int) -> None:
    lengths = torch.randint(longest // 4, longest + 1, (16,)).tolist()
    lengths[0], lengths[-1] = longest, 0
    _check(dim, dtype, lengths, heads=12 if dim <= 64 else 8, device=torch.device("cuda"))


@gpu
def test_attention_gpu_is_deterministic() -> None:
    from fastbert import kernels

    lengths = [512] * 8
    qkv = torch.randn(sum(lengths), 3, 12, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    cu = _cu(lengths, "cuda")
    grads = [torch.autograd.grad(kernels.attention(qkv, cu, 512).float().square().sum(), qkv)[0] for _ in range(2)]
    assert torch.equal(grads[0], grads[1])


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("longest", [128, 512])
def test_attention_gpu_position_bias_mpnet_shapes(dtype: torch.dtype, longest: int) -> None:
    """MPNet-base: 12 heads of 64, a table of R = 128 (clamping past 128 at S = 512)."""
    lengths = torch.randint(longest // 4, longest + 1, (16,)).tolist()
    lengths[0], lengths[-1] = longest, 0
    _check_biased(64, dtype, lengths, radius=128, heads=12, device=torch.device("cuda"))


@gpu
def test_attention_gpu_position_bias_grad_is_deterministic() -> None:
    from fastbert import kernels

    lengths = [512] * 8
    qkv = torch.randn(sum(lengths), 3, 12, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    table = torch.randn(12, 257, device="cuda", requires_grad=True)
    cu = _cu(lengths, "cuda")
    runs = [torch.autograd.grad(kernels.attention(qkv, cu, 512, position_bias=table).float().square().sum(),
                                (qkv, table)) for _ in range(2)]  # fmt: skip
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("biased", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("dim", [26, 64])
def test_attention_inference_launcher(dim: int, dtype: torch.dtype, biased: bool) -> None:
    from fastbert import kernels

    lengths = BIASED if biased else RAGGED
    qkv = torch.randn(sum(lengths), 3, 2, dim, dtype=torch.float64, device=DEVICE)
    cu, longest = _cu(lengths), max(lengths)
    table = _table(2, RADIUS).float() if biased else None
    check_inference(
        f"attention[d={dim}{', bias' if biased else ''}]",
        lambda x: kernels.INFERENCE["attention"](x, cu, longest, 0.1, True, position_bias=table),
        lambda x: reference.attention(x, cu, longest, position_bias=table), [qkv], dtype, row_strided,
    )  # fmt: skip
