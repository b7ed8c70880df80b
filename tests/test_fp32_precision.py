"""fp32 on CUDA follows torch's TF32 setting (issue 28, item 3): with TF32 allowed the Triton kernels use TF32 tensor
cores; without it attention goes to torch's exact SDPA, never to the IEEE Triton dot by default. Checked on CPU: the
dispatch decision on fake CUDA tensors, the precision each kernel is launched with (the launch stubbed), and the torch
path's numerics."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import pytest
import torch

from fastbert import ops

pytest.importorskip("triton")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from fastbert import kernels  # noqa: E402

if kernels.unavailable_reason() is not None:
    pytest.skip(f"Triton kernels unavailable: {kernels.unavailable_reason()}", allow_module_level=True)

limits = importlib.import_module("fastbert.kernels.limits")
attention_kernel = importlib.import_module("fastbert.kernels.attention")  # the package's `attention` is the function

REFUSAL = "fp32 without TF32: torch's SDPA is the faster exact path"


@contextlib.contextmanager
def matmul_precision(value: str) -> Iterator[None]:
    """torch.set_float32_matmul_precision inside a block ('highest': no TF32; 'high': TF32 allowed)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@contextlib.contextmanager
def allow_tf32_flag() -> Iterator[None]:
    """TF32 allowed through the older switch, torch.backends.cuda.matmul.allow_tf32."""
    before = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


NEW_API = hasattr(torch.backends.cuda.matmul, "fp32_precision")  # torch >= 2.9
needs_new_api = pytest.mark.skipif(not NEW_API, reason="torch < 2.9 has no fp32_precision switches")


@contextlib.contextmanager
def fp32_precision(matmul: str, generic: str = "none") -> Iterator[None]:
    """torch >= 2.9's switches inside a block: `torch.backends.cuda.matmul.fp32_precision` ("tf32", "ieee", or "none":
    inherit) and the global `torch.backends.fp32_precision`. They leave the legacy float32 matmul precision as it was,
    and torch raises on a legacy read while the two disagree, so both new switches are put back, and the legacy read
    checked to work again (the tests after this one in the worker read it)."""
    legacy = torch.get_float32_matmul_precision()
    before = (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision)
    torch.backends.fp32_precision = generic
    torch.backends.cuda.matmul.fp32_precision = matmul
    try:
        yield
    finally:
        torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = before
        assert torch.get_float32_matmul_precision() == legacy


def precision_switch(setting: str) -> contextlib.AbstractContextManager[None]:
    """One way a caller sets TF32: 'highest'/'high' (legacy precision), 'allow_tf32' (legacy flag), 'new_tf32' /
    'new_ieee' (the new per-backend switch), 'generic_tf32' (the new global switch, cuda matmul inheriting it)."""
    if setting == "allow_tf32":
        return allow_tf32_flag()
    if setting.startswith("new_"):
        return fp32_precision(setting.removeprefix("new_"))
    if setting == "generic_tf32":
        return fp32_precision("none", generic="tf32")
    return matmul_precision(setting)


SETTINGS = ["highest", "high", "allow_tf32",
            pytest.param("new_tf32", marks=needs_new_api), pytest.param("new_ieee", marks=needs_new_api),
            pytest.param("generic_tf32", marks=needs_new_api)]  # fmt: skip
TF32_ALLOWED = {"highest": False, "high": True, "allow_tf32": True, "new_tf32": True, "new_ieee": False,
                "generic_tf32": True}  # fmt: skip


@pytest.mark.parametrize("setting", SETTINGS)
def test_tf32_allowed_reads_every_switch_without_raising(setting: str) -> None:
    """torch >= 2.9 raises on a read of the legacy switches (allow_tf32, get_float32_matmul_precision) once a caller
    set the new one: tf32_allowed() and fp32_dot_precision() read whichever decides, and never raise."""
    with precision_switch(setting):
        assert limits.tf32_allowed() is TF32_ALLOWED[setting]
        assert limits.fp32_dot_precision() == ("tf32" if TF32_ALLOWED[setting] else "ieee")


@needs_new_api
def test_the_cuda_matmul_switch_overrides_the_global_one() -> None:
    """An explicit "ieee" for CUDA matmuls wins over a global "tf32", and the reverse."""
    with fp32_precision("ieee", generic="tf32"):
        assert not limits.tf32_allowed()
    with fp32_precision("tf32", generic="ieee"):
        assert limits.tf32_allowed()


