"""Training-step benchmark: fwd + bwd + AdamW step of the same batch, fastbert vs transformers, side by side.

    python -m benchmarks.bench_train_step            # BERT-base on CUDA; BERT-mini (4 x 256) on a CPU
    python -m benchmarks.bench_train_step --quick    # fewer rows (32 x 128 only); on a CPU the tiny model too

Rows: sequence classification and MLM at 32 x 128 and 32 x 512 ragged (lengths uniform in [S/4, S]), and the
distillation step of the MiniLM recipe (fastbert/distill/recipes/minilm_sts.py: the 6-layer MiniLM teacher's forward
without grad, then the 3-layer student's step on the cosine loss of mean-pooled embeddings, embeddings frozen; random
weights of that shape, speed does not depend on them). Systems: transformers sdpa, transformers sdpa +
torch.compile, fastbert, fastbert + torch.compile; each has its own copy of the same initial weights and its own
AdamW (fused on CUDA, foreach on CPU), all run the same batch, interleaved round by round. Precision: bf16 autocast
where fastbert.capabilities says bf16 is fast here (a CUDA GPU, a CPU with bf16 dot products), else fp32.

Per row: ms per step (CUDA events on a GPU, perf_counter on a CPU; median of the rounds), host ms (until the step
returned to Python), sequences/s, real (non-pad) tokens/s, the ratio to transformers sdpa, and % of the peak matmul
FLOP/s measured in this run at that dtype on USEFUL FLOPs: a trained encoder of P non-embedding parameters and L
layers of width d does 6 * P * tokens + 12 * L * sum(s_i^2) * d per step (forward 2 + backward 4 per parameter and
token; attention's QK^T and PV 4 * s^2 * d per layer forward, 3x that with backward); a forward without grad (the
teacher) a third of that. Padding and the heads are not counted. loss0 is each system's loss on the first step (the
same weights and batch for all): the check that they train the same model. A system that fails is a row with its
reason. Writes train_step_<device>[-<asked precision>].{json,md,png} with device, versions and commit
to --out (default: a fresh folder, benchmarks/run_folder.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from benchmarks import model_report
from benchmarks.model_systems import failure
from benchmarks.plotting import pyplot
from benchmarks.run_folder import run_folder
from benchmarks.run_model import BERT_BASE, TINY, Shape, _time_once, make_batch, measure_peak
from fastbert import capabilities
from fastbert.distill.losses import embedding_loss, mean_pool

SYSTEMS = ("transformers sdpa", "transformers sdpa + compile", "fastbert", "fastbert + compile")
BASELINE = "transformers sdpa"
MODELS = {  # name -> (config fields, the distillation teacher's fields)
    "bert-base": (BERT_BASE, dict(BERT_BASE, hidden_size=384, num_hidden_layers=6, intermediate_size=1536)),
    "bert-mini": (dict(BERT_BASE, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
                  dict(BERT_BASE, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                       intermediate_size=1024)),  # fmt: skip
    "tiny": (dict(TINY, max_position_embeddings=128), dict(TINY, max_position_embeddings=128)),
}
STUDENT_LAYERS = {6: (0, 3, 5), 4: (0, 2, 3), 2: (1,)}  # teacher layers -> the ones the student keeps (MiniLM: 0 3 5)
MASK_ID, MLM_P = 103, 0.15
Step = Callable[[], torch.Tensor]  # one training step; returns its loss (not synced)


@dataclass(frozen=True)
class Task:
    """A row's job and batch shape."""

    kind: str  # "seqcls", "mlm" or "distill"
    shape: Shape

    @property
    def label(self) -> str:
        return f"{self.kind} {self.shape.batch}x{self.shape.seqlen}{' ragged' if self.shape.ragged else ''}"


@dataclass
class Row:
    task: str
    system: str
    batch: int
    seqlen: int
    real_tokens: int
    ms: float | None = None
    host_ms: float | None = None
    seq_per_s: float | None = None
    tok_per_s: float | None = None
    ratio_vs_sdpa: float | None = None
    useful_tflops: float | None = None
    pct_peak: float | None = None
    loss0: float | None = None
    skipped: str | None = None


