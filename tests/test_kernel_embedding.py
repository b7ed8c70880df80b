"""Triton embedding gather + sum + LayerNorm (+ dropout), forward and backward (table scatter), vs fp64."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import (
    DEVICE,
    DTYPES,
    assert_close,
    check_inference,
    check_op,
    gpu,
    nan_poisoned_empty,
    requires_triton,
    row_strided,
)

from fastbert import reference

pytestmark = requires_triton
EPS = 1e-12


def _case(tokens: int, e: int, vocab: int = 50, positions: int = 40, types: int = 2, device=DEVICE):
    """ids, token types, positions (ints, with repeats so grads accumulate) and fp64 tables + LN params."""
    ints = [torch.randint(0, n, (tokens,), device=device) for n in (vocab, types, positions)]
    tables = [torch.randn(n, e, dtype=torch.float64, device=device) for n in (vocab, positions, types)]
    ln = [torch.randn(e, dtype=torch.float64, device=device) for _ in range(2)]
    return ints, tables, ln


def _check_ids(dtype: torch.dtype, tokens: int, e: int, view=None, device=DEVICE, **sizes) -> None:
    from fastbert import kernels

    (ids, tt, pos), tables, ln = _case(tokens, e, device=device, **sizes)
    check_op(
        f"embedding_layernorm[{e}]", functools.partial(kernels.embedding_layernorm, eps=EPS),
        functools.partial(reference.embedding_layernorm, eps=EPS), [ids, tt, pos, *tables, *ln], dtype, view,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embedding_layernorm_matches_reference(dtype: torch.dtype) -> None:
    _check_ids(dtype, 37, 48, view=row_strided)  # E=48: an ALBERT-style embedding_size below the hidden size


def test_embedding_layernorm_hidden_384_one_token() -> None:
    _check_ids(torch.float32, 1, 384)


def test_embedding_layernorm_inputs_embeds() -> None:
    from fastbert import kernels

    (_, tt, pos), (word, *tables), ln = _case(21, 64)

    def via(fn):  # the word table is unused with inputs_embeds: keep it out of the differentiated inputs
        return lambda tt, pos, posw, typew, w, b, emb: fn(None, tt, pos, word.to(emb.dtype), posw, typew, w, b, EPS,
                                                          inputs_embeds=emb)

    emb = torch.randn(21, 64, dtype=torch.float64, device=DEVICE)
    check_op("embedding_layernorm[inputs_embeds]", via(kernels.embedding_layernorm),
             via(reference.embedding_layernorm), [tt, pos, *tables, *ln, emb], torch.float32, row_strided)


def test_embedding_layernorm_dropout_mask_is_shared_by_forward_and_backward() -> None:
    """Dropout zeros show in the output; backward must apply that same mask (checked through every grad)."""
    from fastbert import kernels

    p, tokens, e = 0.25, 64, 80
    (ids, tt, pos), tables, ln = _case(tokens, e)
    params = [t.float().requires_grad_() for t in (*tables, *ln)]
    with nan_poisoned_empty():
        y = kernels.embedding_layernorm(ids, tt, pos, *params, EPS, dropout_p=p, training=True)
        gout = torch.randn_like(y)
        ours = torch.autograd.grad(y, params, gout)
    keep = y != 0
    frac = keep.double().mean().item()
    assert abs(frac - (1 - p)) < 5 * ((p * (1 - p)) / keep.numel()) ** 0.5, f"kept fraction {frac:.3f}, p={p}"
    ref_params = [t.detach().double().requires_grad_() for t in params]
    expect = reference.embedding_layernorm(ids, tt, pos, *ref_params, EPS) * keep / (1 - p)
    torch.testing.assert_close(y.double(), expect, rtol=0, atol=1e-5)
    for g, r in zip(ours, torch.autograd.grad(expect, ref_params, gout.double()), strict=True):
        torch.testing.assert_close(g.double(), r, rtol=0, atol=1e-5 * max(1.0, r.abs().max().item()))


def test_embedding_layernorm_rejects_bad_input() -> None:
    from fastbert import kernels

    (ids, tt, pos), tables, ln = _case(5, 16)
    tables = [t.float() for t in tables]
    ln = [t.float() for t in ln]
    with pytest.raises(ValueError, match="exactly one"):
        kernels.embedding_layernorm(None, tt, pos, *tables, *ln, EPS)
    with pytest.raises(ValueError, match="must match"):
        kernels.embedding_layernorm(ids, tt[:3], pos, *tables, *ln, EPS)


def test_embedding_layernorm_matches_torch_layer_norm_on_bert_tables() -> None:
    """The model's own call: ids [T] packed, tables from nn.Embedding (padding row included), fp32."""
    from fastbert import kernels

    sizes = ((99, 0), (16, None), (2, None))  # (rows, padding_idx)
    word, posw, typew = (torch.nn.Embedding(n, 32, padding_idx=pad, device=DEVICE) for n, pad in sizes)
    ids = torch.tensor([0, 5, 5, 98, 1, 0, 7], device=DEVICE)
    pos, tt = torch.tensor([0, 1, 2, 3, 0, 1, 2], device=DEVICE), torch.tensor([0, 0, 1, 1, 0, 0, 1], device=DEVICE)
    ln = torch.nn.LayerNorm(32, device=DEVICE)
    y = kernels.embedding_layernorm(ids, tt, pos, word.weight, posw.weight, typew.weight, ln.weight, ln.bias, 1e-12)
    expect = F.layer_norm(word(ids) + posw(pos) + typew(tt), (32,), ln.weight, ln.bias, 1e-12)
    torch.testing.assert_close(y, expect, rtol=0, atol=1e-5)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("e", [128, 768, 1024])
