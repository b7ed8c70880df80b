#!/usr/bin/env bash
# Checks and times everything that needs a GPU: installs fastbert in place, builds the CUDA extension, runs the
# GPU-marked tests, then the Triton kernel suite, the native CUDA ops and the model suite. Results (JSON + Markdown,
# and PNG where matplotlib is installed; device, versions and commit inside) land in benchmarks/results/. Each stage
# runs even if an earlier one failed; the exit code is the first failure's. With $OUT set, every stage's log, the
# test report (JUnit XML) and the results so far are copied there as soon as the stage ends, so a run stopped by a
# time limit keeps what finished.
#   bash benchmarks/gpu_check.sh                               # everything (allow ~20 min)
#   STAGES="install tests" bash benchmarks/gpu_check.sh        # then "kernels", then "native model", ...
#   MODEL_ARGS="--quick --models bert-base" STAGES=model bash benchmarks/gpu_check.sh
#   MODEL_ARGS='--quick --systems "transformers sdpa" fastbert.optimize' STAGES=model bash benchmarks/gpu_check.sh
#   TRAIN_ARGS=--quick STAGES=train bash benchmarks/gpu_check.sh   # training steps, 32 x 128 rows only
# MODEL_ARGS and TRAIN_ARGS are split into words as a shell splits them: quotes keep a name with spaces one word.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAGES=${STAGES:-"install tests kernels native model train"}
MODEL_ARGS=${MODEL_ARGS:-}
TRAIN_ARGS=${TRAIN_ARGS:-}  # --quick: 3 rows instead of 5; rows not started within 8 min are listed as not run
LOGS=${OUT:-benchmarks/results/gpu_logs}
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30  # progress every 30 s, not a log flooded with bars
mkdir -p "$LOGS" benchmarks/results
status=0

keep() {  # copy the results so far next to the logs
    [ -n "${OUT:-}" ] && cp benchmarks/results/*cuda* "$OUT"/ 2>/dev/null
    true
}
run() {  # run NAME CMD...: time one stage, log it, keep going, remember the first failure
    local name=$1; shift
    echo "=== $name: $*"
    local start=$SECONDS
    "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then echo "=== $name FAILED (exit $rc)"; [ "$status" -eq 0 ] && status=$rc; fi
    echo "=== $name took $((SECONDS - start)) s"
    keep
}
skip() { echo "=== $1 SKIPPED: $2" | tee "$LOGS/$1.log"; }
words() {  # words NAME VALUE: VALUE split as a shell splits it (no expansion, nothing run) into the array NAME
    local quoted
    quoted=$("$PY" -c 'import shlex, sys; print(" ".join(map(shlex.quote, shlex.split(sys.argv[1]))))' "$2") \
        || { echo "cannot split $1's value into words: $2"; exit 2; }
    eval "$1=($quoted)"  # every word single-quoted by shlex.quote: nothing in it is expanded or run
}
words model_args "$MODEL_ARGS"
words train_args "$TRAIN_ARGS"

cuda_home=$("$PY" -c "import torch; from torch.utils.cpp_extension import CUDA_HOME
print(CUDA_HOME or '' if torch.version.cuda else '')" 2>/dev/null)  # empty on a CPU-only torch
for stage in $STAGES; do
    case $stage in
        install)
            run install bash -c "$PY -m pip install -q --no-deps --no-build-isolation -e . \
                || $PY -m pip install -q --no-deps --no-build-isolation --break-system-packages -e ."
            if [ -n "$cuda_home" ] && [ -x "$cuda_home/bin/nvcc" ]; then
                "$cuda_home/bin/nvcc" --version | tail -2
                run build env FASTBERT_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-8}" "$PY" setup.py -q build_ext --inplace
            else  # no toolkit: the CPU extension only; the CUDA ops fall back to Triton, with the reason in explain()
                skip build-cuda "no CUDA toolkit for this torch (CUDA_HOME='$cuda_home')"
                run build env FASTBERT_BUILD_NATIVE=1 MAX_JOBS="${MAX_JOBS:-8}" "$PY" setup.py -q build_ext --inplace
            fi ;;
        tests)
            run tests "$PY" -m pytest -q -rfE -m gpu tests --junitxml "$LOGS/gpu_tests.xml" ;;
        kernels)
            run kernels "$PY" -m benchmarks.bench_kernels --out benchmarks/results ;;
        native)
            if "$PY" -c "import sys; from fastbert.backends import native; sys.exit(native.load('_native_cuda')[0] is None)"; then
                run native "$PY" -m benchmarks.bench_native --device cuda --out benchmarks/results/bench_native_cuda
            else
                skip native "the CUDA extension is not built here (see the install stage)"
            fi ;;
        model)
            run model "$PY" -m benchmarks.run_model --out benchmarks/results "${model_args[@]}" ;;
        train)
            run train "$PY" -m benchmarks.bench_train_step --out benchmarks/results --max-minutes 8 \
                "${train_args[@]}" ;;
        *) echo "unknown stage $stage"; status=2 ;;
    esac
done
exit "$status"
