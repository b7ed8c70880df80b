"""The encoder's GEMMs with their epilogues, side by side in one run: fastbert's fp32 kernel (the `gemm` backend),
oneDNN with a prepacked weight, torch (F.linear, then the epilogue), and fastbert's int8 kernel for scale (on VNNI
kernels also as int16 pairs, the pack it reads without VNNI: what the u8 x s8 quads gain). Where fastbert's fp32
GEMMs run as bf16x3 on AMX tiles (gemm.fp32_mode(); above gemm.FMA_ROWS rows), its vector FMA kernel is a column of
its own.

Per layer of a BERT encoder with hidden size H on M tokens: QKV [M, H] x [H, 3H]; attention output [M, H] x [H, H]
+ residual + LayerNorm; FFN in [M, H] x [H, 4H] + GELU; FFN out [M, 4H] x [4H, H] + residual + LayerNorm; and a gated
FFN's first GEMM as ModernBERT's (intermediate 3H/2, rounded up to whole groups of 16): [M, H] x [H, 3H], GELU(first
half) * second half, which the unfused systems write out whole and then combine.
FLOPs = 2 M N K (the epilogues' few per output are not counted); bytes at least 4 (M K + N K + M N) for fp32 (and
4 M N more for a residual), so at these sizes every GEMM is compute-bound (>= 40 FLOPs per byte): the roof is the FMA
peak measured in the same run (`arithmetic_peak`, before and after the GEMMs, the higher kept; on a shared machine the
share of it can still read above 100% when the neighbours were busier during the peak than during a GEMM); with
bf16x3, a sixth of the AMX bf16 tiles' peak where that is higher (six bf16 products per fp32 one).
Timing: the systems' calls interleaved for --budget seconds per shape, fastest call kept (bench_native's rule).

    python -m benchmarks.bench_gemm                      # MiniLM (H 384) and BERT-base (H 768) shapes
    python -m benchmarks.bench_gemm --hidden 384 --rows 64 512 --budget 1

Results: gemm_cpu-<cpu kind>.{json,md,png} in --out (default: a fresh folder, benchmarks/run_folder.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks import model_report
from benchmarks.bench_native import cpu_best_seconds
from benchmarks.plotting import gemm_bars
from benchmarks.run_folder import run_folder
from fastbert.backends import gemm, int8, native, onednn

SYSTEMS = ("fastbert gemm", "oneDNN", "torch", "fastbert int8")
PAIRS = "fastbert int8 (int16 pairs)"  # on VNNI kernels only: the same int8 GEMM on the pack read without VNNI
FMA = "fastbert gemm (FMA)"  # where fp32 GEMMs run as bf16x3: the vector FMA kernel they would run otherwise


def layers(hidden: int) -> list[tuple[str, int, int, str | None]]:
    """(name, K, N, epilogue) of one encoder layer's GEMMs; the epilogue is an activation or "layernorm"."""
    return [("QKV", hidden, 3 * hidden, None), ("attention out", hidden, hidden, "layernorm"),
            ("FFN in", hidden, 4 * hidden, "gelu"), ("FFN out", 4 * hidden, hidden, "layernorm"),
            ("gated FFN in", hidden, 2 * -(-3 * hidden // 32) * 16, "gated")]  # fmt: skip


def system_calls(m: int, k: int, n: int, epilogue: str | None) -> dict[str, Callable[[], torch.Tensor]]:
    """Each system's call for one GEMM + epilogue on the same operands."""
    g = torch.Generator().manual_seed(m + k + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
    cpu, _ = native.load("_native_cpu")
    values, scale = int8.quantize_rows(w)
    pairs, scale = gemm.pack_panels(values.to(torch.int16), 2), scale[:, 0].contiguous()
    fma = gemm.pack_panels(w, 1)
    if epilogue == "layernorm":
        res, lw, lb = torch.randn(m, n, generator=g), torch.ones(n), torch.zeros(n)
        ln = (res, lw, lb, 1e-12)
        calls = {
            "fastbert gemm": lambda: gemm.dense_residual_layernorm(x, w, b, *ln),
            "oneDNN": lambda: onednn.dense_residual_layernorm(x, w, b, *ln),
            "torch": lambda: F.layer_norm(F.linear(x, w, b) + res, (n,), lw, lb, 1e-12),
            "fastbert int8": lambda: int8.dense_residual_layernorm(x, w, b, *ln),
            PAIRS: lambda: cpu.int8_linear(x, pairs, scale, b, None, *ln),
            FMA: lambda: cpu.fp32_linear(x, fma, n, b, None, *ln),
        }
    elif epilogue == "gated":  # ModernBERT's Wi: [2I, H] stacked, GELU(first half) * second half
        group = gemm.gate_group()
        first, second = w.chunk(2)
        values, scale = int8.quantize_rows(gemm.interleaved(first, second, group))
        pairs, scale = gemm.pack_panels(values.to(torch.int16), 2), scale[:, 0].contiguous()
        calls = {
            "fastbert gemm": lambda: gemm.gated_linear(x, w, None, None, None, "gelu"),
            "oneDNN": lambda: _gelu_times_up(onednn.linear(x, w, None, None)),
            "torch": lambda: _gelu_times_up(F.linear(x, w)),
            "fastbert int8": lambda: int8.gated_linear(x, w, None, None, None, "gelu"),
            PAIRS: lambda: cpu.int8_linear(x, pairs, scale, None, "gelu", gated=group),
            FMA: lambda: gemm.gated_linear(x, w, None, None, None, "gelu"),  # gated GEMMs run on FMA tiles anyway
        }
    else:
        act = (lambda t: F.gelu(t)) if epilogue == "gelu" else (lambda t: t)
        calls = {
            "fastbert gemm": lambda: gemm.linear(x, w, b, epilogue),
            "oneDNN": lambda: onednn.linear(x, w, b, epilogue),
            "torch": lambda: act(F.linear(x, w, b)),
            "fastbert int8": lambda: int8.linear(x, w, b, epilogue),
            PAIRS: lambda: cpu.int8_linear(x, pairs, scale, b, epilogue),
            FMA: lambda: cpu.fp32_linear(x, fma, n, b, epilogue),
        }
    return {name: call for name, call in calls.items() if name in systems()}


def _gelu_times_up(y: torch.Tensor) -> torch.Tensor:
    """GELU(first half) * second half of a gated GEMM's output: what runs after an unfused GEMM."""
    gate, up = y.chunk(2, dim=-1)
    return F.gelu(gate) * up


def systems() -> tuple[str, ...]:
    """The columns of this run: the int16-pair int8 GEMM only where the kernels in use read quads (VNNI), the FMA fp32
    GEMM only where fp32 GEMMs run as bf16x3."""
    return SYSTEMS + ((PAIRS,) if int8.k_per_step() == 4 else ()) + ((FMA,) if gemm.fp32_mode() != "fma" else ())


def run(hiddens: list[int], rows: list[int], budget: float) -> dict:
    cpu, _ = native.load("_native_cpu")
    tiles = gemm.fp32_mode() != "fma"
    peaks = [cpu.arithmetic_peak("fp32", 0.5)]  # measured before and after the GEMMs: the higher is the roof
    tile_peaks = [cpu.arithmetic_peak("amx_bf16", 0.5) if tiles else None]
    results = []
    for hidden in hiddens:
        for m in rows:
            for name, k, n, epilogue in layers(hidden):
                calls = system_calls(m, k, n, epilogue)
                for fn in calls.values():
                    fn()  # packs, primitives, quantised weights: built before timing
                best = cpu_best_seconds(calls, budget)
                flops = 2 * m * n * k
                gflops = {s: flops / best[s] / 1e9 for s in calls}
                results.append({"hidden": hidden, "layer": name, "m": m, "k": k, "n": n, "epilogue": epilogue,
                                "gflops": gflops})  # fmt: skip
                print(f"H {hidden} M {m} {name}: " + ", ".join(f"{s} {v:.0f}" for s, v in gflops.items()), flush=True)
    peaks.append(cpu.arithmetic_peak("fp32", 0.5))
    tile_peaks.append(cpu.arithmetic_peak("amx_bf16", 0.5) if tiles else None)
    peak, tile_peak = (max((p for p in ps if p), default=None) for ps in (peaks, tile_peaks))
    return {
        **model_report.cpu_run(),
        "fma_peak_gflops": peak / 1e9 if peak else None,
        "bf16x3_peak_gflops": tile_peak / 6 / 1e9 if tile_peak else None,  # six bf16 tile products an fp32 one
        "systems": list(systems()),
        "results": results,
    }


def roof(doc: dict) -> tuple[float | None, str]:
    """The fp32 roof of a run and its name: the FMA peak, or a sixth of the AMX bf16 peak where fastbert's fp32 GEMMs
    ran as bf16x3 and that is higher."""
    fma, tiles = doc["fma_peak_gflops"], doc.get("bf16x3_peak_gflops")
    if tiles and (not fma or tiles > fma):
        return tiles, "bf16x3 peak (AMX bf16 / 6)"
    return fma, "fp32 FMA peak"


def markdown(doc: dict) -> str:
    (peak, label), names = roof(doc), doc.get("systems", SYSTEMS)
    fma, tiles = doc["fma_peak_gflops"], doc.get("bf16x3_peak_gflops")
    peaks = f"FMA peak {fma:.0f} GFLOP/s" if fma else "FMA peak n/a"
    lines = [
        "# The encoder's GEMMs with their epilogues (fp32; int8 for scale)",
        "",
        f"{doc['device']}, CPU kind {doc['cpu_kind']}, {doc['threads']} threads; commit {doc['commit']}; "
        f"{doc['date_utc']}; load average {', '.join(f'{x:.2f}' for x in doc['load_average'])}; {peaks}"
        + (f"; bf16x3 peak (AMX bf16 / 6) {tiles:.0f} GFLOP/s" if tiles else ""),
        "",
        *((f"**{warning}**", "") if (warning := model_report.load_warning(doc)) else ()),
        f"GFLOP/s (2 M N K per second; int8: multiply-adds x 2), and fastbert gemm's share of the {label}."
        + (f" fastbert gemm runs fp32 as bf16x3 on AMX tiles where K is a multiple of 32, above {gemm.FMA_ROWS} rows; "
           "fastbert gemm (FMA) is its vector FMA kernel." if FMA in names else ""),
        "",
        "| H | M | layer | " + " | ".join(names) + " | gemm / oneDNN | gemm / torch | gemm % of peak |",
        "|---:|---:|---|" + "---:|" * (len(names) + 3),
    ]
    for r in doc["results"]:
        g = r["gflops"]
        share = f"{100 * g['fastbert gemm'] / peak:.0f}%" if peak else "n/a"
        lines.append(f"| {r['hidden']} | {r['m']} | {r['layer']} | " + " | ".join(f"{g[s]:.0f}" for s in names)
                     + f" | {g['fastbert gemm'] / g['oneDNN']:.2f}x | {g['fastbert gemm'] / g['torch']:.2f}x | "
                     f"{share} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> bool:
    warning = model_report.load_warning(doc)
    title = (f"Encoder GEMMs with their epilogues (int8: GOP/s, its own roof), {doc['device']} "
                 f"({doc['cpu_kind']})" + (f"\n{warning}" if warning else ""))
    doc = {**doc, "systems": doc.get("systems", SYSTEMS)}  # files written before the int16-pair column
    return gemm_bars(doc, *roof(doc), title, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_gemm", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[384, 768], help="hidden sizes (MiniLM, BERT-base)")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512], help="tokens per GEMM (M)")
    parser.add_argument("--budget", type=float, default=1.5, help="seconds of interleaved calls per shape")
    parser.add_argument("--out", default=run_folder(), help="directory for gemm_cpu-<kind>.{json,md,png}")
    args = parser.parse_args(argv)
    if (reason := gemm.unavailable_reason()) is not None:  # make bench goes on without the native extension
        print(f"bench_gemm: skipped, fastbert's GEMMs {reason}")
        return 0
    doc = run(args.hidden, args.rows, args.budget)
    print(model_report.write_results(args.out, f"gemm_cpu-{doc['cpu_kind']}", doc, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
