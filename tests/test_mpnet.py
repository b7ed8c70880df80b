"""MPNet's relative position bias against transformers: the buckets and the distance table are bitwise transformers',
sequences far longer than the bucket range on every backend and executor (loop, CPU layer stack, graph replay), left
padding, the gradient of the bias table, and the refusals (a mask with gaps, too few buckets).
tests/test_families.py runs MPNet through every family check (heads, checkpoints both ways, ONNX, int8, bf16)."""

from __future__ import annotations

import pytest
import torch
import transformers

import fastbert
from fastbert import relative_positions
from fastbert.execution import stack as layer_stack
from tests.conftest import NATIVE_CPU
from tests.test_graph_buckets import RerunGraphs

ATOL = 1e-5
LENGTHS = [300, 0, 1, 150, 129]  # past max_distance (128) both ways, an empty row, one token


def hf_mpnet(**extra) -> transformers.MPNetModel:
    """Hidden 78 (head dim 26), 3 layers, a bias table large enough to matter (std 1 instead of 0.02)."""
    config = transformers.MPNetConfig(
        vocab_size=99, hidden_size=78, num_attention_heads=3, num_hidden_layers=3, intermediate_size=37,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=320, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MPNetModel(config).eval()
    with torch.no_grad():
        model.encoder.relative_attention_bias.weight.normal_()
    return model


def ragged(lengths: list[int], left: bool = False, pad: int = 1, vocab: int = 99) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids in [4, vocab) padded with `pad` (MPNet's 1), right or left, and the mask."""
    seqlen = max(lengths)
    positions = torch.arange(seqlen)[None]
    length = torch.tensor(lengths)[:, None]
    mask = (positions >= seqlen - length) if left else (positions < length)
    ids = torch.randint(4, vocab, mask.shape, generator=torch.Generator().manual_seed(1))
    return ids.masked_fill(~mask, pad), mask.long()


def backend_errors(
    backend: str, fast: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[float, float]:
    """hidden_states_error on the batch and on its first row alone, with `backend` forced; skips where it cannot run."""
    try:
        with fastbert.use_backend(backend):
            return hidden_states_error(fast, hf, ids, mask), hidden_states_error(fast, hf, ids[:1], mask[:1])
    except fastbert.BackendUnavailable as exc:
        pytest.skip(f"{backend} cannot run here: {exc}")


def hidden_states_error(fast: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> float:
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        got = fast(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    valid = mask.bool()
    return max((a[valid] - b[valid]).abs().max().item() for a, b in zip(got, want, strict=True))


def test_buckets_and_table_are_transformers_bitwise() -> None:
    distance = torch.arange(-1000, 1001)
    want = transformers.models.mpnet.modeling_mpnet.MPNetEncoder.relative_position_bucket(distance)
    assert torch.equal(relative_positions.relative_buckets(distance), want)
    hf = hf_mpnet()
    x = torch.zeros(1, 300, 78)
    table = relative_positions.bias_table(hf.encoder.relative_attention_bias.weight)
    dense = relative_positions.dense_bias(table, 300)
    assert torch.equal(dense, hf.encoder.compute_position_bias(x)[0])  # clamping at +-128 loses nothing


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_long_ragged_batches_match_on_every_backend(backend: str) -> None:
    hf = hf_mpnet()
    fast = fastbert.optimize(hf)
    lengths = LENGTHS if backend != "triton" else [140, 0, 1, 17]  # the interpreter is slow: one row past 128
    error, single = backend_errors(backend, fast, hf, *ragged(lengths))  # single: a batch of one
    assert error <= ATOL and single <= ATOL


def test_left_padding_matches() -> None:
    hf = hf_mpnet()
    ids, mask = ragged([40, 7, 33], left=True)
    assert hidden_states_error(fastbert.optimize(hf), hf, ids, mask) <= ATOL


@pytest.mark.skipif(NATIVE_CPU is None, reason="native CPU extension unavailable")
def test_the_layer_stack_and_graph_replay_add_the_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without hidden states asked for, the CPU layer stack runs the layers with the table; a (CPU stand-in) graph
    replays it; both give transformers' output."""
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    hf = hf_mpnet()
    ids, mask = ragged(LENGTHS)
    valid = mask.bool()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).last_hidden_state[valid]
    fast = fastbert.optimize(hf)
    before = layer_stack._status["stacked"]
    with torch.inference_mode():
        for _ in range(2):
            got = fast(ids, attention_mask=mask).last_hidden_state[valid]
    assert layer_stack._status["stacked"] >= before + 1
    assert (got - want).abs().max() <= ATOL
    replay_matches(hf, ids, mask, want)


def replay_matches(hf: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, want: torch.Tensor) -> None:
    """fastbert.optimize(hf) under (CPU stand-in) graph capture: one capture, and a replay within ATOL of `want`
    (transformers' last hidden state at the valid positions)."""
    graphed = fastbert.optimize(hf)
    graphed.cuda_graphs = RerunGraphs(graphed)
    captured = RerunGraphs.captures
    with torch.inference_mode():
        for _ in range(3):  # binds, captures, replays
            got = graphed(ids, attention_mask=mask).last_hidden_state[mask.bool()]
    assert RerunGraphs.captures == captured + 1 and (got - want).abs().max() <= ATOL


def test_the_bias_table_gets_transformers_gradient() -> None:
    hf = hf_mpnet()
    fast = fastbert.optimize(hf, freeze=False).train()
    hf.train()
    ids, mask = ragged([150, 20, 1])
    grads = []
    for model, table in ((hf, hf.encoder.relative_attention_bias), (fast, fast.encoder.relative_attention_bias)):
        out = model(ids, attention_mask=mask).last_hidden_state
        (out * mask[..., None]).square().sum().backward()
        grads.append(table.weight.grad)
    assert grads[1] is not None and grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=1e-4)


def test_a_mask_with_gaps_is_refused() -> None:
    hf = hf_mpnet()
    ids, mask = ragged([9, 9])
    mask[0, 4] = 0  # a zero between ones: transformers counts it in the distances, packing would not
    with pytest.raises(ValueError, match="zeros between the ones"):
        fastbert.optimize(hf)(ids, attention_mask=mask)


def test_too_few_buckets_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="relative_attention_num_buckets must be an integer >= 32"):
        fastbert.MPNetConfig(relative_attention_num_buckets=16)
    config = fastbert.MPNetConfig(relative_attention_num_buckets=40)  # a larger table: only 32 rows are read
    assert fastbert.MPNetModel(config).encoder.relative_attention_bias.weight.shape == (40, 12)
    assert "type_vocab_size" not in config.to_dict()


def compile_matches_eager(fast: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, table: str) -> None:
    """torch.compile of `fast` (aot_eager): inference within ATOL of eager with graph breaks at the unpad sync only;
    a training step's loss and the gradient of the relative table `table` (a parameter name) match eager."""
    from torch._dynamo.utils import counters

    valid = mask.bool()
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        eager = fast(ids, attention_mask=mask).last_hidden_state
        compiled = torch.compile(fast, backend="aot_eager")(ids, attention_mask=mask).last_hidden_state
    assert (compiled[valid] - eager[valid]).abs().max() <= ATOL
    assert all("aten._local_scalar_dense" in reason for reason in counters["graph_break"]), dict(
        counters["graph_break"])  # fmt: skip
    fast.train()
    weight = dict(fast.named_parameters())[table]
    grads = []
    for run in (fast, torch.compile(fast, backend="aot_eager")):
        fast.zero_grad()
        loss = (run(ids, attention_mask=mask).last_hidden_state * mask[..., None]).square().sum()
        loss.backward()
        grads.append((loss.detach(), weight.grad.clone()))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], atol=1e-4, rtol=1e-4)


def test_torch_compile_inference_and_training_match_eager() -> None:
    """torch.compile of an MPNet: inference breaks at the unpad sync only, and a training step's loss and the bias
    table's gradient match eager."""
    ids, mask = ragged([140, 20, 1])
    fast = fastbert.optimize(hf_mpnet(), freeze=False)
    compile_matches_eager(fast, ids, mask, "encoder.relative_attention_bias.weight")
