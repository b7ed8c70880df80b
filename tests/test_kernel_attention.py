"""Triton varlen flash attention, forward and backward, vs the fp64 reference; dropout; empty sequences."""

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

from fastbert import reference

pytestmark = requires_triton
RAGGED = [5, 0, 17, 1]  # an empty sequence, a single token, lengths off the block size


def _cu(lengths: list[int], device=DEVICE) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _check(dim: int, dtype: torch.dtype, lengths: list[int], heads: int = 2, view=row_strided, device=DEVICE,
           scale: float | None = None) -> None:
    from fastbert import kernels

    qkv = torch.randn(sum(lengths), 3, heads, dim, dtype=torch.float64, device=device)
    cu, longest = _cu(lengths, device), max(lengths)
    check_op(
        f"attention[d={dim}]", lambda x: kernels.attention(x, cu, longest, scale=scale),
        lambda x: reference.attention(x, cu, longest, scale=scale), [qkv], dtype, view,
    )


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


def _masked_attention(qkv: torch.Tensor, lengths: list[int], keep: torch.Tensor, p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) * keep / (1 - p) @ v per sequence; keep [B, nH, S, S] (the kernel's mask)."""
    outs, start = [], 0
    for b, n in enumerate(lengths):
        q, k, v = qkv[start:start + n].unbind(1)  # [n, nH, D] each
        probs = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1]), dim=-1)
        outs.append(torch.einsum("hij,jhd->ihd", probs * keep[b, :, :n, :n] / (1 - p), v))
        start += n
    return torch.cat(outs)


def test_attention_dropout_mask_statistics_and_backward_consistency() -> None:
    """With one-hot values out[i, j] = P_ij * Z_ij / (1 - p) exposes the keep-mask Z; the same seed must give the
    same Z for real values, in the forward and in both backward kernels (checked against autograd with Z)."""
    from fastbert import kernels

    p, lengths, heads, dim = 0.2, [9, 0, 16, 5], 2, 16
    cu, longest, total = _cu(lengths), max(lengths), sum(lengths)
    qkv = torch.randn(total, 3, heads, dim, device=DEVICE)
    _, pos = reference.packed_positions(cu, total)
    qkv[:, 2] = torch.nn.functional.one_hot(pos.long(), dim).float()[:, None, :]  # v_j = e_j
    torch.manual_seed(11)
    probe = kernels.attention(qkv, cu, longest, p, training=True)
    keep = torch.zeros(len(lengths), heads, longest, longest, device=DEVICE)
    start = 0
    for b, n in enumerate(lengths):
        keep[b, :, :n, :n] = (probe[start:start + n, :, :n] != 0).permute(1, 0, 2).float()
        start += n
    valid = sum(n * n for n in lengths) * heads
    frac = keep.sum().item() / valid
    assert abs(frac - (1 - p)) < 5 * (p * (1 - p) / valid) ** 0.5, f"kept fraction {frac:.3f}, p={p}"
    torch.testing.assert_close(probe, _masked_attention(qkv, lengths, keep, p), rtol=0, atol=1e-5)

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
    assert [name for name, _ in grids] == ["_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_fwd"]
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




@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("dim", [26, 64])
def test_attention_inference_launcher(dim: int, dtype: torch.dtype) -> None:
    from fastbert import kernels

    qkv = torch.randn(sum(RAGGED), 3, 2, dim, dtype=torch.float64, device=DEVICE)
    cu, longest = _cu(RAGGED), max(RAGGED)
    check_inference(f"attention[d={dim}]", lambda x: kernels.INFERENCE["attention"](x, cu, longest, 0.1, True),
                    lambda x: reference.attention(x, cu, longest), [qkv], dtype, row_strided)
