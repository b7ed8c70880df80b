"""onnxruntime vs PyTorch on shapes the export never saw: ragged rows, a fully padded row, batch of 1.

A graph is judged against the truth, the PyTorch model evaluated in fp64, at valid positions, never against another
rounding of it: PyTorch's fp32 can be the less exact of the two (an AVX2 CPU's GEMMs sum in another order). An fp32
graph may differ from fp64 by 1e-4, or by twice the fp32 reference's own error where that is larger, never by more
than 1e-3 (a PyTorch fp32 path gone wrong does not loosen the gate further); an fp16 graph by twice the fp16 model's
own error plus a small floor (the project's low-precision rule). A few tables are built in fp32 even in the fp64
evaluation (rotary frequencies, MPNet's bias table, EuroBERT's RMSNorm statistics): "fp64" is the model's arithmetic
there, not exact. Every output must be finite
everywhere, padding included.
"""

from __future__ import annotations

import copy
import os

import torch
from tqdm.auto import tqdm

from fastbert.checkpoint import PreTrainedModel
from fastbert.config import BertConfig
from fastbert.errors import CheckError
from fastbert.onnx.graph import head_name, output_names, spec_of
from fastbert.onnx.session import Session

BATCHES, LENGTHS = (1, 3), (1, 8, 128, 512)
FP32_ATOL = 1e-4
FP32_CEILING = 1e-3
FP16_FLOOR = 1e-3


def parity_shapes(config: BertConfig) -> list[tuple[int, int]]:
    """(batch, seqlen) pairs checked on export; lengths the position table cannot take are dropped."""
    longest = config.max_position_embeddings
    if config.family.padded_positions:  # RoBERTa's positions start at pad_token_id + 1
        longest -= config.pad_token_id + 1
    return [(b, s) for b in BATCHES for s in LENGTHS if s <= longest]


def make_inputs(
    config: BertConfig, batch: int, seqlen: int, choices: int | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random ids and token types (none for a family without). One row: full length. Several: row 0 right-padded,
    row 1 left-padded, row 2 fully padded, further rows right-padded; ragged lengths are random in [1, seqlen - 1]
    (1 when seqlen is 1)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seqlen) if choices is None else (batch, choices, seqlen)
    ids = torch.randint(0, config.vocab_size, shape, generator=gen)
    types = torch.randint(0, max(config.type_vocab_size, 1), shape, generator=gen)  # type_vocab_size 0: zeros
    lengths = torch.randint(1, max(seqlen, 2), (batch, 1), generator=gen) if batch > 1 else torch.full((1, 1), seqlen)
    positions = torch.arange(seqlen).expand(batch, seqlen).clone()
    if batch > 1:
        positions[1] = positions[1].flip(0)  # left padding: the ones sit at the end
    if batch > 2:
        lengths[2] = 0
    mask = (positions < lengths).long()
    if choices is not None:
        mask = mask.unsqueeze(1).expand(shape).contiguous()
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    return inputs if config.family.token_types else {k: v for k, v in inputs.items() if k != "token_type_ids"}


def _errors(
    model: PreTrainedModel, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], mask: torch.Tensor
) -> dict[str, float]:
    """Max abs error per output; per-token outputs at valid positions only."""
    spec = spec_of(model)
    per_token = dict(zip(spec.outputs, spec.per_token, strict=True))
    errors = {}
    for name in output_names(model):
        diff = (got[name].double() - want[name].double()).abs()
        if per_token[name]:
            diff = diff[mask.bool()]
        errors[name] = diff.max().item() if diff.numel() else 0.0
    return errors


def _torch_outputs(model: PreTrainedModel, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(**inputs)
    return {name: out[name] for name in output_names(model)}


def check_parity(
    model: PreTrainedModel,
    path: str | os.PathLike,
    shapes: list[tuple[int, int]],
    reference: PreTrainedModel | str | os.PathLike,
    progress: bool = True,
) -> dict[tuple[int, int], float]:
    """Max abs error of the ONNX graph at `path` per (batch, seqlen); raises CheckError if any is out of bounds.

    `model` is the exported PyTorch model (its dtype is the graph's); `reference` is the fp32 PyTorch model (evaluated
    in fp64 on a copy: a check holds the weights three times over, the fp64 copy twice), or another fp32 ONNX graph to
    compare against within 1e-4 (the unoptimized export, for the optimized one).
    """
    fp16 = next(model.parameters()).dtype == torch.float16
    if fp16 and not isinstance(reference, PreTrainedModel):
        raise ValueError("an fp16 graph is checked against the fp32 PyTorch model, not against another graph")
    session = Session(path)
    other = copy.deepcopy(reference).double().eval() if isinstance(reference, PreTrainedModel) else Session(reference)
    choices = 2 if head_name(model) == "BertForMultipleChoice" else None
    results = {}
    for batch, seqlen in tqdm(shapes, desc=f"parity {os.path.basename(path)}", disable=not progress, leave=False):
        inputs = make_inputs(model.config, batch, seqlen, choices)
        got = session(**inputs)
        bad = [name for name in output_names(model) if not torch.isfinite(got[name]).all()]
        if bad:
            raise CheckError(f"{path}: non-finite values in {bad} at batch={batch}, seqlen={seqlen}")
        mask = inputs["attention_mask"]
        if isinstance(other, Session):
            want, bound = other(**inputs), FP32_ATOL
        else:
            want = _torch_outputs(other, inputs)
            rounded = _torch_outputs(model if fp16 else reference, inputs)  # PyTorch's own error at this precision
            own = max(_errors(model, rounded, want, mask).values())
            bound = 2 * own + FP16_FLOOR if fp16 else min(max(FP32_ATOL, 2 * own), FP32_CEILING)
        errors = _errors(model, got, want, mask)
        worst = max(errors.values())
        if worst > bound:
            raise CheckError(
                f"{path}: onnxruntime differs from the reference by {worst:.3g} (bound {bound:.3g}) at batch={batch}, "
                f"seqlen={seqlen}; per output: {errors}"
            )
        results[(batch, seqlen)] = worst
    return results
