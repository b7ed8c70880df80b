"""The `native` backend: C++/OpenMP CPU kernels and CUDA kernels from csrc/, bound with pybind11.

Optional: built only on request (FASTBERT_BUILD_NATIVE=1 for `_native_cpu`, FASTBERT_BUILD_CUDA=1 for `_native_cuda`
as well). Importing this module never fails; `unavailable_reason()` says why the backend cannot run (not built, stale:
built for another torch, load error with the build info), and `refuses(op, call, forced)`, called by the dispatch's
limits, says why one call is not taken, so the dispatch falls back with that reason.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from fastbert import capabilities, reference
from fastbert.backends import contract, scope
from fastbert.backends.spec import KERNEL_OPS, Backend, BackendUnavailable, LimitCheck

BUILD_HINTS = {
    "_native_cpu": "FASTBERT_BUILD_NATIVE=1 python setup.py build_ext --inplace (or `make native`)",
    "_native_cuda": "FASTBERT_BUILD_CUDA=1 python setup.py build_ext --inplace (needs torch with CUDA and nvcc)",
}
BUILD_INFO = Path(__file__).parents[1] / "_build_info.json"  # beside the extensions, in fastbert/
CPU_DTYPES = (torch.float32, torch.bfloat16)
BUSY_HOST_ENV = "FASTBERT_BUSY_HOST"
CUDA_OPS = ("embedding_layernorm", "bias_act", "bias_residual_layernorm")  # attention on CUDA is Triton's job
# arguments of the CPU bindings beyond their op's contract (and `out`): what the model's scope permits, passed by the
# functions below and by the layer stack, never part of an op's public signature
BINDING_EXTRAS: dict[str, tuple[str, ...]] = {"attention": ("bf16_products",)}
# (op, dtype) pairs whose native CPU kernel did not beat torch in benchmarks/bench_native.py (2-core AMD EPYC, Zen 4,
# AVX-512, shared machine): auto dispatch leaves them to torch, forcing native still runs them. bf16 erf GELU is
# compute-bound and no faster than torch's vectorised erf below ~30M elements (x0.38-0.95 at BERT batch 8-32 x 128,
# 16 x 512; x1.57 only at 32 x 512).
CPU_SLOWER_THAN_TORCH: frozenset[tuple[str, torch.dtype]] = frozenset({("bias_act", torch.bfloat16)})

_loaded: dict[str, tuple[ModuleType | None, str | None]] = {}


def build_info() -> dict | None:
    """What `setup.py` recorded about the last native build (compiler, flags, torch version, ISAs), if any."""
    try:
        return json.loads(BUILD_INFO.read_text())
    except (OSError, ValueError):
        return None


def _describe(info: dict | None, name: str) -> str:
    if info is None:
        return "no build info"
    ext = info.get("extensions", {}).get(name, {})
    return f"built by {info.get('compiler')} for torch {info.get('torch')}, flags {ext.get('flags')}"


def load(name: str) -> tuple[ModuleType | None, str | None]:
    """(extension module, None) or (None, why not) for `_native_cpu` / `_native_cuda`; the answer is cached."""
    if name not in _loaded:
        info = build_info()
        built_for = (info or {}).get("torch")
        if importlib.util.find_spec(f"fastbert.{name}") is None:
            _loaded[name] = None, f"not built (fastbert.{name} is missing; build it with {BUILD_HINTS[name]})"
        elif built_for != torch.__version__:
            _loaded[name] = (
                None,
                (
                    f"stale: fastbert.{name} was built for torch {built_for or '(unknown: no build info)'}, "
                    f"this is torch {torch.__version__}; rebuild with {BUILD_HINTS[name]}"
                ),
            )
        else:
            try:
                module = importlib.import_module(f"fastbert.{name}")
            except Exception as exc:  # undefined symbols, a missing libgomp or CUDA runtime: a reason, not a crash
                _loaded[name] = None, f"load error: {type(exc).__name__}: {exc} ({_describe(info, name)})"
            else:
                if name == "_native_cpu" and (isa := capabilities.forced_isa()) in module.runnable_isas():
                    module.set_isa(isa)  # FASTBERT_CPU_ISA: run the weaker CPU's kernels (a weaker CPU keeps its own)
                if name == "_native_cpu":
                    policy = os.environ.get(BUSY_HOST_ENV) or "pool"
                    try:
                        module.pool_set_policy(policy)
                    except ValueError as exc:
                        raise ValueError(f"{BUSY_HOST_ENV}={policy!r}: {exc}") from None
                    _policy[0] = policy
                _loaded[name] = module, None
    return _loaded[name]


def describe() -> str | None:
    """The native CPU kernels' instruction set, for explain()."""
    cpu, reason = load("_native_cpu")
    if cpu is None:
        return f"CPU kernels unavailable ({reason})"
    threads, why, late, policy, spells, workers = cpu.threading()
    busy = {
        "pool": f"busy-host policy pool: {late} late region(s), {spells} busy spell(s) on fastbert's own "
        f"{workers} thread(s), which a region waits for only once they hold a job",
        "solo": f"busy-host policy solo: {late} late region(s), {spells} busy spell(s) on the calling thread alone",
        "off": f"busy-host policy off: {late} late region(s), every region on the team",
    }[policy]
    scope = "" if policy == "off" else "; in a spell a forward's torch ops and oneDNN GEMMs run on one thread fewer"
    return (
        f"CPU kernels for {', '.join(cpu.runnable_isas())} run here; using {cpu.isa()}; GEMM row panels sized to "
        f"half of a {cpu.l2_cache_bytes() >> 10} KiB L2; {threads} thread(s), set by {why}; {busy}{scope}"
    )


