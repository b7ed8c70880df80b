"""Export a fastbert model to ONNX through the reference graph, then prove it: onnxruntime vs PyTorch on fresh shapes.

The check runs at shapes other than the export sample (batch {1, 3} x length {1, 8, 128, 512}, capped at
max_position_embeddings), with ragged rows and a fully padded row, so a shape baked into the graph or a NaN on an
all-padding row is caught at export time rather than in production.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

import fastbert
from fastbert.checkpoint import PreTrainedModel
from fastbert.errors import CheckError, UsageError, require
from fastbert.onnx import int8 as int8_graph
from fastbert.onnx.graph import INPUTS, ReferenceGraph, head_name, output_names, spec_of
from fastbert.onnx.parity import check_parity, parity_shapes

OPSET = 17
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
FUSED_OPS = ("EmbedLayerNormalization", "Attention", "SkipLayerNormalization", "BiasGelu", "FastGelu")


@dataclass
class ExportReport:
    """What export did and measured: max abs error per (batch, seqlen), fused-node counts, where files went."""

    path: str
    dtype: str
    parity: dict[tuple[int, int], float] = field(default_factory=dict)
    optimized_path: str | None = None
    fused: dict[str, int] | None = None
    # fp32: optimized vs unoptimized graph; fp16: optimized graph vs PyTorch in fp64
    optimized_parity: dict[tuple[int, int], float] = field(default_factory=dict)
    quantize: str | None = None  # "int8": `path` holds the dynamically quantised graph
    int8_parity: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [f"exported {self.path} ({'fp32 graph checked, then quantized' if self.quantize else self.dtype})"]
        if self.parity:
            worst = max(self.parity.values())
            lines.append(f"  onnxruntime vs PyTorch in fp64, max abs error: {worst:.3g} over {len(self.parity)} shapes")
        if self.optimized_path:
            lines.append(f"optimized {self.optimized_path}: {self.fused}")
        if self.optimized_parity:
            lines.append(f"  optimized vs unoptimized, max abs error: {max(self.optimized_parity.values()):.3g}")
        if self.quantize:
            lines.append(f"quantized {self.path} to dynamic {self.quantize} (onnxruntime quantize_dynamic, QInt8 per "
                         "channel)")  # fmt: skip
        if self.int8_parity:
            worst = {k: max(e[k] for e in self.int8_parity.values()) for k in next(iter(self.int8_parity.values()))}
            template = ("  max abs error, int8 graph vs fastbert int8: {graph_vs_fastbert_int8:.3g}; "
                        "int8 graph vs fp32: "
                        "{graph_vs_fp32:.3g}; fastbert int8 vs fp32: {fastbert_int8_vs_fp32:.3g}")
            lines.append(template.format(**worst))
        return "\n".join(lines)


def _check_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"cannot write {path}: directory {parent} does not exist")
    return path


@contextlib.contextmanager
def _atomic(path: str) -> Iterator[str]:
    """A temporary name beside `path` to write to, renamed to `path` on success and removed on failure: a full disk or
    a failed write never leaves a truncated file under the real name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial.onnx",
                               dir=os.path.dirname(os.path.abspath(path)))  # fmt: skip
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def max_opset() -> int:
    """The newest opset both the installed onnx and torch's TorchScript exporter (the one used here) write."""
    onnx = require("onnx", "onnx", "ONNX export")
    try:
        from torch.onnx._constants import ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET as torch_max
    except ImportError:  # a private name: where torch lacks it, onnx's bound alone applies
        torch_max = None
    newest = onnx.defs.onnx_opset_version()
    return min(newest, torch_max) if torch_max else newest


def dynamic_axes(model: nn.Module) -> dict[str, dict[int, str]]:
    """Every input and output gets symbolic batch (and sequence, or choices for multiple choice) axes."""
    spec = spec_of(model)
    choice = head_name(model) == "BertForMultipleChoice"
    inputs = {0: "batch", 1: "choices", 2: "sequence"} if choice else {0: "batch", 1: "sequence"}
    axes = {name: dict(inputs) for name in INPUTS}
    for name, per_token in zip(spec.outputs, spec.per_token, strict=True):
        if choice:
            axes[name] = {0: "batch", 1: "choices"}
        else:
            axes[name] = {0: "batch", 1: "sequence"} if per_token else {0: "batch"}
    return {k: v for k, v in axes.items() if k in INPUTS or k in output_names(model)}


