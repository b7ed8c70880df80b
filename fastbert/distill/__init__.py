"""fastbert.distill: train smaller students from any BERT teacher, on one machine or many (torchrun).

    from fastbert.distill import DistillConfig, Objectives, distill
    distill("bert-base-dir", "corpus.txt", DistillConfig("out", num_layers=6, objectives=Objectives.distilbert()))

The student lands in `out/student` (config.json + model.safetensors + tokenizer), loadable by fastbert and
transformers alike. See docs/distill.md.
"""

from fastbert.distill.losses import (
    attention_kl,
    embedding_loss,
    hidden_cosine,
    hidden_mse,
    logits_mse,
    mean_pool,
    mlm_cross_entropy,
    soft_target_kl,
)
from fastbert.distill.objectives import Objectives
from fastbert.distill.student import (
    DISTILBERT_LAYERS,
    block_end_map,
    init_from_teacher,
    student_config,
    uniform_layer_map,
)
from fastbert.distill.trainer import DistillConfig, DistillResult, build_student, distill

__all__ = [
    "DISTILBERT_LAYERS",
    "DistillConfig",
    "DistillResult",
    "Objectives",
    "attention_kl",
    "block_end_map",
    "build_student",
    "distill",
    "embedding_loss",
    "hidden_cosine",
    "hidden_mse",
    "init_from_teacher",
    "logits_mse",
    "mean_pool",
    "mlm_cross_entropy",
    "soft_target_kl",
    "student_config",
    "uniform_layer_map",
]