def oversubscribed() -> bool:
    """Whether the CPU kernels' regions follow the busy-host policy now: recent ones found a team thread the OS had not
    run (csrc/cpu/pool.h), so a GEMM on that team (oneDNN's) would wait on it too."""
    return _policy[0] != "off" and load("_native_cpu")[0].pool_busy()


def input_reader(*tensors: torch.Tensor | None) -> ModuleType | None:
    """The CPU extension, where a forward's input reads can run in it (fastbert.validation's range checks, the mask's
    packing in fastbert.padding: one pass each, not a dozen small torch ops): every given tensor on the CPU, the
    native backend not left out (`ops.exclude_backends`), not under tracing; else None (torch's ops, any device)."""
    if not all(t is None or t.is_cpu for t in tensors):  # first: a GPU forward asks nothing more
        return None
    cpu, _ = load("_native_cpu")
    if cpu is None or "native" in scope.excluded_backends() or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    return cpu


_policy = ["off"]  # the extension's policy as last set, so oversubscribed() with it off calls nothing per GEMM


class _TeamNarrowed:
    """pool.h's team_enter/team_leave as a context: torch's ops on this thread run on one thread fewer while a busy
    spell is on. Stateless (the extension counts nesting per thread), so one instance serves every scope."""

    def __enter__(self) -> None:
        _loaded["_native_cpu"][0].team_enter()

    def __exit__(self, *exc: object) -> None:
        _loaded["_native_cpu"][0].team_leave()


_TEAM_NARROWED = _TeamNarrowed()
_NO_SCOPE = contextlib.nullcontext()  # reusable: no context built per forward where nothing is scoped


def team_scope(device: torch.device | None) -> contextlib.AbstractContextManager[None]:
    """A CPU forward's scope: while the machine is oversubscribed, torch's own ops in it (padding, pooling, the
    pooler) and oneDNN's GEMMs run on one thread fewer (on two CPUs, the calling thread alone) instead of waiting on a
    team thread the OS has not run; the kernels keep their threads (csrc/cpu/pool.h). A null context off the CPU,
    with the policy off (or the kernels not loaded) and under tracing."""
    if _policy[0] == "off" or device is None or device.type != "cpu" or torch.compiler.is_compiling():
        return _NO_SCOPE
    return _TEAM_NARROWED


