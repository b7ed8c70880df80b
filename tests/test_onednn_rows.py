"""oneDNN GEMMs on row parts (fastbert.backends.onednn.row_parts): a bf16 GEMM's rows cut in halves where two calls
were measured faster, decided at first use per row count; the cut GEMMs meet DESIGN's bf16 rule; the native layer
stack makes the same calls (bitwise the per-op path's); bad parts raise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastbert import capabilities, reference
from fastbert.backends import onednn, timing
from fastbert.execution import stack as layer_stack
from tests.conftest import NATIVE_CPU, tiny_bert
from tests.kernel_checks import assert_close

pytestmark = pytest.mark.skipif(onednn.unavailable_reason() is not None, reason=f"{onednn.unavailable_reason()}")
# whether oneDNN multiplies bf16 in bf16 here: only then are its GEMMs cut into row parts (onednn._cuttable)
ONEDNN_BF16 = onednn.unavailable_reason() is None and onednn.gemm_dtype(torch.bfloat16) == torch.bfloat16

BF16 = torch.bfloat16


@pytest.fixture
def cuts_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a CPU where the probe found halves faster (AMX): row counts are timed and cut."""
    found = capabilities.Finding(True, "set by the test")
    monkeypatch.setattr(capabilities, "onednn_bf16_row_cuts", lambda: found)


def settled(wins: bool) -> timing.Verdict:
    return timing.Verdict(wins, "set by the test", None)


class SplitEverywhere(dict):
    """Verdicts that cut every row count the rule lets it (>= 256 rows), as if each was measured faster in halves."""

    def get(self, key: tuple, default: object = None) -> timing.Verdict:
        return settled(True)


def packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weight, bias = torch.randn(n, k).to(BF16), torch.randn(n).to(BF16)
    pack, _, b = onednn.operands(weight, bias, 1)
    return weight, pack, b


@pytest.mark.usefixtures("cuts_timed")
def test_parts_follow_the_verdicts_and_the_stack_reads_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTBERT_CPU_GEMM", raising=False)
    _, pack, b = packed(32, 48)
    x = torch.randn(600, 48).to(BF16)
    key = (BF16, 32, 48)
    monkeypatch.setattr(onednn, "_splits", {(*key, 600): settled(True), (*key, 300): settled(False)})
    assert onednn.row_parts(x, pack, b, 32) == onednn._decided_parts(key, 600) == (300, 300)
    onednn._splits[(*key, 300)] = settled(True)
    assert onednn.row_parts(x, pack, b, 32) == onednn._decided_parts(key, 600) == (150,) * 4
    onednn._splits[(*key, 600)] = settled(False)
    assert onednn.row_parts(x, pack, b, 32) == onednn._decided_parts(key, 600) == (600,)
    assert onednn._decided_parts(key, 601) == (601,)  # a row count nobody timed: one call


@pytest.mark.usefixtures("cuts_timed")
@pytest.mark.parametrize("halves_faster", [True, False])
def test_first_use_times_both_and_keeps_the_faster(halves_faster: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTBERT_CPU_GEMM", raising=False)
    monkeypatch.setattr(onednn, "_splits", {})
    monkeypatch.setattr(timing, "samples", lambda *fns, **kw: [[1.0], [2.0]] if halves_faster else [[2.0], [1.0]])
    _, pack, b = packed(32, 48)
    parts = onednn.row_parts(torch.randn(513, 48).to(BF16), pack, b, 32)
    assert parts == ((129, 128, 128, 128) if halves_faster else (513,))
    assert set(onednn._splits) == {(BF16, 32, 48, m) for m in (513, 257, 256)}  # each level timed once
    assert all(v[0] == halves_faster and "oneDNN on row parts" in v[1] for v in onednn._splits.values())


@pytest.mark.usefixtures("cuts_timed")
def test_few_rows_fp32_and_wide_outputs_make_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onednn, "_splits", SplitEverywhere())
    _, pack, b = packed(32, 48)
    assert onednn.row_parts(torch.randn(255, 48).to(BF16), pack, b, 32) == (255,)
    assert onednn.row_parts(torch.randn(600, 48), pack, b, 32) == (600,)  # fp32: never cut
    assert onednn.row_parts(torch.randn(256, 48).to(BF16), pack, b, 32) == (128, 128)
    _, pack, b = packed(48, 32)
    assert onednn.row_parts(torch.randn(600, 32).to(BF16), pack, b, 48) == (600,)  # N > K: never cut


