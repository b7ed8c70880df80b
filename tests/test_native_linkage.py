"""The native extensions link the C++ runtime as torch does, so a kernel's argument check reaches Python intact.

A toolchain that links libstdc++ statically into the extension (a wrapper compiler in CC/CXX adding
-static-libstdc++, as on the GPU machine's image) builds an extension whose TORCH_CHECK_VALUE kills the process
(segfault there) or reaches Python with its message cut short (seen here with g++ 12: 'sequence '). setup.py links
the runtime dynamically and refuses a build that does not; these tests check the built result.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastbert.backends import native

ROOT = Path(__file__).resolve().parents[1]
CPU, CPU_REASON = native.load("_native_cpu")
needs_cpu_ext = pytest.mark.skipif(CPU is None, reason=f"native CPU extension unavailable: {CPU_REASON}")
needs_readelf = pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
CXX_RUNTIME = re.compile(r"^lib(stdc\+\+|c\+\+)\.so")


def cxx_runtime(path: str | Path) -> set[str]:
    """The C++ runtime libraries an ELF file names as NEEDED."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return {lib for lib in re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out) if CXX_RUNTIME.match(lib)}


def built_extensions() -> list[str]:
    """The files of the native extensions built here."""
    specs = [importlib.util.find_spec(f"fastbert.{name}") for name in ("_native_cpu", "_native_cuda")]
    return [spec.origin for spec in specs if spec is not None and spec.origin]


@needs_cpu_ext
@needs_readelf
def test_extensions_link_the_cxx_runtime_torch_links() -> None:
    torch_runtime = cxx_runtime(Path(torch.__file__).parent / "lib" / "libc10.so")
    assert torch_runtime, "torch's libc10.so names no C++ runtime: a static torch build?"
    for path in built_extensions():
        assert torch_runtime <= cxx_runtime(path), f"{path} links no dynamic {sorted(torch_runtime)}"
    info = native.build_info() or {}
    recorded = info.get("extensions", {}).get("_native_cpu", {}).get("cxx_runtime")
    assert recorded is not None and torch_runtime <= set(recorded), f"_build_info.json records {recorded}"


@needs_cpu_ext
def test_a_value_check_reaches_python_whole_in_a_fresh_process() -> None:
    """TORCH_CHECK_VALUE with a message built from several parts, then TORCH_CHECK_TYPE: each raises its Python
    error with its whole message and the process lives on (run apart, so a crash fails this test, not the run)."""
    script = """
import torch
from fastbert.backends import native
ext, reason = native.load("_native_cpu")
assert ext is not None, reason
qkv, cu = torch.randn(10, 3, 2, 16), torch.tensor([0, 4, 10], dtype=torch.int32)
try:
    ext.attention(qkv, cu, 5, 0.25)
except ValueError as exc:
    print("ValueError:", str(exc).splitlines()[0])
try:
    ext.bias_act(torch.randn(2, 4, dtype=torch.float16), torch.randn(4), "relu")
except TypeError as exc:
    print("TypeError:", str(exc).splitlines()[0])
print("alive")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode} (negative: killed by that signal)\n{done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert lines == [
        "ValueError: sequence 1 has length 6: lengths must be in [0, max_seqlen = 5]",
        "TypeError: native CPU kernels take float32 or bfloat16, got x of Half",
        "alive",
    ], done.stdout


def test_a_native_build_without_torch_says_the_one_command_that_works() -> None:
    """pip's isolated build environment has no torch: the native build stops with the command that builds against the
    installed torch, instead of a ModuleNotFoundError from deep in setup.py."""
    root = Path(__file__).resolve().parents[1]
    script = ("import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--name']; "
              f"exec(compile(open({str(root / 'setup.py')!r}).read(), 'setup.py', 'exec'))")  # fmt: skip
    env = {**os.environ, "FASTBERT_BUILD_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "FASTBERT_BUILD_NATIVE=1 pip install --no-build-isolation ." in out.stderr, out.stderr[-2000:]
