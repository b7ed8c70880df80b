"""Distillation runs: build the student (initialised from the teacher's layers), its projections and the objective,
then train it with the shared loop of `fastbert.train.fit` (one process or many under `torchrun`: DDP wraps the
student, the frozen teacher runs in every process; mixed precision, accumulation, AdamW + warmup, clipping,
resumable checkpoints, a wall-time budget, a progress bar), with a held-out evaluation before and after training.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fastbert.auto import model_class
from fastbert.checkpoint import PreTrainedModel, built_like
from fastbert.distill.data import TeacherCache, collate, read_corpus, tokenize_corpus
from fastbert.distill.models import DistillStudent, has_mlm_head, load_teacher, teacher_targets
from fastbert.distill.objectives import Objectives
from fastbert.distill.student import block_end_map, init_from_teacher, student_config, uniform_layer_map
from fastbert.errors import UsageError
from fastbert.masking import MLMMasker
from fastbert.tokenization import WordPieceTokenizer
from fastbert.train import (
    PRECISION_CHOICES,
    PRECISIONS,
    STATE_FILE,
    DistEnv,
    LengthGroupedBatchSampler,
    LoopConfig,
    check_writable,
    fingerprint,
    fit,
    init_distributed,
    latest_checkpoint,
    resolve_precision,
    run_eval,
)
from fastbert.train import loop as train_loop


@dataclass
class DistillConfig:
    """Everything a distillation run needs besides the teacher and the corpus."""

    output_dir: str
    num_layers: int | None = None  # default: half the teacher's
    layer_map: list[int] | None = None  # teacher layer copied into each student layer; default uniform
    hidden_size: int | None = None  # narrower student (fresh layers, projections for hidden-state losses)
    student_overrides: dict = field(default_factory=dict)  # e.g. embedding_size, layer_sharing, num_hidden_groups
    student_init: str | None = None  # checkpoint the student starts from (config, layers, tokenizer); default: teacher
    init: str = "auto"  # auto: copy what fits | copy: everything must be copied | random
    projection: bool | None = None  # None: learned projection iff the student is narrower
    freeze_embeddings: bool = False  # keep the (copied) word embeddings fixed: less optimizer work per step
    objectives: Objectives = field(default_factory=Objectives.distilbert)
    max_length: int = 128
    batch_size: int = 32  # per process
    grad_accum: int = 1
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    max_minutes: float | None = None  # wall-time budget of training and held-out evaluations, the one before included
    lr: float = 1e-4
    warmup_ratio: float = 0.05
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    precision: str = "auto"  # student compute: fp32 | bf16 | fp16 | auto (bf16 where it is fast here, else fp32)
    teacher_precision: str = "fp32"  # fp32 | bf16 | auto (teacher weights cast)
    mlm_probability: float = 0.15
    whole_word: bool = False
    cache_teacher: bool = False  # keep teacher targets on disk across epochs (unmasked inputs only)
    checkpoint_every: int = 500  # resumable checkpoints (not at the end: the student is the final result)
    keep_checkpoints: int = 2
    resume: str | None = None  # None | "latest" (in output_dir/checkpoints) | a step-N directory
    overwrite: bool = False  # train into an output_dir that holds another run's results (else refused)
    eval_fraction: float = 0.02
    max_eval: int = 2000
    eval_every: int = 0  # held-out evaluation every N steps (0: only before and after training)
    seed: int = 0
    device: str | None = None
    log_every: int = 10
    compile: bool = False  # the student's training forward (teacher targets included) through torch.compile
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        """Reject sizes no run can use, naming the field, before any work (the loop's fields: by LoopConfig)."""
        for name, low in (("num_layers", 1), ("hidden_size", 1), ("batch_size", 1), ("max_length", 2)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise UsageError(f"{name} must be >= {low}, got {value}")
        _loop_config(self, None)


@dataclass
class DistillResult:
    """Where the student went, the student itself, the logged history and the held-out loss before/after training.

    `train_seconds` is the training loop's wall time (periodic and final held-out evaluations included).
    """

    student_dir: str
    student: PreTrainedModel  # the trained student (this process's copy)
    history: list[dict]
    eval_before: float
    eval_after: float
    train_seconds: float


def _resolve_resume(cfg: DistillConfig) -> str | None:
    if cfg.resume is None:
        return None
    if cfg.resume == "latest":
        path = latest_checkpoint(os.path.join(cfg.output_dir, "checkpoints"))
        if path is None:
            raise FileNotFoundError(f"resume='latest' but there is no checkpoint in {cfg.output_dir}/checkpoints")
        return path
    if not os.path.isfile(os.path.join(cfg.resume, STATE_FILE)):
        raise FileNotFoundError(f"no distillation checkpoint at {cfg.resume} (expected {STATE_FILE} there)")
    return cfg.resume


def build_student(teacher: PreTrainedModel, cfg: DistillConfig) -> tuple[PreTrainedModel, list[int]]:
    """The student model (MLM head iff a logits objective is on) initialised from the chosen layers of `teacher` (the
    model the student starts from: the teacher, or `student_init`'s)."""
    t_cfg = teacher.config
    layers = cfg.num_layers if cfg.num_layers is not None else max(1, t_cfg.num_hidden_layers // 2)
    layer_map = list(cfg.layer_map) if cfg.layer_map is not None else uniform_layer_map(t_cfg.num_hidden_layers, layers)
    s_cfg = student_config(t_cfg, layers, cfg.hidden_size, layer_map, **cfg.student_overrides)
    # the teacher's family; with a pooler where it has one, so its Model class's from_pretrained works
    cls = model_class(s_cfg.model_type, "mlm" if cfg.objectives.uses_logits else "model")
    student = built_like(cls, s_cfg, teacher)
    if cfg.init not in ("auto", "copy", "random"):
        raise ValueError(f"init must be 'auto', 'copy' or 'random', got {cfg.init!r}")
    if cfg.init != "random":
        init_from_teacher(student, teacher, layer_map, strict=cfg.init == "copy")
    return student, layer_map


def _projections(s_width: int, t_width: int, cfg: DistillConfig, layer_map: dict[int, int], layers: int) -> dict:
    obj = cfg.objectives
    if not obj.uses_hidden:
        return {}
    project = cfg.projection
    if project is None:
        if s_width > t_width:
            raise ValueError(
                f"the student ({s_width}) is wider than the teacher ({t_width}); hidden-state objectives need a "
                "learned projection: pass projection=True (--projection) if a wider student is what you want"
            )
        project = s_width != t_width
    if not project and s_width != t_width:
        raise ValueError(f"student width {s_width} != teacher width {t_width}: hidden-state objectives need projection")
    if not project:
        return {}
    indices = set(layer_map) if obj.hidden_mse else set()
    if obj.cosine or obj.embedding:
        indices.add(layers)
    return {k: nn.Linear(s_width, t_width) for k in sorted(indices)}


def _cached_targets(cache: TeacherCache, indices, batch, teacher, obj, layer_map) -> dict:
    """Teacher targets from the cache, computing and storing them for examples it lacks."""
    lengths = batch["attention_mask"].sum(1).tolist()
    found = cache.get(indices)
    if found is None:
        t = teacher_targets(teacher, batch, obj, layer_map)
        per_example = []
        for row, n in enumerate(lengths):
            entry = {"embedding": t["embedding"][row]} if "embedding" in t else {}
            if "last" in t:
                entry["last"] = t["last"][row, :n]
            for k, h in t.get("hidden", {}).items():
                entry[f"hidden.{k}"] = h[row, :n]
            per_example.append(entry)
        cache.put(indices, per_example)
        return t
    width = batch["attention_mask"].shape[1]

    def padded(name: str) -> torch.Tensor:
        rows = [e[name] for e in found]
        out = rows[0].new_zeros(len(rows), width, rows[0].shape[-1])
        for i, r in enumerate(rows):
            out[i, : r.shape[0]] = r
        return out

    t: dict = {}
    for name in ("embedding", "anchor"):
        if name in found[0]:
            t[name] = torch.stack([e[name] for e in found])
    if "last" in found[0]:
        t["last"] = padded("last")
    if obj.hidden_mse:
        t["hidden"] = {k: padded(f"hidden.{k}") for k in layer_map}
    return _to_device(t, batch["input_ids"].device)


def _to_device(tree, device: torch.device):
    """Every tensor of a (nested) dict of targets moved to `device`: the cache keeps them on the CPU."""
    if torch.is_tensor(tree):
        return tree.to(device)
    return {k: _to_device(v, device) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _check(
    cfg: DistillConfig, teacher: PreTrainedModel, tokenizer: WordPieceTokenizer, student_tok: WordPieceTokenizer
) -> None:
    obj = cfg.objectives
    obj.validate()
    if tokenizer.vocab_size != teacher.config.vocab_size:
        raise ValueError(
            f"tokenizer vocabulary ({tokenizer.vocab_size}) != teacher vocabulary ({teacher.config.vocab_size}): "
            "distillation needs the teacher's own WordPiece vocabulary"
        )
    if not same_inputs(tokenizer, student_tok) and not (obj.pooled_only and cfg.cache_teacher):
        raise ValueError(
            f"the student ({cfg.student_init}) has another vocabulary than the teacher: no token of their inputs "
            "lines up, so only pooled objectives (embedding, similarity) can compare them, with cache_teacher=True "
            "(the teacher's targets are computed from its own tokenization before training)"
        )
    if obj.anchor and not (cfg.student_init and obj.pooled_only and cfg.cache_teacher):
        raise ValueError(
            "the anchor objective keeps the space of the model the student starts from: it needs student_init, "
            "pooled objectives only and cache_teacher=True (its targets are computed before training)"
        )
    if obj.uses_logits and not has_mlm_head(teacher):
        raise ValueError(
            "objectives kl/mlm/logits_mse need a teacher with an MLM head (BertForMaskedLM or BertForPreTraining); "
            f"this teacher is a {type(teacher).__name__} (a sentence encoder: use Objectives.sentence_embedding(), "
            "--preset sentence)"
        )
    if cfg.cache_teacher and (obj.masks_inputs or obj.uses_logits or obj.attention):
        raise ValueError(
            "cache_teacher caches embeddings/hidden states of unmasked inputs only: switch off kl, mlm, "
            "logits_mse and attention, or cache_teacher"
        )
    for name in ("precision", "teacher_precision"):
        if getattr(cfg, name) not in PRECISION_CHOICES:
            raise ValueError(f"{name} must be one of {PRECISION_CHOICES}, got {getattr(cfg, name)!r}")


def same_inputs(a: WordPieceTokenizer, b: WordPieceTokenizer) -> bool:
    """Both tokenizers turn a text into the same ids (same vocabulary, same special tokens)."""
    return a is b or a.backend.get_vocab() == b.backend.get_vocab() and (a.pad_id, a.cls_id) == (b.pad_id, b.cls_id)


POOLED = Objectives(embedding=1.0)
Labeller = tuple[PreTrainedModel, list[list[int]], int]  # a model, the corpus tokenised for it, its pad id


@torch.no_grad()
def label(
    labellers: dict[str, Labeller], rows: Sequence[int], device: torch.device, desc: str, show: bool, batch: int = 64
) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """Each labeller's mean-pooled embeddings of `rows`, yielded as (rows, {name: [n, H] fp32}) in batches sorted by
    the first one's lengths (little padding), with a progress bar: pooled-only runs compute every target up front."""
    first = next(iter(labellers.values()))[1]
    order = sorted(rows, key=lambda i: len(first[i]))
    bar = train_loop.progress(len(order), desc, show)
    for start in range(0, len(order), batch):
        chunk = order[start : start + batch]
        out = {}
        for name, (model, ids, pad_id) in labellers.items():
            inputs = _to_device(collate([ids[i] for i in chunk], pad_id), device)
            out[name] = teacher_targets(model, inputs, POOLED, {})["embedding"].cpu()
        yield chunk, out
        bar.update(len(chunk))
    bar.close()


def _label_corpus(cache: TeacherCache, labellers: dict[str, Labeller], env: DistEnv) -> None:
    """Fill the cache with every training text's targets (each rank labels its share; shards flushed as it goes, so a
    killed run keeps what it labelled)."""
    n = len(next(iter(labellers.values()))[1])
    rows = [i for i in range(env.rank, n, env.world_size) if i not in cache.entries]
    for k, (chunk, found) in enumerate(label(labellers, rows, env.device, "teacher", env.is_main)):
        cache.put(chunk, [{name: value[row] for name, value in found.items()} for row in range(len(chunk))])
        if k % 50 == 49:
            cache.flush()
    cache.flush()
    if env.distributed:
        dist.barrier()
    cache.refresh()


def _held_out_targets(labellers: dict[str, Labeller], device: torch.device) -> dict[str, torch.Tensor]:
    """Every held-out text's pooled targets, {name: [N, H]} in input order."""
    n = len(next(iter(labellers.values()))[1])
    out: dict[str, torch.Tensor] = {}
    for chunk, found in label(labellers, range(n), device, "teacher (held-out)", False):
        for name, value in found.items():
            out.setdefault(name, torch.empty(n, value.shape[1]))[chunk] = value
    return out


def _loop_config(cfg: DistillConfig, resume_path: str | None) -> LoopConfig:
    """The shared training loop's settings for this run (validated by LoopConfig)."""
    names = ("lr", "epochs", "max_steps", "max_minutes", "warmup_ratio", "weight_decay", "grad_accum", "precision")
    names += ("max_grad_norm", "eval_every", "log_every", "keep_checkpoints", "overwrite", "compile", "compile_backend")
    return LoopConfig(
        cfg.output_dir,
        **{name: getattr(cfg, name) for name in names},
        save_every=cfg.checkpoint_every,
        resume=resume_path or False,
        final_dir="student",
        run_files=("teacher_cache", "distill_config.json"),
        resume_flag="--resume latest",
    )


# DistillConfig fields a resumed run may change: how long, where and how it executes, how often it reports or saves;
# every other field (lr, precisions, masking, the held-out split...) changes what the run computes
NOT_IDENTITY = {"output_dir", "epochs", "max_steps", "max_minutes", "resume", "checkpoint_every", "keep_checkpoints"}
NOT_IDENTITY |= {"eval_every", "device", "log_every", "overwrite", "compile", "compile_backend"}


def _module_fingerprint(module: nn.Module) -> str:
    """A live model by content: its class and a SHA-256 of every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(type(module).__name__.encode())
    for name, tensor in sorted(module.state_dict().items()):
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name} {flat.dtype} {tuple(tensor.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return f"{type(module).__name__}:{digest.hexdigest()[:16]}"


def _source_identity(source: object) -> str | None:
    """A teacher, corpus or tokenizer by content: a path's fingerprint, texts' digest, a live model's weights."""
    if source is None:
        return None
    if isinstance(source, (str, os.PathLike)) and os.path.exists(source):
        return fingerprint(source)
    if isinstance(source, Sequence) and not isinstance(source, str):
        return hashlib.sha256("\n".join(map(str, source)).encode()).hexdigest()[:16]
    if isinstance(source, nn.Module):
        return _module_fingerprint(source)
    if isinstance(source, WordPieceTokenizer):
        return hashlib.sha256(json.dumps(source.backend.get_vocab(), sort_keys=True).encode()).hexdigest()[:16]
    return str(source)


def _digest(ids: list[list[int]]) -> str:
    digest = hashlib.sha256()
    for row in ids:
        digest.update(len(row).to_bytes(4, "little"))
        digest.update(array("q", row).tobytes())
    return digest.hexdigest()[:16]


def _cache_key(
    teacher: str | None, ids: list[list[int]], teacher_precision: str, obj: Objectives, hidden_map, anchor=None
) -> dict:
    """What the teacher cache's targets depend on: the teacher by content, the tokenised training inputs (corpus,
    tokenizer, max_length and held-out split in one digest), the teacher's precision and which targets it holds."""
    targets = {"last": bool(obj.cosine), "embedding": obj.uses_embedding}
    targets["hidden"] = {str(k): v for k, v in hidden_map.items()} if obj.hidden_mse else {}
    return {
        "format": 1,
        "teacher": teacher,
        "inputs": _digest(ids),
        "teacher_precision": teacher_precision,
        "targets": targets,
        **({"anchor": anchor} if anchor else {}),  # the model the student starts from, on the student's inputs
    }


def _identity(cfg: DistillConfig, teacher: object, corpus: object, tokenizer: object, eval_corpus: object) -> dict:
    """The options that define a distillation run, which a resumed run must share (`fastbert.train` checks)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IDENTITY}
    sources = {"teacher": teacher, "corpus": corpus, "tokenizer": tokenizer, "eval_corpus": eval_corpus}
    sources["student_init"] = cfg.student_init
    return {"command": "distill", **fields, **{k: _source_identity(v) for k, v in sources.items()}}


def _resolve_precisions(cfg: DistillConfig, env: DistEnv) -> DistillConfig:
    """'auto' resolved for this device, for the student and the teacher; the run says what it picked (rank 0)."""
    student, why = resolve_precision(cfg.precision, env.device)
    teacher, _ = resolve_precision(cfg.teacher_precision, env.device)
    if env.is_main and (student != cfg.precision or why.startswith("warning")):
        print(why, flush=True)
    return dataclasses.replace(cfg, precision=student, teacher_precision=teacher)


def distill(
    teacher: str | os.PathLike | nn.Module,
    corpus: str | os.PathLike | Sequence[str],
    config: DistillConfig,
    tokenizer: WordPieceTokenizer | str | None = None,
    eval_corpus: str | os.PathLike | Sequence[str] | None = None,
    on_step: Callable[[int, dict], None] | None = None,
) -> DistillResult:
    """Distil `teacher` into a smaller student on `corpus`; the student (+ tokenizer) lands in output_dir/student.

    `tokenizer` defaults to the teacher directory's own. Every bad input is reported before training starts.
    `on_step(step, record)` runs after every optimizer step (record: that step's logged history entry, or {}).
    """
    cfg = config
    env = init_distributed(cfg.device)
    resume_path = _resolve_resume(cfg)
    identity = _identity(cfg, teacher, corpus, tokenizer, eval_corpus)
    loop = dataclasses.replace(_loop_config(cfg, resume_path), identity=identity)
    loop = train_loop.check_output_dir(loop, env.is_main)
    check_writable(cfg.output_dir)
    teacher_model = load_teacher(teacher)
    if tokenizer is None:
        if not isinstance(teacher, (str, os.PathLike)):
            raise ValueError("a live teacher model needs its tokenizer: pass tokenizer=")
        tokenizer = teacher
    if not isinstance(tokenizer, WordPieceTokenizer):
        tokenizer = WordPieceTokenizer.from_pretrained(tokenizer)
    source, student_tok = teacher_model, tokenizer  # what the student starts from, and its tokenizer
    if cfg.student_init is not None:
        source, student_tok = load_teacher(cfg.student_init), WordPieceTokenizer.from_pretrained(cfg.student_init)
    _check(cfg, teacher_model, tokenizer, student_tok)
    obj = cfg.objectives
    texts = read_corpus(corpus)
    eval_texts = read_corpus(eval_corpus) if eval_corpus is not None else None
    if eval_texts is None:
        n_eval = min(cfg.max_eval, int(len(texts) * cfg.eval_fraction))
        eval_texts, texts = (texts[-n_eval:], texts[:-n_eval]) if n_eval else (texts[: min(64, len(texts))], texts)

    cfg = _resolve_precisions(cfg, env)
    torch.manual_seed(cfg.seed)
    teacher_model.requires_grad_(False)
    teacher_model = teacher_model.to(env.device).eval()
    student, init_map = build_student(source, cfg)  # copied from the full-precision teacher (or student_init)
    anchor_model = source.to(env.device).eval().requires_grad_(False) if obj.anchor else None
    del source
    if cfg.teacher_precision != "fp32":
        teacher_model = teacher_model.to(PRECISIONS[cfg.teacher_precision])
    s_layers, t_layers = student.config.num_hidden_layers, teacher_model.config.num_hidden_layers
    hidden_map = dict(obj.layer_map) if obj.layer_map is not None else block_end_map(t_layers, s_layers)
    if obj.attention:
        if student.config.num_attention_heads != teacher_model.config.num_attention_heads:
            raise ValueError("attention distillation needs as many heads in the student as in the teacher")
    projections = _projections(student.config.hidden_size, teacher_model.config.hidden_size, cfg, hidden_map, s_layers)
    if cfg.freeze_embeddings:
        (student.bert if hasattr(student, "bert") else student).embeddings.word_embeddings.requires_grad_(False)
    if getattr(student, "pooler", None) is not None:
        student.pooler.requires_grad_(False)  # no objective reaches it; frozen, it stays the teacher's (and DDP-safe)
    ids = tokenize_corpus(texts, student_tok, cfg.max_length)
    eval_ids = tokenize_corpus(eval_texts, student_tok, cfg.max_length)
    same = same_inputs(tokenizer, student_tok)
    teacher_ids = ids if same else tokenize_corpus(texts, tokenizer, cfg.max_length)
    cache, eval_targets = None, None
    if cfg.cache_teacher:
        anchor = {"model": identity["student_init"], "inputs": _digest(ids)} if obj.anchor else None
        key = _cache_key(identity["teacher"], teacher_ids, cfg.teacher_precision, obj, hidden_map, anchor)
        cache = TeacherCache(os.path.join(cfg.output_dir, "teacher_cache"), key, env.rank)
        if cache.rebuilt and env.is_main:
            print(cache.rebuilt, flush=True)
        if env.distributed:  # rank 0 has emptied another run's shards before any rank writes its own
            dist.barrier()
        if obj.pooled_only:  # small targets: all of them first, the teacher's from its own tokenization
            labellers = {"embedding": (teacher_model, teacher_ids, tokenizer.pad_id)}
            held_out = {"embedding": (teacher_model, tokenize_corpus(eval_texts, tokenizer, cfg.max_length),
                                      tokenizer.pad_id)}  # fmt: skip
            if obj.anchor:  # the model the student starts from, on the student's inputs
                labellers["anchor"] = (anchor_model, ids, student_tok.pad_id)
                held_out["anchor"] = (anchor_model, eval_ids, student_tok.pad_id)
            _label_corpus(cache, labellers, env)
            eval_targets = _held_out_targets(held_out, env.device)
    del anchor_model

    def targets(batch: dict[str, torch.Tensor]) -> dict:
        """The teacher's targets; training batches (they carry corpus indices) go through the cache if there is one,
        held-out ones (eval_index) through the targets computed before training if there are."""
        if "eval_index" in batch:
            rows = batch["eval_index"].cpu()
            return {name: value[rows].to(batch["input_ids"].device) for name, value in eval_targets.items()}
        if cache is not None and "index" in batch:
            return _cached_targets(cache, batch["index"].tolist(), batch, teacher_model, obj, hidden_map)
        return teacher_targets(teacher_model, batch, obj, hidden_map)

    module = DistillStudent(student, projections, obj, hidden_map, targets).to(env.device)
    masker = (
        MLMMasker.from_tokenizer(student_tok, whole_word=cfg.whole_word, probability=cfg.mlm_probability)
        if obj.masks_inputs
        else None
    )

    def make_batch(rows: list[int]) -> dict[str, torch.Tensor]:
        """Corpus rows padded (and masked from the RNG, which checkpoints restore per rank), with their indices."""
        return {**collate([ids[i] for i in rows], student_tok.pad_id, masker), "index": torch.tensor(rows)}

    def evaluate(model: nn.Module) -> dict[str, float]:
        """Mean held-out loss, each eval batch masked from its own fixed seed so every evaluation sees one input."""
        total = 0.0
        for start in range(0, len(eval_ids), cfg.batch_size):
            gen = torch.Generator().manual_seed(cfg.seed + start)
            batch = collate(eval_ids[start : start + cfg.batch_size], student_tok.pad_id, masker, gen)
            if eval_targets is not None:
                batch["eval_index"] = torch.arange(start, start + len(batch["input_ids"]))
            total += float(model(**{k: v.to(env.device) for k, v in batch.items()}).loss) * len(batch["input_ids"])
        return {"eval_loss": total / len(eval_ids)}

    def after_step(step: int, record: dict) -> None:
        if cache is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            cache.flush()
        if on_step is not None:
            on_step(step, record)

    t_eval = train_loop.clock()
    eval_before = run_eval(module, evaluate, env, cfg.precision)["eval_loss"]  # the initial student: same on resume
    eval_seconds = train_loop.clock() - t_eval  # inside the budget, and its estimate of one evaluation
    sampler = LengthGroupedBatchSampler(
        [len(r) for r in ids], cfg.batch_size, cfg.seed, rank=env.rank, world_size=env.world_size
    )
    loop = dataclasses.replace(loop, precision=cfg.precision)
    kept = {"projections": module.projections}  # trained, checkpointed, but not part of the saved student
    dataset = range(len(ids))  # corpus indices: make_batch turns a batch of them into tensors
    result = fit(
        module,
        dataset,
        make_batch,
        sampler,
        loop,
        env,
        evaluate,
        "distill",
        state=kept,
        on_step=after_step,
        eval_seconds=eval_seconds,
    )
    if cache is not None:
        cache.flush()
    student_dir = os.path.join(cfg.output_dir, "student")
    if env.is_main:
        student_tok.save(student_dir)
        with open(os.path.join(cfg.output_dir, "distill_config.json"), "w", encoding="utf-8") as f:
            json.dump(_jsonable(cfg, init_map, hidden_map), f, indent=2)
    if env.distributed:
        dist.barrier()
    history = [{"step": 0, "eval_loss": eval_before}, *result["history"]]
    eval_after = result["metrics"]["eval_loss"]
    return DistillResult(student_dir, student, history, eval_before, eval_after, result["train_seconds"])


def _jsonable(cfg: DistillConfig, init_map: list[int], hidden_map: dict[int, int]) -> dict:
    out = dataclasses.asdict(cfg)
    out["init_layer_map"] = init_map
    out["hidden_layer_map"] = {str(k): v for k, v in hidden_map.items()}
    return out
