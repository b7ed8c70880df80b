"""Every Triton kernel specialization a model launches, compiled for a GPU architecture on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which never lowers them; a kernel that the installed Triton
cannot compile (an API it lacks, a layout it rejects, too many registers) would first fail on a GPU. This records the
launches of BERT-base- and MiniLM-shaped layers (fp32, fp16, bf16; a training step and an inference forward) under the
interpreter, in a child process, then compiles each distinct launch to a cubin with Triton's own ptxas, with the
alignment hints the JIT would give it.

    python tests/kernel_compile.py --arch 90 --arch 80     # sm_90 (H100/H200) and sm_80 (A100)
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
POINTER_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32",
                 "int8": "i8", "uint8": "u8", "bool": "i1"}  # fmt: skip
SHAPES = (
    {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},  # BERT-base: head dim 64
    {"hidden_size": 384, "num_attention_heads": 12, "intermediate_size": 1536},  # MiniLM: head dim 32
)


def _scalar_type(value: Any) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


def _launch_record(fn: Any, args: tuple, kwargs: dict) -> dict:
    """One launch as (module, kernel, signature, constexprs, options): what triton.compile needs to rebuild it."""
    params = inspect.signature(fn).parameters
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    signature, constexprs, aligned = {}, {}, []
    for name, value in bound.arguments.items():
        if "constexpr" in str(params[name].annotation) or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif hasattr(value, "dtype") and hasattr(value, "data_ptr"):
            signature[name] = "*" + POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
            aligned += [name] if value.data_ptr() % 16 == 0 else []
        else:
            signature[name] = _scalar_type(value)
            aligned += [name] if isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0 else []
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": signature, "constexprs": constexprs,
            "aligned": aligned, "options": options}  # fmt: skip


def _divisibility(fn: Any, entry: dict) -> dict[tuple[int], list]:
    """The hints Triton's JIT adds at launch: 16-byte-aligned pointers and integers divisible by 16 (except the
    parameters it is told not to specialize), so the variant compiled is the one a GPU would run."""
    unhinted = {p.name for p in fn.params if p.do_not_specialize}
    names = list(entry["signature"])
    return {(names.index(n),): [["tt.divisibility", 16]] for n in entry["aligned"] if n not in unhinted}


def record(out: Path) -> None:
    """Run the model workload under the interpreter and write every distinct launch to `out` (JSON)."""
    import torch
    from triton.runtime import interpreter

    from fastbert import BertConfig, BertModel

    launches: dict[str, dict] = {}
    call = interpreter.GridExecutor.__call__

    def recording_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        entry = _launch_record(self.fn, args, kwargs)
        launches.setdefault(json.dumps(entry, sort_keys=True), entry)
        return call(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = recording_call
    ids, mask = torch.randint(1, 1000, (1, 128)), torch.ones(1, 128, dtype=torch.long)  # 128 tokens: real blocks
    for shape in SHAPES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            torch.manual_seed(0)
            config = BertConfig(vocab_size=1000, num_hidden_layers=1, backend="triton", **shape)
            model = BertModel(config).to(dtype).train()
            model(input_ids=ids, attention_mask=mask).last_hidden_state.float().square().mean().backward()
            with torch.no_grad():
                model.eval()(input_ids=ids, attention_mask=mask)
                model(input_ids=ids, attention_mask=mask)  # the second forward runs the plan's bound launchers
    out.write_text(json.dumps(list(launches.values()), indent=1))


def compile_all(launches: list[dict], archs: list[int]) -> list[str]:
    """Compile every launch for every architecture; the failures, one line each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    for arch in archs:
        for entry in launches:
            fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
            attrs = _divisibility(fn, entry)
            source = ASTSource(fn=fn, signature=entry["signature"], constexprs=entry["constexprs"], attrs=attrs)
            try:
                triton.compile(source, target=GPUTarget("cuda", arch, 32), options=entry["options"])
            except Exception as e:  # noqa: BLE001  (every failure is reported, with the launch that caused it)
                consts = {k: v for k, v in entry["constexprs"].items() if v is not None}
                failures.append(f"sm_{arch} {entry['kernel']} {consts}: {type(e).__name__}: {str(e)[:400]}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x 10 (default: 90)")
    parser.add_argument("--launches", type=Path, help="record the launches to this JSON file (or reuse it)")
    args = parser.parse_args(argv)
    launches_file = args.launches or Path(os.environ.get("TMPDIR", "/tmp")) / f"fastbert_launches_{os.getpid()}.json"
    if not launches_file.exists():
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import kernel_compile as k; " \
               f"k.record(k.Path({str(launches_file)!r}))"  # fmt: skip
        subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT)
    launches = json.loads(launches_file.read_text())
    if args.launches is None:
        launches_file.unlink()
    import triton

    start = time.perf_counter()
    failures = compile_all(launches, args.arch or [90])
    print(f"triton {triton.__version__}: {len(launches)} kernel launches x {len(args.arch or [90])} architecture(s) "
          f"compiled in {time.perf_counter() - start:.0f} s, {len(failures)} failed")  # fmt: skip
    print("\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
