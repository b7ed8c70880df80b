"""fastbert-kernels: pure Python by default; the native extension (csrc/) builds only on request.

FASTBERT_BUILD_NATIVE=1 builds `fastbert._native_cpu` (C++/OpenMP, csrc/cpu); FASTBERT_BUILD_CUDA=1 also builds
`fastbert._native_cuda` (csrc/cuda, needs torch with CUDA). MAX_JOBS bounds parallel compile jobs. Each build writes
`_build_info.json` beside the extensions (a digest of csrc/, compiler, flags, torch version, ISAs, C++ runtime), which
the native backend checks. Each extension must link the C++ runtime dynamically, as torch does: a kernel's C++
exception (TORCH_CHECK_*) crosses into torch's libraries, and with a static copy of libstdc++ (a wrapper compiler in
CC/CXX that adds -static-libstdc++) it reaches Python garbled or kills the process. A build that would not is refused.
"""

import glob
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess

from setuptools import find_packages, setup

# ISA flags live in csrc/cpu/isa_*.cpp (runtime dispatch). -fno-trapping-math / -fno-math-errno change no result (we
# never read FP exception flags or errno) but let GCC if-convert clamps and inline sqrt, so the loops vectorise.
CPU_FLAGS = ["-O3", "-std=c++20", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
CPU_ISAS = "runtime dispatch: avx512amx, avx512bf16, avx512vnni, avx512, avx2, generic"  # csrc/cpu/isa_*.cpp
CUDA_ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_80,code=compute_80"]
NVCC_FLAGS = ["-O3", "-std=c++20", *CUDA_ARCH_FLAGS]
# The C++ runtime linked the way torch links it: libstdc++ and libgcc_s as shared libraries, named before the
# driver's own (possibly static, from a wrapper's -static-libstdc++) copy, so that every C++ symbol resolves to them.
LINK_FLAGS = ["-fopenmp", "-shared-libgcc", "-Wl,--push-state,--no-as-needed,-Bdynamic", "-lstdc++", "-Wl,--pop-state"]
CXX_RUNTIMES = re.compile(r"^lib(stdc\+\+|c\+\+)\.so")  # GCC's or LLVM's C++ runtime, as a NEEDED entry


def needed(path: str) -> list[str]:
    """The shared libraries an ELF file names as NEEDED (readelf, from the binutils the linker came with)."""
    if shutil.which("readelf") is None:
        raise SystemExit("fastbert native build: readelf (binutils) not found; it checks the extension's linkage")
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def cxx_runtime(path: str) -> list[str]:
    """The C++ runtime libraries `path` links dynamically (empty: none, or a static copy)."""
    return [lib for lib in needed(path) if CXX_RUNTIMES.match(lib)]


def _enabled(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def native_build() -> dict:
    """ext_modules + cmdclass for the requested native extensions (empty unless asked for)."""
    build_cuda = _enabled("FASTBERT_BUILD_CUDA")
    if not (build_cuda or _enabled("FASTBERT_BUILD_NATIVE")):
        return {}
    try:  # compiled against the torch it will run with: the one installed, not a copy in pip's build environment
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError as e:
        raise SystemExit(
            f"fastbert native build: torch is not importable here ({e}). The extension compiles against the installed "
            "torch: install torch first, then build without pip's isolated environment:\n"
            "    FASTBERT_BUILD_NATIVE=1 pip install --no-build-isolation ."
        ) from None

    cpu_sources = sorted(glob.glob("csrc/cpu/*.cpp"))
    ext = [CppExtension("fastbert._native_cpu", cpu_sources, extra_compile_args=CPU_FLAGS, extra_link_args=LINK_FLAGS)]
    if build_cuda:
        cuda_sources = sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu"))
        ext.append(
            CUDAExtension(
                "fastbert._native_cuda",
                cuda_sources,
                extra_compile_args={"cxx": ["-O3"], "nvcc": NVCC_FLAGS},
                extra_link_args=LINK_FLAGS[1:],
            )
        )

    class BuildWithInfo(BuildExtension):
        """BuildExtension that records how each extension was built next to it (read by fastbert.backends.native)."""

        def build_extensions(self) -> None:
            super().build_extensions()
            torch_runtime = cxx_runtime(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
            runtimes = {e.name: cxx_runtime(self.get_ext_fullpath(e.name)) for e in self.extensions}
            for name, runtime in runtimes.items():
                if not set(torch_runtime) <= set(runtime):
                    raise SystemExit(
                        f"fastbert native build: {name} links the C++ runtime {runtime or 'statically'}, torch links "
                        f"{torch_runtime}: a kernel's C++ exception would crash the process; the compiler "
                        f"{os.environ.get('CXX') or self.compiler.compiler_so[0]} must link it dynamically"
                    )
            sources = hashlib.sha1()  # every kernel source: a changed kernel is a new build, its GEMMs timed again
            root = os.path.dirname(os.path.abspath(__file__))
            for file in sorted(glob.glob(os.path.join(root, "csrc", "**", "*"), recursive=True)):
                if os.path.isfile(file):
                    sources.update(os.path.relpath(file, root).encode() + b"\0" + open(file, "rb").read())
            self.build_info = {
                "sources": sources.hexdigest()[:16],
                "torch": torch.__version__,
                "torch_cuda": torch.version.cuda,
                "machine": platform.machine(),
                "compiler": " ".join(getattr(self.compiler, "compiler_so", ["?"])[:1]),
                "extensions": {
                    e.name.rsplit(".", 1)[-1]: {
                        "file": os.path.basename(self.get_ext_fullpath(e.name)),
                        "flags": e.extra_compile_args,
                        "link_flags": e.extra_link_args,
                        "cxx_runtime": runtimes[e.name],
                        "isa": CPU_ISAS if e.name.endswith("cpu") else CUDA_ARCH_FLAGS,
                    }
                    for e in self.extensions
                },
            }

        def run(self) -> None:
            super().run()  # with --inplace, setuptools copies the extensions into the source tree at the end
            where = os.path.dirname(self.get_ext_fullpath(self.extensions[0].name))
            with open(os.path.join(where, "_build_info.json"), "w") as fh:
                json.dump(self.build_info, fh, indent=1)

    return {"ext_modules": ext, "cmdclass": {"build_ext": BuildWithInfo.with_options(use_ninja=True)}}


setup(
    name="fastbert-kernels",
    version="0.1.0",
    description="Fused kernels and a drop-in, faster BertModel for BERT-family encoders",
    python_requires=">=3.10",
    packages=find_packages(include=["fastbert", "fastbert.*"]),
    package_data={"fastbert.kernels": ["configs/*.json"]},  # measured launch settings per GPU (kernels/tuning.py)
    # Lower bounds are the versions `make test-oldest` runs (requirements/oldest.txt); CI runs both ends.
    install_requires=["torch>=2.13", "safetensors>=0.4.3", "numpy", "tqdm"],
    extras_require={
        "triton": ["triton>=3.8"],
        "onnx": ["onnx>=1.17", "onnxruntime>=1.21", "onnxscript"],
        "train": ["tokenizers>=0.22.1"],
        "hf": ["transformers>=5.3", "sentence-transformers>=6.0"],
    },
    entry_points={"console_scripts": ["fastbert=fastbert.cli:main"]},
    **native_build(),
)