def test_embedding_layernorm_gpu_bert_shapes(dtype: torch.dtype, e: int) -> None:
    _check_ids(dtype, 8191, e, view=row_strided, device=torch.device("cuda"), vocab=30522, positions=512)


@gpu
def test_embedding_layernorm_gpu_backward_is_deterministic() -> None:
    from fastbert import kernels

    (ids, tt, pos), tables, ln = _case(16384, 768, vocab=30522, positions=512, device=torch.device("cuda"))
    params = [t.half().requires_grad_() for t in (*tables, *ln)]
    grads = []
    for _ in range(2):
        y = kernels.embedding_layernorm(ids, tt, pos, *params, EPS)
        grads.append(torch.autograd.grad(y.float().square().sum(), params))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embedding_layernorm_table_grads_repeat_bitwise_and_match_reference(dtype: torch.dtype) -> None:
    """Heavily duplicated ids (one id over 80 tokens in a row): two backward runs give bitwise equal table grads,
    and they match fastbert.reference in fp64 within the kernel bounds."""
    from fastbert import kernels

    tokens, e = 150, 40
    (ids, tt, pos), tables, ln = _case(tokens, e, vocab=7, positions=3, types=2)
    ids[20:100] = 4
    params = [t.to(dtype).requires_grad_() for t in (*tables, *ln)]
    gout = torch.randn(tokens, e, dtype=dtype, device=DEVICE)
    runs = []
    for _ in range(2):
        with nan_poisoned_empty():
            y = kernels.embedding_layernorm(ids, tt, pos, *params, EPS)
            runs.append(torch.autograd.grad(y, params[:3], gout))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    ref = [t.detach().double().requires_grad_() for t in params]
    expect = torch.autograd.grad(reference.embedding_layernorm(ids, tt, pos, *ref, EPS), ref[:3], gout.double())
    low = [t.detach().clone().requires_grad_() for t in params]  # plain torch at this dtype: the low-precision bound
    torch_lowp = torch.autograd.grad(reference.embedding_layernorm(ids, tt, pos, *low, EPS), low[:3], gout)
    for name, got, r, lp in zip(("word", "position", "type"), runs[0], expect, torch_lowp, strict=True):
        assert_close(f"embedding table grad {name}", got, r, None if dtype == torch.float32 else lp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_table_grad_is_the_fixed_order_fp32_sum(dtype: torch.dtype) -> None:
    """The deterministic reduction's contract: row r of the grad sums, in fp32, the rows whose id is r in one fixed
    order (token order inside each chunk of sorted positions, then the chunk sums in order; a run longer than
    several chunks included), rounded once; rows no token names are 0."""
    from fastbert.kernels import embedding

    tokens, e, rows = 300, 70, 9
    ids = torch.randint(0, rows - 1, (tokens,), device=DEVICE)  # row `rows - 1` is never named
    ids[10:250] = 3
    grad_rows = torch.randn(tokens, e, device=DEVICE) * torch.logspace(-3, 3, tokens, device=DEVICE)[:, None]
    keys, order = torch.sort(ids.cpu(), stable=True)
    expect = torch.zeros(rows, e)
    for lo in range(0, tokens, embedding.SEGMENT_CHUNK):
        pieces: dict[int, torch.Tensor] = {}
        for i in range(lo, min(lo + embedding.SEGMENT_CHUNK, tokens)):
            k = int(keys[i])
            pieces[k] = pieces[k] + grad_rows[order[i]].cpu() if k in pieces else grad_rows[order[i]].cpu()
        for k, piece in pieces.items():
            expect[k] += piece
    with nan_poisoned_empty():
        got = embedding._table_grad(grad_rows, ids, torch.empty(rows, e, dtype=dtype, device=DEVICE))
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":  # triton 3.9's interpreter truncates fp32 -> bf16 (a GPU
        expect = (expect.view(torch.int32) & -65536).view(torch.float32)  # rounds to nearest even): exact there
    assert got.dtype == dtype and torch.equal(got.cpu(), expect.to(dtype))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_embedding_layernorm_inference_launcher(dtype: torch.dtype) -> None:
    from fastbert import kernels

    (ids, tt, pos), tables, ln = _case(37, 78)
    check_inference("embedding_layernorm", functools.partial(kernels.INFERENCE["embedding_layernorm"], eps=EPS),
                    functools.partial(reference.embedding_layernorm, eps=EPS), [ids, tt, pos, *tables, *ln], dtype)
    emb = torch.randn(37, 78, dtype=torch.float64, device=DEVICE)

    def via(fn):
        return lambda tt, pos, w, p, t, lw, lb, e: fn(None, tt, pos, w, p, t, lw, lb, EPS, inputs_embeds=e)

    check_inference("embedding_layernorm[inputs_embeds]", via(kernels.INFERENCE["embedding_layernorm"]),
                    via(reference.embedding_layernorm), [tt, pos, *tables, *ln, emb], dtype, row_strided)
