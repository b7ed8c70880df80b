"""The backends, one module each: what it takes is data (its SPEC, a `spec.Backend`), and none imports the dispatcher
(`fastbert.ops`), which imports them all. In the registry's order: triton: fastbert/kernels/ on GPUs; native: csrc/'s
C++ and CUDA kernels; int8: dynamic int8 GEMMs on CPU, opt-in; gemm: fastbert's fp32 GEMMs with fused epilogues on
CPU; onednn: oneDNN GEMMs with fused epilogues on CPU; torch: `fastbert.reference` plus the dispatcher's compositions.
Beside them: spec.py (the Backend record), timing.py and timing_store.py (first-use timings, kept per machine), and
scope.py (this thread's forced, excluded and opted-in backends, which the dispatcher and the backends both read)."""
