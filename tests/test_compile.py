"""torch.compile of a fastbert model: the fused kernels are torch custom ops (native CPU kernels forward only; Triton
kernels with a backward op registered as their gradient), so dynamo traces through them instead of breaking the graph
at each one. Compiled outputs and gradients match eager (DESIGN.md: fp32 atol 1e-5)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import NATIVE_CPU, NATIVE_CPU_REASON, ragged_batch, tiny_bert
from kernel_checks import requires_triton
from torch._dynamo.utils import counters

from fastbert import kernels, ops

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _batch(device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    ids, mask, types = ragged_batch(120, 3, 9, torch.Generator().manual_seed(1))
    return {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, token_type_ids=types).items()}


def _valid(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return out[mask.bool()]


def _train_step(model: torch.nn.Module, run, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = run(**batch).last_hidden_state
    loss = _valid(out, batch["attention_mask"]).pow(2).mean()
    loss.backward()
    # a parameter the loss does not reach (the pooler) has no grad in eager, a zero grad from a compiled graph
    return loss.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.skipif(NATIVE_CPU is None, reason=f"native CPU extension unavailable: {NATIVE_CPU_REASON}")
def test_native_custom_ops_have_matching_fake_implementations() -> None:
    x, bias, res = torch.randn(5, 12), torch.randn(12), torch.randn(5, 12)
    ids, pos = torch.randint(0, 20, (2, 3)), torch.arange(3).expand(2, 3)
    tables = torch.randn(20, 12), torch.randn(4, 12), torch.randn(2, 12)
    qkv, cu = torch.randn(5, 3, 2, 6), torch.tensor([0, 2, 5], dtype=torch.int32)
    ops = torch.ops.fastbert
    for op, args in (
        (ops.native_bias_act, (x, bias, "gelu")),
        (ops.native_bias_residual_layernorm, (x, bias, res, bias, bias, 1e-5)),
        (ops.native_embedding_layernorm, (ids, pos % 2, pos, *tables, bias, bias, 1e-5, None)),
        (ops.native_embedding_layernorm, (None, pos % 2, pos, *tables, bias, bias, 1e-5, torch.randn(2, 3, 12))),
        (ops.native_attention, (qkv, cu, 3, 0.4)),
    ):
        torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))


def test_compiled_inference_matches_eager_without_graph_breaks_in_the_encoder() -> None:
    model, batch = tiny_bert(), _batch()
    with torch.no_grad():
        eager = model(**batch).last_hidden_state
        compiled = torch.compile(model, backend="aot_eager")(**batch).last_hidden_state
    mask = batch["attention_mask"]
    torch.testing.assert_close(_valid(compiled, mask), _valid(eager, mask), atol=ATOL, rtol=0)
    breaks = counters["graph_break"]
    assert all("aten._local_scalar_dense" in reason for reason in breaks), f"graph breaks: {dict(breaks)}"
    with torch.no_grad():  # where: dynamo resumes the frames around it, so the one sync counts once per frame
        places = {
            (b.user_stack[-1].name, b.user_stack[-1].lineno)
            for b in torch._dynamo.explain(model)(**batch).break_reasons
        }
    assert {name for name, _ in places} == {"unpad_and_read"} and len(places) == 1, (
        f"more breaks than the unpad host sync: {places}"
    )


def test_compiled_encoder_is_one_graph() -> None:
    """The encoder (every layer's fused ops and GEMMs) traces whole: zero graph breaks, fullgraph compiles."""
    from fastbert.padding import unpad

    model, batch = tiny_bert(), _batch()
    mask = batch["attention_mask"]
    packing = unpad(mask, *mask.shape, mask.device)
    with torch.no_grad():
        x = model.embeddings(packing.pack(batch["input_ids"]), packing.pack(batch["token_type_ids"]),
                             packing.pack(torch.arange(9).expand(3, 9)))  # fmt: skip
        eager = model.encoder(x, packing)[0]
        compiled = torch.compile(model.encoder, fullgraph=True, backend="eager")(x, packing)[0]
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(compiled, eager, atol=ATOL, rtol=0)


def test_compiled_training_step_matches_eager() -> None:
    model = tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
    batch = _batch()
    loss, grads = _train_step(model, model, batch)
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):  # the second step runs the cached graph
        closs, cgrads = _train_step(model, compiled, batch)
        torch.testing.assert_close(closs, loss, atol=ATOL, rtol=0)
        for c, e in zip(cgrads, grads, strict=True):
            torch.testing.assert_close(c, e, atol=ATOL, rtol=0)