def test_where_halves_never_won_no_row_count_is_timed_or_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the probe found one call at least as fast at every row count (no AMX), row_parts times nothing, even for
    a row count never seen, and every GEMM is one call; the stack's question is settled for every row count."""
    monkeypatch.delenv("FASTBERT_CPU_GEMM", raising=False)
    monkeypatch.setattr(onednn, "_splits", {})
    monkeypatch.setattr(capabilities, "onednn_bf16_row_cuts", lambda: capabilities.Finding(False, "set by the test"))
    monkeypatch.setattr(timing, "samples", lambda *fns, **kw: pytest.fail("a row count was timed"))
    weight, pack, b = packed(32, 48)
    for m in (256, 513, 1000):
        assert onednn.row_parts(torch.randn(m, 48).to(BF16), pack, b, 32) == (m,)
        assert onednn.parts_settled(weight, m)
    assert onednn._splits == {}


def test_the_probe_cuts_where_halves_win_and_not_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """capabilities.onednn_bf16_row_cuts: yes where halves beat one call by the margin at most probed row counts, no
    where they do not or at one only (a disturbed sample), and no on one thread without timing anything."""
    if not capabilities.onednn_bf16_prepack().ok:
        pytest.skip(capabilities.onednn_bf16_prepack().why)

    def verdict(*gains: float, threads: int = 2) -> capabilities.Finding:
        each = iter(gains)
        monkeypatch.setattr(capabilities, "_best_seconds", lambda runs, clock: {"one": next(each), "halves": 1.0})
        before = torch.get_num_threads()
        torch.set_num_threads(threads)  # test workers may run on one thread
        try:
            return capabilities._time_row_cuts.__wrapped__()
        finally:
            torch.set_num_threads(before)

    assert verdict(1.5, 1.4, 1.6).ok and "by 1.50x" in verdict(1.5, 1.4, 1.6).why
    assert verdict(1.0, 1.2, 1.3).ok  # two row counts of three
    assert not verdict(1.05, 1.0, 1.02).ok and "median 1.02x" in verdict(1.05, 1.0, 1.02).why
    assert not verdict(1.0, 1.6, 0.98).ok  # one disturbed row count does not decide
    assert not verdict(1.5, 1.5, 1.5, threads=1).ok and "one thread" in verdict(1.5, 1.5, 1.5, threads=1).why


