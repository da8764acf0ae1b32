#!/usr/bin/env bash
# Issue 32's GPU check in one device call: GPU test stages of bench/gpu_run.sh run at once (STAGES, default the decode
# index tests and the store tests; '' for none), then the index benchmark beside vLLM (INDEX_BENCH=0 skips it: decode
# batch 64 at 32K / 150K, causal prefill 4K / 32K: PREFILL, '' for none; every format or FORMATS), then, where
# SWEEP_ROWS names `kvtool bench index --sweep` rows, those rows alone at 64 x 32K and 64 x 150K (SWEEP_FORMATS,
# default bf16,nvfp4,mxfp4), and where ATTN_SWEEP_ROWS names `kvtool bench attn --sweep` rows, those rows beside the
# default launch and vLLM's (ATTN_BATCHES, default 16,64,256; ATTN_FORMATS, default bf16,fp8); both sweeps through
# bench/sweep_rows.py.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. KVTOOL_CACHE_DIR=${KVTOOL_CACHE_DIR:-.kvtool-cache} PYTHONUNBUFFERED=1
OUT="${OUT:-bench/out}"; mkdir -p "$OUT"
export OUT
for stage in ${STAGES-tests-index-decode tests-store}; do
  (SHARDS=${SHARDS:-8} SHARD_TIMEOUT=${SHARD_TIMEOUT:-280} bash bench/gpu_run.sh "$stage" 2>&1 \
    | grep -v "^==\|^\[" | tail -14) &
done
wait
if [ "${INDEX_BENCH:-1}" != 0 ]; then
  timeout 200 python3 -m kvtool bench index --device cuda --batches 64 --contexts 32768,150000 \
    --prefill "${PREFILL-4096,32768}" --formats "${FORMATS:-bf16,fp8,nvfp4,mxfp4}" --peer vllm --no-peers \
    > "$OUT/index_peer.txt" 2>&1; echo "index rc=$?"
  grep -iE "^ *(decode|prefill|b64|goal)|vllm|floor" "$OUT/index_peer.txt" | tail -40
fi
if [ -n "${SWEEP_ROWS:-}" ]; then
  COLUMNS=160 timeout "${SWEEP_TIMEOUT:-170}" python3 bench/sweep_rows.py index "$SWEEP_ROWS" -- --device cuda \
    --batches 64 --contexts 32768,150000 --prefill '' --formats "${SWEEP_FORMATS:-bf16,nvfp4,mxfp4}" --peer vllm \
    --no-peers > "$OUT/index_sweep.txt" 2>&1; echo "sweep rc=$?"
  grep -E "^decode|vllm" "$OUT/index_sweep.txt" | tail -40
fi
if [ -n "${ATTN_SWEEP_ROWS:-}" ]; then
  COLUMNS=160 timeout "${ATTN_SWEEP_TIMEOUT:-240}" python3 bench/sweep_rows.py attn "$ATTN_SWEEP_ROWS" -- \
    --device cuda --batches "${ATTN_BATCHES:-16,64,256}" --formats "${ATTN_FORMATS:-bf16,fp8}" --peer vllm \
    --no-peers > "$OUT/attn_sweep.txt" 2>&1; echo "attn sweep rc=$?"
  grep -E "triton|vllm" "$OUT/attn_sweep.txt" | tail -50
fi
