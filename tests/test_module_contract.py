"""fastbert's BertModel keeps nn.Module's contract: forward hooks and pre-hooks on any submodule (modifying and
capturing), global hooks, torch.nn.utils.parametrize, weight norm, peft's LoRA (and its merge) and a Captum attribution
on the embeddings do on fastbert what they do on transformers' BertModel, with the same outputs, for inference and
training. A hooked or wrapped leaf runs its own forward; the rest stays fused (fastbert.execution.structure.plain)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch.nn.utils import parametrize

import fastbert

transformers = pytest.importorskip("transformers")
TINY = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
ATOL = 1e-5  # DESIGN: fp32 against transformers, every valid row


def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**TINY)).eval()
    return hf, fastbert.BertModel.from_hf(hf).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    mask = (torch.arange(9)[None] < torch.tensor([9, 4, 6])[:, None]).long()
    return torch.randint(1, TINY["vocab_size"], mask.shape, generator=gen) * mask, mask


def outputs(model: torch.nn.Module, forwards: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The last of `forwards` forwards (the first binds a plan, later ones run it): valid rows, pooler output."""
    ids, mask = batch()
    for _ in range(forwards):
        out = model(ids, attention_mask=mask)
    return out.last_hidden_state[mask.bool()], out.pooler_output


def assert_same(hf: torch.nn.Module, fb: torch.nn.Module) -> None:
    for mine, theirs in zip(outputs(fb), outputs(hf), strict=True):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)