@pytest.mark.usefixtures("cuts_timed")
@pytest.mark.parametrize("act", [None, "gelu"])
def test_cut_gemm_meets_the_bf16_rule(act: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTBERT_CPU_GEMM", raising=False)
    monkeypatch.setattr(onednn, "_splits", SplitEverywhere())
    weight, bias = torch.randn(40, 64).to(BF16), torch.randn(40).to(BF16)
    x = torch.randn(517, 64).to(BF16)
    out = onednn.linear(x, weight, bias, act)
    ref64 = reference.linear(x.double(), weight.double(), bias.double(), act)
    assert_close(f"oneDNN linear on row parts, act {act}", out, ref64, reference.linear(x, weight, bias, act))


@pytest.mark.usefixtures("cuts_timed")
def test_cut_residual_gemm_meets_the_bf16_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTBERT_CPU_GEMM", raising=False)
    monkeypatch.setattr(onednn, "_splits", SplitEverywhere())
    weight, bias = torch.randn(40, 64).to(BF16), torch.randn(40).to(BF16)
    x, residual = torch.randn(517, 64).to(BF16), torch.randn(517, 40).to(BF16)
    ln_w, ln_b = torch.randn(40).to(BF16), torch.randn(40).to(BF16)
    out = onednn.dense_residual_layernorm(x, weight, bias, residual, ln_w, ln_b, 1e-5)

    def ref(*ts: torch.Tensor) -> torch.Tensor:
        xs, w, b, r, lw, lb = ts
        return F.layer_norm(F.linear(xs, w, b) + r, (40,), lw, lb, 1e-5)

    operands = (x, weight, bias, residual, ln_w, ln_b)
    assert_close("oneDNN residual GEMM on row parts", out, ref(*(t.double() for t in operands)), ref(*operands))


@pytest.mark.usefixtures("cuts_timed")
@pytest.mark.skipif(NATIVE_CPU is None, reason="native CPU extension unavailable")
@pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN multiplies bf16 as fp32 on this CPU: no GEMM is cut")
def test_stacked_layers_make_the_same_cut_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "onednn")  # every GEMM on oneDNN, untimed, as a stack needs
    monkeypatch.setattr(onednn, "_splits", SplitEverywhere())
    cuts = []
    row_parts = onednn.row_parts
    monkeypatch.setattr(onednn, "row_parts", lambda *a: cuts.append(p := row_parts(*a)) or p)
    model = tiny_bert(num_hidden_layers=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).to(BF16)
    ids = torch.randint(1, 120, (4, 90), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[2, 40:] = 0
    outs = []
    for stacked in ("0", "1"):
        monkeypatch.setenv("FASTBERT_LAYER_STACK", stacked)
        before = layer_stack._status["stacked"]
        with torch.inference_mode():
            outs.append(model(ids, attention_mask=mask).last_hidden_state)
        assert (layer_stack._status["stacked"] > before) == (stacked == "1")
    assert any(len(parts) > 1 for parts in cuts)  # attention out and FFN out (N <= K) were cut
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(NATIVE_CPU is None, reason="native CPU extension unavailable")
def test_bad_row_parts_raise() -> None:
    h, tokens = 6, 5
    x, cu = torch.randn(tokens, h), torch.tensor([0, tokens], dtype=torch.int32)
    norm = [torch.ones(h), torch.zeros(h)]
    shapes = ((3 * h, h), (h, h), (8, h), (h, 8))  # QKV, attention out, FFN in, FFN out
    gemms = [onednn.operands(torch.randn(n, k), torch.zeros(n), tokens) for n, k in shapes]
    for bad, match in ((torch.tensor([2, 2]), "sum to its 5 rows"), (torch.tensor([5, 0]), "positive"),
                       (torch.tensor([5.0]), "int64")):  # fmt: skip
        qkv = [gemms[0][0], bad, gemms[0][2]]
        layer = [*qkv, *gemms[1], *norm, *gemms[2], *gemms[3], *norm]
        with pytest.raises(ValueError, match=match):
            NATIVE_CPU.encoder_layers(x, cu, tokens, 2, 1.0, layer, "gelu", [1e-12, 1e-12])


@pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN multiplies bf16 as fp32 on this CPU: its bf16 cuts cannot run")
def test_benchmark_times_every_cut_and_writes_its_table(tmp_path) -> None:
    """bench_onednn_rows at one row count: one call, halves and quarters timed per GEMM, JSON and Markdown written."""
    import json

    from benchmarks import bench_onednn_rows

    assert bench_onednn_rows.main(["--iters", "1", "--rows", "128", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("onednn_rows_cpu-*.json")).read_text())
    assert len(doc["results"]) == sum(len(shapes) for shapes in bench_onednn_rows.SHAPES.values())
    assert all(set(r["ms"]) == {"1", "2", "4"} and min(r["ms"].values()) > 0 for r in doc["results"])
    assert "| BERT-base | [128, 768] x [768, 2304] |" in next(tmp_path.glob("onednn_rows_cpu-*.md")).read_text()
