"""fastbert-kernels: pure Python by default; the native extension (csrc/) builds only on request.

FASTBERT_BUILD_NATIVE=1 builds `fastbert._native_cpu` (C++/OpenMP, csrc/cpu); FASTBERT_BUILD_CUDA=1 also builds
`fastbert._native_cuda` (csrc/cuda, needs torch with CUDA). MAX_JOBS bounds parallel compile jobs. Each build writes
`_build_info.json` beside the extensions (compiler, flags, torch version, ISAs), which the native backend checks.
"""

import glob
import json
import os
import platform

from setuptools import find_packages, setup

# ISA flags live in csrc/cpu/isa_*.cpp (runtime dispatch). -fno-trapping-math / -fno-math-errno change no result (we
# never read FP exception flags or errno) but let GCC if-convert clamps and inline sqrt, so the loops vectorise.
CPU_FLAGS = ["-O3", "-std=c++20", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
CPU_ISAS = "runtime dispatch: avx512bf16, avx512, avx2, generic"  # csrc/cpu/isa_*.cpp
CUDA_ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_80,code=compute_80"]
NVCC_FLAGS = ["-O3", "-std=c++20", *CUDA_ARCH_FLAGS]


def _enabled(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def native_build() -> dict:
    """ext_modules + cmdclass for the requested native extensions (empty unless asked for)."""
    build_cuda = _enabled("FASTBERT_BUILD_CUDA")
    if not (build_cuda or _enabled("FASTBERT_BUILD_NATIVE")):
        return {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    cpu_sources = sorted(glob.glob("csrc/cpu/*.cpp"))
    ext = [
        CppExtension("fastbert._native_cpu", cpu_sources, extra_compile_args=CPU_FLAGS, extra_link_args=["-fopenmp"])
    ]
    if build_cuda:
        cuda_sources = sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu"))
        ext.append(
            CUDAExtension(
                "fastbert._native_cuda", cuda_sources, extra_compile_args={"cxx": ["-O3"], "nvcc": NVCC_FLAGS}
            )
        )

    class BuildWithInfo(BuildExtension):
        """BuildExtension that records how each extension was built next to it (read by fastbert.backends.native)."""

        def build_extensions(self) -> None:
            super().build_extensions()
            self.build_info = {
                "torch": torch.__version__,
                "torch_cuda": torch.version.cuda,
                "machine": platform.machine(),
                "compiler": " ".join(getattr(self.compiler, "compiler_so", ["?"])[:1]),
                "extensions": {
                    e.name.rsplit(".", 1)[-1]: {
                        "file": os.path.basename(self.get_ext_fullpath(e.name)),
                        "flags": e.extra_compile_args,
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
    packages=find_packages(include=["fastbert", "fastbert.*"]) + ["fastbert.kernels"],
    package_dir={"fastbert.kernels": "kernels"},
    install_requires=["torch>=2.4", "safetensors>=0.4", "numpy", "tqdm"],
    extras_require={
        "triton": ["triton>=3.6"],
        "onnx": ["onnx>=1.16", "onnxruntime>=1.18", "onnxscript"],
        "train": ["tokenizers>=0.19"],
    },
    entry_points={"console_scripts": ["fastbert=fastbert.cli:main"]},
    **native_build(),
)
