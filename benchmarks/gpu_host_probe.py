"""Where a BERT-base forward's time goes on a GPU, in about a minute: host microseconds per launch, then per forward
at 1x128, 16x512 ragged[0.2S,S] and 128x128 for transformers sdpa, fastbert eager (the plan loop) and fastbert graphed:
wall ms (CUDA events), host ms until the call returns, GPU busy ms (profiler), host syncs per forward, the graphed
call's host ms before its replay starts, and the max abs error of the eager and the *replayed* outputs vs transformers
fp32. Writes gpu_host_probe_<dtype>.json to --out after every row (a run cut short keeps what it measured).

    python -m benchmarks.gpu_host_probe --out DIR [--dtype bf16]
    python -m benchmarks.gpu_host_probe --out DIR --tiny          # a small model on any device (dry run)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

SHAPES = ((1, 128, False), (16, 512, True), (128, 128, False))


def host_us(fn: Callable[[], Any], n: int, cuda: bool) -> float:
    """Host microseconds per call of `fn`: the launches are queued, not waited for."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - start) / n * 1e6
    if cuda:
        torch.cuda.synchronize()
    return round(us, 2)


def timed(fn: Callable[[], Any], n: int, cuda: bool) -> tuple[float, float]:
    """(median wall ms by CUDA events, median host ms until the call returns), the GPU idle before each call."""
    walls, hosts = [], []
    for _ in range(n):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        fn()
        hosts.append((time.perf_counter() - t) * 1e3)
        if cuda:
            end.record()
            end.synchronize()
            walls.append(start.elapsed_time(end))
    return round(statistics.median(walls or hosts), 3), round(statistics.median(hosts), 3)


