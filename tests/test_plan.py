"""fastbert.execution.plan: the first forward in a mode binds each op once; later forwards loop over the layers with the
bound ops and compute exactly what the module-by-module path computes, fall back to it when a model says so (hooks,
another forward, a module in another mode), and bind again when the mode changes."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import fastbert
from benchmarks.host_work import CUDA_PATH_EXCLUDED
from fastbert import ops
from tests.conftest import tiny_bert


def ragged() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 120, (3, 11), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 1:] = 0
    return ids, mask


def counted(model: torch.nn.Module, *args, **kwargs) -> tuple[torch.Tensor, int]:
    """last_hidden_state and how many dispatch decisions (ops.select calls) the forward made."""
    calls = [0]
    select = ops.select

    def counting(*a, **k):  # noqa: ANN002, ANN003
        calls[0] += 1
        return select(*a, **k)

    ops.select = counting
    try:
        return model(*args, **kwargs).last_hidden_state, calls[0]
    finally:
        ops.select = select


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bound_forward_equals_the_module_by_module_one(backend: str) -> None:
    """Forced torch and Triton (interpreter), torch's GEMMs (the CUDA path's choice): every op is bound, and the second
    forward dispatches only the pooler's GEMM."""
    model, (ids, mask) = tiny_bert(), ragged()
    with torch.no_grad(), ops.use_backend(backend), ops.exclude_backends(*CUDA_PATH_EXCLUDED):
        first, decisions_first = counted(model, ids, attention_mask=mask)
        second, decisions_second = counted(model, ids, attention_mask=mask)
    assert decisions_first > 10 and decisions_second == 1  # the pooler's linear is outside the encoder loop
    assert torch.equal(first, second)
    said = fastbert.explain()
    assert "one loop over the layers' tensors" in said and f"attention -> bound to {backend}" in said


def test_training_with_a_bound_plan_gives_the_same_gradients() -> None:
    model, (ids, mask) = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), ragged()
    model.train()
    grads = []
    with ops.use_backend("torch"):
        for _ in range(2):  # the first binds, the second runs the plan's loop
            model.zero_grad()
            model(ids, attention_mask=mask).last_hidden_state.square().sum().backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert "(training, with grad, forced torch): one loop" in fastbert.explain()
    assert len(grads[0]) > 20 and all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_hooks_and_mode_changes_are_seen_every_forward() -> None:
    model, (ids, mask) = tiny_bert(), ragged()
    with torch.no_grad(), ops.use_backend("torch"):
        model(ids, attention_mask=mask)
        seen = []
        handle = model.encoder.layer[1].output.register_forward_hook(lambda m, a, out: seen.append(out.shape))
        model(ids, attention_mask=mask)
        assert len(seen) == 1 and "module by module, because a BertOutput has forward hooks" in fastbert.explain()
        handle.remove()
        model.encoder.layer[0].attention.train()  # one module in another mode than the model
        model(ids, attention_mask=mask)
        assert "a BertAttention is in training mode" in fastbert.explain()
        model.train()
        model(ids, attention_mask=mask)  # a new mode: a forward that binds, module by module
    assert len(model.plans.plans) == 2


def test_weights_changed_in_place_or_replaced_are_read_by_the_next_forward() -> None:
    model, (ids, mask) = tiny_bert(), ragged()
    with torch.no_grad(), ops.use_backend("torch"):
        for _ in range(2):
            model(ids, attention_mask=mask)
        model.encoder.layer[0].attention.self.key.weight.mul_(1.5)  # in place: the cached QKV weight is stale
        model.encoder.layer[1].attention.self.value.bias = torch.nn.Parameter(torch.randn(78))  # a new tensor
        after = model(ids, attention_mask=mask).last_hidden_state
        fresh = copy.deepcopy(model)  # no plan: module by module
        expected = fresh(ids, attention_mask=mask).last_hidden_state
    assert torch.equal(after, expected)


