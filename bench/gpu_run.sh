#!/usr/bin/env bash
# One-call GPU batches for the H200 (device tool): `bash bench/gpu_run.sh tests-store|bench-quant|...|profile`.
# Logs and JSON reports go to $OUT (or bench/out when run elsewhere). The tests-* stages run only the GPU-marked tests
# (the rest runs in CI), sharded over parallel processes (SHARDS, SHARD_TIMEOUT).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT="${OUT:-bench/out}"; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

# sharded NAME PYTEST_ARGS...: the selected tests in $SHARDS parallel pytest processes (one GPU; the compiles run on
# the host's cores at once), each under $SHARD_TIMEOUT seconds; one log, a summary line per shard, the failures.
# A shard that hits its limit prints no summary: its unreached test ids are listed in $OUT/NAME.unreached.
sharded() {
  local name=$1; shift
  local dir; dir=$(mktemp -d)
  python3 -m pytest --collect-only -q -p no:cacheprovider "$@" | grep '::' > "$dir/ids"
  echo "$name: $(wc -l < "$dir/ids") tests in ${SHARDS:-10} shards"
  [ -s "$dir/ids" ] || { echo "$name: no tests collected"; return; }  # pytest without ids would run everything
  split -n "r/${SHARDS:-10}" "$dir/ids" "$dir/shard_"
  for f in "$dir"/shard_*; do
    [ -s "$f" ] || { rm -f "$f"; continue; }
    timeout "${SHARD_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -rf $(cat "$f") > "$f.log" 2>&1 &
  done
  wait
  : > "$OUT/$name.unreached"
  for f in "$dir"/shard_??; do
    echo "== $(basename "$f")"; cat "$f" "$f.log"
    if ! tail -1 "$f.log" | grep -qE "passed|failed|error"; then
      done_n=$(grep -oE "^[.sFEx]+" "$f.log" | tr -d '\n' | wc -c)
      tail -n +"$((done_n + 1))" "$f" >> "$OUT/$name.unreached"
    fi
  done > "$OUT/$name.log"
  for f in "$dir"/shard_??; do echo "$(basename "$f"): $(tail -1 "$f.log" | cut -c1-100)"; done
  grep -h "^FAILED\|^ERROR" "$dir"/shard_*.log | head -20
  echo "$name: $(wc -l < "$OUT/$name.unreached") tests not reached (listed in $OUT/$name.unreached)"
}
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    tests-store) sharded tests_store -m gpu tests/kernels/test_kernels_store.py tests/kernels/test_kernel_codecs.py tests/formats ;;
    tests-attn) sharded tests_attn -m gpu tests/kernels/test_kernels_attn.py tests/reference/test_attention.py ;;
    tests-index) sharded tests_index -m gpu tests/kernels/test_kernels_index.py tests/reference/test_indexer.py ;;
    tests-index-gluon) sharded tests_index_gluon -m gpu -k gluon tests/kernels/test_kernels_index.py ;;
    tests-index-decode) sharded tests_index_decode -m gpu -k "decode and not prefill" tests/kernels/test_kernels_index.py ;;
    tests-rest) sharded tests_rest -m gpu $(ls -d tests/io tests/workflows tests/cli tests/engines 2>/dev/null) ;;
    bench-quant) python3 -m kvtool bench quant --device cuda --sizes 64M,256M,1G --formats nvfp4,mxfp4,mxfp4-floor,fp8,fp8-token > "$OUT/bench_quant.txt" 2>&1; tail -60 "$OUT/bench_quant.txt" ;;
    bench-attn) python3 -m kvtool bench attn --device cuda > "$OUT/bench_attn.txt" 2>&1; tail -60 "$OUT/bench_attn.txt" ;;
    bench-attn-sweep) python3 -m kvtool bench attn --device cuda --sweep > "$OUT/bench_attn_sweep.txt" 2>&1; tail -80 "$OUT/bench_attn_sweep.txt" ;;
    bench-index) python3 -m kvtool bench index --device cuda > "$OUT/bench_index.txt" 2>&1; tail -60 "$OUT/bench_index.txt" ;;
    bench-decode) python3 -m kvtool bench decode --device cuda > "$OUT/bench_decode.txt" 2>&1; tail -40 "$OUT/bench_decode.txt" ;;
    profile)  # Nsight Compute on the default kernels at the goal shapes (bench/profile_kernels.py): a full report
      # each, at the clocks the benchmarks run at (--clock-control none), plus the per-SASS-line stall summary
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      for case in ${PROFILE_CASES:-store_nvfp4 store_mxfp4 index_nvfp4 attn_nvfp4 attn_fp8}; do
        read -r kern fmt <<< "${case/_/ }"
        rep="$OUT/ncu_${kern}_$fmt"
        timeout 150 "$NCU" --nvtx --nvtx-include "profile/" --set full --import-source no --clock-control none \
          -f -o "$rep" python3 bench/profile_kernels.py "$kern" "$fmt" > "$rep.log" 2>&1
        "$NCU" --import "$rep.ncu-rep" > "$rep.txt" 2>&1
        "$NCU" --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
        python3 bench/ncu_source_top.py "$rep.sass.csv" --top 30 > "$rep.top.txt" 2>&1
        echo "== $case"; grep -E "^  [a-zA-Z_]|Duration|Throughput|Issue Slots|Achieved Occupancy|Registers Per|No Eligible" \
          "$rep.txt" | head -40; head -45 "$rep.top.txt"
      done ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "=== $stage done rc=$? $(date -u +%H:%M:%S)"
done