def gpu_busy_ms(fn: Callable[[], Any], n: int) -> float | str:
    """Device time of every kernel, copy and memset per call (torch.profiler), or why it could not say."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        # device-side events only: a CPU op's self device time would count its kernels twice
        total = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type != DeviceType.CPU)
        return round(total / n / 1e3, 3)
    except Exception as exc:  # a profiler problem must not cost the other columns
        return f"failed: {type(exc).__name__}: {exc}"[:160]


def syncs(fn: Callable[[], Any]) -> int:
    """Host syncs one call makes (torch's sync debug mode warns at each)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@contextlib.contextmanager
def stamped_replays() -> Iterator[list[float]]:
    """Inside the block each CUDAGraph.replay appends perf_counter() at its start to the yielded list."""
    stamps: list[float] = []
    real = torch.cuda.CUDAGraph.replay

    def replay(self: torch.cuda.CUDAGraph) -> None:
        stamps.append(time.perf_counter())
        real(self)

    torch.cuda.CUDAGraph.replay = replay
    try:
        yield stamps
    finally:
        torch.cuda.CUDAGraph.replay = real


def before_replay_ms(fn: Callable[[], Any], n: int) -> float | None:
    """Median host ms from the call's start to its first graph replay (None where the call replays no graph)."""
    waits = []
    with stamped_replays() as stamps:
        for _ in range(n):
            torch.cuda.synchronize()
            stamps.clear()
            t = time.perf_counter()
            fn()
            if stamps:
                waits.append((stamps[0] - t) * 1e3)
    return round(statistics.median(waits), 3) if waits else None


def launch_costs(dev: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Host us per launch: a fused op through fastbert's launcher and bare, F.linear, a small torch op."""
    from fastbert import kernels
    from fastbert.kernels import bias_act

    x = torch.randn(128, 3072, device=dev, dtype=dtype)
    bias = torch.randn(3072, device=dev, dtype=dtype)
    y = torch.empty_like(x)
    x768, w = torch.randn(128, 768, device=dev, dtype=dtype), torch.randn(3072, 768, device=dev, dtype=dtype)
    block_m, block_n, warps = bias_act._blocks(3072)
    grid = (-(-128 // block_m), -(-3072 // block_n))

    def bare() -> None:
        bias_act._bias_act_fwd[grid](x, bias, y, 128, 3072, x.stride(0), ACT=0, BLOCK_M=block_m, BLOCK_N=block_n,
                                     num_warps=warps)  # fmt: skip

    return {
        "fastbert bias_act_inference (checks + launcher + triton)": host_us(
            lambda: kernels.bias_act_inference(x, bias), 1000, True),
        "bare triton launch": host_us(bare, 1000, True),
        "F.linear 128x768x3072": host_us(lambda: torch.nn.functional.linear(x768, w), 1000, True),
        "torch.add small": host_us(lambda: torch.add(bias, 1), 1000, True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model: a dry run of every column")
    args = parser.parse_args()
    import transformers

    import fastbert
    from benchmarks.run_model import BERT_BASE, TINY, Shape, make_batch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype] if cuda else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": args.dtype,
                           "versions": {m.__name__: m.__version__ for m in (torch, transformers)}}  # fmt: skip
    with contextlib.suppress(ImportError):
        import triton

        doc["versions"]["triton"] = triton.__version__
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu_host_probe_{args.dtype}.json")

    def save() -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)

    if cuda:
        try:
            doc["host_us_per_launch"] = launch_costs(dev, dtype)
        except Exception as exc:  # a changed kernel signature must not cost the per-forward rows
            doc["host_us_per_launch"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        print(json.dumps(doc["host_us_per_launch"]), flush=True)
        save()
    torch.manual_seed(0)
    fields = dict(TINY, max_position_embeddings=512) if args.tiny else BERT_BASE
    config = transformers.BertConfig(**fields, attn_implementation="sdpa")
    hf32 = transformers.BertModel(config).eval().to(dev)
    hf = transformers.BertModel(config).eval().to(dev, dtype)
    hf.load_state_dict(hf32.state_dict())
    eager = fastbert.optimize(hf32, dtype=dtype, device=dev, cuda_graphs=False)
    graphed = fastbert.optimize(hf32, dtype=dtype, device=dev)  # graphs by default on CUDA
    rows = doc["rows"] = []
    for batch, seqlen, ragged in SHAPES:
        ids, mask, types = (t.to(dev) for t in make_batch(Shape(batch, seqlen, ragged, 0.2), fields["vocab_size"], dev))
        valid = mask.bool()
        with torch.inference_mode():
            ref = hf32(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state.float()
            for name, model in (("transformers sdpa", hf), ("fastbert eager", eager), ("fastbert graphed", graphed)):
                run = functools.partial(model, input_ids=ids, attention_mask=mask, token_type_ids=types)
                for _ in range(3):  # bind the plan, capture, replay
                    out = run().last_hidden_state
                row: dict[str, Any] = {"shape": f"{batch}x{seqlen}{' ragged' if ragged else ''}", "system": name,
                                       "real_tokens": int(mask.sum())}  # fmt: skip
                row["max_abs_err_vs_fp32"] = float(f"{(out.float() - ref)[valid].abs().max().item():.3g}")
                row["wall_ms"], row["host_ms"] = timed(run, 30, cuda)
                if cuda:
                    row["gpu_busy_ms"] = gpu_busy_ms(run, 5)
                    row["syncs_per_forward"] = syncs(run)
                    if not ragged:
                        row["syncs_without_mask"] = syncs(functools.partial(model, input_ids=ids, token_type_ids=types))
                    row["host_ms_before_first_replay"] = before_replay_ms(run, 20)
                    out = run().last_hidden_state  # the replayed output's error, after the timed calls
                    row["max_abs_err_last_call"] = float(f"{(out.float() - ref)[valid].abs().max().item():.3g}")
                rows.append(row)
                save()
                print(json.dumps(row), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    try:
        doc["explain"] = fastbert.explain().splitlines()
    except Exception as exc:  # the report must not cost the rows
        doc["explain"] = f"failed: {type(exc).__name__}: {exc}"
    save()


if __name__ == "__main__":
    main()
