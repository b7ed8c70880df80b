"""Measure the Triton kernels' launch settings on this GPU and write the table the kernels read
(fastbert/kernels/configs/<device>.json; fastbert/kernels/tuning.py reads it at launch, its rule elsewhere).

For each kernel at the BERT-base and MiniLM shapes (feature dims, head dims, token counts of 1 x 128, 16 x 512 ragged
and 128 x 128), each dtype: every candidate's output is checked against the rule's (its output buffer poisoned
first), then timed (median of triton.testing.do_bench); the fastest goes into the table with its time and the rule's.
The most valuable keys go first (fp16, BERT-base, attention), the table is written after every key and merged with the
entries already there, so a run stopped early keeps what it measured.

    python -m benchmarks.tune_kernels                          # on a GPU (a few minutes)
    python -m benchmarks.tune_kernels --max-minutes 3 --dtypes fp16
    TRITON_INTERPRET=1 python -m benchmarks.tune_kernels --dry-run --out /tmp/t   # CPU: tiny shapes, the whole path
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from fastbert import kernels
from fastbert.kernels import tuning

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Shapes:
    models: dict[str, tuple[int, int, int]]  # name -> (hidden, intermediate, head dim)
    rows: tuple[int, ...]  # token-count classes of the row kernels
    attention: tuple[tuple[int, int], ...]  # (batch, longest sequence)


# 1 x 128, 16 x 512 ragged [0.2S, S] and 128 x 128: token classes 128, 8192, 16384; attention caps 128 and 512
SUITE = Shapes({"bert-base": (768, 3072, 64), "minilm": (384, 1536, 32)}, (128, 8192, 16384),
               ((1, 128), (16, 512), (128, 128)))  # fmt: skip
DRY = Shapes({"bert-base": (64, 128, 32), "minilm": (32, 64, 16)}, (16,), ((2, 32),))  # CPU dry run: seconds


@dataclass(frozen=True)
class Key:
    kernel: str
    dtype: str
    n: int  # feature dim (attention: head dim)
    rows: int  # token-count class (attention: the sequence-length cap)


def candidates(kernel: str, n: int, rows: int) -> list[tuning.Launch]:
    """Settings worth timing for one key: tiles of 1-16K elements at 4-64 elements per thread."""
    if kernel == "attention":
        tiles = [(m, b) for m, b in ((32, 32), (64, 32), (32, 64), (64, 64)) if max(m, b) <= max(16, rows)]
        return [(m, b, w, s) for m, b in tiles for w in (4, 8) for s in (2, 3)]
    full = max(16, 1 << (n - 1).bit_length())
    widths = [full] if kernel in tuning.WHOLE_ROW else sorted({min(full, w) for w in (256, 512, 1024, full)})
    found = []
    for block_n in widths:
        for block_m in (1, 2, 4, 8, 16):
            tile = block_m * block_n
            if block_m > rows or not min(1024, 16 * block_n) <= tile <= 16384:
                continue
            found += [(block_m, block_n, w, None) for w in (1, 2, 4, 8, 16) if 4 <= tile // (32 * w) <= 64]
    return found


def inputs(key: Key, device: torch.device, hidden: int, shapes: Shapes) -> Callable[[], torch.Tensor]:
    """One launch of the key's forward-only launcher on random inputs of its shape."""
    dtype, gen = DTYPES[key.dtype], torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    if key.kernel == "attention":
        batch = next((b for b, s in shapes.attention if max(16, 1 << (s - 1).bit_length()) == key.rows), 1)
        heads = hidden // key.n
        lengths = torch.linspace(0.2 * key.rows, key.rows, batch).long().clamp(min=1) if batch > 1 else \
            torch.tensor([key.rows])  # fmt: skip
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device, torch.int32)
        qkv = rand(int(lengths.sum()), 3, heads, key.n)
        return lambda: kernels.attention_inference(qkv, cu, int(lengths.max()))
    rows = key.rows
    if key.kernel == "bias_act":
        x, bias = rand(rows, key.n), rand(key.n, scale=0.1)
        return lambda: kernels.bias_act_inference(x, bias, "gelu")
    if key.kernel == "gated_act":
        x, up = rand(rows, key.n), rand(rows, key.n)
        return lambda: kernels.gated_act_inference(x, up, "gelu")
    if key.kernel == "bias_residual_layernorm":
        x, res, bias, w, b = rand(rows, key.n), rand(rows, key.n), rand(key.n), rand(key.n), rand(key.n)
        return lambda: kernels.bias_residual_layernorm_inference(x, bias, res, w, b, 1e-12)
    ids = torch.randint(0, 30522, (rows,), generator=gen).to(device)
    types = torch.randint(0, 2, (rows,), generator=gen).to(device)
    positions = (torch.arange(rows) % 512).to(device)
    word, pos, typ = rand(30522, key.n), rand(512, key.n), rand(2, key.n)
    w, b = rand(key.n), rand(key.n)
    return lambda: kernels.embedding_layernorm_inference(ids, types, positions, word, pos, typ, w, b, 1e-12)


