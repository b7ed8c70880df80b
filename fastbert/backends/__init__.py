"""The backends, one module each: what it takes is data (its SPEC, a `spec.Backend`), and none imports the dispatcher
(`fastbert.ops`), which imports them all. onednn: oneDNN GEMMs with fused epilogues on CPU; native: csrc/'s C++ and
CUDA kernels; triton: kernels/ on GPUs; the torch backend is `fastbert.reference` plus the dispatcher's compositions."""
