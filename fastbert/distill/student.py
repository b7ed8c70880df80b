"""Student construction: a smaller BertConfig derived from the teacher's, and initialisation from chosen teacher
layers (DistilBERT's [0, 2, 4, 7, 9, 11] of 12, or a uniform map). Tensors are copied where shapes agree: a narrower
student starts fresh, an ALBERT-style student with embedding_size == teacher width keeps the teacher's tables.
"""

from __future__ import annotations

import logging

import torch

from fastbert.checkpoint import PreTrainedModel
from fastbert.config import BertConfig

log = logging.getLogger("fastbert.distill")

DISTILBERT_LAYERS = (0, 2, 4, 7, 9, 11)


def uniform_layer_map(teacher_layers: int, student_layers: int) -> list[int]:
    """Evenly spaced teacher layers, first and last included (gives DistilBERT's map for 12 -> 6)."""
    if not 1 <= student_layers <= teacher_layers:
        raise ValueError(f"student layers must be in [1, {teacher_layers}], got {student_layers}")
    if student_layers == 1:
        return [teacher_layers - 1]
    return [int(i * (teacher_layers - 1) / (student_layers - 1) + 0.5) for i in range(student_layers)]


def block_end_map(teacher_layers: int, student_layers: int) -> dict[int, int]:
    """hidden_states index of the student -> teacher for intermediate losses: 0 <-> 0 (embeddings), and student
    layer k's output <-> the output of the last teacher layer of the k-th block (TinyBERT's g(m) = m * L_t / L_s)."""
    return {k: round(k * teacher_layers / student_layers) for k in range(student_layers + 1)}


def student_config(
    teacher: BertConfig,
    num_layers: int,
    hidden_size: int | None = None,
    layer_map: list[int] | None = None,
    **overrides,
) -> BertConfig:
    """The teacher's config with fewer layers and, optionally, a narrower width or ALBERT options.

    A narrower student scales intermediate_size with the width and keeps the head dimension where it divides. A
    family with global and sliding-window layers (ModernBERT) keeps the kind of each teacher layer `layer_map` picks
    (default: uniform_layer_map's).
    """
    values = teacher.to_dict()
    for key in ("architectures", "dtype", "torch_dtype", "_name_or_path", "transformers_version"):
        values.pop(key, None)
    values["num_hidden_layers"] = num_layers
    if teacher.family.sliding_layers:
        chosen = layer_map if layer_map is not None else uniform_layer_map(teacher.num_hidden_layers, num_layers)
        values["layer_types"] = [teacher.layer_kinds[j] for j in chosen]
    if hidden_size is not None and hidden_size != teacher.hidden_size:
        values["hidden_size"] = hidden_size
        values["intermediate_size"] = teacher.intermediate_size * hidden_size // teacher.hidden_size
        if hidden_size % teacher.head_dim == 0:
            values["num_attention_heads"] = hidden_size // teacher.head_dim
    values.update(overrides)
    return BertConfig.from_dict(values)


def _copy(dst: torch.Tensor, src: torch.Tensor, done: set[int]) -> bool:
    """Copy if shapes agree and this storage was not written yet (shared ALBERT layers take their first source)."""
    if dst.shape != src.shape:
        return False
    key = dst.data_ptr()
    if key not in done:
        with torch.no_grad():
            dst.copy_(src.to(dst.dtype))
        done.add(key)
    return True


def init_from_teacher(
    student: PreTrainedModel, teacher: PreTrainedModel, layer_map: list[int], strict: bool = False
) -> dict[str, list[str]]:
    """Copy embeddings, the mapped encoder layers (student i <- teacher layer_map[i]), pooler and MLM head.

    Returns {"copied": [...], "fresh": [...]} student keys; `strict=True` raises if anything stays fresh.
    """
    n_student, n_teacher = student.config.num_hidden_layers, teacher.config.num_hidden_layers
    if len(layer_map) != n_student:
        raise ValueError(f"layer map has {len(layer_map)} entries for a {n_student}-layer student")
    if any(not 0 <= j < n_teacher for j in layer_map):
        raise ValueError(f"layer map {layer_map} refers to layers outside the teacher's 0..{n_teacher - 1}")
    s_prefix = "bert." if hasattr(student, "bert") else ""
    t_prefix = "bert." if hasattr(teacher, "bert") else ""
    t_state = teacher.state_dict()
    done: set[int] = set()
    copied, fresh = [], []
    for key, value in student.state_dict(keep_vars=True).items():
        if s_prefix and not key.startswith(s_prefix):
            source = key  # a head tensor (cls.predictions...): same name in both
        else:
            base = key[len(s_prefix) :]
            if base.startswith("encoder.layer."):
                _, _, index, rest = base.split(".", 3)
                base = f"encoder.layer.{layer_map[int(index)]}.{rest}"
            source = t_prefix + base
        ok = source in t_state and _copy(value.data, t_state[source], done)
        (copied if ok else fresh).append(key)
    if fresh and strict:
        raise ValueError(f"could not copy from the teacher (shape or name mismatch): {fresh[:10]}")
    if fresh:
        log.info("student tensors left freshly initialised: %s", fresh[:10])
    student.tie_weights()
    return {"copied": copied, "fresh": fresh}