def tasks_for(quick: bool, tiny: bool) -> list[Task]:
    """The rows: 32 x {128, 512} ragged for both heads and the distillation step at 32 x 128 (quick: 32 x 128;
    the tiny model: 4 x 32, for the smoke test)."""
    if tiny:
        shapes = (Shape(4, 32, True),)
    else:
        shapes = (Shape(32, 128, True),) if quick else (Shape(32, 128, True), Shape(32, 512, True))
    return [Task(k, s) for k in ("seqcls", "mlm") for s in shapes] + [Task("distill", shapes[0])]


def hf_config(fields: dict, dropout: float, **extra: Any) -> Any:
    import transformers

    return transformers.BertConfig(**fields, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                   attn_implementation="sdpa", **extra)  # fmt: skip


def useful_flops(params: int, layers: int, hidden: int, lengths: torch.Tensor, train: bool = True) -> float:
    """6 * P * tokens + 12 * L * sum(s^2) * d for a training step (fwd + bwd); a third of it for a forward only."""
    s = lengths.double()
    step = 6 * params * float(s.sum()) + 12 * layers * float((s * s).sum()) * hidden
    return step if train else step / 3


def _encoder_params(model: nn.Module) -> int:
    encoder = model.encoder if hasattr(model, "encoder") else model.base_model.encoder
    return sum(p.numel() for p in encoder.parameters())


def _optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=1e-5, fused=fused, foreach=None if fused else True)


def _autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


def _build_pair(hf: nn.Module, system: str, device: torch.device, compile_backend: str) -> nn.Module:
    """The system's own copy of `hf`'s weights: transformers (sdpa) or fastbert's class of the same contract."""
    if system.startswith("fastbert"):
        from fastbert.auto import BY_NAME

        model = BY_NAME[type(hf).__name__].from_hf(hf)
    else:
        model = copy.deepcopy(hf)
    model = model.to(device).train()
    return torch.compile(model, backend=compile_backend) if system.endswith("compile") else model