def _cuda_attention_call(dtype: torch.dtype) -> tuple[tuple, dict]:
    """An attention call on fake CUDA tensors: select() reads devices, dtypes and shapes, and runs nothing."""
    with FakeTensorMode():
        qkv = torch.empty(24, 3, 4, 16, device="cuda", dtype=dtype)
        cu_seqlens = torch.empty(3, device="cuda", dtype=torch.int32)
    return (qkv, cu_seqlens, 16), {}


@pytest.mark.parametrize("setting", SETTINGS)
def test_cuda_fp32_attention_goes_to_sdpa_unless_tf32_is_allowed(setting: str) -> None:
    allowed = TF32_ALLOWED[setting]
    with precision_switch(setting):
        _, backend = ops.select("attention", *_cuda_attention_call(torch.float32))
        assert backend == ("triton" if allowed else "torch")
        if not allowed:
            assert f"triton: {REFUSAL}" in ops.decisions()["attention"]  # what explain() prints
            with ops.use_backend("triton"):  # chosen by name it still runs, with the exact IEEE dot
                assert ops.select("attention", *_cuda_attention_call(torch.float32))[1] == "triton"
        for low in (torch.float16, torch.bfloat16):  # 16-bit inputs always take the tensor-core kernel
            assert ops.select("attention", *_cuda_attention_call(low))[1] == "triton"


class _Launch:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **meta)` records the meta-parameters, runs nothing."""

    def __init__(self) -> None:
        self.meta: list[dict] = []

    def __getitem__(self, grid: tuple) -> object:
        return lambda *args, **meta: self.meta.append(meta)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_launch_with_the_precision_torch_allows(
    setting: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every kernel with dots (attention's training forward, its two backward kernels, the inference launch) is
    launched with the precision torch allows: IEEE for fp32 without TF32, TF32 otherwise."""
    expected = "ieee" if dtype == torch.float32 and not TF32_ALLOWED[setting] else "tf32"
    launches = {name: _Launch() for name in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq")}
    for name, launch in launches.items():
        monkeypatch.setattr(attention_kernel, name, launch)
    qkv = torch.randn(10, 3, 2, 16, dtype=dtype, requires_grad=True)
    cu_seqlens = torch.tensor([0, 4, 10], dtype=torch.int32)
    with precision_switch(setting):
        attention_kernel.attention(qkv, cu_seqlens, 6).sum().backward()  # the stubs write nothing: launches only
        with torch.no_grad():
            attention_kernel.attention_inference(qkv, cu_seqlens, 6)
    precisions = {name: [m["PRECISION"] for m in launch.meta] for name, launch in launches.items()}
    assert precisions == {"_attn_fwd": [expected, expected], "_attn_bwd_dkdv": [expected], "_attn_bwd_dq": [expected]}


def _naive_attention(qkv: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """Per sequence, in fp64: softmax(q k^T / sqrt(D)) v."""
    out = torch.zeros(qkv.shape[0], qkv.shape[2], qkv.shape[3], dtype=torch.float64)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        q, k, v = qkv[start:end].double().unbind(1)  # [L, nH, D] each
        scores = torch.einsum("qhd,khd->hqk", q, k) / qkv.shape[-1] ** 0.5
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def test_torch_backend_attention_is_exact_fp32_with_an_empty_sequence() -> None:
    """The path fp32 takes without TF32 (SDPA on the padded batch): fp32 atol 1e-5 on every row, an empty sequence
    and padding to a max_seqlen above every length included, nothing non-finite."""
    torch.manual_seed(0)
    bounds = [0, 5, 5, 12, 13]  # lengths 5, 0, 7, 1
    qkv = torch.randn(13, 3, 4, 24)
    with ops.use_backend("torch"):
        out = ops.attention(qkv, torch.tensor(bounds, dtype=torch.int32), 9)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _naive_attention(qkv, bounds), atol=1e-5, rtol=0)


def test_fully_padded_row_gives_zeros_on_the_torch_path() -> None:
    """A row whose attention mask is all zeros comes back as zeros (never NaN) through the torch attention."""
    from fastbert import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64)  # fmt: skip
    model = BertModel(config).eval()
    ids = torch.randint(1, 100, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1] = 0
    mask[2, 4:] = 0
    with ops.use_backend("torch"), torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() and (out[2, 4:] == 0).all() and (out[0] != 0).any()