def enter_team_scope(module: object, args: object) -> None:
    """team_scope as a forward pre-hook, for pipelines fastbert does not own (sentence-transformers' pooling). As the
    outermost scope it first closes one whose leave never came: torch skips an always_call hook on an interrupt."""
    device = getattr(module, "device", None)
    if _policy[0] != "off" and not torch.compiler.is_compiling() and (device is None or device.type == "cpu"):
        _loaded["_native_cpu"][0].team_enter(outermost=True)


def leave_team_scope(module: object, args: object, output: object) -> None:
    """Its forward hook, registered with always_call so that an exception leaves the scope too (a leave with no
    scope entered does nothing, so a policy changed mid-forward leaves no thread narrowed)."""
    cpu = _loaded.get("_native_cpu", (None, None))[0]
    if cpu is not None and not torch.compiler.is_compiling():
        cpu.team_leave()


def set_busy_host_policy(name: str) -> None:
    """What the CPU kernels' regions do while the machine is oversubscribed (csrc/cpu/pool.h): "pool" (the default:
    fastbert's own threads, which a region waits for only once they hold a job), "solo" (the calling thread alone) or
    "off" (torch's OpenMP team throughout). FASTBERT_BUSY_HOST sets it when the kernels load."""
    cpu, reason = load("_native_cpu")
    if cpu is None:
        raise BackendUnavailable(f"native CPU kernels: {reason}")
    cpu.pool_set_policy(name)
    _policy[0] = name


def unavailable_reason() -> str | None:
    """None when at least one native extension loads, else why neither does (the CPU one's reason first)."""
    cpu, cpu_reason = load("_native_cpu")
    if cpu is not None:
        return None
    cuda, cuda_reason = load("_native_cuda")
    if cuda is not None:
        return None
    if "not built" in (cuda_reason or "") or not torch.cuda.is_available():
        return cpu_reason
    return f"{cpu_reason}; CUDA: {cuda_reason}"