def keys(shapes: Shapes, models: list[str], dtypes: list[str], kernel_names: list[str]) -> Iterator[tuple[Key, int]]:
    """(key, hidden size) in order of value: fp16 first, BERT-base first, attention first."""
    for dtype in dtypes:
        for model in models:
            hidden, inter, head = shapes.models[model]
            for kernel in kernel_names:
                if kernel == "attention":
                    caps = sorted({max(16, 1 << (s - 1).bit_length()) for _, s in shapes.attention})
                    yield from ((Key(kernel, dtype, head, cap), hidden) for cap in caps)
                else:
                    n = inter if kernel in ("bias_act", "gated_act") else hidden
                    yield from ((Key(kernel, dtype, n, rows), hidden) for rows in shapes.rows)


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median ms of one call: triton.testing.do_bench on a GPU; a few perf_counter calls elsewhere (dry runs)."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))

    def measure(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return measure


def poisoned(run: Callable[[], torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """run() after a NaN-filled buffer of the output's size was freed: the allocator hands that block back, so an
    element the kernel leaves unwritten shows as NaN."""
    torch.full_like(like, float("nan"))
    return run()


def tune(key: Key, hidden: int, device: torch.device, measure: Callable, shapes: Shapes) -> dict | None:
    """The fastest correct candidate for one key, as a table entry (None where no candidate beat nothing)."""
    run = inputs(key, device, hidden, shapes)
    reference = run()  # the rule's output (no trial active, and the table is not read: see main)
    eps = torch.finfo(reference.dtype).eps
    rule_ms, best = measure(run), None
    for launch in candidates(key.kernel, key.n, key.rows):
        with tuning.trial(key.kernel, launch):
            out = poisoned(run, reference)
            if not torch.allclose(out.float(), reference.float(), rtol=8 * eps, atol=8 * eps):
                tqdm.write(f"  {key}: {launch} gives a different output; skipped")
                continue
            ms = measure(run)
        if best is None or ms < best[0]:
            best = (ms, launch)
    if best is None:
        return None
    (ms, (block_m, block_n, warps, stages)) = best
    return {"dtype": key.dtype, "n": key.n, "rows": key.rows, "BLOCK_M": block_m, "BLOCK_N": block_n,
            "num_warps": warps, "num_stages": stages, "ms": round(ms, 5), "rule_ms": round(rule_ms, 5)}  # fmt: skip


def merge(table: dict, kernel: str, entry: dict) -> None:
    """Put `entry` into the table, replacing the one for the same (dtype, n, rows)."""
    same = ("dtype", "n", "rows")
    rows = [e for e in table["kernels"].get(kernel, []) if any(e.get(k) != entry[k] for k in same)]
    table["kernels"][kernel] = sorted(rows + [entry], key=lambda e: (e["dtype"], e["n"], e["rows"]))


def versions() -> dict[str, str]:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": str(torch.version.cuda)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(SUITE.models), default=list(SUITE.models))
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp16", "bf16"])
    parser.add_argument("--kernels", nargs="+", choices=tuning.KERNELS,
                        default=["attention", "bias_act", "bias_residual_layernorm", "embedding_layernorm"])
    parser.add_argument("--max-minutes", type=float, help="start no key after this")
    parser.add_argument("--out", type=Path, default=tuning.CONFIG_DIR, help="the folder the table goes to")
    parser.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny shapes")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.dry_run:
        parser.error("tuning needs a GPU; --dry-run checks the tuner on CPU (with TRITON_INTERPRET=1)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry-run on CPU needs TRITON_INTERPRET=1")
    shapes = DRY if args.dry_run else SUITE
    name = tuning.device_name(device)
    path = args.out / tuning.file_name(name)
    table = json.loads(path.read_text()) if path.exists() else {"device": name, "kernels": {}}
    table.update(device=name, versions=versions(), written=time.strftime("%Y-%m-%d"))
    os.environ[tuning.ENV] = os.path.join(os.sep, "nonexistent")  # the reference and rule_ms are the rule's
    tuning.reset()
    measure, deadline = timer(device), time.monotonic() + 60 * (args.max_minutes or math.inf)
    todo = list(keys(shapes, args.models, args.dtypes, args.kernels))
    args.out.mkdir(parents=True, exist_ok=True)
    for key, hidden in tqdm(todo, desc="keys", mininterval=10):
        if time.monotonic() > deadline:
            tqdm.write(f"stopped at --max-minutes: {key} and later not measured")
            break
        entry = tune(key, hidden, device, measure, shapes)
        if entry is None:
            continue
        merge(table, key.kernel, entry)
        path.write_text(json.dumps(table, indent=1) + "\n")
        tqdm.write(f"{key.kernel} {key.dtype} n={key.n} rows={key.rows}: {entry['ms']:.4f} ms vs rule "
                   f"{entry['rule_ms']:.4f} ms with {entry['BLOCK_M']}x{entry['BLOCK_N']} w{entry['num_warps']} "
                   f"s{entry['num_stages']}")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