def _head_batch(kind: str, seed: int, batch: int, seqlen: int) -> dict[str, torch.Tensor]:
    ids, mask, types = ragged_batch(120, batch, seqlen, torch.Generator().manual_seed(seed))
    out = dict(input_ids=ids, attention_mask=mask, token_type_ids=types)
    if kind == "mlm":
        masked = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.6
        out["labels"] = ids.masked_fill(masked, -100)
    elif kind == "seqcls":
        out["labels"] = torch.arange(batch) % 2
    return out


def _compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("kind", ["base", "mlm", "seqcls"])
def test_whole_model_and_heads_compile_once_per_mode(kind: str) -> None:
    """torch.compile of a whole model or head: training steps and inference match eager, and a repeated batch (or a
    mode seen before) compiles nothing new: the plan's bookkeeping and the dispatch's caches are never guards that
    change from call to call (before: the plan's first-forward recording, its binding and the backends' caches
    recompiled the forward on the 2nd and 3rd calls, on the way to dynamo's recompile limit)."""
    from fastbert import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=78, num_hidden_layers=2, num_attention_heads=3,
                        intermediate_size=160, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    model = {"base": BertModel, "mlm": BertForMaskedLM, "seqcls": BertForSequenceClassification}[kind](config).train()
    compiled = torch.compile(model, backend="aot_eager")

    def step(run: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = run(**batch)
        loss = out.loss if kind != "base" else _valid(out.last_hidden_state, batch["attention_mask"]).pow(2).mean()
        loss.backward()
        return loss.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]

    first, second = _head_batch(kind, 1, 3, 9), _head_batch(kind, 2, 4, 12)
    for batch in (first, second):
        loss, grads = step(model, batch)
        closs, cgrads = step(compiled, batch)
        torch.testing.assert_close(closs, loss, atol=ATOL, rtol=0)
        for c, e in zip(cgrads, grads, strict=True):  # relative too: an MLM head's gradients reach ~20 in fp32
            torch.testing.assert_close(c, e, atol=ATOL, rtol=1e-5)
    trained = _compiled_graphs()
    for batch in (first, second, first):
        step(compiled, batch)
    assert _compiled_graphs() == trained, "a training step on a batch seen before compiled again"
    model.eval()
    with torch.no_grad():
        eager = model(**first)
        out = compiled(**first)
        evaluated = _compiled_graphs()
        compiled(**first)
        compiled(**second)
        compiled(**first)
    assert _compiled_graphs() == evaluated, "an inference call on a batch seen before compiled again"
    field = "last_hidden_state" if kind == "base" else "logits"
    torch.testing.assert_close(getattr(out, field), getattr(eager, field), atol=ATOL, rtol=0)
    breaks = counters["graph_break"]
    assert all("aten._local_scalar_dense" in reason for reason in breaks), f"graph breaks: {dict(breaks)}"


def test_capability_probes_never_run_inside_a_trace() -> None:
    """The CPU probes (a timed bf16 GEMM, oneDNN's bf16 prepack) run eagerly, once, even when the first call that asks
    is traced: traced, their timing broke the graph and inductor failed lowering the probe's oneDNN GEMM
    (LoweringException on mkldnn._linear_pointwise: the distillation step's compiled teacher)."""
    from fastbert import capabilities

    if capabilities.forced_isa() is not None:
        pytest.skip(f"{capabilities.FORCE_ENV} is set: the bf16 probe does not run")
    probes = (capabilities._try_onednn_bf16_prepack, capabilities._time_bf16_gemm)
    for probe in probes:
        probe.cache_clear()
    model, batch = tiny_bert(), _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(model, backend="aot_eager")(**batch)
    assert capabilities._time_bf16_gemm.cache_info().currsize == 1, "the probe did not run eagerly"
    breaks = counters["graph_break"]
    assert all("aten._local_scalar_dense" in reason for reason in breaks), f"graph breaks: {dict(breaks)}"


