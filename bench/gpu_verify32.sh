#!/usr/bin/env bash
# Issue 32's GPU check in one device call: the decode index tests and the store tests (two sharded batches at once),
# then the index benchmark beside vLLM (decode batch 64 at 32K / 150K, causal prefill 4K / 32K, every format).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. KVTOOL_CACHE_DIR=${KVTOOL_CACHE_DIR:-.kvtool-cache} PYTHONUNBUFFERED=1
OUT="${OUT:-bench/out}"; mkdir -p "$OUT"
export OUT
(SHARDS=${SHARDS:-8} SHARD_TIMEOUT=${SHARD_TIMEOUT:-280} bash bench/gpu_run.sh tests-index-decode 2>&1 | grep -v "^==\|^\[" | tail -14) &
(SHARDS=${SHARDS:-8} SHARD_TIMEOUT=${SHARD_TIMEOUT:-280} bash bench/gpu_run.sh tests-store 2>&1 | grep -v "^==\|^\[" | tail -14) &
wait
timeout 200 python3 -m kvtool bench index --device cuda --batches 64 --contexts 32768,150000 --prefill 4096,32768 \
  --formats bf16,fp8,nvfp4,mxfp4 --peer vllm --no-peers > "$OUT/index_peer.txt" 2>&1; echo "index rc=$?"
grep -iE "^ *(decode|prefill|b64|goal)|vllm|floor" "$OUT/index_peer.txt" | tail -40
