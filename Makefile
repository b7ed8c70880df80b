# Two entry points, each self-contained on a fresh machine: `make bench` (the main job) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c requirements/constraints.txt
STAMP  := $(VENV)/.installed

# Native kernels (csrc/): `make native` builds the CPU extension in place; `make cuda-check` compiles the CUDA sources
# (compile only, no GPU needed) wherever nvcc exists. Keep CUDA_GENCODE in sync with setup.py's CUDA_ARCH_FLAGS.
NVCC         ?= $(shell command -v nvcc 2>/dev/null)
MAX_JOBS     ?= 2
CUDA_GENCODE := -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=compute_80
TORCH_INC     = $(shell $(PY) -c "from torch.utils import cpp_extension as c; \
                  print(*map('-I{}'.format, c.include_paths()))")
PY_INC        = $(shell $(PY) -c "import sysconfig; print('-I' + sysconfig.get_paths()['include'])")

.PHONY: venv test test-oldest bench bench-busy lint clean native cuda-check

venv: $(STAMP)

$(STAMP): requirements/constraints.txt requirements/dev.txt requirements/checkpoints.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PIP) -r requirements/dev.txt
	$(PIP) --no-deps -r requirements/checkpoints.txt
	$(PIP) --no-build-isolation --no-deps -e .
	touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .

native: venv
	FASTBERT_BUILD_NATIVE=1 MAX_JOBS=$(MAX_JOBS) $(PY) setup.py -q build_ext --inplace

# nvcc also compiles the binding as host C++ (it adds the CUDA include path); the CPU torch wheel lacks one generated
# CUDA header, stubbed with -idirafter so a real one wins where it exists.
CUDA_CHECK := build/cuda-check
ifneq ($(NVCC),)
cuda-check: $(CUDA_CHECK)/fused_ops.o $(CUDA_CHECK)/bind.o
else
cuda-check:
	@echo "cuda-check: nvcc not found, CUDA sources not compile-checked"
endif

$(CUDA_CHECK)/fused_ops.o: csrc/cuda/fused_ops.cu csrc/cuda/launch.h
	mkdir -p $(CUDA_CHECK)
	$(NVCC) -std=c++20 -O3 $(CUDA_GENCODE) -c $< -o $@

$(CUDA_CHECK)/bind.o: csrc/cuda/bind.cpp csrc/cuda/launch.h csrc/bind_utils.h $(STAMP)
	mkdir -p $(CUDA_CHECK)/stub/c10/cuda/impl && touch $(CUDA_CHECK)/stub/c10/cuda/impl/cuda_cmake_macros.h
	$(NVCC) -std=c++20 -x c++ -c $< -o $@ $(TORCH_INC) $(PY_INC) \
		-Xcompiler -idirafter,$(CUDA_CHECK)/stub -DTORCH_EXTENSION_NAME=_native_cuda

# The weaker CPU's paths on any machine: no bf16 instructions (fastbert's capability probe), oneDNN and ATen limited
# to AVX2, the native kernels' AVX2 build. `make test` runs the CPU-dependent tests this way too, every time.
# inductor's cache key leaves out the ISA ATEN_CPU_CAPABILITY picks: the forced runs keep their own cache
AVX2_ENV   := FASTBERT_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \
              TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/build/torchinductor-avx2
AVX2_TESTS := tests/test_capabilities.py tests/test_fastpath.py tests/test_precision.py tests/test_native.py \
              tests/test_bench_model.py tests/test_model_equivalence.py tests/test_kernel_dispatch.py tests/test_int8.py \
              tests/test_gemm.py tests/test_gated.py tests/test_eurobert.py tests/test_layer_stack.py \
              tests/test_bench_encode.py::test_mpnet_runs_every_system_without_token_types

test: venv lint native cuda-check
	$(PY) -m pytest -q -n 2 tests benchmarks --benchmark-disable  # two workers: the 2-core CI machine, in half the time
	$(AVX2_ENV) $(PY) -m pytest -q $(AVX2_TESTS) --benchmark-disable