def test_a_model_with_plans_copies_and_pickles() -> None:
    model, (ids, mask) = tiny_bert(), ragged()
    with torch.no_grad():
        for _ in range(2):
            out = model(ids, attention_mask=mask).last_hidden_state
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert not twin.plans.plans
        with torch.no_grad():
            assert torch.allclose(twin(ids, attention_mask=mask).last_hidden_state, out, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_autocast_binds_each_op_with_its_casts(backend: str) -> None:
    """Under bf16 autocast the plan binds every op, wrapped in the casts its dispatching function makes: the bound
    forward computes exactly what the module-by-module one does, with one dispatch (the pooler's GEMM)."""
    model, (ids, mask) = tiny_bert(), ragged()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad(), ops.use_backend(backend), \
            ops.exclude_backends(*CUDA_PATH_EXCLUDED):  # fmt: skip
        first, _ = counted(model, ids, attention_mask=mask)
        second, decisions = counted(model, ids, attention_mask=mask)
    assert decisions == 1 and torch.equal(first, second)
    said = fastbert.explain()
    assert "autocast bfloat16" in said and f"bias_residual_layernorm -> bound to {backend}" in said
    assert "with the op's autocast casts" in said


def test_the_tf32_setting_is_part_of_a_cuda_fp32_mode() -> None:
    """Which fp32 attention runs on CUDA follows torch's TF32 switch, so a change of it binds another plan."""
    from fastbert.execution.mode import current_mode

    model, cuda = tiny_bert(), torch.device("cuda")
    matmul, before = (
        torch.backends.cuda.matmul,
        (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()),
    )
    try:
        matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        exact = current_mode(model, cuda, torch.float32, False)
        matmul.allow_tf32 = True
        assert current_mode(model, cuda, torch.float32, False) != exact and not exact.tf32
    finally:
        matmul.allow_tf32 = before[0]
        torch.set_float32_matmul_precision(before[1])
    assert current_mode(model, cuda, torch.float16, False) == current_mode(model, cuda, torch.float16, False)
    assert not current_mode(model, torch.device("cpu"), torch.float32, False).tf32


def test_inputs_embeds_that_need_grad_get_it_from_a_frozen_model() -> None:
    """After a no-grad forward bound forward-only launchers, inputs_embeds that require grad (prompt tuning,
    attributions) still get a gradient: the mode counts them."""
    model = tiny_bert().requires_grad_(False)
    ids, mask = ragged()
    with torch.no_grad():
        for _ in range(2):
            model(ids, attention_mask=mask)
    embeds = model.embeddings.word_embeddings(ids).detach().requires_grad_(True)
    for _ in range(2):
        out = model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        assert out.requires_grad
    out.sum().backward()
    assert embeds.grad is not None and embeds.grad.abs().sum() > 0


def test_a_parametrized_linear_runs_module_by_module() -> None:
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    model, (ids, mask) = tiny_bert(), ragged()
    with torch.no_grad(), ops.use_backend("torch"):
        model(ids, attention_mask=mask)
        parametrize.register_parametrization(model.encoder.layer[1].intermediate.dense, "weight", Double())
        expected = copy.deepcopy(model)(ids, attention_mask=mask).last_hidden_state
        out = model(ids, attention_mask=mask).last_hidden_state
    assert torch.equal(out, expected) and "stands where fastbert's Linear was" in fastbert.explain()


def test_moving_or_casting_drops_the_plans_and_fused_weights() -> None:
    model, (ids, mask) = tiny_bert(), ragged()
    with torch.no_grad():
        for _ in range(2):
            model(ids, attention_mask=mask)
    model.double()
    assert not model.plans.plans and model.encoder.layer[0].attention.self._fused is None
    with torch.no_grad():
        assert model(ids, attention_mask=mask).last_hidden_state.dtype == torch.float64


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9: no new switch")
@pytest.mark.parametrize("value", ["tf32", "ieee"])
def test_the_mode_reads_torchs_new_tf32_switch_without_raising(value: str) -> None:
    """torch >= 2.9's `torch.backends.cuda.matmul.fp32_precision`: once set, torch raises on the legacy reads, which a
    CUDA fp32 mode used to make every forward."""
    from fastbert.execution.mode import current_mode
    from tests.test_fp32_precision import fp32_precision

    with fp32_precision(value):
        mode = current_mode(tiny_bert(), torch.device("cuda"), torch.float32, False)
    assert mode.tf32 == (value == "tf32")


def test_a_frozen_model_with_grad_enabled_walks_no_parameters_in_python() -> None:
    """A frozen model called without no_grad (optimize(freeze=True) does this) checks its weights' requires_grad in
    one C-level scan, not a walk of the module tree: as few Python calls as under no_grad, give or take a few."""
    from benchmarks.host_work import count

    model, (ids, mask) = tiny_bert(num_hidden_layers=6).requires_grad_(False), ragged()
    with ops.use_backend("torch"):
        for _ in range(2):
            model(ids, attention_mask=mask)
        frozen = count(lambda: model(ids, attention_mask=mask))
        with torch.no_grad():
            model(ids, attention_mask=mask)
            plain = count(lambda: model(ids, attention_mask=mask))
    assert frozen.python_calls <= plain.python_calls + 5, (frozen, plain)