def refuses(op: str, call: dict[str, Any], forced: bool = False) -> str | None:
    """Why the native backend will not take this call (`call`: its arguments by name), or None if it will."""
    tensors = [v for v in call.values() if isinstance(v, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "forward only: inputs require grad"
    if call.get("training", False) and call.get("dropout_p", 0.0) > 0:
        return "no dropout in native kernels: needs dropout_p == 0 or training=False"
    device = tensors[0].device
    if device.type == "cuda":
        if op not in CUDA_OPS:
            return f"no native CUDA kernel for {op}"
        _, reason = load("_native_cuda")
        if reason:
            return f"CUDA extension unavailable ({reason})"
    else:
        _, reason = load("_native_cpu")
        if reason:
            return f"CPU extension unavailable ({reason})"
    big = _data_tensors(op, call)
    if (shape_reason := _layout_refusal(op, call, big, device)) is not None:
        return shape_reason
    dtype = big[0].dtype
    if (op, dtype) in CPU_SLOWER_THAN_TORCH and device.type == "cpu" and not forced:
        return f"not faster than torch for {dtype} on CPU (benchmarks/bench_native.py); used when forced"
    return None


def _data_tensors(op: str, call: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The tensors the kernel streams (one dtype for all), the one that sets the output dtype first."""
    if op == "embedding_layernorm":
        lead = call["inputs_embeds"] if call.get("inputs_embeds") is not None else call["word_weight"]
        return lead, call["position_weight"], call["type_weight"]
    if op == "bias_residual_layernorm":
        return call["x"], call["residual"]
    if op == "gated_act":
        return call["x"], call["up"]
    return (call["qkv"] if op == "attention" else call["x"],)


def _layout_refusal(op: str, call: dict[str, Any], big: tuple[torch.Tensor, ...], device: torch.device) -> str | None:
    """Dtype and shape combinations the kernels do not take (torch's broadcasting and mixed dtypes)."""
    if op == "embedding_layernorm":
        tokens = call["input_ids"].shape if call.get("input_ids") is not None else big[0].shape[:-1]
        if any(call[k].shape != tokens for k in ("token_type_ids", "position_ids")):
            return "token_type_ids/position_ids broadcast against the tokens (torch only)"
    if op == "bias_residual_layernorm" and call["x"].shape != call["residual"].shape:
        return "residual broadcasts against x (torch only)"
    if op == "gated_act" and call["x"].shape != call["up"].shape:
        return "up broadcasts against x (torch only)"
    if op == "gated_act" and call.get("kind", reference.ACT_GELU) not in reference.GATE_ACTIVATIONS:
        return f"activation {call.get('kind')!r} is none of {reference.GATE_ACTIVATIONS}"
    if any(t.dtype != big[0].dtype for t in big):
        return f"mixed dtypes {sorted({str(t.dtype) for t in big})} (torch only)"
    scores = call.get("position_scores") if op == "attention" else None
    if scores is not None and scores.dtype not in (torch.float32, big[0].dtype):
        return f"position_scores must be float32 or qkv's dtype, got {scores.dtype} with {big[0].dtype} qkv"
    rotary = call.get("rotary") if op == "attention" else None
    if rotary is not None and rotary.dtype != torch.float32:
        return f"rotary must be float32, got {rotary.dtype}"
    if device.type == "cpu" and big[0].dtype not in CPU_DTYPES:
        return f"CPU kernels take float32/bfloat16, not {big[0].dtype}"
    if device.type == "cuda" and op != "bias_act" and big[0].shape[-1] > (limit := load("_native_cuda")[0].MAX_ROW):
        return f"CUDA LayerNorm kernels keep rows of at most {limit} elements in registers"  # csrc/cuda/launch.h
    return None


def _ext(device: torch.device) -> ModuleType:
    name = "_native_cuda" if device.type == "cuda" else "_native_cpu"
    module, reason = load(name)
    if module is None:
        raise BackendUnavailable(f"native {device.type} kernels unavailable: {reason}")
    return module


def _no_dropout(dropout_p: float, training: bool) -> None:
    if training and dropout_p > 0:
        raise ValueError("native kernels implement no dropout: pass dropout_p=0 or training=False")


# Dynamo cannot trace into a pybind function: under torch.compile each op goes through a torch custom op
# (`torch.ops.fastbert.native_<op>`, forward only: the op's declared arguments without the dropout ones, a fake giving
# the output's shape and dtype, both derived from fastbert.backends.contract), so the compiled graph holds the kernel
# whole instead of breaking at it. Eager calls skip the custom op's dispatch.
def _custom_op(op: contract.Op) -> Callable[..., torch.Tensor]:
    params, name = op.forward_only(), op.name
    defaults = tuple(p.default for p in params)

    def run(*args: Any) -> torch.Tensor:  # torch may leave out trailing arguments equal to their defaults
        lead = next(a for a in args if isinstance(a, torch.Tensor))
        return getattr(_ext(lead.device), name)(*args, *defaults[len(args) :])

    custom = torch.library.custom_op(f"fastbert::native_{name}", run, mutates_args=(), schema=op.schema(params))
    custom.register_fake(op.fake(params))
    return custom


_COMPILED = SimpleNamespace(**{op.name: _custom_op(op) for op in contract.KERNELS})


def _kernels(device: torch.device) -> Any:
    """What runs the ops: the extension itself, or under torch.compile the custom ops that wrap it."""
    return _COMPILED if torch.compiler.is_compiling() else _ext(device)


# One function per op, with fastbert.ops' signatures.
def embedding_layernorm(
    input_ids: torch.Tensor | None,  # [*] int
    token_type_ids: torch.Tensor,  # [*] int
    position_ids: torch.Tensor,  # [*] int
    word_weight: torch.Tensor,  # [V, E]
    position_weight: torch.Tensor,  # [P, E]
    type_weight: torch.Tensor,  # [Tt, E]
    ln_weight: torch.Tensor,  # [E]
    ln_bias: torch.Tensor,  # [E]
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
    inputs_embeds: torch.Tensor | None = None,  # [*, E]
) -> torch.Tensor:  # [*, E]
    """LayerNorm(word[ids] + position[pos] + type[tt]) in one pass, fp32 sum and statistics."""
    _no_dropout(dropout_p, training)
    device = (inputs_embeds if inputs_embeds is not None else word_weight).device
    return _kernels(device).embedding_layernorm(
        input_ids, token_type_ids, position_ids, word_weight, position_weight, type_weight, ln_weight, ln_bias,
        float(eps), inputs_embeds,
    )  # fmt: skip


def bias_act(x: torch.Tensor, bias: torch.Tensor, kind: str = reference.ACT_GELU) -> torch.Tensor:
    """act(x + bias) for act in gelu (erf), gelu_tanh, relu; x [*, N], bias [N]."""
    return _kernels(x.device).bias_act(x, bias, kind)


def gated_act(x: torch.Tensor, up: torch.Tensor, kind: str = reference.ACT_GELU) -> torch.Tensor:
    """act(x) * up for act in gelu (erf), gelu_tanh, relu, silu; x and up [*, N] of one dtype (CPU only)."""
    return _kernels(x.device).gated_act(x, up, kind)


def bias_residual_layernorm(
    x: torch.Tensor,  # [*, N]
    bias: torch.Tensor,  # [N]
    residual: torch.Tensor,  # [*, N]
    ln_weight: torch.Tensor,  # [N]
    ln_bias: torch.Tensor,  # [N]
    eps: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:  # [*, N]
    """LayerNorm(x + bias + residual) in one pass (dropout must be off)."""
    _no_dropout(dropout_p, training)
    return _kernels(x.device).bias_residual_layernorm(x, bias, residual, ln_weight, ln_bias, float(eps))


def attention(
    qkv: torch.Tensor,  # [T, 3, nH, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    max_seqlen: int,
    dropout_p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
    position_bias: torch.Tensor | None = None,  # [nH, 2R + 1] fp32
    position_scores: torch.Tensor | None = None,  # [2, nH, T, W]
    position_columns: torch.Tensor | None = None,  # [2R + 1] int32
    rotary: torch.Tensor | None = None,  # [2, T, R/2] fp32
    window: int | None = None,
) -> torch.Tensor:  # [T, nH, D]
    """Varlen bidirectional attention over packed QKV (CPU only), exact fp32 softmax, with MPNet's relative position
    bias read from its table by distance, DeBERTa's disentangled position scores gathered through their columns,
    rotary positions applied as q and k are loaded, and a window that skips the key chunks beyond it; fp32 products in
    bf16 where `bf16_products()` says so."""
    _no_dropout(dropout_p, training)
    scale = 1.0 / math.sqrt(qkv.shape[-1]) if scale is None else float(scale)
    kernels = _kernels(qkv.device)
    # the compiled custom op's schema is the op's contract, which has no precision flag: exact fp32 there
    extra = {"bf16_products": True} if kernels is not _COMPILED and bf16_products() else {}
    return kernels.attention(
        qkv, cu_seqlens, int(max_seqlen), scale, position_bias, position_scores, position_columns, rotary,
        None if window is None else int(window), **extra,
    )  # fmt: skip


def bf16_products() -> bool:
    """Whether fp32 attention may round its two products' operands to bf16: inside an int8-quantized model, whose int8
    GEMMs err far more than bf16 does, and only where the CPU kernels run them on AMX tiles (elsewhere, exact fp32).
    The native layer stack asks the same, so its layers match the loop's bit for bit."""
    return "int8" in scope.opted_in_backends()


def _limit(op: str) -> LimitCheck:
    return lambda call, forced: refuses(op, call, forced)


SPEC = Backend(
    "native",
    devices=("cpu", "cuda"),
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    module=sys.modules[__name__],
    ops=KERNEL_OPS,
    limits={op: _limit(op) for op in KERNEL_OPS},
    forward_only=True,
)