def _sample(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A small export sample (batch 2, length 16) whose shape the parity check never uses."""
    shape = (2, 2, 16) if head_name(model) == "BertForMultipleChoice" else (2, 16)
    ids = torch.randint(0, model.config.vocab_size, shape)
    mask = torch.ones(shape, dtype=torch.long)
    mask[1, ..., 10:] = 0
    return ids, mask, torch.zeros(shape, dtype=torch.long)


def _write(graph: ReferenceGraph, model: PreTrainedModel, path: str, opset: int) -> None:
    with warnings.catch_warnings():
        # the TorchScript exporter is deprecated in favour of dynamo, which cannot yet emit the fusable layout
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(
            graph,
            _sample(model),
            path,
            dynamo=False,
            opset_version=opset,
            input_names=list(INPUTS),
            output_names=list(output_names(model)),
            dynamic_axes=dynamic_axes(model),
            do_constant_folding=True,
        )
    _annotate(path, model)


def _annotate(path: str, model: PreTrainedModel) -> None:
    """Store the model class and config in the ONNX metadata, so a Session can rebuild outputs and check inputs."""
    import onnx

    proto = onnx.load(path)
    meta = {
        "fastbert.model_class": type(model).__name__,
        "fastbert.head": head_name(model),  # the Bert class it is, whose outputs the graph has
        "fastbert.config": model.config.to_json_string(),
        "fastbert.version": fastbert.__version__,
    }
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, path)


def symbolic_axes(path: str | os.PathLike) -> dict[str, list[str | int]]:
    """Each graph input/output -> its dims as saved: a name where symbolic, an int where fixed."""
    import onnx

    graph = onnx.load(os.fspath(path), load_external_data=False).graph
    return {
        v.name: [d.dim_param if d.HasField("dim_param") else d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in list(graph.input) + list(graph.output)
    }


def _check_symbolic(path: str, model: nn.Module) -> None:
    """Raise unless every axis named in dynamic_axes is symbolic in the saved graph."""
    saved = symbolic_axes(path)
    for name, axes in dynamic_axes(model).items():
        fixed = [axis for axis in axes if isinstance(saved[name][axis], int)]
        if fixed:
            raise CheckError(f"{path}: {name} has fixed axes {fixed} ({saved[name]}): dynamic axes were lost")


def expected_fusions(model: PreTrainedModel) -> dict[str, int]:
    """Fused-node counts a fully optimized export must show: one embedding (none for RoBERTa's), per layer 1 Attention
    (none with MPNet's or DeBERTa's relative positions: onnxruntime's BERT fusion has no pattern for terms added to
    the scores), 2 SkipLN, 1 GELU. None required of the rotary families: its patterns have no rotated q and k, gates
    or pre-norm layers (whatever it fuses is reported, and the parity check still runs)."""
    config = model.config
    if config.family.rotary:
        return {}
    layers = config.num_hidden_layers
    gelu = {"gelu": "BiasGelu", "gelu_new": "FastGelu", "gelu_pytorch_tanh": "FastGelu"}.get(config.hidden_act)
    has_mlm = head_name(model) in ("BertForMaskedLM", "BertForPreTraining")
    embedding = 0 if config.family.padded_positions else 1  # RoBERTa's positions are not a pattern onnxruntime fuses
    attention = 0 if config.family.relative_attention or config.disentangled_kinds else layers
    counts = {"EmbedLayerNormalization": embedding, "Attention": attention, "SkipLayerNormalization": 2 * layers}
    if gelu:
        counts[gelu] = layers + int(has_mlm)  # the MLM transform's dense + GELU fuses too
    return counts


def optimize(model: PreTrainedModel, path: str, optimized_path: str) -> dict[str, int]:
    """Run onnxruntime's transformers optimizer (model_type bert) on `path`; raise unless every layer fused."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    config = model.config
    options = FusionOptions("bert")
    # The bert default reduces the mask to per-row lengths (right padding only); keep the 2-D mask, as fastbert
    # takes any layout of ones (left padding, holes).
    options.use_raw_attention_mask(True)
    optimized = optimize_model(
        path,
        model_type="bert",
        num_heads=config.num_attention_heads,
        hidden_size=config.hidden_size,
        optimization_options=options,
        opt_level=0,
    )
    stats = optimized.get_fused_operator_statistics()
    fused = {op: int(stats.get(op, 0)) for op in FUSED_OPS}
    expected = expected_fusions(model)
    wrong = {op: (fused.get(op, 0), n) for op, n in expected.items() if fused.get(op, 0) != n}
    if wrong:
        raise CheckError(f"onnxruntime's optimizer did not fuse the graph as expected (got, expected): {wrong}")
    with _atomic(optimized_path) as tmp:
        optimized.save_model_to_file(tmp)
    return fused


def export(
    model: PreTrainedModel,
    path: str | os.PathLike,
    *,
    dtype: str = "fp32",
    opset: int = OPSET,
    check: bool = True,
    optimize_graph: bool = False,
    optimized_path: str | os.PathLike | None = None,
    shapes: list[tuple[int, int]] | None = None,
    progress: bool = True,
    quantize: str | None = None,
) -> ExportReport:
    """Write `model` (BertModel or any fastbert head) to `path` as ONNX and, with `check`, verify it in onnxruntime.

    `dtype` is "fp32" or "fp16". `optimize_graph` also writes onnxruntime's fused graph (default `<path>.opt.onnx`),
    checks the fused-node counts and that it matches the plain graph. `quantize="int8"` writes the dynamically
    quantised graph to `path` instead (made from the checked fp32 graph, the fused one with `optimize_graph`) and
    reports its parity against fastbert's int8 model. Raises CheckError with the max error on a parity failure. The
    model is copied, never modified.
    """
    spec_of(model)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if opset < OPSET:
        raise ValueError(f"opset must be >= {OPSET} (LayerNormalization), got {opset}")
    if check or optimize_graph or quantize:
        require("onnxruntime", "onnx", "checking, optimizing or quantizing an ONNX export")
    newest = max_opset()
    if opset > newest:
        raise UsageError(f"opset {opset} is beyond what this installation writes: the newest that both onnx and "
                         f"torch's ONNX exporter write is {newest}; use an opset from {OPSET} to {newest}")  # fmt: skip
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
    if quantize and dtype != "fp32":
        raise ValueError("quantize='int8' quantizes the fp32 graph: leave dtype as 'fp32'")
    path = _check_path(path)
    if quantize:  # the fp32 graphs go beside a temporary name; `path` gets the int8 one
        with tempfile.TemporaryDirectory(prefix="fastbert-int8-export-") as tmp:
            fp32 = export(model, os.path.join(tmp, "fp32.onnx"), opset=opset, check=check,
                          optimize_graph=optimize_graph, shapes=shapes, progress=False)  # fmt: skip
            with _atomic(path) as tmp_int8:
                int8_graph.quantize_graph(fp32.optimized_path or fp32.path, tmp_int8)
            report = dataclasses.replace(fp32, path=path, optimized_path=None, quantize=quantize)
        if check:
            source = copy.deepcopy(model).to(device="cpu", dtype=torch.float32).eval()
            report.int8_parity = int8_graph.int8_parity(source, path, shapes or parity_shapes(model.config), progress)
        if progress:
            tqdm.write(report.summary())
        return report
    report = ExportReport(path=path, dtype=dtype)
    source = copy.deepcopy(model).to(device="cpu", dtype=torch.float32).eval()
    exported = source if dtype == "fp32" else copy.deepcopy(source).to(DTYPES[dtype])
    with torch.no_grad(), _atomic(path) as tmp:
        _write(ReferenceGraph(exported).eval(), exported, tmp, opset)
    _check_symbolic(path, exported)
    shapes = shapes if shapes is not None else parity_shapes(model.config)
    if check:
        report.parity = check_parity(exported, path, shapes, reference=source, progress=progress)
    if optimize_graph:
        opt_path = _check_path(optimized_path or os.path.splitext(path)[0] + ".opt.onnx")
        report.optimized_path = opt_path
        report.fused = optimize(exported, path, opt_path)
        if check:
            against = path if dtype == "fp32" else source  # fp16 graphs are judged against PyTorch in fp64
            report.optimized_parity = check_parity(exported, opt_path, shapes, reference=against, progress=progress)
    if progress:
        tqdm.write(report.summary())
    return report
