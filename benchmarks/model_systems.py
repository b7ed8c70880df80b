"""The systems the model suite compares, each built as a `Runner`: (input_ids, attention_mask, token_type_ids) -> the
last hidden state `[B, S, H]` (padded, any dtype), on the same inputs.

transformers (eager, sdpa, torch.compile of sdpa), onnxruntime on transformers' own export, OpenVINO on the same
graph (f32 asked for explicitly in the fp32 table, bf16 in the bf16 table where its CPU plugin finds bf16
instructions), and fastbert: converted with fastbert.optimize (with and without CUDA graphs, or with its defaults), and
the drop-in path (the checkpoint loaded with from_pretrained, moved and cast, eval, no_grad), on CUDA with its default
graphs and without; on CPU, the int8 paths in the fp32 table: fastbert int8, onnxruntime dynamic int8, OpenVINO static
int8 as its docs recommend (NNCF, `model_type=TRANSFORMER`, calibrated on random batches of their own seed) and torch
dynamic int8. Low precision is what a
user would run: on CPU transformers under autocast (its supported CPU recipe) and fastbert with weights in that dtype;
on GPU every model cast to that dtype.

Extra rows: a module listed in `EXTRA_SYSTEMS` that imports cleanly joins the suite. It defines `NAME` (the row's
label) and `build(hf_model, dtype, device) -> Runner | None` (None: no row at that dtype/device); `hf_model` is the
fp32 transformers encoder (BertModel, or RobertaModel for the RoBERTa-base row) in eval mode, the source of the
weights.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import fastbert
from fastbert.execution import graphs as cuda_graphs
from fastbert.ops import exclude_backends

Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
EXTRA_SYSTEMS = ("benchmarks.onnx_row",)  # fastbert.onnx.Session, provided by the ONNX work
# CPU rows of the fp32 table
INT8_SYSTEMS = ("fastbert int8", "onnxruntime int8", "OpenVINO int8 (NNCF)", "torch dynamic int8")
FAILURE_CHARS = 400  # a row's reason: enough for a C++ library's location and cause
CALIBRATION_SEED = 1234  # the random batches NNCF calibrates on: never the ones measured


@dataclass
class System:
    """One row source: its label, how it runs low precision, and its runner (None with a reason when it can't)."""

    name: str
    mode: str
    run: Runner | None
    skipped: str | None = None


def _autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def hf_runner(model: nn.Module, device: torch.device, dtype: torch.dtype) -> tuple[Runner, str]:
    """transformers as users run it: CPU low precision under autocast, GPU low precision with cast weights."""
    cpu_autocast = device.type == "cpu" and dtype != torch.float32
    if not cpu_autocast:
        model = model.to(dtype)
    typed = takes_token_types(model)

    def run(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        extra = {"token_type_ids": types} if typed else {}
        with _autocast(device, dtype) if cpu_autocast else contextlib.nullcontext():
            return model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state

    return run, "autocast" if cpu_autocast else ("weights" if dtype != torch.float32 else "fp32")


def transformers_model(hf: nn.Module, attn: str, device: torch.device) -> nn.Module:
    """A copy of `hf` (BertModel, RobertaModel, ...) with another attention implementation ('eager', 'sdpa'), same
    weights."""
    config = type(hf.config).from_dict(hf.config.to_dict())
    config._attn_implementation = attn if attn != "sdpa" or type(hf)._supports_sdpa else "eager"  # DeBERTa: its own
    pooling = {"add_pooling_layer": hf.pooler is not None} if hasattr(hf, "pooler") else {}  # DeBERTa has none
    model = type(hf)(config, **pooling)
    model.load_state_dict(hf.state_dict())
    return model.to(device).eval()


def fastbert_runner(
    hf: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    graphs: bool | None = False,
    autocast: bool = False,
    exclude: tuple[str, ...] = (),
    quantize: str | None = None,
) -> Runner:
    """fastbert converted from the same weights, cast to `dtype` (or fp32 weights under autocast to `dtype`);
    `graphs` is optimize's cuda_graphs (None: its default); `exclude` leaves backends out of the dispatch (the native
    row's counterpart); `quantize="int8"` its int8 row."""
    model = fastbert.optimize(
        hf, dtype=None if autocast else dtype, device=device, cuda_graphs=graphs, quantize=quantize
    )
    typed = takes_token_types(hf)  # as transformers' model: ModernBERT's takes none

    def run(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        extra = {"token_type_ids": types} if typed else {}
        with _autocast(device, dtype) if autocast else contextlib.nullcontext(), exclude_backends(*exclude):
            return model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state

    return run


def fastbert_dropin_runner(
    hf: nn.Module, device: torch.device, dtype: torch.dtype, workdir: str, graphs: bool = True
) -> Runner:
    """fastbert as README's first example runs it: the checkpoint (the same weights, saved by transformers) loaded by
    from_pretrained, moved to the device and cast (`.cuda().half()`), eval, called under no_grad. `graphs=False` turns
    its CUDA graphs off (every forward eager: the bound plan's loop), the row that shows what the graphs buy."""
    import fastbert.auto

    path = os.path.join(workdir, f"{type(hf).__name__}_{hf.config.num_hidden_layers}x{hf.config.hidden_size}_hf")
    if not os.path.exists(path):  # one checkpoint per model of the suite, shared by its dtypes
        transformers_model(hf, "eager", torch.device("cpu")).save_pretrained(path)
    model = fastbert.auto.model_class(hf.config.model_type, "model").from_pretrained(path).to(device)
    if getattr(hf, "pooler", True) is None:  # saved without one: from_pretrained builds a fresh one, as transformers'
        model.pooler = None
    model = (model if dtype == torch.float32 else model.to(dtype)).eval()
    if not graphs:
        cuda_graphs.disable(model)
    typed = takes_token_types(hf)

    def run(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        extra = {"token_type_ids": types} if typed else {}
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state

    return run


def takes_token_types(model: nn.Module) -> bool:
    """Whether a transformers encoder's forward names token_type_ids (MPNetModel has none: it would swallow them in
    **kwargs, so its export has no such input)."""
    return "token_type_ids" in inspect.signature(type(model).forward).parameters


class _LastHidden(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.types = takes_token_types(model)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        extra = {"token_type_ids": types} if self.types else {}
        return self.model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state


def onnxruntime_runner(hf: nn.Module, workdir: str, quantize: bool = False) -> Runner:
    """transformers' eager model exported with torch.onnx (dynamic batch and length), run by onnxruntime on CPU;
    `quantize`: that graph through onnxruntime's dynamic int8 quantisation (QInt8 weights), as CPU users do."""
    import onnxruntime as ort

    config = hf.config  # one export per model of the suite, shared by its fp32 and int8 rows
    stem = f"{type(hf).__name__}_{config.num_hidden_layers}x{config.hidden_size}"
    path = os.path.join(workdir, f"{stem}.onnx")
    if not os.path.exists(path):
        wrapper = _LastHidden(transformers_model(hf, "eager", torch.device("cpu"))).eval()
        names = ["input_ids", "attention_mask", "token_type_ids"][: 3 if wrapper.types else 2]
        # token type 0: a model with one token type (RoBERTa, GTE) has no row 1 to trace through
        example = (torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long),
                   torch.zeros(2, 8, dtype=torch.long))[: len(names)]  # fmt: skip
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                wrapper,
                example,
                path,
                input_names=names,
                output_names=["last_hidden_state"],
                dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "last_hidden_state"]},
                opset_version=17,
                dynamo=False,
            )
    if quantize:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantized = os.path.join(workdir, f"{stem}_int8.onnx")
        if not os.path.exists(quantized):
            quantize_dynamic(path, quantized, weight_type=QuantType.QInt8)
        path = quantized
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    # no spinning: idle pool threads would steal the CPU from the systems timed next in the interleaved rounds
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in session.get_inputs()}  # no token_type_ids for a model without them (MPNet)

    def run(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": types.numpy()}
        return torch.from_numpy(session.run(None, {k: v for k, v in feed.items() if k in inputs})[0])

    run.path = path  # the graph it runs (OpenVINO reads the same file in the encode benchmark)
    return run


def openvino_runner(model: object, precision: str | None = "f32") -> Runner:
    """OpenVINO's CPU plugin on a graph (an ONNX path or an openvino.Model), latency hint, torch's thread count;
    `precision` the INFERENCE_PRECISION_HINT asked for, None for the plugin's own choice (bf16 on CPUs with bf16
    instructions). The runner's `precision` says what the plugin chose."""
    import openvino as ov

    core = ov.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": torch.get_num_threads()}
    if precision is None and _onednn_capped_below_bf16():
        precision = "f32"  # its choice on a CPU without bf16: its capped oneDNN has no bf16 kernels for bf16's pick
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    compiled = core.compile_model(core.read_model(model) if isinstance(model, str) else model, "CPU", config)
    names = {p.get_any_name() for p in compiled.inputs}

    def run(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": types.numpy()}
        return torch.from_numpy(compiled({k: v for k, v in feed.items() if k in names})[0])

    chosen = compiled.get_property("INFERENCE_PRECISION_HINT")
    run.precision = chosen.get_type_name() if hasattr(chosen, "get_type_name") else str(chosen)
    return run


def _onednn_capped_below_bf16() -> bool:
    """Whether ONEDNN_MAX_CPU_ISA (the AVX2 stand-in on a bigger CPU) leaves oneDNN, OpenVINO's CPU plugin's too,
    without bf16 kernels, while the plugin still finds the CPU's bf16 instructions and would pick bf16."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in ("SSE41", "AVX", "AVX2", "AVX2_VNNI")


def openvino_bf16_reason() -> str | None:
    """Why OpenVINO's CPU plugin would not run bf16 natively here (no bf16 instructions in its own probe), or None."""
    import openvino as ov

    if _onednn_capped_below_bf16():
        cap = os.environ["ONEDNN_MAX_CPU_ISA"]
        return f"ONEDNN_MAX_CPU_ISA={cap} caps OpenVINO's oneDNN below bf16 (its f32 is the fp32 row)"
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        return "OpenVINO finds no bf16 instructions on this CPU (its default precision here is f32: the fp32 row)"
    return None


def nncf_int8(path: str, batches: list[dict[str, Any]]) -> object:
    """OpenVINO's recommended int8: static post-training quantisation of the fp32 graph at `path` with NNCF
    (`model_type=TRANSFORMER`: SmoothQuant, bias correction), calibrated on `batches` (feeds by input name; the names
    the graph lacks are dropped)."""
    import nncf
    import openvino as ov

    model = ov.Core().read_model(path)
    names = {p.get_any_name() for p in model.inputs}
    feeds = [{k: v for k, v in batch.items() if k in names} for batch in batches]
    return nncf.quantize(model, nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(feeds))


def torch_dynamic_int8_runner(hf: nn.Module) -> Runner:
    """transformers (sdpa) with every nn.Linear through torch.ao.quantization.quantize_dynamic (qint8 weights)."""
    model = transformers_model(hf, "sdpa", torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated upstream, and still what many CPU users run
        torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    return hf_runner(model, torch.device("cpu"), torch.float32)[0]


def calibration(config: Any, batches: int = 8, batch: int = 8, longest: int = 128) -> list[dict[str, Any]]:
    """Random ragged batches for static int8 calibration (lengths uniform in [longest / 4, longest], ids above the
    special ones, token types 0), from their own seed: the model suite's inputs are random ids too."""
    g = torch.Generator().manual_seed(CALIBRATION_SEED)
    out = []
    for _ in range(batches):
        lengths = torch.randint(longest // 4, longest + 1, (batch,), generator=g)
        mask = (torch.arange(longest)[None, :] < lengths[:, None]).long()
        ids = torch.randint(5, config.vocab_size, (batch, longest), generator=g) * mask
        out.append({"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": (0 * ids).numpy()})
    return out


def failure(exc: BaseException) -> str:
    """A row's one-line reason for an exception: its message's lines joined, bounded (OpenVINO's first line is only
    the C++ file and line that raised; the cause follows it). Some exceptions carry no message."""
    message = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(message) > FAILURE_CHARS:
        message = message[: FAILURE_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {message or 'no message'}"


def build_systems(
    hf: nn.Module, device: torch.device, dtype: torch.dtype, names: tuple[str, ...], workdir: str
) -> list[System]:
    """Every requested system for one (model, dtype), in a fixed order; a system that can't run says why."""
    out: list[System] = []
    for name in names:
        try:
            out.append(_build(name, hf, device, dtype, workdir))
        except Exception as exc:  # an export or compile failure is a row's outcome, not the suite's
            out.append(System(name, "-", None, failure(exc)))
    for module_name in EXTRA_SYSTEMS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            run = module.build(hf, dtype, device)
        except Exception as exc:  # the extra row's failure is its row's outcome
            out.append(System(module.NAME, "extra", None, failure(exc)))
            continue
        out.append(System(module.NAME, "extra", run, None if run is not None else "not at this dtype/device"))
    return out


def _build(name: str, hf: nn.Module, device: torch.device, dtype: torch.dtype, workdir: str) -> System:
    if name in ("transformers eager", "transformers sdpa"):
        run, mode = hf_runner(transformers_model(hf, name.split()[1], device), device, dtype)
        if name == "transformers sdpa" and not type(hf)._supports_sdpa:
            mode += f"; {type(hf).__name__} has no SDPA attention: its own"
        return System(name, mode, run)
    if name == "transformers sdpa + compile":
        model = transformers_model(hf, "sdpa", device)
        run, mode = hf_runner(model, device, dtype)
        return System(name, mode, torch.compile(run, dynamic=False))
    if name == "onnxruntime":
        if device.type != "cpu" or dtype != torch.float32:
            return System(name, "-", None, "the pinned onnxruntime build runs fp32 on CPU only")
        return System(name, "fp32", onnxruntime_runner(hf, workdir))
    if name == "OpenVINO":  # on the onnxruntime row's graph: f32 asked for explicitly, bf16 its own way
        if device.type != "cpu" or dtype == torch.float16:
            return System(name, "-", None, "OpenVINO's CPU plugin: fp32 and bf16 rows")
        if dtype == torch.bfloat16 and (why := openvino_bf16_reason()) is not None:
            return System(name, "-", None, why)
        run = openvino_runner(onnxruntime_runner(hf, workdir).path, "f32" if dtype == torch.float32 else "bf16")
        return System(name, run.precision, run)
    if name in INT8_SYSTEMS:
        if device.type != "cpu" or dtype != torch.float32:
            return System(name, "-", None, "int8 rows are CPU rows of the fp32 table (int8 of the fp32 model)")
        if name == "fastbert int8":
            return System(name, "int8", fastbert_runner(hf, device, dtype, quantize="int8"))
        if name == "onnxruntime int8":
            return System(name, "int8", onnxruntime_runner(hf, workdir, quantize=True))
        if name == "OpenVINO int8 (NNCF)":
            graph = onnxruntime_runner(hf, workdir).path
            return System(name, "int8 static", openvino_runner(nncf_int8(graph, calibration(hf.config)), None))
        return System(name, "int8", torch_dynamic_int8_runner(hf))
    if name == "fastbert":
        return System(name, "weights" if dtype != torch.float32 else "fp32", fastbert_runner(hf, device, dtype))
    if name == "fastbert without native":
        if device.type != "cpu":
            return System(name, "-", None, "the native comparison row is a CPU row")
        mode = "weights" if dtype != torch.float32 else "fp32"
        return System(name, mode, fastbert_runner(hf, device, dtype, exclude=("native", "gemm")))  # no csrc/ kernels
    if name == "fastbert autocast":
        if dtype == torch.float32:
            return System(name, "-", None, "autocast is a low-precision mode")
        return System(name, "autocast", fastbert_runner(hf, device, dtype, autocast=True))
    if name == "fastbert (drop-in)":
        mode = "weights" if dtype != torch.float32 else "fp32"
        run = fastbert_dropin_runner(hf, device, dtype, workdir)
        return System(name, f"{mode}; from_pretrained, .to(device, dtype)", run)
    if name == "fastbert (no graphs)":
        if device.type != "cuda":
            return System(name, "-", None, "CUDA only: the drop-in row with its CUDA graphs off")
        mode = "weights" if dtype != torch.float32 else "fp32"
        run = fastbert_dropin_runner(hf, device, dtype, workdir, graphs=False)
        return System(name, f"{mode}; drop-in, CUDA graphs off", run)
    if name == "fastbert.optimize":
        mode = "weights" if dtype != torch.float32 else "fp32"
        return System(name, f"{mode}; optimize's defaults", fastbert_runner(hf, device, dtype, graphs=None))
    if name == "fastbert + CUDA graphs":
        if device.type != "cuda":
            return System(name, "-", None, "CUDA only")
        limits = f"graphs up to {cuda_graphs.MAX_BATCH} seq / {cuda_graphs.MAX_TOKENS} tok, eager above"
        return System(name, f"weights; {limits}", fastbert_runner(hf, device, dtype, graphs=True))
    raise ValueError(f"unknown system {name!r}")


def scratch_dir() -> tempfile.TemporaryDirectory:
    """Where exported ONNX files live for one run."""
    return tempfile.TemporaryDirectory(prefix="fastbert-bench-")
