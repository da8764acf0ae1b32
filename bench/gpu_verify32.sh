#!/usr/bin/env bash
# Issue 32's GPU check in one device call: the index and attention GPU tests, then the prefill / bf16 peer benches.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. KVTOOL_CACHE_DIR=${KVTOOL_CACHE_DIR:-.kvtool-cache} PYTHONUNBUFFERED=1
OUT="${OUT:-bench/out}"; mkdir -p "$OUT"
SHARDS=${SHARDS:-14} SHARD_TIMEOUT=${SHARD_TIMEOUT:-250} bash bench/gpu_run.sh tests-index tests-attn 2>&1 | grep -v "^==\|^\[" | tail -40
timeout 150 python3 -m kvtool bench index --device cuda --batches 1 --contexts 1024 --prefill 4096,32768 --formats bf16,fp8,nvfp4,mxfp4 --peer vllm --no-peers > "$OUT/index_prefill.txt" 2>&1; echo "index rc=$?"
grep -i "prefill\|ratio\|vllm" "$OUT/index_prefill.txt" | tail -30
timeout 100 python3 -m kvtool bench attn --device cuda --batches 16,64,256 --formats bf16 --peer vllm --no-peers > "$OUT/attn_bf16.txt" 2>&1; echo "attn rc=$?"
tail -12 "$OUT/attn_bf16.txt"
