"""The native CPU kernels run without the GIL: while one Python thread is inside a kernel, another Python thread runs
(a server's tokenisation or I/O beside a forward). A thread held on the GIL would not run until the kernel returned."""

from __future__ import annotations

import gc
import math
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from fastbert.backends import gemm, int8, native, timing

EXT, EXT_REASON = native.load("_native_cpu")
pytestmark = pytest.mark.skipif(EXT is None, reason=f"native CPU extension unavailable: {EXT_REASON}")

T, H, HEADS, FFN = 96, 64, 4, 128  # tokens, hidden, heads, FFN width: each call well under a millisecond


def ran_meanwhile(call: Callable[[], object], seconds: float = 0.3) -> bool:
    """True when another Python thread ran while this one repeated `call` for `seconds`. No forced switch between
    threads in that time (a 60 s switch interval), so the other thread can only run when a call releases the GIL.
    Nothing is freed meanwhile (results kept, the per-op calls writing into one `out`, the cyclic GC paused): freeing
    a tensor releases the GIL too (torch does), which would pass any call."""
    results = [call()]  # once before: a first call's one-time set-up may release the GIL on its own
    go, ran = threading.Event(), threading.Event()
    other = threading.Thread(target=lambda: go.wait() and ran.set())
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)  # before the thread starts: it must never take the GIL by a forced switch
    gc.disable()
    try:
        other.start()
        go.set()  # the other thread now waits for the GIL only
        end = time.perf_counter() + seconds
        while time.perf_counter() < end and not ran.is_set():
            results.append(call())
        return ran.is_set()
    finally:
        gc.enable()
        sys.setswitchinterval(interval)
        other.join()


def ops() -> dict[str, Callable[[], object]]:
    """One call of every native kernel on small operands."""
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g), torch.randn(H, H, generator=g)
    bias, lw, lb = torch.randn(H, generator=g), torch.ones(H), torch.zeros(H)
    ids, zeros, positions = torch.randint(0, 50, (T,), generator=g), torch.zeros(T, dtype=torch.long), torch.arange(T)
    tables = [torch.randn(rows, H, generator=g) for rows in (50, T, 2)]
    qkv, cu = torch.randn(T, 3, HEADS, H // HEADS, generator=g), torch.tensor([0, 40, T], dtype=torch.int32)
    packed, q8, out, heads_out = gemm.packed(w), int8.quantized(w), torch.empty(T, H), torch.empty(T, HEADS, H // HEADS)
    amx = {}  # the GEMMs on AMX tiles, where the kernels in use have them
    if EXT is not None and EXT.has_bf16_linear():
        x16, w16, split = x.bfloat16(), gemm.packed(w, torch.bfloat16), gemm.pack_bf16x3(w)
        amx = {
            "bf16_linear": lambda: EXT.bf16_linear(x16, w16, H, bias, "gelu"),
            "bf16x3_linear": lambda: EXT.bf16x3_linear(x, split, H, bias, "gelu", out=out),
        }
    return amx | {
        "embedding_layernorm": lambda: EXT.embedding_layernorm(ids, zeros, positions, *tables, lw, lb, 1e-12, None,
                                                               out=out),
        "bias_act": lambda: EXT.bias_act(x, bias, "gelu", out=out),
        "bias_residual_layernorm": lambda: EXT.bias_residual_layernorm(x, bias, res, lw, lb, 1e-12, out=out),
        "attention": lambda: EXT.attention(qkv, cu, 56, 1 / math.sqrt(H // HEADS), out=heads_out),
        "fp32_linear": lambda: EXT.fp32_linear(x, packed, H, bias, "gelu", out=out),
        "int8_linear": lambda: EXT.int8_linear(x, q8.packed, q8.scale, bias, None, res, lw, lb, 1e-12, out=out),
    }  # fmt: skip


@pytest.mark.parametrize("op", list(ops()))
def test_kernel_releases_the_gil(op: str) -> None:
    assert ran_meanwhile(ops()[op]), f"{op} held the GIL for its whole run"


def test_encoder_layers_release_the_gil() -> None:
    g = torch.Generator().manual_seed(0)
    x, cu = torch.randn(T, H, generator=g), torch.tensor([0, 40, T], dtype=torch.int32)
    ones, zeros = torch.ones(H), torch.zeros(H)

    def dense(n: int, k: int) -> list[torch.Tensor]:
        return list(gemm.operands(torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g), T))

    layer = [*dense(3 * H, H), *dense(H, H), ones, zeros, *dense(FFN, H), *dense(H, FFN), ones, zeros]
    call = lambda: EXT.encoder_layers(x, cu, 56, HEADS, 1 / math.sqrt(H // HEADS), layer * 2, "gelu", [1e-12] * 4)  # noqa: E731
    assert ran_meanwhile(call), "encoder_layers held the GIL for its whole run"


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_forwards_in_two_threads_match_one_at_a_time(quantize: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads sharing one model (as a threaded server does) get each input's own output, bitwise, every time:
    the packed-weight cache, the first-use timings, the layer stack's trace and status are shared between them.
    A verdict the two threads' concurrent timing left provisional keeps its path here: its re-check, due 3 s later,
    may settle on the other path, which legitimately changes the numbers (1 run in ~30 failed that way)."""
    import fastbert
    from tests.conftest import tiny_bert

    monkeypatch.setattr(timing, "RECHECK_AFTER_S", 1e9)

    model = tiny_bert(num_hidden_layers=3)
    if quantize:
        model = fastbert.optimize(model, quantize=quantize)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(1, 120, (b, n), generator=g), torch.ones(b, n, dtype=torch.long)) for b, n in
               ((2, 9), (3, 17), (1, 5), (4, 12))]  # fmt: skip
    for _, mask in batches[1:]:
        mask[0, -3:] = 0  # ragged
    outputs: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def serve(worker: int) -> None:
        with torch.inference_mode():
            for step in range(24):
                ids, mask = batches[(step + worker) % len(batches)]
                outputs[worker].append(model(ids, attention_mask=mask).last_hidden_state)

    workers = [threading.Thread(target=serve, args=(w,)) for w in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a forward did not return (deadlock?)"
    with torch.inference_mode():  # after: the threads were the first to run these shapes (first-use timings)
        expected = [model(ids, attention_mask=mask).last_hidden_state for ids, mask in batches]
    for worker, outs in outputs.items():
        assert len(outs) == 24
        for step, out in enumerate(outs):
            assert torch.equal(out, expected[(step + worker) % len(batches)]), (worker, step)
