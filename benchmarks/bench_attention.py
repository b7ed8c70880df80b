"""pytest-benchmark: attention on a ragged batch.

CPU: transformers-style eager (padded [B, nH, S, S] scores with an additive mask) vs fastbert's dispatched op on packed
tokens. No GPU claims there: on CPU `fastbert.ops` picks the native or torch path. Lengths are uniform in [S/4, S]
(DESIGN.md), so the packed path skips the padding.

GPU (skipped without CUDA): the Triton kernel with and without an MPNet relative position bias (nH = 12, D = 64, a
[12, 2R + 1] table with R = 128), and with DeBERTa-v3's disentangled scores ([2, nH, T, 511] gathered by distance
through its 256 log buckets), next to torch eager (fastbert.reference: padded SDPA, the terms materialised as an
[B, nH, S, S] mask), and with ModernBERT's rotary positions and a 128-token window (the [2, T, 32] table read as q
and k are loaded, key blocks outside the window skipped), forward and forward + backward, fp16. Times are
`triton.testing.do_bench` medians (L2 flushed, after warm-up), in `extra_info` with TFLOP/s, GB/s and the max error vs
the fp32 reference; pytest-benchmark's own table times the same call with a device sync. The CPU side has the rotary
and window pair too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.bench_kernels import window_pairs
from fastbert import kernels, ops, reference, relative_positions
from fastbert.padding import unpad
from fastbert.rotary import inverse_frequencies, rotary_rows

BATCH, SEQLEN, HEADS, HEAD_DIM = 4, 64, 4, 64
GPU_BATCH, GPU_SEQLEN, GPU_HEADS, GPU_HEAD_DIM, GPU_RADIUS = 32, 512, 12, 64, 128  # MPNet-base, 32 x <= 512 tokens
GPU = "cuda"


def _eager(padded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, S, 3, nH, D] -> [B, S, nH, D] the way transformers' eager BertSelfAttention computes it."""
    q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    scores = scores + (1.0 - mask[:, None, None, :].float()) * torch.finfo(scores.dtype).min
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("path", ["eager", "fastbert"])
def test_attention_ragged(benchmark, path: str) -> None:
    lengths = torch.randint(SEQLEN // 4, SEQLEN + 1, (BATCH,))
    mask = (torch.arange(SEQLEN)[None, :] < lengths[:, None]).long()
    padded = torch.randn(BATCH, SEQLEN, 3, HEADS, HEAD_DIM)
    packing = unpad(mask, BATCH, SEQLEN, padded.device)
    qkv = packing.pack(padded)
    with torch.no_grad():
        if path == "eager":
            fn = lambda: packing.pack(_eager(padded, mask))
        else:
            fn = lambda: ops.attention(qkv, packing.cu_seqlens, packing.max_seqlen)
        benchmark.group = f"attention B={BATCH} S<={SEQLEN} nH={HEADS} D={HEAD_DIM}"
        out = benchmark(fn)
        torch.testing.assert_close(out, reference.attention(qkv, packing.cu_seqlens, packing.max_seqlen))


def _work(lengths: torch.Tensor, bias: bool, element_size: int, backward: bool) -> tuple[float, float]:
    """(FLOPs, bytes) of one call. FLOPs: the forward's two GEMMs, 2 * 2 * L^2 * D per (sequence, head), and the
    backward's five, 2.5x (the FlashAttention paper's convention); the bias add, like the softmax, is not counted.
    Bytes: forward reads q, k, v and writes the output; backward reads q, k, v, the output, dO and writes dqkv (the
    kernels' fp32 statistics left out); the table ([nH, 2R + 1] fp32, read from cache after its first touch) counted
    once per kernel that reads it, with the bias gradient's [programs, nH, 2R + 1] fp32 partials written and read
    back."""
    tokens = int(lengths.sum())
    flops = 4 * GPU_HEADS * GPU_HEAD_DIM * float((lengths.double() ** 2).sum())
    row = GPU_HEADS * GPU_HEAD_DIM * element_size
    table = GPU_HEADS * (2 * GPU_RADIUS + 1) * 4 if bias else 0
    nbytes = 4 * tokens * row + table
    if backward:
        flops *= 1 + 2.5
        programs = GPU_BATCH * -(-GPU_SEQLEN // 64) * GPU_HEADS  # the dQ kernel's grid, 64-row query blocks
        nbytes += 8 * tokens * row + 2 * table + (2 * programs * (2 * GPU_RADIUS + 1) * 4 if bias else 0)
    return flops, nbytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the Triton attention kernel)")
@pytest.mark.skipif(kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason()))
@pytest.mark.parametrize("direction", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", f"position bias R={GPU_RADIUS}"])
@pytest.mark.parametrize("path", ["triton", "torch eager"])
def test_attention_position_bias_gpu(benchmark, path: str, bias: bool, direction: str) -> None:
    import triton.testing

    gen = torch.Generator().manual_seed(GPU_SEQLEN)
    lengths = torch.randint(GPU_SEQLEN // 4, GPU_SEQLEN + 1, (GPU_BATCH,), generator=gen)
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(device=GPU, dtype=torch.int32)
    qkv = torch.randn(int(lengths.sum()), 3, GPU_HEADS, GPU_HEAD_DIM, generator=gen).to(GPU, torch.float16)
    table = torch.randn(GPU_HEADS, 2 * GPU_RADIUS + 1, generator=gen).to(GPU) if bias else None
    attend = kernels.attention if path == "triton" else reference.attention
    backward = direction == "fwd+bwd"
    x = qkv.clone().requires_grad_(backward)
    t = table.clone().requires_grad_(backward) if bias else None
    grad = torch.randn(x.shape[0], GPU_HEADS, GPU_HEAD_DIM, device=GPU, dtype=x.dtype)

    def call() -> None:
        if backward:
            x.grad = None
            if t is not None:
                t.grad = None
            attend(x, cu, GPU_SEQLEN, position_bias=t).backward(grad)
        else:
            with torch.no_grad():
                attend(x, cu, GPU_SEQLEN, position_bias=t)

    with torch.no_grad():
        ref = reference.attention(qkv.float(), cu, GPU_SEQLEN, position_bias=table)
        err = (attend(qkv, cu, GPU_SEQLEN, position_bias=table).float() - ref).abs().max().item()
    assert err < 2e-2, f"{path}: max error {err:.3g} vs the fp32 reference"
    benchmark.group = (f"attention {direction} fp16 B={GPU_BATCH} S<={GPU_SEQLEN} nH={GPU_HEADS} D={GPU_HEAD_DIM} "
                       f"(bias: R={GPU_RADIUS})")  # fmt: skip
    benchmark.extra_info["max_err"] = err
    if benchmark.enabled:
        ms = triton.testing.do_bench(call, return_mode="median")
        flops, nbytes = _work(lengths, bias, qkv.element_size(), backward)
        benchmark.extra_info.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, gbps=nbytes / (ms * 1e-3) / 1e9)

    def synced() -> None:
        call()
        if x.is_cuda:
            torch.cuda.synchronize()

    benchmark(synced)


def _deberta_scores(tokens: int, seqlen: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """DeBERTa-v3-base's terms for sequences up to `seqlen`: random scaled scores [2, nH, T, W] against the rows its
    256 log buckets reach, and each distance's column."""
    _, width, columns = relative_positions.deberta_rows(seqlen, 256, 512, torch.device(device))
    scores = torch.randn(2, GPU_HEADS, tokens, width, generator=gen) * 0.3
    return scores.to(device), columns


@pytest.mark.parametrize("path", ["eager", "fastbert"])
def test_attention_disentangled_ragged(benchmark, path: str) -> None:
    """CPU, DeBERTa's terms: transformers-style eager (the terms gathered into [B, nH, S, S], added to padded scores)
    vs fastbert's dispatched op (the native kernel gathers them by distance)."""
    gen = torch.Generator().manual_seed(SEQLEN)
    lengths = torch.randint(SEQLEN // 4, SEQLEN + 1, (BATCH,), generator=gen)
    mask = (torch.arange(SEQLEN)[None, :] < lengths[:, None]).long()
    packing = unpad(mask, BATCH, SEQLEN, torch.device("cpu"))
    qkv = packing.pack(torch.randn(BATCH, SEQLEN, 3, HEADS, HEAD_DIM, generator=gen))
    _, width, columns = relative_positions.deberta_rows(SEQLEN, 256, 512, torch.device("cpu"))
    scores = torch.randn(2, HEADS, qkv.shape[0], width, generator=gen) * 0.3
    cu, longest = packing.cu_seqlens, packing.max_seqlen
    with torch.no_grad():
        if path == "eager":
            fn = lambda: reference.attention(qkv, cu, longest, position_scores=scores, position_columns=columns)
        else:
            fn = lambda: ops.attention(qkv, cu, longest, position_scores=scores, position_columns=columns)
        benchmark.group = f"attention + DeBERTa terms B={BATCH} S<={SEQLEN} nH={HEADS} D={HEAD_DIM} W={width}"
        out = benchmark(fn)
        want = reference.attention(qkv, cu, longest, position_scores=scores, position_columns=columns)
        torch.testing.assert_close(out, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the Triton attention kernel)")
@pytest.mark.skipif(kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason()))
@pytest.mark.parametrize("direction", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("path", ["triton", "torch eager"])
def test_attention_disentangled_gpu(benchmark, path: str, direction: str) -> None:
    """DeBERTa-v3-base's attention (nH 12, D 64, 32 x <= 512 tokens, W 511), fp16, with the scores' gradient."""
    import triton.testing

    gen = torch.Generator().manual_seed(GPU_SEQLEN)
    lengths = torch.randint(GPU_SEQLEN // 4, GPU_SEQLEN + 1, (GPU_BATCH,), generator=gen)
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(device=GPU, dtype=torch.int32)
    qkv = torch.randn(int(lengths.sum()), 3, GPU_HEADS, GPU_HEAD_DIM, generator=gen).to(GPU, torch.float16)
    scores, columns = _deberta_scores(qkv.shape[0], GPU_SEQLEN, GPU, gen)
    scores = scores.half()
    attend = kernels.attention if path == "triton" else reference.attention
    backward = direction == "fwd+bwd"
    x, sc = qkv.clone().requires_grad_(backward), scores.clone().requires_grad_(backward)
    grad = torch.randn(x.shape[0], GPU_HEADS, GPU_HEAD_DIM, device=GPU, dtype=x.dtype)

    def call() -> None:
        if backward:
            x.grad = sc.grad = None
            attend(x, cu, GPU_SEQLEN, position_scores=sc, position_columns=columns).backward(grad)
        else:
            with torch.no_grad():
                attend(x, cu, GPU_SEQLEN, position_scores=sc, position_columns=columns)

    with torch.no_grad():
        ref = reference.attention(qkv.float(), cu, GPU_SEQLEN, position_scores=scores.float(), position_columns=columns)
        got = attend(qkv, cu, GPU_SEQLEN, position_scores=scores, position_columns=columns)
        err = (got.float() - ref).abs().max().item()
    assert err < 2e-2, f"{path}: max error {err:.3g} vs the fp32 reference"
    benchmark.group = f"attention + DeBERTa terms {direction} fp16 B={GPU_BATCH} S<={GPU_SEQLEN} nH={GPU_HEADS} W=511"
    benchmark.extra_info["max_err"] = err
    if benchmark.enabled:
        ms = triton.testing.do_bench(call, return_mode="median")
        flops, nbytes = _work(lengths, False, qkv.element_size(), backward)
        nbytes += scores.numel() * scores.element_size() * (3 if backward else 1)  # read; grad written and read
        benchmark.extra_info.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, gbps=nbytes / (ms * 1e-3) / 1e9)

    def synced() -> None:
        call()
        torch.cuda.synchronize()

    benchmark(synced)


WINDOW = 64  # ModernBERT's sliding layers: local_attention 128, keys within 64 of the query


def _rotary_table(lengths: torch.Tensor, device: str) -> torch.Tensor:
    """[2, T, D/2]: each packed token's cos and sin at its position in its sequence, ModernBERT's local base."""
    positions = torch.cat([torch.arange(int(n)) for n in lengths])
    return rotary_rows(positions, inverse_frequencies(HEAD_DIM, 10_000.0)).to(device)


@pytest.mark.parametrize("path", ["eager", "fastbert"])
def test_attention_rotary_window_ragged(benchmark, path: str) -> None:
    """CPU, a ModernBERT sliding layer: transformers-style eager (q and k rotated in padded [B, nH, S, D] tensors, the
    window and the padding as an additive [B, 1, S, S] mask) vs fastbert's op on packed tokens (the native kernel:
    rotation as q and k are loaded, the key chunks outside the window skipped). S <= 256, window 64."""
    seqlen = 256
    lengths = torch.randint(seqlen // 4, seqlen + 1, (BATCH,), generator=torch.Generator().manual_seed(3))
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    padded = torch.randn(BATCH, seqlen, 3, HEADS, HEAD_DIM)
    packing = unpad(mask, BATCH, seqlen, padded.device)
    qkv = packing.pack(padded)
    table = _rotary_table(lengths, "cpu")
    angles = rotary_rows(torch.arange(seqlen), inverse_frequencies(HEAD_DIM, 10_000.0))  # [2, S, D/2]
    cos, sin = (torch.cat((t, t), -1)[None, None] for t in angles)  # [1, 1, S, D]
    index = torch.arange(seqlen)
    allowed = ((index[None, :] - index[:, None]).abs() <= WINDOW)[None] & mask[:, None, :].bool()
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]

    def eager() -> torch.Tensor:
        q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = (x * cos + torch.cat((-x[..., HEAD_DIM // 2 :], x[..., : HEAD_DIM // 2]), -1) * sin for x in (q, k))
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM) + additive
        return packing.pack((torch.softmax(scores, dim=-1) @ v).transpose(1, 2))

    with torch.no_grad():
        if path == "eager":
            fn = eager
        else:
            fn = lambda: ops.attention(qkv, packing.cu_seqlens, packing.max_seqlen, rotary=table, window=WINDOW)
        benchmark.group = f"attention + rotary, window {WINDOW} B={BATCH} S<={seqlen} nH={HEADS} D={HEAD_DIM}"
        out = benchmark(fn)
        want = reference.attention(qkv, packing.cu_seqlens, packing.max_seqlen, rotary=table, window=WINDOW)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the Triton attention kernel)")
@pytest.mark.skipif(kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason()))
@pytest.mark.parametrize("direction", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("window", [None, 2 * WINDOW], ids=["global", f"window {2 * WINDOW}"])
@pytest.mark.parametrize("path", ["triton", "torch eager"])
def test_attention_rotary_gpu(benchmark, path: str, window: int | None, direction: str) -> None:
    """ModernBERT-base's attention (nH 12, D 64, 32 x <= 512 tokens), fp16: a global layer (rotary only) and a
    sliding one. FLOPs count the pairs the window keeps (bench_kernels.window_pairs); bytes add the fp32 table, read
    by each kernel, and in the backward dQ and dK read and written once more (their rotation back)."""
    import triton.testing

    half = window // 2 if window else None  # keys within local_attention // 2
    gen = torch.Generator().manual_seed(GPU_SEQLEN)
    lengths = torch.randint(GPU_SEQLEN // 4, GPU_SEQLEN + 1, (GPU_BATCH,), generator=gen)
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(device=GPU, dtype=torch.int32)
    qkv = torch.randn(int(lengths.sum()), 3, GPU_HEADS, GPU_HEAD_DIM, generator=gen).to(GPU, torch.float16)
    table = _rotary_table(lengths, GPU)
    attend = kernels.attention if path == "triton" else reference.attention
    backward = direction == "fwd+bwd"
    x = qkv.clone().requires_grad_(backward)
    grad = torch.randn(x.shape[0], GPU_HEADS, GPU_HEAD_DIM, device=GPU, dtype=x.dtype)

    def call() -> None:
        if backward:
            x.grad = None
            attend(x, cu, GPU_SEQLEN, rotary=table, window=half).backward(grad)
        else:
            with torch.no_grad():
                attend(x, cu, GPU_SEQLEN, rotary=table, window=half)

    with torch.no_grad():
        ref = reference.attention(qkv.float(), cu, GPU_SEQLEN, rotary=table, window=half)
        err = (attend(qkv, cu, GPU_SEQLEN, rotary=table, window=half).float() - ref).abs().max().item()
    assert err < 2e-2, f"{path}: max error {err:.3g} vs the fp32 reference"
    kind = f"window {window}" if window else "global"
    benchmark.group = f"attention + rotary ({kind}) {direction} fp16 B={GPU_BATCH} S<={GPU_SEQLEN} nH={GPU_HEADS}"
    benchmark.extra_info["max_err"] = err
    if benchmark.enabled:
        ms = triton.testing.do_bench(call, return_mode="median")
        flops, nbytes = _work(lengths, False, qkv.element_size(), backward)
        if half is not None:  # the kept pairs instead of every L^2
            flops *= window_pairs(lengths, half) / window_pairs(lengths, None)
        kernels_reading = 3 if backward else 1
        nbytes += kernels_reading * table.numel() * 4
        if backward:  # dQ and dK rotated back: read and written once more
            nbytes += 2 * 2 * int(lengths.sum()) * GPU_HEADS * GPU_HEAD_DIM * qkv.element_size()
        benchmark.extra_info.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, gbps=nbytes / (ms * 1e-3) / 1e9)

    def synced() -> None:
        call()
        torch.cuda.synchronize()

    benchmark(synced)
