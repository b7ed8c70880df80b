"""fastbert-kernels: pure Python by default; the native extension (csrc/) builds only on request."""

from setuptools import find_packages, setup

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
)
