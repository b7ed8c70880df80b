"""The encoder's bf16 GEMMs with their epilogues, side by side in one run: fastbert's bf16 kernel on AMX tiles (the
`gemm` backend's bf16 calls), oneDNN with a prepacked weight (on its row parts, as fastbert's oneDNN path runs it) and
torch (F.linear, then the epilogue), all in bf16.

Per layer of a BERT encoder with hidden size H on M tokens: QKV [M, H] x [H, 3H]; attention output [M, H] x [H, H] +
residual + LayerNorm; FFN in [M, H] x [H, 4H] + GELU; FFN out [M, 4H] x [4H, H] + residual + LayerNorm. As in a
forward, every call finds its weight out of the caches: each system cycles through --layers copies of each weight
(BERT-base's 12 layers of bf16 weights are 170 MB, more than any L2), the reason this kernel exists.
FLOPs = 2 M N K. The roof is the AMX bf16 tile peak measured in the same run (tile products from registers,
`arithmetic_peak("amx_bf16")`, before and after, the higher kept). Timing: the systems' calls interleaved for
--budget seconds per shape, fastest call kept (bench_native's rule); "layer" sums the four GEMMs' fastest calls.

    python -m benchmarks.bench_bf16_gemm
    python -m benchmarks.bench_bf16_gemm --hidden 768 --rows 128 --budget 1 --out /tmp/b

Results: bf16_gemm_cpu-<cpu kind>.{json,md,png} in --out (default: a fresh folder, benchmarks/run_folder.py). Needs AMX
tiles (skipped elsewhere: bf16 GEMMs there are oneDNN's).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks import model_report
from benchmarks.bench_native import cpu_best_seconds
from benchmarks.plotting import gemm_bars
from benchmarks.run_folder import run_folder
from fastbert.backends import gemm, native, onednn

SYSTEMS = ("fastbert bf16 (AMX)", "oneDNN", "torch")
GEMMS = ("QKV", "attention out", "FFN in", "FFN out")


def layers(hidden: int) -> list[tuple[str, int, int, str | None]]:
    """(name, K, N, epilogue) of one encoder layer's GEMMs; the epilogue is an activation or "layernorm"."""
    return [("QKV", hidden, 3 * hidden, None), ("attention out", hidden, hidden, "layernorm"),
            ("FFN in", hidden, 4 * hidden, "gelu"), ("FFN out", 4 * hidden, hidden, "layernorm")]  # fmt: skip


