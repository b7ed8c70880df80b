#!/usr/bin/env bash
# One call on a CUDA machine checks and times everything that needs a GPU: installs fastbert in place, builds the
# CUDA extension, runs the GPU-marked tests, then the Triton kernel suite, the native CUDA ops and the model suite.
# Results (JSON + Markdown + PNG, with device, versions and commit) land in benchmarks/results/ and, when $OUT is
# set, are copied there too. Each stage runs even if an earlier one failed; the exit code is the first failure's.
#   bash benchmarks/gpu_check.sh            # everything
#   STAGES="tests kernels" bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAGES=${STAGES:-"install tests kernels native model"}
export PYTHONUNBUFFERED=1
status=0
run() {  # run NAME CMD...: time one stage, keep going, remember the first failure
    local name=$1; shift
    echo "=== $name: $*"
    local start=$SECONDS
    "$@" || { rc=$?; echo "=== $name FAILED (exit $rc)"; [ "$status" -eq 0 ] && status=$rc; }
    echo "=== $name took $((SECONDS - start)) s"
}
for stage in $STAGES; do
    case $stage in
        install) run install bash -c "$PY -m pip install -q --no-deps --no-build-isolation -e . \
                     || $PY -m pip install -q --no-deps --no-build-isolation --break-system-packages -e ."
                 run build env FASTBERT_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-8}" \
                     "$PY" setup.py -q build_ext --inplace ;;
        tests)   run tests "$PY" -m pytest -q -m gpu tests ;;
        kernels) run kernels "$PY" -m benchmarks.bench_kernels --out benchmarks/results ;;
        native)  run native "$PY" benchmarks/bench_native.py --device cuda ;;
        model)   run model "$PY" -m benchmarks.run_model --out benchmarks/results ;;
        *) echo "unknown stage $stage"; status=2 ;;
    esac
done
if [ -n "${OUT:-}" ]; then cp benchmarks/results/*cuda* "$OUT"/ 2>/dev/null || true; fi
exit "$status"
