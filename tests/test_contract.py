"""One contract per fused op (fastbert.backends.contract): every implementation of every op takes exactly the declared
parameters, in order, with the declared defaults: the public function, the reference (plus its `upcast`), each
backend's function and forward-only launcher, the native extension's bindings and the custom ops torch.compile traces
(forward-only: the declared parameters without the dropout ones). A new op, or a changed one, fails here until every
implementation agrees."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from fastbert import ops, reference
from fastbert.backends import contract, native

OPS = list(contract.OPS.values())


def parameters(function: object) -> list[tuple[str, object]]:
    """(name, default) of each parameter, in order."""
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def declared(op: contract.Op, params: tuple[contract.Param, ...] | None = None) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in (params or op.params)]


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_the_public_function_and_the_reference_take_the_declared_parameters(op: contract.Op) -> None:
    assert parameters(getattr(ops, op.name)) == declared(op)
    assert parameters(getattr(reference, op.name)) == [*declared(op), ("upcast", False)]
    assert ops._PARAMS[op.name] == op.names  # what select reads a call by


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_every_backend_takes_the_declared_parameters(op: contract.Op) -> None:
    checked = []
    for backend in ops.backends().values():
        if op.name not in backend.ops or (backend.name == "triton" and backend.unavailable()):
            continue
        function = backend.function(op.name)
        extra = [("upcast", False)] if getattr(function, "__module__", "") == reference.__name__ else []
        assert parameters(function) == [*declared(op), *extra], (backend.name, op.name)
        if (launcher := backend.inference_function(op.name)) is not None:
            assert parameters(launcher) == declared(op), (backend.name, op.name, "forward-only launcher")
        checked.append(backend.name)
    assert checked, f"no backend implements {op.name}"


@pytest.mark.parametrize("op", contract.KERNELS, ids=lambda op: op.name)
def test_the_native_custom_ops_and_bindings_take_the_forward_only_parameters(op: contract.Op) -> None:
    """The custom op torch.compile traces has the declared forward-only schema; the C++ binding the same names (and
    an optional `out`), then the extras native.BINDING_EXTRAS declares, in that order."""
    schema = getattr(torch.ops.fastbert, f"native_{op.name}").default._schema
    assert [a.name for a in schema.arguments] == [p.name for p in op.forward_only()]
    cpu, why = native.load("_native_cpu")
    if cpu is None:
        pytest.skip(f"native CPU extension unavailable: {why}")
    first_line = getattr(cpu, op.name).__doc__.splitlines()[0]
    names = re.findall(r"(\w+): ", first_line[first_line.index("(") :])
    extras = native.BINDING_EXTRAS.get(op.name, ())
    assert [n for n in names if n != "out"] == [p.name for p in op.forward_only()] + list(extras), first_line


def test_a_declaration_gives_schema_signature_and_fake() -> None:
    op = contract.ATTENTION
    schema = ("(Tensor qkv, Tensor cu_seqlens, SymInt max_seqlen, float? scale=None, Tensor? position_bias=None, "
              "Tensor? position_scores=None, Tensor? position_columns=None, Tensor? rotary=None, "
              "SymInt? window=None) -> Tensor")
    assert op.schema(op.forward_only()) == schema
    assert str(inspect.signature(ops.attention)).startswith("(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen")
    qkv = torch.empty(7, 3, 2, 4, dtype=torch.bfloat16, device="meta")
    out = op.fake(op.forward_only())(qkv, torch.empty(3, dtype=torch.int32, device="meta"), 5)
    assert out.shape == (7, 2, 4) and out.dtype == torch.bfloat16
    brln = contract.BIAS_RESIDUAL_LAYERNORM.output(dict(x=torch.empty(3, 8, dtype=torch.bfloat16),
                                                        residual=torch.empty(3, 8)))  # fmt: skip
    assert brln.dtype == torch.float32  # autocast: the wider of x's and the residual stream's dtypes


def test_the_reference_dense_residual_layernorm_is_the_torch_backends_composition() -> None:
    """The oracle of the GEMM + epilogue op: the reference's GEMM then bias_residual_layernorm, which the torch backend
    composes from the dispatched ops."""
    gen = torch.Generator().manual_seed(0)
    x, w, res = torch.randn(5, 8, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(5, 6, generator=gen)
    b, g, beta = (torch.randn(6, generator=gen) for _ in range(3))
    with ops.use_backend("torch"):
        composed = ops.dense_residual_layernorm(x, w, b, res, g, beta, 1e-12)
    expected = reference.dense_residual_layernorm(x.double(), w.double(), b.double(), res.double(), g.double(),
                                                  beta.double(), 1e-12)  # fmt: skip
    torch.testing.assert_close(composed, expected.float(), atol=1e-5, rtol=0)
