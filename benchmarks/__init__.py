"""fastbert's benchmarks: kernel micro-benchmarks (pytest-benchmark) and the model throughput suite (run_model)."""
