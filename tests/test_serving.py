"""What serving code meets: a model built under inference mode, transformers 4's `head_mask`, a forced backend that
implements only some ops, and runs that must repeat bit for bit across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fastbert
from fastbert import BertConfig, BertModel, capabilities, ops

TINY = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(9)[None] < torch.tensor([9, 5, 0])[:, None]).long()
    return torch.randint(1, TINY["vocab_size"], mask.shape, generator=gen) * mask, mask


def test_a_model_built_under_inference_mode_runs_and_follows_weight_updates() -> None:
    ids, mask = batch()
    with torch.inference_mode():
        torch.manual_seed(0)
        model = BertModel(BertConfig(**TINY)).eval()
        first = model(ids, attention_mask=mask).last_hidden_state
        again = model(ids, attention_mask=mask).last_hidden_state
        model.encoder.layer[0].attention.self.query.weight.mul_(0.5)  # in place, inside inference mode
        model.encoder.layer[0].attention.self.query.weight = torch.nn.Parameter(
            model.encoder.layer[0].attention.self.query.weight * 2, requires_grad=False
        )  # new storage: the fused QKV cache must notice
        restored = model(ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(first).all() and torch.equal(first, again)
    assert torch.allclose(first, restored, atol=1e-6)


def test_head_mask_of_ones_is_accepted_and_anything_else_refused_clearly() -> None:
    torch.manual_seed(0)
    model = BertModel(BertConfig(**TINY)).eval()
    ids, mask = batch()
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).last_hidden_state
        ones = model(ids, attention_mask=mask, head_mask=torch.ones(2, 4)).last_hidden_state
        assert torch.equal(plain, ones)
        with pytest.raises(ValueError, match="head_mask"):
            model(ids, attention_mask=mask, head_mask=torch.tensor([[1.0, 0.0, 1.0, 1.0]] * 2))
        head = fastbert.BertForSequenceClassification(BertConfig(**TINY)).eval()
        with pytest.raises(ValueError, match="head_mask"):
            head(ids, attention_mask=mask, head_mask=torch.zeros(2, 4))


@pytest.mark.parametrize("name", ["onednn", "native"])
def test_a_forced_backend_runs_its_ops_and_leaves_the_others_to_the_automatic_choice(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FASTBERT_BACKEND=onednn (GEMMs and attention only) runs a whole model; explain() says what went where."""
    backend = ops.backends()[name]
    if backend.unavailable():
        pytest.skip(f"{name}: {backend.unavailable()}")
    torch.manual_seed(0)
    model = BertModel(BertConfig(**TINY)).eval()
    ids, mask = batch()
    with torch.no_grad(), fastbert.use_backend(name):
        forced = model(ids, attention_mask=mask).last_hidden_state
    with torch.no_grad(), fastbert.use_backend("torch"):
        plain = model(ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    assert (forced[valid] - plain[valid]).abs().max() <= 1e-5
    monkeypatch.setattr(ops, "_decisions", {})  # only this forward's decisions
    monkeypatch.setattr(ops, "_decisions_by_dtype", {})
    monkeypatch.setattr(ops, "_last_facts", {})
    with torch.no_grad(), fastbert.use_backend(name):
        BertModel(BertConfig(**TINY)).eval()(ids, attention_mask=mask)  # a model's first forward in a mode dispatches
    assert f"forced {name}):" in fastbert.explain()  # later ones run the plan bound from it (fastbert.execution)
    decisions = ops.decisions()
    assert {"linear", "embedding_layernorm", "attention"} <= set(decisions)
    for op, decision in decisions.items():
        expected = f"{name} (forced)" if op in backend.ops else f"(forced {name} implements no {op}: automatic choice)"
        assert expected in decision, (op, decision)


def test_a_fixed_gemm_choice_repeats_bit_for_bit_across_processes() -> None:
    """FASTBERT_CPU_GEMM=gemm|onednn|torch skips the first-use timing, so every process runs the same GEMMs."""
    code = (
        "import torch, fastbert, sys\n"
        "torch.manual_seed(0)\n"
        f"m = fastbert.BertModel(fastbert.BertConfig(**{TINY!r})).eval()\n"
        "ids = torch.randint(1, 99, (3, 40), generator=torch.Generator().manual_seed(1))\n"
        "with torch.no_grad(): out = m(ids).last_hidden_state\n"
        "sys.stdout.write(out.numpy().tobytes().hex())\n"
    )
    for choice in ("gemm", "onednn", "torch"):
        env = {**os.environ, "FASTBERT_CPU_GEMM": choice}
        runs = [
            subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
            for _ in range(2)
        ]
        assert runs[0] and runs[0] == runs[1], choice


def test_importing_fastbert_leaves_onednn_caches_to_the_user() -> None:
    """The caches are the whole process's: shrinking them made other torch work evict fastbert's GEMMs every pass."""
    code = "import os, fastbert; print([os.environ.get(name) for name in fastbert.capabilities.ONEDNN_CACHE_ENV])"
    env = {k: v for k, v in os.environ.items() if k not in capabilities.ONEDNN_CACHE_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[None, None]"
    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "8"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['8', None]"


def test_config_backend_names_come_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = ops.Backend("mine", devices=("cpu",), dtypes=(torch.float32,), module="fastbert.reference")
    with pytest.raises(ValueError, match="backend must be None, 'auto' or one of"):
        BertConfig(**TINY, backend="mine")
    monkeypatch.setitem(ops._BACKENDS, "mine", extra)
    assert BertConfig(**TINY, backend="mine").backend == "mine"


def test_config_backend_onednn_forces_it_and_no_other_name_means_it(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = BertModel(BertConfig(**TINY, backend="onednn")).eval()
    ids, mask = batch()
    monkeypatch.setattr(ops, "_decisions", {})
    monkeypatch.setattr(ops, "_decisions_by_dtype", {})
    monkeypatch.setattr(ops, "_last_facts", {})
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert ops.decisions()["linear"] == "onednn (forced)"
    assert ops.canonical("onednn") == "onednn" and ops.canonical("auto") is None
    # no aliases: `cpu` was onednn's name once, and read as "every op on the CPU" it misled
    with pytest.raises(ValueError, match="backend must be None, 'auto' or one of"):
        BertConfig(**TINY, backend="cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        ops.use_backend("cpu")
