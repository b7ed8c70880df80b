"""Serve an exported graph with onnxruntime behind BertModel's own call signature and output classes (CPU deployment).

Inputs may be torch tensors or numpy arrays; ids of any integer dtype (int32 included) are cast to the graph's int64,
and are range-checked against the stored config exactly as BertModel checks them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from fastbert.config import BertConfig
from fastbert.errors import require
from fastbert.onnx.graph import INPUTS, SPECS
from fastbert.outputs import ModelOutput
from fastbert.validation import check_inputs

_ORT_TO_NUMPY = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
_UNSUPPORTED = ("position_ids", "inputs_embeds", "output_attentions", "output_hidden_states", "labels")


def _as_tensor(name: str, value: Any) -> torch.Tensor | None:
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


class Session:
    """`Session(path)(input_ids, attention_mask=None, token_type_ids=None)` -> the exported class's output object.

    `intra_op_threads` sets onnxruntime's intra-op thread pool (None: onnxruntime's default, all cores);
    `providers` defaults to CPUExecutionProvider; `spin=False` puts idle pool threads to sleep at once (use it when
    the same process also runs torch work). Outputs are CPU torch tensors.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        intra_op_threads: int | None = None,
        providers: list[str] | None = None,
        spin: bool = True,
    ) -> None:
        ort = require("onnxruntime", "onnx", "an ONNX Session")
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no ONNX model at {path}; write one with fastbert.onnx.export(model, path) or `fastbert export-onnx`"
            )
        options = ort.SessionOptions()
        if intra_op_threads is not None:
            if intra_op_threads < 1:
                raise ValueError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
            options.intra_op_num_threads = intra_op_threads
        # Idle pool threads spin by default (lower latency); a process that also runs torch work wants them asleep.
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        self.session = ort.InferenceSession(path, options, providers=providers or ["CPUExecutionProvider"])
        meta = self.session.get_modelmeta().custom_metadata_map
        if "fastbert.model_class" not in meta:
            raise ValueError(f"{path} was not written by fastbert.onnx.export (no fastbert metadata in the graph)")
        self.path = path
        self.model_class = meta["fastbert.model_class"]
        self.config = BertConfig.from_dict(json.loads(meta["fastbert.config"]))
        self.spec = SPECS[meta.get("fastbert.head", self.model_class)]
        self.input_types = {i.name: _ORT_TO_NUMPY[i.type] for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]

    def __call__(
        self,
        input_ids: torch.Tensor | np.ndarray,
        attention_mask: torch.Tensor | np.ndarray | None = None,
        token_type_ids: torch.Tensor | np.ndarray | None = None,
        return_dict: bool = True,
        **unsupported: Any,
    ) -> ModelOutput | tuple:
        """Run the graph; same inputs and outputs as the PyTorch model (attention_mask, token_type_ids optional)."""
        asked = sorted(k for k, v in unsupported.items() if v is not None and v is not False)
        unknown = sorted(set(unsupported) - set(_UNSUPPORTED))
        if unknown:
            raise TypeError(f"Session got unexpected argument(s) {unknown}")
        if asked:
            raise ValueError(f"{asked} not available from an exported graph; use the PyTorch model for these")
        feeds = self._prepare(input_ids, attention_mask, token_type_ids)
        values = self.session.run(self.output_names, feeds)
        out = self.spec.output_class(**{n: torch.from_numpy(v) for n, v in zip(self.output_names, values, strict=True)})
        return out if return_dict else out.to_tuple()

    def _prepare(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> dict[str, np.ndarray]:
        """Validate like BertModel does, fill the optional inputs, cast to the graph's integer type."""
        ids = _as_tensor("input_ids", input_ids)
        if ids is None:
            raise ValueError("input_ids is required (inputs_embeds cannot be fed to an exported graph)")
        mask = _as_tensor("attention_mask", attention_mask)
        types = _as_tensor("token_type_ids", token_type_ids)
        choice = self.spec is SPECS["BertForMultipleChoice"]
        if choice and ids.dim() != 3:
            raise ValueError(f"{self.model_class} takes input_ids [batch, num_choices, seqlen], got {tuple(ids.shape)}")
        flat = [None if t is None else (t.reshape(-1, t.shape[-1]) if choice else t) for t in (ids, mask, types)]
        _, _, ranges = check_inputs(self.config, flat[0], flat[1], flat[2], None, None)
        if ranges is not None:
            ranges.read_and_check()
        mask = torch.ones_like(ids) if mask is None else mask
        types = torch.zeros_like(ids) if types is None or not self.config.token_types else types  # no table: unread
        return {
            name: t.detach().cpu().numpy().astype(self.input_types[name], copy=False)
            for name, t in zip(INPUTS, (ids, mask, types), strict=True)
        }
