"""The execution layer under the ways a model changes after its plan is bound, and the ways two callers interleave:
each case is seen by the next forward, which computes what a fresh copy of the model (module by module) computes.
The CUDA-graph cases run on CPU with a capture that replays by running the captured function again."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.func import functional_call

import fastbert
from fastbert import ops
from fastbert.execution import Inputs
from fastbert.execution import plan as plan_module
from fastbert.padding import unpad
from tests.conftest import tiny_bert
from tests.test_graph_buckets import RerunGraphs, batch


def fresh(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What a copy of `model` (no plan: module by module) computes."""
    return copy.deepcopy(model)(ids, attention_mask=mask).last_hidden_state


def bound(**overrides: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny model whose plan is bound (two forwards), and its batch."""
    model, (ids, mask) = tiny_bert(max_position_embeddings=64, **overrides), batch([9, 4], 9)
    with torch.no_grad():
        for _ in range(2):
            model(ids, attention_mask=mask)
    return model, ids, mask


def replaying() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny model with the CPU graph twin whose bucket is captured and replayed once (inference mode)."""
    model, (ids, mask) = tiny_bert(max_position_embeddings=64), batch([9, 4], 9)
    model.cuda_graphs = RerunGraphs(model)
    with torch.inference_mode():
        for _ in range(3):
            model(ids, attention_mask=mask)
    return model, ids, mask


@pytest.mark.parametrize("how", ["del", "pop", "insert"])
def test_a_layer_list_edited_in_place_is_read(how: str) -> None:
    """ModuleList's del, pop and insert rewrite its table without registering anything."""
    model, ids, mask = bound(num_hidden_layers=3)
    with torch.no_grad():
        if how == "del":
            del model.encoder.layer[2]
        elif how == "pop":
            model.encoder.layer.pop(1)
        else:
            model.encoder.layer.insert(0, copy.deepcopy(model.encoder.layer[2]))
        torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state, fresh(model, ids, mask),
                                   atol=0, rtol=0)  # fmt: skip


def test_functional_call_swaps_weights_for_outputs_and_gradients() -> None:
    """torch.func.functional_call writes the parameters into the modules' tables directly (no registration)."""
    model, ids, mask = bound()
    model.requires_grad_(False)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    with torch.no_grad():
        params["encoder.layer.0.attention.self.query.weight"].mul_(0.5)
    out = functional_call(model, params, (ids,), {"attention_mask": mask}).last_hidden_state
    expected = functional_call(copy.deepcopy(model), params, (ids,), {"attention_mask": mask}).last_hidden_state
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    grad = torch.autograd.grad(out.sum(), params["encoder.layer.0.attention.self.query.weight"])[0]
    assert grad is not None and grad.abs().sum() > 0


def test_functional_call_under_graphs_replays_the_swapped_weights() -> None:
    model, ids, mask = replaying()
    with torch.inference_mode():
        half = {k: v * 0.5 if k.endswith("dense.weight") else v for k, v in model.state_dict().items()}
        got = functional_call(model, half, (ids,), {"attention_mask": mask}).last_hidden_state
        want = functional_call(copy.deepcopy(model), half, (ids,), {"attention_mask": mask}).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_hooks_and_forwards_on_the_encoder_are_honoured() -> None:
    model, ids, mask = bound()
    calls = []
    model.encoder.register_forward_hook(lambda m, a, o: calls.append(1))
    with torch.no_grad():
        for _ in range(3):
            model(ids, attention_mask=mask)
    assert len(calls) == 3
    other, _, _ = bound()
    other.encoder.forward = lambda x, packing, hidden=False, attentions=False: (x * 0, [], [])
    with torch.no_grad():
        assert other(ids, attention_mask=mask).last_hidden_state.abs().max() == 0


def test_backward_hooks_on_a_leaf_and_a_module_fire_every_step() -> None:
    model, ids, mask = bound()
    calls = []
    model.encoder.layer[0].output.dense.register_full_backward_hook(lambda m, gi, go: calls.append("leaf"))
    model.encoder.layer[0].output.register_full_backward_hook(lambda m, gi, go: calls.append("module"))
    for _ in range(3):
        model(ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert calls.count("leaf") == 3 and calls.count("module") == 3


def test_a_class_swapped_on_an_instance_after_binding_is_read() -> None:
    class Zero(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 0

    model, ids, mask = bound()
    model.encoder.layer[1].output.dense.__class__ = Zero
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state, fresh(model, ids, mask),
                                   atol=0, rtol=0)  # fmt: skip


def test_a_submodule_cast_on_its_own_changes_the_mode() -> None:
    model, ids, mask = bound()
    for child in model.children():
        child.to(torch.float64)  # not through BertModel._apply
    with torch.no_grad():
        out = model(ids, attention_mask=mask).last_hidden_state
    assert out.dtype == torch.float64 and "cpu/float64" in fastbert.explain()


def test_caches_made_under_inference_mode_serve_a_forward_that_needs_grad() -> None:
    """After warm-up (inference_mode), input embeddings that require grad (Captum on inputs) on a frozen model."""
    model, (ids, mask) = tiny_bert(max_position_embeddings=64).requires_grad_(False), batch([9, 4], 9)
    with torch.inference_mode():
        for _ in range(2):
            model(ids, attention_mask=mask)
    embeds = model.embeddings.word_embeddings.weight[ids].detach().requires_grad_(True)
    for _ in range(2):
        model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state.sum().backward()
    assert embeds.grad is not None and embeds.grad.abs().sum() > 0


def test_peft_merge_and_unload_is_read() -> None:
    """peft merges with `.data +=` (no version bump): a fused QKV copy made before must not come back after unload."""
    peft = pytest.importorskip("peft")
    from peft.tuners.lora import LoraLayer

    model, ids, mask = bound()
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["query", "value"], init_lora_weights=False),
                                 model)  # fmt: skip
    with torch.no_grad():
        adapted = model(ids, attention_mask=mask).last_hidden_state
        for name, module in list(model.named_modules()):
            if isinstance(module, LoraLayer):
                module.merge()
                parent, child = name.rsplit(".", 1)
                setattr(model.get_submodule(parent), child, module.get_base_layer())
        for _ in range(2):
            merged = model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)