def make_step(task: Task, system: str, models: dict[str, nn.Module], batch: dict[str, torch.Tensor],
              device: torch.device, dtype: torch.dtype, compile_backend: str = "inductor") -> Step:  # fmt: skip
    """One optimizer step of `system` on `batch`: zero grads, forward under autocast, backward, AdamW."""
    if task.kind == "distill":
        teacher = _build_pair(models["teacher"], system, device, compile_backend).eval()
        student = _build_pair(models["student"], system, device, compile_backend)
        getattr(student, "_orig_mod", student).embeddings.requires_grad_(False)  # the recipe's freeze_embeddings
        optimizer = _optimizer(student, device)
        ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]

        def loss_fn() -> torch.Tensor:
            with torch.no_grad():
                target = mean_pool(teacher(input_ids=ids, attention_mask=mask, token_type_ids=types)[0], mask)
            hidden = student(input_ids=ids, attention_mask=mask, token_type_ids=types)[0]
            return embedding_loss(mean_pool(hidden, mask), target, "cosine")
    else:
        model = _build_pair(models[task.kind], system, device, compile_backend)
        optimizer = _optimizer(model, device)

        def loss_fn() -> torch.Tensor:
            return model(**batch).loss

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            loss = loss_fn()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def task_batch(task: Task, vocab: int, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """The row's batch: ids, right padding, token types; labels (two classes, or 15% of the real tokens masked)."""
    ids, mask, types = make_batch(task.shape, vocab, device, seed)
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    gen = torch.Generator().manual_seed(seed + 1)
    if task.kind == "seqcls":
        batch["labels"] = torch.randint(0, 2, (task.shape.batch,), generator=gen).to(device)
    elif task.kind == "mlm":
        picked = (torch.rand(ids.shape, generator=gen) < MLM_P).to(device) & (mask == 1)
        batch["labels"] = ids.masked_fill(~picked, -100)
        batch["input_ids"] = ids.masked_fill(picked, MASK_ID)
    return batch


def task_models(task: Task, model: str, dropout: float) -> dict[str, nn.Module]:
    """The row's fp32 transformers models, seeded random weights (each system copies them): the head model, or the
    distillation teacher and its student (the teacher's layers STUDENT_LAYERS)."""
    import transformers

    fields, teacher_fields = MODELS[model]
    torch.manual_seed(0)
    if task.kind == "seqcls":
        return {"seqcls": transformers.BertForSequenceClassification(hf_config(fields, dropout, num_labels=2))}
    if task.kind == "mlm":
        return {"mlm": transformers.BertForMaskedLM(hf_config(fields, dropout))}
    teacher = transformers.BertModel(hf_config(teacher_fields, dropout), add_pooling_layer=False).eval()
    keep = STUDENT_LAYERS[teacher.config.num_hidden_layers]
    student = copy.deepcopy(teacher)
    student.encoder.layer = nn.ModuleList(student.encoder.layer[i] for i in keep)
    student.config.num_hidden_layers = len(keep)
    return {"teacher": teacher, "student": student}


def task_flops(task: Task, models: dict[str, nn.Module], lengths: torch.Tensor) -> float:
    """Useful FLOPs of one step of the row (see the module docstring)."""
    total = 0.0
    for name, m in models.items():
        cfg = m.config
        total += useful_flops(_encoder_params(m), cfg.num_hidden_layers, cfg.hidden_size, lengths, name != "teacher")
    return total


def run_task(task: Task, model: str, systems: tuple[str, ...], device: torch.device, dtype: torch.dtype,
             rounds: int, warmup: int, dropout: float, peak: float, log: Callable[[str], None],
             compile_backend: str = "inductor", deadline: float = float("inf")) -> list[Row]:  # fmt: skip
    """Every system on the row's batch: warm-up steps (the first one's loss is loss0; compiles happen here), then
    `rounds` interleaved timed steps; a system that raises, or that would start after `deadline` (perf_counter
    seconds), becomes a row with its reason."""
    models = task_models(task, model, dropout)
    vocab = next(iter(models.values())).config.vocab_size
    batch = task_batch(task, vocab, device)
    lengths = batch["attention_mask"].sum(1).cpu()
    real = int(lengths.sum())
    flops = task_flops(task, models, lengths)
    steps: dict[str, Step] = {}
    rows = {s: Row(task.label, s, task.shape.batch, task.shape.seqlen, real) for s in systems}
    for system in systems:
        begin = time.perf_counter()
        if begin > deadline:
            rows[system].skipped = "not run: the --max-minutes budget was spent before this row"
            continue
        try:
            steps[system] = make_step(task, system, models, batch, device, dtype, compile_backend)
            for i in range(warmup):
                loss = float(steps[system]())
                if i == 0:
                    rows[system].loss0 = loss
            log(f"{task.label} {system}: loss0 {rows[system].loss0:.5f}, warm-up {time.perf_counter() - begin:.1f} s")
        except Exception as exc:  # a failing system is a row with its reason, never the end of the suite
            rows[system].skipped = failure(exc)
            steps.pop(system, None)
            log(f"{task.label} {system}: {rows[system].skipped}")
    times: dict[str, list[tuple[float, float]]] = {s: [] for s in steps}
    for _ in range(rounds):
        for system, step in list(steps.items()):
            try:
                times[system].append(_time_once(step, device))
            except Exception as exc:
                rows[system].skipped = failure(exc)
                del steps[system], times[system]
    for system, measured in times.items():
        row = rows[system]
        sec = statistics.median(t for t, _ in measured)
        row.ms, row.host_ms = sec * 1e3, statistics.median(h for _, h in measured) * 1e3
        row.seq_per_s, row.tok_per_s = task.shape.batch / sec, real / sec
        row.useful_tflops = flops / sec / 1e12
        row.pct_peak = 100 * flops / sec / peak
    base = rows.get(BASELINE)
    for row in rows.values():
        if row.ms is not None and base is not None and base.ms is not None:
            row.ratio_vs_sdpa = base.ms / row.ms
    return list(rows.values())


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# Training step: {doc['device']}",
        "",
        *([doc["note"], ""] if doc.get("note") else []),
        f"{doc['model']} ({doc['precision']}), dropout {doc['dropout']}, AdamW ({doc['optimizer']}); "
        f"median of {doc['rounds']} interleaved rounds after {doc['warmup']} warm-up steps. Peak matmul measured in "
        f"this run: {doc['peak_tflops']:.2f} TFLOP/s. Commit {doc['commit']}; "
        + ", ".join(f"{k} {v}" for k, v in doc["versions"].items())
        + ".",
        "",
        "| row | system | ms/step | host ms | seq/s | real tok/s | vs sdpa | useful TFLOP/s | % peak | loss0 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for r in doc["rows"]:
        if r["skipped"]:
            lines.append(f"| {r['task']} | {r['system']} | did not run: {r['skipped']} |||||||||")
            continue
        lines.append(
            f"| {r['task']} | {r['system']} | {f(r['ms'], '.1f')} | {f(r['host_ms'], '.1f')} | "
            f"{f(r['seq_per_s'], '.1f')} | {f(r['tok_per_s'], '.0f')} | {f(r['ratio_vs_sdpa'], '.2f')}x | "
            f"{f(r['useful_tflops'], '.3f')} | {f(r['pct_peak'], '.1f')}% | {f(r['loss0'], '.5f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: str) -> None:
    """Ratio to transformers sdpa per row and system (a system that did not run is marked with its reason)."""
    plt = pyplot()
    if plt is None:
        return
    tasks = list(dict.fromkeys(r["task"] for r in doc["rows"]))
    systems = list(dict.fromkeys(r["system"] for r in doc["rows"]))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(tasks)), 4))
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        for i, task in enumerate(tasks):
            row = next(r for r in doc["rows"] if r["task"] == task and r["system"] == system)
            x = i + (j - (len(systems) - 1) / 2) * width
            if row["ratio_vs_sdpa"] is None:
                ax.text(x, 0.02, "did not run", rotation=90, ha="center", va="bottom", fontsize=7)
                continue
            ax.bar(x, row["ratio_vs_sdpa"], width, color=f"C{j}", label=system if i == 0 else None)
            ax.text(x, row["ratio_vs_sdpa"], f"{row['ratio_vs_sdpa']:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(tasks)), tasks, fontsize=8)
    ax.set_ylabel("steps/s vs transformers sdpa")
    title = f"Training step, {doc['model']} {doc['precision']}: {doc['device']}"
    ax.set_title(textwrap.fill(title, 100), fontsize=8)
    if ax.get_legend_handles_labels()[1]:  # none where no system ran
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def device_label(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else f"cpu-{capabilities.cpu_kind()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="32 x 128 rows only (and the tiny model on a CPU)")
    p.add_argument("--model", choices=sorted(MODELS), help="default: bert-base on CUDA, bert-mini on a CPU")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--rounds", type=int, default=None, help="timed steps per system (default 10 CUDA, 3 CPU)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system first (compiles happen here)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend for the compile rows")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, all cores)")
    p.add_argument("--note", default="", help="what the device name leaves out (CPU generation, machine load)")
    p.add_argument("--max-minutes", type=float, help="start no system after this (a compile under way finishes)")
    p.add_argument("--out", default=run_folder())
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or ("bert-base" if device.type == "cuda" else ("tiny" if args.quick else "bert-mini"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.precision) or capabilities.fast_dtype(device)
    rounds = args.rounds or (10 if device.type == "cuda" else 3)
    precision = "fp32" if dtype == torch.float32 else "bf16 autocast"
    print(f"{model}, {precision} ({'chosen' if args.precision == 'auto' else 'asked'}), device {device}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.perf_counter()
    deadline = start + 60 * args.max_minutes if args.max_minutes else float("inf")
    peak = measure_peak(device, dtype)
    rows: list[Row] = []
    for task in tasks_for(args.quick, model == "tiny"):
        rows += run_task(task, model, tuple(args.systems), device, dtype, rounds, max(1, args.warmup), args.dropout,
                         peak, lambda line: print(line, file=sys.stderr, flush=True), args.compile_backend,
                         deadline)  # fmt: skip
    doc = {
        "device": model_report.device_name(device),
        "cpu": capabilities.cpu_model() if device.type == "cpu" else None,
        "device_type": device.type,
        "versions": model_report.versions(),
        "commit": model_report.git_commit(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "note": args.note,
        "model": model,
        "precision": precision,
        "dropout": args.dropout,
        "optimizer": "fused" if device.type == "cuda" else "foreach",
        "compile_backend": args.compile_backend,
        "rounds": rounds,
        "warmup": max(1, args.warmup),
        "peak_tflops": peak / 1e12,
        "flops_formula": "6 * P_nonembedding * real_tokens + 12 * L * sum(s_i^2) * d per trained encoder; /3 no grad",
        "seconds": time.perf_counter() - start,
        "rows": [asdict(r) for r in rows],
    }
    if device.type == "cpu":
        doc["device"] = f"{doc['device']}; {doc['cpu']}"
    stem = f"train_step_{device_label(device)}" + ("" if args.precision == "auto" else f"-{args.precision}")
    table = model_report.write_results(args.out, stem, doc, markdown, plot)  # an asked precision: its own files
    print(table)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
