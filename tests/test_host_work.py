"""The host-overhead guard: fastbert's own Python per BERT-base forward on the CUDA path, counted on CPU with the Triton
launches stubbed (benchmarks/host_work.py). Counts, never times: a regression in host work fails here on any machine."""

from __future__ import annotations

import pytest
import torch

import fastbert
from benchmarks.host_work import BERT_BASE, count, cuda_path, stub_graphs

pytest.importorskip("triton")
EAGER_CEILING, GRAPHED_CEILING = 1000, 300  # Python calls per forward (the goals; transformers makes ~2,000)


@pytest.fixture(scope="module")
def bert_base() -> fastbert.BertModel:
    torch.manual_seed(0)
    return fastbert.BertModel(fastbert.BertConfig(**BERT_BASE)).eval()


def test_eager_and_graphed_forwards_stay_under_their_python_call_ceilings(bert_base: fastbert.BertModel) -> None:
    ids = torch.randint(1, 1000, (2, 64))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    with torch.no_grad(), cuda_path() as launches:
        for _ in range(2):
            bert_base(ids, attention_mask=mask)
        eager = count(lambda: bert_base(ids, attention_mask=mask), launches)
        stub_graphs(bert_base)
        for _ in range(2):
            bert_base(ids, attention_mask=mask)
        graphed = count(lambda: bert_base(ids, attention_mask=mask), launches)
    layers = BERT_BASE["num_hidden_layers"]
    assert eager.launches == 4 * layers + 1  # embedding + 4 fused ops a layer: every op reached its kernel
    assert eager.dispatches <= 1 and graphed.dispatches <= 1  # the pooler's GEMM; the encoder's ops are bound
    assert eager.python_calls < EAGER_CEILING, eager
    assert graphed.launches == 0 and graphed.python_calls < GRAPHED_CEILING, graphed
