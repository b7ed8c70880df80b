"""Row buckets (fastbert.execution.rows): token counts rounded up where oneDNN compiles a GEMM per row count. Every
real token's output and hidden state is the one the call computes unbucketed, on every family the loop runs (BERT
through the layer stack and the loop, MPNet's bias table, DeBERTa's position scores, GTE's rotary tables), on ragged
batches with a fully padded row and a batch of 1; the decision says why in each mode."""

from __future__ import annotations

import copy

import pytest
import torch

import fastbert
from fastbert import capabilities
from fastbert.execution import rows
from fastbert.execution.mode import Mode
from tests.conftest import tiny_bert
from tests.test_families import hf_model as family_model

ATOL = 1e-5  # DESIGN's fp32 rule: each path against the reference within 1e-5


def test_buckets_are_eight_steps_per_octave_in_multiples_of_16() -> None:
    totals = range(0, 5000)
    buckets = [rows.bucket(t) for t in totals]
    assert buckets[0] == 0
    for total, b in zip(totals, buckets, strict=True):
        assert b >= total and b % 16 == 0 and rows.bucket(b) == b
        assert b - total < max(16, total / 8)  # at most 12.5% more rows (16 below 128 tokens)
    assert all(a <= b for a, b in zip(buckets, buckets[1:], strict=False))
    for low in (128, 256, 512, 1024, 2048):
        assert len({rows.bucket(t) for t in range(low + 1, 2 * low + 1)}) == 8


def test_the_probe_times_row_counts_no_bucket_has() -> None:
    """Its 'new' row counts must be ones the loop never compiles, or a process that ran the loop first finds them
    cached and reads no cost."""
    assert all(rows.bucket(r) != r for r in capabilities._ROW_PROBE_FRESH + (capabilities._ROW_PROBE_PRIME,))
    finding = capabilities.new_row_count_cost(torch.float32)
    assert "float32 GEMM at a new row count took" in finding.why


def _mode(device: str = "cpu", dtype: torch.dtype = torch.float32, grad: bool = False, training: bool = False) -> Mode:
    return Mode(torch.device(device), dtype, None, grad, training, None, frozenset(), frozenset(), False)


def test_the_decision_says_why_in_each_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rows.ENV, raising=False)
    costly = capabilities.Finding(True, "a new row count took 9x")
    cheap = capabilities.Finding(False, "a new row count took 1.2x")
    onednn, own = {"linear": frozenset({"onednn"})}, {"linear": frozenset({"int8"}), "dense_residual_layernorm":
                                                       frozenset({"gemm", "int8"})}  # fmt: skip
    monkeypatch.setattr(capabilities, "new_row_count_cost", lambda dtype: costly)
    assert rows._decide(_mode(), onednn) == (True, f"{costly.why}: row counts rounded up to eight steps per octave")
    assert rows._decide(_mode(), {"linear": frozenset({"gemm", "onednn"})})[0] is True
    assert rows._decide(_mode("cuda"), onednn)[0] is False
    assert "inference only" in rows._decide(_mode(training=True), onednn)[1]
    assert "inference only" in rows._decide(_mode(grad=True), onednn)[1]
    assert rows._decide(_mode(), own) == (False, "the first forward's GEMMs ran on gemm and int8, which compile "
                                                 "nothing per row count")  # fmt: skip
    assert rows._decide(_mode(dtype=torch.float16), onednn)[0] is False
    monkeypatch.setattr(capabilities, "new_row_count_cost", lambda dtype: cheap)
    assert rows._decide(_mode(), onednn) == (False, f"{cheap.why}: row counts as they come")
    monkeypatch.setenv(rows.ENV, "1")
    assert rows._decide(_mode(), own) == (True, f"{rows.ENV}=1")
    assert rows._decide(_mode(training=True), onednn)[0] is False
    monkeypatch.setenv(rows.ENV, "0")
    monkeypatch.setattr(capabilities, "new_row_count_cost", lambda dtype: costly)
    assert rows._decide(_mode(), onednn) == (False, f"{rows.ENV}=0")


def test_a_plan_on_fastbert_gemms_is_not_bucketed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the first forward's GEMMs ran on, as the plan recorded it, decides: not a value the test makes up."""
    monkeypatch.delenv(rows.ENV, raising=False)
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "gemm")
    monkeypatch.setattr(capabilities, "new_row_count_cost", lambda dtype: capabilities.Finding(True, "costly"))
    ids, mask = _ragged(99, [5, 2], 5, 0)
    model = tiny_bert()
    with torch.inference_mode():
        for _ in range(2):
            model(ids, attention_mask=mask)
    assert "token rows not bucketed: the first forward's GEMMs ran on gemm, which compile nothing" in fastbert.explain()