def test_a_forward_with_attentions_binds_no_plan_that_sticks() -> None:
    """output_attentions runs attention outside the dispatch: the next plain forward binds the plan again."""
    model, (ids, mask) = tiny_bert(), batch([9, 4], 9)
    with torch.no_grad():
        model(ids, attention_mask=mask, output_attentions=True)
        for _ in range(2):
            model(ids, attention_mask=mask)
    (plan,) = model.plans.plans.values()
    assert plan.how["attention"].startswith("bound to"), plan.how["attention"]


def test_int32_ids_replay() -> None:
    model, ids, mask = replaying()
    with torch.inference_mode():
        out = model(ids.int(), attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, fresh(model, ids, mask), atol=1e-5, rtol=0)
    assert not model.cuda_graphs.refused


def test_a_failed_capture_is_not_tried_again() -> None:
    tries = []

    class Failing(RerunGraphs):
        @staticmethod
        def capture(run, pool):  # noqa: ANN001, ANN205
            tries.append(1)
            raise RuntimeError("cannot capture")

    model = tiny_bert(max_position_embeddings=64)
    model.cuda_graphs = Failing(model)
    ids, mask = batch([9, 4], 9)
    with torch.inference_mode():
        for _ in range(5):
            model(ids, attention_mask=mask)
    assert len(tries) == 1


def test_the_default_graphs_bind_and_capture_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made on the first forward where graphs are on by default: no second binding, no second capture, so
    fastbert.warmup's work holds for the first request."""
    from fastbert.execution.graphs import CudaGraphs

    captures, binds = [], []
    monkeypatch.setattr(CudaGraphs, "device_type", "cpu")
    monkeypatch.setattr(CudaGraphs, "capture", staticmethod(lambda run, pool: captures.append(1) or RerunGraphs.capture(
        run, pool)))  # fmt: skip
    binding = plan_module.Plans._binding_run
    monkeypatch.setattr(plan_module.Plans, "_binding_run", lambda *a, **k: binds.append(1) or binding(*a, **k))
    model = tiny_bert(max_position_embeddings=64)
    assert fastbert.warmup(model, [(2, 9)]) == 1
    ids = torch.full((2, 9), 5)
    with torch.inference_mode():
        for _ in range(3):
            model(ids, attention_mask=torch.ones_like(ids))
    assert len(binds) == 1 and len(captures) == 1


def test_graphs_captured_for_one_mode_never_replay_for_another() -> None:
    """Two callers in two modes, interleaved as two threads can be: A checks, B checks (dropping A's graphs), A
    captures, B runs: B must not replay A's graph."""

    class Tagged(RerunGraphs):
        def _capture(self, plan, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            graph = super()._capture(plan, *args, **kwargs)
            graph.forced = plan.mode.forced
            return graph

    model = tiny_bert(max_position_embeddings=64)
    model.cuda_graphs = Tagged(model)
    ids, mask = batch([9, 4], 9)
    cpu = torch.device("cpu")

    def go(run: plan_module.Run) -> torch.Tensor:
        positions = torch.arange(9).expand(2, 9).contiguous()
        return run(Inputs(ids, torch.zeros_like(ids), positions, None), unpad(mask, 2, 9, cpu))[0]

    with torch.inference_mode():
        for _ in range(2):
            model(ids, attention_mask=mask)
            with ops.use_backend("torch"):
                model(ids, attention_mask=mask)
        with ops.use_backend("torch"):
            run_a = model.plans.prepare(model, cpu, None, False, False)
        run_b = model.plans.prepare(model, cpu, None, False, False)
        with ops.use_backend("torch"):
            go(run_a)
        go(run_b)
    assert all(graph.forced is None for graph in model.cuda_graphs.graphs.values())


def test_autocast_graphs_record_the_weight_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under autocast a capture must record the casts of the weights, not autocast's cached copies: an in-place edit
    between replays, inside one autocast block, is read."""
    from fastbert import capabilities

    monkeypatch.setattr(capabilities, "bf16_via_fp32", lambda device: False)  # F.linear's autocast cast, every CPU
    model = tiny_bert(max_position_embeddings=64)
    model.cuda_graphs = RerunGraphs(model)
    ids, mask = batch([9, 4], 9)
    with warnings.catch_warnings(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
            ops.use_backend("torch"):  # fmt: skip  (F.linear: autocast casts, and caches, the weights)
        warnings.simplefilter("ignore")
        for _ in range(3):
            model(ids, attention_mask=mask)
        model.encoder.layer[0].output.dense.weight.mul_(0.5)
        out = model(ids, attention_mask=mask).last_hidden_state
        twin = copy.deepcopy(model)  # the same graph layout (bf16 rounding follows the padded shapes), new weights
        twin.cuda_graphs = RerunGraphs(twin)
        for _ in range(3):
            expected = twin(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