def system_calls(m: int, k: int, n: int, epilogue: str | None, copies: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Each system's call for one GEMM + epilogue on the same bf16 operands, each call on the next of `copies`
    weights."""
    g = torch.Generator().manual_seed(m + k + n)
    bf16 = torch.bfloat16
    weights = [(torch.randn(n, k, generator=g) / k**0.5).to(bf16) for _ in range(copies)]
    x, b = torch.randn(m, k, generator=g).to(bf16), torch.randn(n, generator=g).to(bf16)
    ln = (torch.randn(m, n, generator=g).to(bf16), torch.ones(n, dtype=bf16), torch.zeros(n, dtype=bf16), 1e-12)

    def cycling(run: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        nxt = itertools.cycle(weights).__next__
        return lambda: run(nxt())

    if epilogue == "layernorm":
        res, lw, lb, eps = ln
        return {
            SYSTEMS[0]: cycling(lambda w: gemm.dense_residual_layernorm(x, w, b, *ln)),
            SYSTEMS[1]: cycling(lambda w: onednn.dense_residual_layernorm(x, w, b, *ln)),
            SYSTEMS[2]: cycling(lambda w: F.layer_norm(F.linear(x, w, b) + res, (n,), lw, lb, eps)),
        }
    act = (lambda t: F.gelu(t)) if epilogue == "gelu" else (lambda t: t)
    return {
        SYSTEMS[0]: cycling(lambda w: gemm.linear(x, w, b, epilogue)),
        SYSTEMS[1]: cycling(lambda w: onednn.linear(x, w, b, epilogue)),
        SYSTEMS[2]: cycling(lambda w: act(F.linear(x, w, b))),
    }


def run(hiddens: list[int], rows: list[int], budget: float, copies: int) -> dict:
    cpu, _ = native.load("_native_cpu")
    peaks = [cpu.arithmetic_peak("amx_bf16", 0.5)]  # measured before and after the GEMMs: the higher is the roof
    results = []
    for hidden in hiddens:
        for m in rows:
            for name, k, n, epilogue in layers(hidden):
                calls = system_calls(m, k, n, epilogue, copies)
                for fn in calls.values():
                    for _ in range(copies):
                        fn()  # packs, primitives, row parts: built before timing
                best = cpu_best_seconds(calls, budget)
                results.append({"hidden": hidden, "layer": name, "m": m, "k": k, "n": n, "epilogue": epilogue,
                                "us": {s: t * 1e6 for s, t in best.items()},
                                "gflops": {s: 2 * m * n * k / t / 1e9 for s, t in best.items()}})  # fmt: skip
                print(f"H {hidden} M {m} {name}: " + ", ".join(f"{s} {v * 1e6:.0f} us" for s, v in best.items()),
                      flush=True)  # fmt: skip
    peaks.append(cpu.arithmetic_peak("amx_bf16", 0.5))
    peak = max((p for p in peaks if p), default=None)
    return {
        **model_report.cpu_run(),
        "weight_copies": copies,
        "amx_peak_gflops": peak / 1e9 if peak else None,
        "systems": list(SYSTEMS),
        "results": results,
    }


def layer_sums(doc: dict) -> list[tuple[int, int, dict[str, float]]]:
    """(H, M, system -> us) of each layer: its four GEMMs' fastest calls summed."""
    sums: dict[tuple[int, int], dict[str, float]] = {}
    for r in doc["results"]:
        total = sums.setdefault((r["hidden"], r["m"]), dict.fromkeys(doc["systems"], 0.0))
        for s in doc["systems"]:
            total[s] += r["us"][s]
    return [(h, m, us) for (h, m), us in sums.items()]


def markdown(doc: dict) -> str:
    peak, names = doc["amx_peak_gflops"], doc["systems"]
    mine, onednn_name = names[0], names[1]
    lines = [
        "# The encoder's bf16 GEMMs with their epilogues",
        "",
        f"{doc['device']}, CPU kind {doc['cpu_kind']}, {doc['threads']} threads; commit {doc['commit']}; "
        f"{doc['date_utc']}; load average {', '.join(f'{x:.2f}' for x in doc['load_average'])}; AMX bf16 peak "
        + (f"{peak:.0f} GFLOP/s" if peak else "n/a") + f"; each call on the next of {doc['weight_copies']} weights",
        "",
        *((f"**{warning}**", "") if (warning := model_report.load_warning(doc)) else ()),
        "A layer's four GEMMs, microseconds (fastest call of each, summed; lower is better):",
        "",
        "| H | M | " + " | ".join(names) + f" | {onednn_name} / {mine} |",
        "|---:|---:|" + "---:|" * (len(names) + 1),
    ]
    for h, m, us in layer_sums(doc):
        ratio = us[onednn_name] / us[mine]
        lines.append(f"| {h} | {m} | " + " | ".join(f"{us[s]:.0f}" for s in names) + f" | {ratio:.2f}x |")
    lines += ["", f"Each GEMM, GFLOP/s (2 M N K per second), and {mine}'s share of the AMX peak:", "",
              "| H | M | layer | " + " | ".join(names) + f" | {mine} / {onednn_name} | % of peak |",
              "|---:|---:|---|" + "---:|" * (len(names) + 2)]  # fmt: skip
    for r in doc["results"]:
        g = r["gflops"]
        share = f"{100 * g[mine] / peak:.0f}%" if peak else "n/a"
        lines.append(f"| {r['hidden']} | {r['m']} | {r['layer']} | " + " | ".join(f"{g[s]:.0f}" for s in names)
                     + f" | {g[mine] / g[onednn_name]:.2f}x | {share} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> bool:
    warning = model_report.load_warning(doc)
    title = (f"Encoder bf16 GEMMs with their epilogues, weights out of cache, {doc['device']} ({doc['cpu_kind']})"
                 + (f"\n{warning}" if warning else ""))
    return gemm_bars(doc, doc["amx_peak_gflops"], "AMX bf16 peak", title, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_bf16_gemm", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[384, 768], help="hidden sizes (MiniLM, BERT-base)")
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 512, 1024], help="tokens per GEMM (M)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of interleaved calls per shape")
    parser.add_argument("--layers", type=int, default=12, help="weight copies each system cycles through")
    parser.add_argument("--out", default=run_folder(), help="directory for bf16_gemm_cpu-<kind>.{json,md,png}")
    args = parser.parse_args(argv)
    cpu, reason = native.load("_native_cpu")
    if cpu is None or not getattr(cpu, "has_bf16_linear", bool)():
        print(f"bench_bf16_gemm: skipped, fastbert's bf16 GEMM needs AMX tiles and the native extension ({reason})")
        return 0
    doc = run(args.hidden, args.rows, args.budget, args.layers)
    print(model_report.write_results(args.out, f"bf16_gemm_cpu-{doc['cpu_kind']}", doc, markdown, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
