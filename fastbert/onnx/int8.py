"""Dynamic int8 ONNX graphs: onnxruntime's `quantize_dynamic` (int8 weights per output channel, activations quantised
at run time) applied to the checked fp32 export, and the quantised graph's parity against fastbert's own int8 model.

The two quantise differently (onnxruntime: one uint8 scale per tensor; fastbert: one int8 scale per token), so the
report gives three max abs errors at valid positions per shape: graph vs fastbert int8, graph vs fp32, fastbert int8
vs fp32. Non-finite outputs fail the export.
"""

from __future__ import annotations

import os

import torch
from tqdm.auto import tqdm

import fastbert
from fastbert import ops
from fastbert.checkpoint import PreTrainedModel
from fastbert.errors import CheckError
from fastbert.onnx.graph import output_names
from fastbert.onnx.parity import _errors, _torch_outputs, make_inputs
from fastbert.onnx.session import Session


def quantize_graph(fp32_path: str, path: str) -> None:
    """Write the dynamically quantised version of the fp32 graph at `fp32_path` to `path`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(fp32_path, path, weight_type=QuantType.QInt8, per_channel=True)


def int8_parity(
    model: PreTrainedModel, path: str | os.PathLike, shapes: list[tuple[int, int]], progress: bool = True
) -> dict[tuple[int, int], dict[str, float]]:
    """Per (batch, seqlen): max abs errors of the int8 graph vs fastbert int8 and vs fp32, and fastbert int8 vs
    fp32 (every GEMM int8 in fastbert's model, as the graph has them)."""
    session = Session(path)
    quantized = fastbert.optimize(model, quantize="int8")
    results = {}
    for batch, seqlen in tqdm(shapes, desc=f"int8 parity {os.path.basename(path)}", disable=not progress, leave=False):
        inputs = make_inputs(model.config, batch, seqlen)
        got = session(**inputs)
        bad = [name for name in output_names(model) if not torch.isfinite(got[name]).all()]
        if bad:
            raise CheckError(f"{path}: non-finite values in {bad} at batch={batch}, seqlen={seqlen}")
        with ops.use_backend("int8"):
            mine = _torch_outputs(quantized, inputs)
        fp32 = _torch_outputs(model, inputs)
        mask = inputs["attention_mask"]
        results[(batch, seqlen)] = {
            "graph_vs_fastbert_int8": max(_errors(model, got, mine, mask).values()),
            "graph_vs_fp32": max(_errors(model, got, fp32, mask).values()),
            "fastbert_int8_vs_fp32": max(_errors(model, mine, fp32, mask).values()),
        }
    return results