def test_the_probe_leaves_the_callers_random_stream_alone() -> None:
    """It runs at a plan's first forward, mid-training too: a resumed run must draw what the uninterrupted one drew."""
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    capabilities._time_new_row_counts.__wrapped__(torch.float32)
    assert torch.equal(torch.rand(3), expected)


def _runs(model: torch.nn.Module, setting: str, monkeypatch: pytest.MonkeyPatch, ids: torch.Tensor,
          mask: torch.Tensor, hidden: bool) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Every hidden state (or the last) of a copy of `model` whose plan binds with FASTBERT_ROW_BUCKETS=`setting`,
    from its second forward (the first binds the plan module by module)."""
    monkeypatch.setenv(rows.ENV, setting)
    model = copy.deepcopy(model)
    with torch.inference_mode():
        for _ in range(2):
            out = model(ids, attention_mask=mask, output_hidden_states=hidden)
    return tuple(out.hidden_states) if hidden else (out.last_hidden_state,)


def _ragged(vocab: int, lengths: list[int], seqlen: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    mask = (torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(5, vocab, (len(lengths), seqlen), generator=g)
    return ids * mask + pad * (1 - mask), mask


MODELS = {
    "bert": lambda: tiny_bert(max_position_embeddings=64, num_hidden_layers=3),
    "mpnet": lambda: fastbert.optimize(family_model("mpnet")),
    "deberta-v2": lambda: fastbert.optimize(family_model("deberta-v2")),
}


@pytest.mark.parametrize("hidden", [False, True], ids=["last", "every hidden state"])
@pytest.mark.parametrize("lengths", [[9, 4, 0, 7], [3]], ids=["ragged", "batch of 1"])
@pytest.mark.parametrize("family", list(MODELS))
def test_bucketed_rows_give_each_token_its_own_output(family: str, lengths: list[int], hidden: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """[9, 4, 0, 7]: 20 tokens in 32 rows, fillers of 9 and 3 tokens; [3]: 3 tokens in 16 rows, five fillers."""
    model = MODELS[family]()
    ids, mask = _ragged(99, lengths, max(lengths), getattr(model.config, "pad_token_id", 0) or 0)
    laid: list[int] = []
    lay = rows.lay

    def spy(plan, x, packing):
        out = lay(plan, x, packing)
        laid.append(out[0].shape[0] - x.shape[0])
        return out

    monkeypatch.setattr(rows, "lay", spy)
    plain = _runs(model, "0", monkeypatch, ids, mask, hidden)
    assert laid and not any(laid)
    laid.clear()
    bucketed = _runs(model, "1", monkeypatch, ids, mask, hidden)
    assert laid and all(n == rows.bucket(sum(lengths)) - sum(lengths) > 0 for n in laid)
    valid = mask.bool()
    assert len(bucketed) == len(plain)
    for got, want in zip(bucketed, plain, strict=True):
        assert got.shape == want.shape
        assert (got[valid] - want[valid]).abs().max() <= ATOL
        assert not got[~valid].any()  # padding positions stay zeros


def test_rotary_tables_follow_the_fillers(monkeypatch: pytest.MonkeyPatch) -> None:
    """GTE's rotary positions are counted within each sequence of the laid-out batch."""
    from tests.test_rotary_bert_families import FAMILIES
    from tests.test_rotary_bert_families import hf_model as rotary_model

    model = fastbert.optimize(rotary_model(FAMILIES[0]))
    ids, mask = _ragged(101, [23, 0, 1, 17, 9], 23, 0)
    plain = _runs(model, "0", monkeypatch, ids, mask, True)
    bucketed = _runs(model, "1", monkeypatch, ids, mask, True)
    for got, want in zip(bucketed, plain, strict=True):
        assert (got[mask.bool()] - want[mask.bool()]).abs().max() <= ATOL


def test_explain_says_whether_rows_are_bucketed(monkeypatch: pytest.MonkeyPatch) -> None:
    ids, mask = _ragged(99, [5, 2], 5, 0)
    _runs(tiny_bert(), "1", monkeypatch, ids, mask, False)
    assert f"token rows bucketed: {rows.ENV}=1" in fastbert.explain()
    _runs(tiny_bert(), "0", monkeypatch, ids, mask, False)
    assert f"token rows not bucketed: {rows.ENV}=0" in fastbert.explain()