NO_CXX = shutil.which(os.environ.get("CXX", "g++")) is None


@pytest.mark.skipif(NO_CXX, reason="inductor's CPU backend needs a C++ compiler")
def test_inductor_compiles_the_distillation_step() -> None:
    """The MiniLM recipe's distillation step with the inductor backend (bf16 autocast on the CPU: the teacher's
    forward without grad, the student's training step) runs and matches eager within bf16's error (bench_train_step's
    'fastbert + compile' distillation row failed with InductorError: LoweringException)."""
    from fastbert import capabilities
    from fastbert.distill.losses import embedding_loss, mean_pool

    for probe in (capabilities._try_onednn_bf16_prepack, capabilities._time_bf16_gemm):
        probe.cache_clear()  # as in a fresh process: the traced teacher is the first to ask
    teacher, batch = tiny_bert(), _batch()
    student = tiny_bert(num_hidden_layers=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
    student.embeddings.requires_grad_(False)
    mask = batch["attention_mask"]

    def loss(t: torch.nn.Module, s: torch.nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                target = mean_pool(t(**batch)[0], mask)
            return embedding_loss(mean_pool(s(**batch)[0], mask), target, "cosine")

    compiled = loss(torch.compile(teacher), torch.compile(student))
    compiled.backward()
    eager = loss(teacher, student)
    torch.testing.assert_close(compiled.float(), eager.float(), atol=2e-2, rtol=0)
    assert all(p.grad is not None for p in student.encoder.parameters())


def _triton_case(device: torch.device | str) -> None:
    """Inference and a training step (dropout on: the seed drawn at run time follows torch.manual_seed) with every
    fused op forced onto the Triton kernels, compiled vs eager."""
    model = tiny_bert(backend="triton").to(device).train()
    batch = _batch(device)
    torch.manual_seed(3)
    loss, grads = _train_step(model, model, batch)
    compiled = torch.compile(model, backend="aot_eager")
    torch.manual_seed(3)
    closs, cgrads = _train_step(model, compiled, batch)
    torch.testing.assert_close(closs, loss, atol=ATOL, rtol=0)
    for c, e in zip(cgrads, grads, strict=True):
        torch.testing.assert_close(c, e, atol=ATOL, rtol=0)
    assert all("aten._local_scalar_dense" in reason for reason in counters["graph_break"]), counters["graph_break"]
    model.eval()
    with torch.no_grad():
        eager = model(**batch).last_hidden_state
        out = compiled(**batch).last_hidden_state
    torch.testing.assert_close(out, eager, atol=ATOL, rtol=0)


@requires_triton
def test_compiled_triton_kernels_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter case runs where there is no GPU (the gpu case covers CUDA)")
    _triton_case("cpu")


@pytest.mark.gpu
@requires_triton
def test_compiled_triton_kernels_on_gpu() -> None:
    _triton_case("cuda")


def test_inference_table_names_every_kernel_op() -> None:
    if kernels.unavailable_reason() is not None:
        pytest.skip(str(kernels.unavailable_reason()))
    assert set(kernels.INFERENCE) == set(ops.KERNEL_OPS)


@requires_triton
def test_the_triton_custom_ops_stay_those_fastbert_calls_after_transformers_looks_for_kernels() -> None:
    """transformers imports a top-level `kernels` to see whether the HF kernels package is installed. From the
    repository root that name was this repository's top-level kernels/ folder (now fastbert/kernels/): a second copy
    of fastbert.kernels, whose @custom_op redefinitions freed the fastbert::triton_* ops fastbert.kernels calls (a
    compiled Triton launch then read freed memory: the crashed worker in
    test_compiled_triton_kernels_under_the_interpreter). No `kernels` is found (looked up without importing it, so
    this test never makes the copy), transformers' probe says there is none, and each op fastbert.kernels calls is
    still the one torch has registered."""
    import importlib
    import importlib.util

    from torch._library.custom_ops import CustomOpDef

    assert importlib.util.find_spec("kernels") is None, "a folder of this repository imports as `kernels`"
    probe = pytest.importorskip("transformers.utils.import_utils").is_kernels_available
    probe.cache_clear()  # probe now, in this process, whatever an earlier import of transformers found
    assert not probe()
    ops = []
    for name in ("attention", "bias_act", "bias_residual_layernorm", "embedding"):
        module = importlib.import_module(f"fastbert.kernels.{name}")
        ops += [op for op in vars(module).values() if isinstance(op, CustomOpDef)]
    assert len(ops) == 8, [op._qualname for op in ops]  # a forward and a backward op per kernel
    stale = [op._qualname for op in ops if getattr(torch.ops.fastbert, op._name).default is not op._opoverload]
    assert not stale, f"redefined since fastbert.kernels defined them: {stale}"


def _pretrain_argv(tmp: Path) -> list[str]:
    docs = [f"Document {d} says the cat sat on mat {d}. The dog ran to park {d}. A bird flew." for d in range(12)]
    (tmp / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    return ["pretrain", "--train", str(tmp / "corpus.txt"), "--output-dir", str(tmp / "out"), "--vocab-size", "80",
            "--max-length", "24", "--batch-size", "4", "--layers", "1", "--hidden", "16", "--heads", "2",
            "--intermediate", "32", "--heldout-fraction", "0.2", "--max-steps", "2"]  # fmt: skip


def _distill_argv(tmp: Path) -> list[str]:
    from distill_tiny import corpus, make_teacher

    (tmp / "corpus.txt").write_text("\n".join(corpus(24)) + "\n")
    teacher = make_teacher(str(tmp / "teacher"), layers=2, hidden=16)
    return ["distill", teacher, str(tmp / "corpus.txt"), "--output", str(tmp / "out"), "--layers", "1",
            "--max-steps", "2", "--batch-size", "8"]  # fmt: skip


@pytest.mark.parametrize("command", ["pretrain", "distill"])
def test_cli_compile_flag_trains_through_torch_compile(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fastbert pretrain|distill --compile` runs its training steps through torch.compile with the backend asked
    for (aot_eager here: inductor takes minutes on 2 cores); the run ends and writes its model as without it."""
    from fastbert.cli import main

    backends: list[str] = []
    real = torch.compile

    def spy(model: torch.nn.Module, **kwargs: object) -> torch.nn.Module:
        backends.append(str(kwargs.get("backend")))
        return real(model, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    argv = _pretrain_argv(tmp_path) if command == "pretrain" else _distill_argv(tmp_path)
    assert main([*argv, "--compile", "--compile-backend", "aot_eager", "--precision", "fp32"]) == 0
    assert backends == ["aot_eager"]
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    final = tmp_path / "out" / ("final" if command == "pretrain" else "student")
    assert (final / "config.json").is_file()


@pytest.mark.parametrize(
    "module,argv",
    [
        ("fastbert.pretrain.cli", ["--train", "x.txt", "--output-dir", "o"]),
        ("fastbert.finetune.cli", ["sequence", "--model", "m", "--train", "t.csv", "--output-dir", "o"]),
        ("fastbert.distill.cli", ["teacher", "corpus.txt", "--output", "o"]),
    ],
)
def test_every_training_command_takes_the_compile_flags(module: str, argv: list[str]) -> None:
    """pretrain, finetune and distill parse --compile / --compile-backend; pretrain and finetune hand them to the
    loop's LoopConfig (distill to its DistillConfig, run above)."""
    import argparse
    import importlib

    from fastbert.train import LoopConfig, loop_options

    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(parser)
    args = parser.parse_args([*argv, "--compile"])
    assert args.compile is True and args.compile_backend == "inductor"
    if module != "fastbert.distill.cli":
        config = LoopConfig("o", **loop_options(args))
        assert config.compile and config.compile_backend == "inductor"
