"""The encoder's later layers in one native call (fastbert.execution.stack): bitwise the per-op path's output, fp32 and
int8, on every ISA this CPU runs; op by op, with the reason in explain(), whenever the call could differ from the per-op
path (hooks, grad, a backend it has no kernel of, hidden states asked for); bad arguments to the native entry raise."""

from __future__ import annotations

import copy

import pytest
import torch

import fastbert
from fastbert import BertModel, capabilities, ops
from fastbert.backends import gemm, int8, native, onednn, timing
from fastbert.execution import stack as layer_stack
from tests.conftest import NATIVE_CPU, NATIVE_CPU_REASON, busy_spell, tiny_bert
from tests.kernel_checks import assert_close

pytestmark = pytest.mark.skipif(NATIVE_CPU is None, reason=f"native CPU extension unavailable: {NATIVE_CPU_REASON}")


def tiny_model(act: str = "gelu") -> BertModel:
    """Three layers (two stacked), no dropout (a layer in training mode still computes the same)."""
    return tiny_bert(num_hidden_layers=3, hidden_act=act, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def ragged_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 120, (4, 19), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 1:] = 0
    mask[3, :] = 0  # an empty sequence: cu_seqlens repeats a bound
    return ids, mask


def run(model: BertModel, stacked: bool, monkeypatch: pytest.MonkeyPatch, **kwargs) -> tuple[torch.Tensor, bool]:
    """last_hidden_state with the stack on or off, and whether this forward stacked its layers."""
    monkeypatch.setenv("FASTBERT_LAYER_STACK", "1" if stacked else "0")
    ids, mask = ragged_batch()
    before = layer_stack._status["stacked"]
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, **kwargs).last_hidden_state
    return out, layer_stack._status["stacked"] > before


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_stacked_layers_equal_the_per_op_path_bitwise(ext, act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")  # fastbert's GEMM without timing: the stack's precondition
    model = tiny_model(act=act)
    per_op, stacked_before = run(model, False, monkeypatch)
    stacked, ran = run(model, True, monkeypatch)
    assert not stacked_before and ran
    assert torch.equal(per_op, stacked)
    assert "layers 1-3 in one native call (every GEMM on gemm, attention on native;" in fastbert.explain()


def chunked_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """11 sequences of 0-40 tokens, 201 in all: enough for the native call to cut into chunks, the later ones no longer
    than 16 tokens, where the attention kernels' path changes (AMX tiles from 40 at head dim 32, bf16 pairs to 16)."""
    ids = torch.randint(1, 120, (11, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros_like(ids)
    for row, length in enumerate((40, 38, 36, 0, 12, 10, 14, 16, 9, 15, 11)):
        mask[row, :length] = 1
    return ids, mask


def cu_of(mask: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0)).to(torch.int32)


@pytest.mark.parametrize("quantize", [None, "int8", "bf16"])
@pytest.mark.parametrize("chunks", ["", "3", "1"])
def test_chunks_of_sequences_equal_the_per_op_path_bitwise(ext, quantize: str | None, chunks: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The native call's chunks of whole sequences, each through every layer on one thread (one per thread, 3, or the
    batch whole): every row bitwise the per-op path's, fp32, int8 and bf16 on fastbert's own GEMMs, on every ISA."""
    if quantize == "bf16" and not ext.has_bf16_linear():
        pytest.skip(f"bf16 GEMMs of fastbert's own need AMX tiles; {ext.isa()} has none")
    monkeypatch.setenv(layer_stack.CHUNKS_ENV, chunks)
    hidden, inner = 64, 96
    model = tiny_bert(num_hidden_layers=4, hidden_size=hidden, num_attention_heads=2, intermediate_size=inner,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    if quantize == "bf16":
        model = model.to(torch.bfloat16)
    elif quantize == "int8":
        model = fastbert.optimize(model, quantize="int8")
    ids, mask = chunked_batch()
    asked = int(chunks) if chunks else ext.threading()[0]
    starts = ext.sequence_chunks(cu_of(mask), hidden, inner, asked)
    assert len(starts) - 1 == asked  # the batch has sequences and tokens for as many as asked
    assert asked == 1 or max(mask[starts[-2]:].sum(1)) <= 16 < max(mask.sum(1))  # the last chunk's attention differs
    outs = []
    with ops.use_backend("int8" if quantize == "int8" else "gemm"), torch.inference_mode():
        for stacked in ("0", "1"):
            monkeypatch.setenv("FASTBERT_LAYER_STACK", stacked)
            outs.append(model(ids, attention_mask=mask).last_hidden_state)
    assert ext.encoder_layers_chunks() == asked
    assert (f"; the batch in {asked} chunks" if asked > 1 else "; the batch whole") in layer_stack.describe()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("policy", ["pool", "solo"], indirect=True)
def test_a_busy_spell_cuts_more_chunks_for_the_pool_to_share(ext, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a busy spell under the pool policy the batch is cut into up to four chunks a thread (a thread the OS runs
    less claims fewer), bitwise the per-op path's rows; under solo, or with no spell, one a thread."""
    monkeypatch.setenv(layer_stack.CHUNKS_ENV, "")
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the cut needs a second thread (this suite's workers run one)
    try:
        hidden, inner = 64, 96
        model = tiny_bert(num_hidden_layers=4, hidden_size=hidden, num_attention_heads=2, intermediate_size=inner,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
        ids, mask = chunked_batch()
        outs, used = [], []
        with ops.use_backend("gemm"), torch.inference_mode():
            for stacked, busy in (("0", False), ("1", False), ("1", True)):
                monkeypatch.setenv("FASTBERT_LAYER_STACK", stacked)
                native.set_busy_host_policy(policy if busy else "off")  # off: no spell, whatever the test load does
                if busy:
                    busy_spell()
                outs.append(model(ids, attention_mask=mask).last_hidden_state)
                used.append(ext.encoder_layers_chunks())
                words = layer_stack.describe()
        most = len(ext.sequence_chunks(cu_of(mask), hidden, inner, 8)) - 1
    finally:
        torch.set_num_threads(before)
    assert 2 < most <= 8
    assert used[1:] == [2, most if policy == "pool" else 2]
    assert ("claimed as threads come free (a busy spell" in words) == (policy == "pool")
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", ["pool"], indirect=True)
def test_a_busy_spell_cuts_onednn_layers_into_chunks_too(dtype: torch.dtype, policy: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """oneDNN's GEMMs run on torch's team, so with no spell the batch stays whole; in a busy spell it is cut like
    fastbert's own, each chunk's GEMMs one oneDNN call on its thread, under inference mode on every thread. oneDNN may
    round a chunk's rows differently: DESIGN's bound against the fp64 model (bf16: twice the whole batch's error)."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "onednn")
    monkeypatch.setenv("FASTBERT_LAYER_STACK", "1")
    monkeypatch.setenv(layer_stack.CHUNKS_ENV, "")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = tiny_bert(num_hidden_layers=4, hidden_size=64, num_attention_heads=2, intermediate_size=96,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
        ids, mask = chunked_batch()
        with torch.inference_mode():
            ref64 = copy.deepcopy(model).double()(ids, attention_mask=mask).last_hidden_state
            model = model.to(dtype)
            native.set_busy_host_policy("off")
            model(ids, attention_mask=mask)  # a model's first forward runs op by op
            whole = model(ids, attention_mask=mask).last_hidden_state
            used_whole = NATIVE_CPU.encoder_layers_chunks()
            native.set_busy_host_policy(policy)
            busy_spell()
            chunked = model(ids, attention_mask=mask).last_hidden_state
            used = NATIVE_CPU.encoder_layers_chunks()
    finally:
        torch.set_num_threads(before)
    assert used_whole == 1 and used > 2
    assert "every GEMM on onednn" in layer_stack.describe()
    real = mask.bool()
    lowp = whole[real] if dtype != torch.float32 else None
    assert_close(f"busy chunks, oneDNN {dtype}", chunked[real], ref64[real], lowp)


def test_sequences_cut_into_chunks_of_equal_work() -> None:
    """Chunks of whole, consecutive sequences, no more than asked, each of 48 tokens at least, each cut at the sequence
    boundary nearest an equal share of the work where the 48 tokens allow it, else later (never earlier)."""
    lengths = torch.tensor([3, 120, 7, 7, 64, 0, 30, 30, 30, 200, 9, 1, 40, 8])
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    hidden, inner = 384, 1536
    work = (lengths * (4 * hidden + 2 * inner + 2 * lengths)).double()
    before = torch.nn.functional.pad(work.cumsum(0), (1, 0))  # work before each sequence
    for asked in (1, 2, 3, 4, 8, 100):
        starts = NATIVE_CPU.sequence_chunks(cu, hidden, inner, asked)
        assert starts[0] == 0 and starts[-1] == len(lengths) and starts == sorted(set(starts))
        assert 1 < len(starts) - 1 <= asked if asked > 1 else starts == [0, len(lengths)]
        assert all(cu[b] - cu[a] >= 48 for a, b in zip(starts, starts[1:], strict=False))
        for i, cut in enumerate(starts[1:-1], 1):
            off = (before - work.sum() * i / asked).abs()  # each boundary's distance from the equal share
            nearest = int(off.argmin())
            allowed = nearest > starts[i - 1] and min(cu[nearest] - cu[starts[i - 1]], cu[-1] - cu[nearest]) >= 48
            assert cut == nearest if allowed else cut > nearest
    sixes = torch.arange(0, 140, 20, dtype=torch.int32)  # six sequences of 20 tokens: two chunks of 48+ at most
    assert NATIVE_CPU.sequence_chunks(sixes, hidden, inner, 4) == [0, 3, 6]
    assert NATIVE_CPU.sequence_chunks(sixes[:6], hidden, inner, 4) == [0, 5]  # 100 tokens: 60 + 40 or 40 + 60
    assert NATIVE_CPU.sequence_chunks(torch.tensor([0, 500], dtype=torch.int32), hidden, inner, 4) == [0, 1]


@pytest.mark.parametrize("hidden", [78, 128])
def test_int8_layers_stack_with_their_int8_kernels(ext, hidden: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bitwise the per-op path, where the stack's int8 quad GEMMs take the rows the LayerNorm before quantised: at
    hidden 78 on VNNI tiles, at 128 (K a multiple of 64, 27 tokens: one short block) on AMX tiles where there are."""
    model = fastbert.optimize(tiny_bert(num_hidden_layers=4, hidden_size=hidden, num_attention_heads=2,
                                        intermediate_size=2 * hidden, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0), quantize="int8")  # fmt: skip
    with ops.use_backend("int8"):  # every GEMM int8, whatever this CPU's timings say
        per_op, _ = run(model, False, monkeypatch)
        stacked, ran = run(model, True, monkeypatch)
    assert ran and "(every GEMM on int8, attention on native;" in layer_stack.describe()
    assert torch.equal(per_op, stacked)  # an fp32 GEMM, or rows quantised otherwise, would change the numbers


def test_each_gemm_keeps_the_backend_the_first_layer_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """An int8 model whose first-use verdicts kept two of the four GEMM shapes in fp32: the stack runs the same mix."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")  # the fp32 GEMMs on fastbert's kernel, untimed
    rows = int(ragged_batch()[1].sum())
    size = timing.size_class(rows), "float32"
    verdicts = {(234, 78, None, False, *size): (True, "int8 faster"), (78, 78, None, True, *size): (False, "slower"),
                (160, 78, "gelu", False, *size): (True, "int8 faster"), (78, 160, None, True, *size): (False, "slower")}
    monkeypatch.setattr(int8, "_verdicts", verdicts)
    model = fastbert.optimize(tiny_model(), quantize="int8")
    per_op, _ = run(model, False, monkeypatch)
    stacked, ran = run(model, True, monkeypatch)
    assert ran and torch.equal(per_op, stacked)
    assert "QKV on int8, attention out on gemm, FFN in on int8, FFN out on gemm" in layer_stack.describe()


def test_weights_changed_in_place_are_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    model = tiny_model()
    before, _ = run(model, True, monkeypatch)
    with torch.no_grad():
        model.encoder.layer[2].output.dense.weight.mul_(2.0)
        model.encoder.layer[1].attention.self.value.bias.add_(0.5)
    after, ran = run(model, True, monkeypatch)
    per_op, _ = run(model, False, monkeypatch)
    assert ran and torch.equal(after, per_op) and not torch.equal(after, before)


def _hook(model: BertModel, seen: list) -> None:
    model.encoder.layer[-1].intermediate.register_forward_hook(lambda module, args, out: seen.append(out.shape))


def _forward_override(model: BertModel, seen: list) -> None:  # as accelerate's hooks do: forward set on the instance
    inter = model.encoder.layer[2].intermediate
    inter.forward = lambda x, plain=inter.forward: seen.append(x.shape) or plain(x) * 0.5


def _float64_layernorm(model: BertModel, seen: list) -> None:
    model.encoder.layer[2].output.LayerNorm.double()


def _parametrized(model: BertModel, seen: list) -> None:
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    parametrize.register_parametrization(model.encoder.layer[1].output.dense, "weight", Doubled())


def _no_biases(model: BertModel, seen: list) -> None:
    for layer in model.encoder.layer:
        layer.output.dense.bias = None


@pytest.mark.parametrize(
    "setup, reason, calls",
    [
        (_hook, "BertIntermediate has forward hooks", 2),
        (_forward_override, "BertIntermediate runs another forward", 2),
        (lambda model, seen: model.encoder.layer[1].attention.self.train(), "BertSelfAttention is in training mode", 0),
        (_float64_layernorm, "not built like layer 1", 0),
        (_parametrized, "ParametrizedLinear stands where fastbert's Linear was", 0),
        (_no_biases, "plain weight and bias in every Linear", 0),
    ],
    ids=["hook", "forward-override", "training-submodule", "float64-layernorm", "parametrized", "no-biases"],
)
def test_layers_that_differ_run_op_by_op(setup, reason: str, calls: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each way a later layer could compute something else than the native call keeps the per-op path, which stays
    deterministic here (no dropout) so both forwards must agree; hooks and overrides run in both."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    model, seen = tiny_model(), []
    setup(model, seen)
    out, ran = run(model, True, monkeypatch)
    assert not ran and reason in fastbert.explain()
    per_op, _ = run(model, False, monkeypatch)
    assert torch.equal(out, per_op) and len(seen) == calls


def test_dropout_in_a_later_sublayer_keeps_it_random(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later layer's attention output in training mode, with dropout: the per-op path applies it, so must this."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    model = tiny_bert(num_hidden_layers=3, hidden_dropout_prob=0.5)
    model.encoder.layer[2].attention.output.train()
    first, ran = run(model, True, monkeypatch)
    second, _ = run(model, True, monkeypatch)
    assert not ran and "BertSelfOutput is in training mode" in fastbert.explain()
    assert not torch.equal(first, second)  # dropout drew different masks


def test_the_forward_that_times_a_gemm_shape_stacks_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """First use of a shape times fastbert's GEMM against the path without it (dispatched ops inside the op), on the
    first layer's own inputs in the loop: its GEMMs report the backend each took, not the ones the timing ran, so that
    forward stacks the layers after it, and the next one every layer."""
    monkeypatch.delenv("FASTBERT_CPU_GEMM", raising=False)
    monkeypatch.setattr(gemm, "_verdicts", {})

    def gemm_faster(*fns, repeats: int = 9) -> list[list[float]]:
        for fn in fns:
            fn()  # both paths run, the other through the dispatcher
        return [[1.0], [2.0]]

    monkeypatch.setattr(timing, "samples", gemm_faster)
    per_op, _ = run(tiny_model(), False, monkeypatch)
    model = tiny_model()
    run(model, True, monkeypatch)  # binds the plan (module by module)
    monkeypatch.setattr(gemm, "_verdicts", {})
    stacked, ran = run(model, True, monkeypatch)
    layer_shapes = {(234, 78, None, False), (78, 78, None, True), (160, 78, "gelu", False), (78, 160, None, True)}
    assert layer_shapes <= {key[:4] for key in gemm._verdicts}  # all four timed in this forward
    assert ran and torch.equal(per_op, stacked)
    assert "layers 2-3 in one native call" in layer_stack.describe()  # the first layer timed them in the loop
    again, ran = run(model, True, monkeypatch)
    assert ran and torch.equal(per_op, again)
    assert "layers 1-3 in one native call" in layer_stack.describe()  # settled: every layer in the native call


def test_the_first_layer_runs_the_ops_the_plan_bound_not_the_dispatchs_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan binds the GEMM ops to torch where its first forward found every GEMM faster there (a busy machine's
    verdicts, say); the dispatch may choose otherwise later. The stack's first layer runs the plan's ops, as the loop
    does, and so stays in the loop: bitwise the per-op output (the dispatch's choice differed by 4e-6 in fp32)."""
    monkeypatch.delenv("FASTBERT_CPU_GEMM", raising=False)

    def timed(gemm_s: float) -> None:  # fresh verdicts, each GEMM's first use timed at gemm_s against 1.5 s
        def samples(*fns, repeats: int = 9) -> list[list[float]]:
            for fn in fns:
                fn()
            return [[gemm_s], [1.5]]

        monkeypatch.setattr(timing, "samples", samples)
        monkeypatch.setattr(gemm, "_verdicts", {})
        monkeypatch.setattr(onednn, "_verdicts", {})

    timed(2.0)
    model = tiny_bert(num_hidden_layers=3, hidden_size=192, num_attention_heads=3, intermediate_size=768,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # K of 192 and 768: sums reorder
    run(model, False, monkeypatch)  # module by module, every GEMM on torch: the plan binds linear and the residual op
    timed(1.0)  # now fastbert's GEMM wins every shape
    per_op, _ = run(model, False, monkeypatch)
    stacked, ran = run(model, True, monkeypatch)
    assert not ran and "because the first layer ran its QKV GEMM on torch" in layer_stack.describe()
    assert torch.equal(per_op, stacked)


def test_grad_forced_backends_and_hidden_states_run_op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    monkeypatch.setenv("FASTBERT_LAYER_STACK", "1")
    model, (ids, mask) = tiny_model(), ragged_batch()
    before = layer_stack._status["stacked"]
    with torch.no_grad(), ops.use_backend("torch"):
        model(ids, attention_mask=mask)
    assert "stack: attention is not bound to the native kernel (bound to torch" in fastbert.explain()
    with torch.enable_grad():
        model(ids, attention_mask=mask)
        assert "stack: forward only" in fastbert.explain()  # its weights need grad
        model.embeddings.requires_grad_(False)  # fine-tuning the upper layers only
        model.encoder.layer[0].requires_grad_(False)
        out = model(ids, attention_mask=mask).last_hidden_state
    assert "(eval, with grad): one loop over the layers' tensors" in fastbert.explain()  # the stack records no autograd
    out.sum().backward()
    assert model.encoder.layer[1].output.dense.weight.grad is not None
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == 4 and layer_stack._status["stacked"] == before


def test_bad_native_arguments_raise() -> None:
    x, cu = torch.randn(5, 6), torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="16 tensors and eps 2 values per layer"):
        NATIVE_CPU.encoder_layers(x, cu, 5, 2, 1.0, [x] * 15, "gelu", [1e-12, 1e-12])
    with pytest.raises(ValueError, match="not a multiple of 4 heads"):
        NATIVE_CPU.encoder_layers(x, cu, 5, 4, 1.0, [], "gelu", [])
    with pytest.raises(ValueError, match="biases must have 3H, H, I and H elements"):
        NATIVE_CPU.encoder_layers(x, cu, 5, 2, 1.0, [x] * 16, "gelu", [1e-12, 1e-12])
    qkv_bias, bias = torch.zeros(18), torch.zeros(6)
    layer = [x, torch.empty(0), qkv_bias, x, torch.empty(0), bias, bias, bias, x, torch.empty(0), bias,
             x, torch.empty(0), bias, bias, bias]  # fmt: skip
    with pytest.raises(ValueError, match="packed must be"):
        NATIVE_CPU.encoder_layers(x, cu, 5, 2, 1.0, layer, "gelu", [1e-12, 1e-12])
    with pytest.raises(ValueError, match=r"chunks must be >= 0 \(0: one per thread\), got -1"):
        NATIVE_CPU.encoder_layers(x, cu, 5, 2, 1.0, [], "gelu", [], chunks=-1)
    with pytest.raises(ValueError, match="packed must be"):  # a bad GEMM inside a chunk raises on the calling thread
        NATIVE_CPU.encoder_layers(torch.randn(100, 6), torch.tensor([0, 50, 100], dtype=torch.int32), 50, 2, 1.0,
                                  layer, "gelu", [1e-12, 1e-12], chunks=2)  # fmt: skip


def test_a_bad_chunk_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    model = tiny_model()
    run(model, False, monkeypatch)  # the plan's first forward
    assert run(model, True, monkeypatch)[1]
    monkeypatch.setenv(layer_stack.CHUNKS_ENV, "two")
    with pytest.raises(ValueError, match="FASTBERT_STACK_CHUNKS='two': a count of chunks, 0 for one per thread"):
        run(model, True, monkeypatch)


def test_benchmark_times_both_paths_and_writes_its_table(tmp_path) -> None:
    """bench_layer_stack on one small shape: both paths timed (it checks they agree), JSON and Markdown written."""
    import json

    from benchmarks import bench_layer_stack

    assert bench_layer_stack.main(["--iters", "1", "--shapes", "2x5", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("layer_stack_cpu-*.json")).read_text())
    assert [(r["precision"], r["batch"], r["tokens"]) for r in doc["results"]] == [
        ("fp32", 2, 5), ("int8", 2, 5), ("bf16", 2, 5), ("bf16, FASTBERT_CPU_GEMM=onednn", 2, 5)]  # fmt: skip
    assert all(r["ms"]["op by op"] > 0 and r["ms"]["stacked"] > 0 for r in doc["results"])
    assert "| int8 | 2 x 5 |" in next(tmp_path.glob("layer_stack_cpu-*.md")).read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_gemms_stack_through_torch_registry(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose GEMMs run on oneDNN's prepacked weights (fp32, and bf16 models, which fastbert's own GEMMs do not
    take): the native call makes the onednn backend's calls itself, so the output is bitwise the per-op path's."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "onednn")  # oneDNN for every GEMM, untimed
    model = tiny_model().to(dtype)
    per_op, _ = run(model, False, monkeypatch)
    stacked, ran = run(model, True, monkeypatch)
    assert ran and "(every GEMM on onednn, attention on native;" in layer_stack.describe()
    assert per_op.dtype == dtype and torch.equal(per_op, stacked)


def test_an_untimed_onednn_row_cut_runs_the_first_layer_in_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN takes some bf16 GEMMs in row parts, where those were timed faster at the row count (onednn.row_parts, in
    the GEMM's call): a forward at a row count whose cut is not timed yet runs the first layer in the loop, which times
    it, and the layers after it in the native call; the next forward sends every layer there. Both are bitwise the
    per-op path's."""
    if onednn.gemm_dtype(torch.bfloat16) != torch.bfloat16:
        pytest.skip("oneDNN runs bf16 GEMMs in fp32 on this CPU: nothing is cut into row parts")
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "onednn")
    monkeypatch.setattr(onednn, "_splits", {})
    found = capabilities.Finding(True, "set by the test: halves win on some row counts here, as with AMX")
    monkeypatch.setattr(capabilities, "onednn_bf16_row_cuts", lambda: found)

    def parts_faster(*fns, repeats: int = 9) -> list[list[float]]:
        for fn in fns:
            fn()
        return [[1.0], [2.0]]

    monkeypatch.setattr(timing, "samples", parts_faster)
    model = tiny_model().to(torch.bfloat16)

    def forward(stacked: bool, rows: int) -> torch.Tensor:
        monkeypatch.setenv("FASTBERT_LAYER_STACK", "1" if stacked else "0")
        ids = torch.randint(1, 120, (10, rows // 10), generator=torch.Generator().manual_seed(7))
        with torch.inference_mode():
            return model(ids, attention_mask=torch.ones_like(ids)).last_hidden_state

    forward(True, 300)  # binds the plan module by module, timing the cuts at its row count
    timed = set(onednn._splits)
    rows = 280  # a row count of its own (cut from 256 rows)
    first = forward(True, rows)
    assert "layers 2-3 in one native call (every GEMM on onednn" in layer_stack.describe()
    assert set(onednn._splits) > timed  # its cuts, timed by the first layer in the loop
    again = forward(True, rows)
    assert "layers 1-3 in one native call (every GEMM on onednn" in layer_stack.describe()
    per_op = forward(False, rows)
    assert torch.equal(first, per_op) and torch.equal(again, per_op)