# The oldest versions setup.py claims (requirements/oldest.txt) in a second venv, on a small subset of the suite:
# equivalence with transformers, tokenization, a Triton kernel under the interpreter, ONNX parity, sentence-transformers.
# Same torch as .venv, so the native extension built there loads here too.
OLD_VENV     := .venv-oldest
OLD_PY       := $(OLD_VENV)/bin/python
OLDEST_TESTS := tests/test_model_equivalence.py tests/test_tokenization.py tests/test_kernel_embedding.py \
                tests/test_onnx.py tests/test_sentence_transformers.py tests/test_native_linkage.py

$(OLD_VENV)/.installed: requirements/oldest.txt setup.py
	rm -rf $(OLD_VENV)
	$(PYTHON) -m venv $(OLD_VENV)
	$(OLD_PY) -m pip install -q --upgrade pip setuptools wheel
	$(OLD_PY) -m pip install -q -r requirements/oldest.txt
	$(OLD_PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

test-oldest: $(OLD_VENV)/.installed native
	$(OLD_PY) -m pytest -q -p no:cacheprovider $(OLDEST_TESTS)

# The native CPU kernels are part of the fast path: built here too, but a machine without a compiler still benchmarks.
# Each run writes its own folder (BENCH_OUT, ignored by git): committed results in benchmarks/results/ change only when
# someone copies a run there on purpose.
# Runs are keyed by CPU model (fastbert.capabilities.cpu_key: vendor, family, model), then by time.
BENCH_TIME := $(shell date -u +%Y%m%dT%H%M%SZ)
CPU_KEY := $(shell awk -F': *' '/^vendor_id/ && !v {v=$$2} /^cpu family/ && !f {f=$$2} /^model[[:space:]]*:/ && !m \
	{m=$$2} END {if (v != "") print tolower(v) "-family" f "-model" m; else print "unknown-cpu"}' /proc/cpuinfo 2>/dev/null)
BENCH_OUT ?= benchmarks/results/runs/$(or $(CPU_KEY),unknown-cpu)/$(BENCH_TIME)
bench: venv
	$(PIP) -r requirements/bench.txt
	$(MAKE) native || echo "make bench: the native CPU extension did not build (see above); fastbert runs without it"
	$(PY) -m benchmarks.run_model --out $(BENCH_OUT) $(BENCH_ARGS)
	$(PY) -m benchmarks.bench_encode --out $(BENCH_OUT) $(ENCODE_ARGS)
	$(PY) -m benchmarks.bench_gemm --out $(BENCH_OUT)
	$(PY) -m benchmarks.headline $(BENCH_OUT)
	@echo "make bench: this run's tables, data and plots are in $(BENCH_OUT)/ (benchmarks/results/ is unchanged)"

# The encode workload under each background load (benchmarks/neighbours.py), BUSY_ROUNDS times over, each round with
# its own quiet run; then one table and plot across them (benchmarks/busy_summary.py: medians and ranges, each busy
# run against the quiet run nearest in time): README's busy-host table. About 2-3 minutes a load and round on 2 cores.
# Rounds left in BENCH_OUT by an earlier run are removed first: the summary takes every run in the folder.
BUSY_LOADS   ?= none spin=1 spin=2 torch=1 torch=2
BUSY_ROUNDS  ?= 2
BUSY_SYSTEMS := "fastbert fp32" "fastbert int8" "fastbert bf16" "onnxruntime fp32 (plain export)" "OpenVINO fp32" \
                "OpenVINO default" "onnxruntime dynamic int8" "OpenVINO int8 (NNCF)"
bench-busy: venv
	$(PIP) -r requirements/bench.txt
	$(MAKE) native || echo "make bench-busy: the native CPU extension did not build (see above)"
	rm -rf $(BENCH_OUT)/busy/round*
	for round in $$(seq $(BUSY_ROUNDS)); do for load in $(BUSY_LOADS); do \
		neighbours=$$([ "$$load" = none ] || echo "--neighbours $$load"); \
		$(PY) -m benchmarks.bench_encode --passes 2 --systems $(BUSY_SYSTEMS) $$neighbours \
			--out $(BENCH_OUT)/busy/round$$round/$$(echo $$load | tr -d =) || exit 1; \
	done; done
	$(PY) -m benchmarks.busy_summary $(BENCH_OUT)/busy
	@echo "make bench-busy: this run's tables, data and plots are in $(BENCH_OUT)/busy/"

clean:
	rm -rf $(VENV) $(OLD_VENV) build *.egg-info