class Double(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def _scale_output(path: str, factor: float) -> Callable:
    def apply(model: torch.nn.Module, calls: list) -> None:
        model.get_submodule(path).register_forward_hook(lambda m, args, out: calls.append(1) or out * factor)

    return apply


def _scale_input(path: str, factor: float) -> Callable:
    def apply(model: torch.nn.Module, calls: list) -> None:
        model.get_submodule(path).register_forward_pre_hook(lambda m, args: calls.append(1) or (args[0] * factor,))

    return apply


def _parametrized(path: str) -> Callable:
    def apply(model: torch.nn.Module, calls: list) -> None:
        parametrize.register_parametrization(model.get_submodule(path), "weight", Double())

    return apply


def _weight_norm(path: str) -> Callable:
    def apply(model: torch.nn.Module, calls: list) -> None:
        torch.nn.utils.parametrizations.weight_norm(model.get_submodule(path))

    return apply


def _legacy_weight_norm(path: str) -> Callable:
    def apply(model: torch.nn.Module, calls: list) -> None:  # a pre-hook that recomputes the weight
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.nn.utils.weight_norm(model.get_submodule(path))

    return apply


CASES = {
    "hook on an FFN Linear": _scale_output("encoder.layer.1.intermediate.dense", 0.5),
    "hook on an output Linear": _scale_output("encoder.layer.0.output.dense", 1.5),
    "pre-hook on the query": _scale_input("encoder.layer.0.attention.self.query", 1.5),
    "hook on the value": _scale_output("encoder.layer.1.attention.self.value", -1.0),
    "hook on a LayerNorm": _scale_output("encoder.layer.0.attention.output.LayerNorm", 0.9),
    "hook on the word embeddings": _scale_output("embeddings.word_embeddings", 2.0),
    "pre-hook on the embeddings' LayerNorm": _scale_input("embeddings.LayerNorm", 0.5),
    "hook on the pooler's Linear": _scale_output("pooler.dense", 0.25),
    "hook on a whole layer": _scale_output("encoder.layer.0.intermediate", 0.5),
    "parametrized key": _parametrized("encoder.layer.1.attention.self.key"),
    "parametrized FFN Linear": _parametrized("encoder.layer.0.output.dense"),
    "weight norm": _weight_norm("encoder.layer.1.intermediate.dense"),
    "legacy weight norm": _legacy_weight_norm("encoder.layer.0.attention.self.value"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hooks_and_wrapped_modules_give_transformers_outputs(name: str) -> None:
    hf, fb = pair()
    theirs, mine = [], []
    CASES[name](hf, theirs)
    CASES[name](fb, mine)
    with torch.no_grad():
        assert_same(hf, fb)
    assert len(mine) == len(theirs)  # each hook ran once per forward, as in transformers
    said = fastbert.explain()
    assert "module by module, because" in said or "stands where" in said


def test_a_capturing_hook_on_the_embeddings_sees_transformers_shapes() -> None:
    """Activation capture (probes, Captum) on the word embeddings sees [B, S, E], as in transformers."""
    hf, fb = pair()
    seen: dict[str, list] = {"hf": [], "fb": []}
    for key, model in (("hf", hf), ("fb", fb)):
        model.embeddings.word_embeddings.register_forward_hook(lambda m, args, out, key=key: seen[key].append(out))
    with torch.no_grad():
        outputs(hf, 1), outputs(fb, 1)
    (theirs,), (mine,) = seen["hf"], seen["fb"]
    assert mine.shape == theirs.shape and torch.equal(mine, theirs)


def test_global_hooks_run_on_every_leaf() -> None:
    """A global forward hook (torch.nn.modules.module.register_module_forward_hook) sees every Linear run and can
    change its output, as in transformers."""

    def scale_linears(module: torch.nn.Module, args: tuple, out: object) -> object:
        return out * 1.01 if isinstance(module, torch.nn.Linear) else None

    hf, fb = pair()
    with torch.no_grad():
        plain_fb = outputs(fb)
        handle = torch.nn.modules.module.register_module_forward_hook(scale_linears)
        try:
            assert_same(hf, fb)
        finally:
            handle.remove()
        for before, after in zip(plain_fb, outputs(fb), strict=True):  # and the fast path comes back after
            torch.testing.assert_close(before, after, atol=0, rtol=0)


def test_training_through_a_parametrized_linear_gives_transformers_gradients() -> None:
    hf, fb = pair()
    for model in (hf, fb):
        parametrize.register_parametrization(model.encoder.layer[1].intermediate.dense, "weight", Double())
        model.train()
    ids, mask = batch()
    grads = []
    for model in (hf, fb):
        for _ in range(2):  # binds a plan, then runs it
            model.zero_grad()
            model(ids, attention_mask=mask).last_hidden_state[mask.bool()].square().sum().backward()
        original = model.encoder.layer[1].intermediate.dense.parametrizations.weight.original
        grads.append((original.grad, model.encoder.layer[0].attention.self.query.weight.grad))
    for theirs, mine in zip(*grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def _lora_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' and fastbert's models with the same LoRA adapters (random, so they change the outputs) on the
    attention's query and value and every FFN Linear, injected by peft."""
    peft = pytest.importorskip("peft")
    hf, fb = pair()
    config = dict(r=4, lora_alpha=8, target_modules=["query", "value", "intermediate.dense", "output.dense"],
                  init_lora_weights=False)  # fmt: skip
    for model in (hf, fb):
        peft.inject_adapter_in_model(peft.LoraConfig(**config), model)
    adapters = {k: v for k, v in hf.state_dict().items() if "lora_" in k}
    assert adapters and not fb.load_state_dict(adapters, strict=False).unexpected_keys
    return hf, fb


def test_peft_lora_adapters_run_merge_and_unmerge_as_in_transformers() -> None:
    from peft.tuners.lora import LoraLayer

    hf, fb = _lora_pair()
    with torch.no_grad():
        before = outputs(fb)
        assert_same(hf, fb)
        for model in (hf, fb):
            for module in model.modules():
                if isinstance(module, LoraLayer):
                    module.merge()
        assert_same(hf, fb)
        for model in (hf, fb):
            for module in model.modules():
                if isinstance(module, LoraLayer):
                    module.unmerge()
        for mine, unmerged in zip(outputs(fb), before, strict=True):
            torch.testing.assert_close(mine, unmerged, atol=ATOL, rtol=0)
    assert "stands where fastbert's Linear was" in fastbert.explain()


def test_peft_lora_trains_its_adapters_as_in_transformers() -> None:
    """The usual LoRA fine-tune: base weights frozen, adapters trained; their gradients equal transformers'."""
    hf, fb = _lora_pair()
    ids, mask = batch()
    grads = []
    for model in (hf, fb):
        model.train()
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
        for _ in range(2):
            model.zero_grad()
            model(ids, attention_mask=mask).last_hidden_state[mask.bool()].square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[1].keys() == grads[0].keys() and all(g is not None for g in grads[1].values())
    for name, theirs in grads[0].items():
        torch.testing.assert_close(grads[1][name], theirs, atol=1e-4, rtol=1e-4, msg=name)


def test_a_captum_attribution_on_the_embeddings_equals_transformers() -> None:
    """Captum's LayerIntegratedGradients on the word embeddings (it hooks their output): the same attributions, of
    transformers' shape."""
    captum = pytest.importorskip("captum.attr")
    ids, mask = batch()
    attributions = []
    for model in pair():

        def forward(ids: torch.Tensor, mask: torch.Tensor, model: torch.nn.Module = model) -> torch.Tensor:
            return model(ids, attention_mask=mask).pooler_output[:, 0]

        lig = captum.LayerIntegratedGradients(forward, model.embeddings.word_embeddings)
        attributions.append(lig.attribute(ids, torch.zeros_like(ids), additional_forward_args=(mask,), n_steps=8))
    theirs, mine = attributions
    assert mine.shape == theirs.shape == (*ids.shape, TINY["hidden_size"])
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


def _cpu_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """fastbert's own GEMMs (packed weights) where the native extension is built, else the default path."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")


def test_load_state_dict_into_inference_tensors_is_read_by_the_next_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's hot reload: a model made under inference_mode (its weights have no version counter) loads new
    weights in place; the fused QKV copy and the packed GEMM weights built from the old ones are not reused."""
    _cpu_fast_path(monkeypatch)
    hf, _ = pair()
    with torch.inference_mode():
        fb = fastbert.BertModel.from_hf(hf).eval()
        new = {k: v * 0.5 if k.endswith("weight") and v.dim() == 2 else v for k, v in fb.state_dict().items()}
        outputs(fb)
        fb.load_state_dict(new)
        mine = outputs(fb)
    expected = fastbert.BertModel.from_hf(hf).eval()
    expected.load_state_dict(new)
    with torch.no_grad():
        for a, b in zip(mine, outputs(expected), strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("route", ["data", "numpy"])
def test_edits_behind_torchs_back_are_read_after_weights_changed(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`param.data` edited in place or a NumPy view written bump no version counter: BertModel.weights_changed() is
    the one call that says so, and the next forward reads them."""
    _cpu_fast_path(monkeypatch)
    _, fb = pair()
    with torch.no_grad():
        outputs(fb)
        for weight in (fb.encoder.layer[0].attention.self.query.weight, fb.encoder.layer[1].output.dense.weight):
            if route == "data":
                weight.data.mul_(0.5)
            else:
                weight.detach().numpy()[:] *= 0.5
        fb.weights_changed()
        mine = outputs(fb)
        fresh = fastbert.BertModel(fb.config).eval()
        fresh.load_state_dict(fb.state_dict())
        for a, b in zip(mine, outputs(fresh), strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
