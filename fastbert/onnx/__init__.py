"""ONNX export of fastbert models, checked in onnxruntime, and an onnxruntime serving Session.

`export(model, path)` writes the reference graph (see `graph.py`) and verifies it against PyTorch; `Session(path)`
runs it with BertModel's inputs and output classes. Needs the `onnx` extra (onnx, onnxruntime).
"""

from fastbert.onnx.exporter import ExportReport, expected_fusions, export, symbolic_axes
from fastbert.onnx.parity import check_parity, make_inputs, parity_shapes
from fastbert.onnx.session import Session

__all__ = [
    "ExportReport",
    "Session",
    "check_parity",
    "expected_fusions",
    "export",
    "make_inputs",
    "parity_shapes",
    "symbolic_axes",
]
