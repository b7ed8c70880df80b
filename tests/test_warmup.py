"""fastbert.warmup on a CPU: the first request after it pays nothing the warm-up could pay (no weight packing, no GEMM
timing, no plan binding), for shapes other than the warmed ones too."""

from __future__ import annotations

import pytest
import torch
from conftest import NATIVE_CPU, NATIVE_CPU_REASON

import fastbert
from fastbert.backends import gemm, timing
from fastbert.execution import plan


@pytest.mark.skipif(NATIVE_CPU is None, reason=f"native CPU extension unavailable: {NATIVE_CPU_REASON}")
def test_after_warmup_the_first_requests_pay_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTBERT_CPU_GEMM", "auto")
    config = fastbert.BertConfig(vocab_size=300, hidden_size=96, num_hidden_layers=2, num_attention_heads=3,
                                 intermediate_size=192)  # fmt: skip
    model = fastbert.BertModel(config).eval()
    paid: list[str] = []
    samples, pack = timing.samples, gemm.pack_panels
    monkeypatch.setattr(timing, "samples", lambda *a, **k: paid.append("timing") or samples(*a, **k))
    monkeypatch.setattr(gemm, "pack_panels", lambda *a, **k: paid.append("packing") or pack(*a, **k))
    bind = plan.Plans.bind
    monkeypatch.setattr(plan.Plans, "bind", lambda *a, **k: paid.append("binding") or bind(*a, **k))
    assert fastbert.warmup(model, [(1, 16), (2, 128)]) == 0  # no CUDA graphs on a CPU
    assert {"timing", "packing", "binding"} <= set(paid), f"the warm-up paid only {set(paid)}"
    paid.clear()
    with torch.inference_mode():
        for batch, seqlen in ((1, 9), (3, 100)):  # 9 and 300 rows: both GEMM size classes, shapes not warmed
            ids = torch.randint(1, 300, (batch, seqlen))
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert paid == []


def test_warmup_takes_one_shape_or_a_list_and_refuses_what_is_not_a_shape() -> None:
    """`fastbert.warmup(model, (8, 128))` is one shape, as `[(8, 128)]`; anything but (batch, seqlen) pairs of positive
    ints is a ValueError showing the expected form (a bare pair raised TypeError: cannot unpack an int)."""
    config = fastbert.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64)  # fmt: skip
    model = fastbert.BertModel(config).eval()
    assert fastbert.warmup(model, (2, 8)) == 0 and fastbert.warmup(model, [(1, 4), (2, 8)]) == 0
    for bad in ((0, 8), [(2, -1)], [], "8x128", [(2,)]):
        with pytest.raises(ValueError, match=r"\(batch, seqlen\) pairs"):
            fastbert.warmup(model, bad)
