#!/usr/bin/env bash
# One-call GPU batches for the H200 (device tool): `bash bench/gpu_run.sh tests-store|bench-quant|...|profile`.
# Logs and JSON reports go to $OUT (or bench/out when run elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT="${OUT:-bench/out}"; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    tests-store) timeout "${STAGE_TIMEOUT:-590}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_store.py tests/test_kernel_codecs.py tests/test_formats.py > "$OUT/tests_store.log" 2>&1; tail -5 "$OUT/tests_store.log" ;;
    tests-attn) timeout "${STAGE_TIMEOUT:-590}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attn.py tests/test_attention.py > "$OUT/tests_attn.log" 2>&1; tail -5 "$OUT/tests_attn.log" ;;
    tests-index) timeout "${STAGE_TIMEOUT:-590}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels_index.py tests/test_indexer.py > "$OUT/tests_index.log" 2>&1; tail -5 "$OUT/tests_index.log" ;;
    tests-rest) timeout "${STAGE_TIMEOUT:-590}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_container.py tests/test_decode.py tests/test_models.py > "$OUT/tests_rest.log" 2>&1; tail -5 "$OUT/tests_rest.log" ;;
    bench-quant) python3 -m kvtool bench quant --device cuda --sizes 64M,256M,1G --formats nvfp4,mxfp4,mxfp4-floor,fp8,fp8-token > "$OUT/bench_quant.txt" 2>&1; tail -60 "$OUT/bench_quant.txt" ;;
    bench-attn) python3 -m kvtool bench attn --device cuda > "$OUT/bench_attn.txt" 2>&1; tail -60 "$OUT/bench_attn.txt" ;;
    bench-attn-sweep) python3 -m kvtool bench attn --device cuda --sweep > "$OUT/bench_attn_sweep.txt" 2>&1; tail -80 "$OUT/bench_attn_sweep.txt" ;;
    bench-index) python3 -m kvtool bench index --device cuda > "$OUT/bench_index.txt" 2>&1; tail -60 "$OUT/bench_index.txt" ;;
    bench-decode) python3 -m kvtool bench decode --device cuda > "$OUT/bench_decode.txt" 2>&1; tail -40 "$OUT/bench_decode.txt" ;;
    profile)  # Nsight Compute on the default kernels at the goal shapes (bench/profile_kernels.py), one report each
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      for case in "store nvfp4" "store mxfp4" "index nvfp4" "attn nvfp4" "attn fp8"; do
        read -r kern fmt <<< "$case"
        timeout 120 "$NCU" --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \
          --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
          python3 bench/profile_kernels.py "$kern" "$fmt" > "$OUT/ncu_${kern}_$fmt.txt" 2>&1
        echo "== $case"; grep -E "^  [a-z_]|Duration|Throughput|Issue Slots|Achieved Occupancy|Registers|Stall" \
          "$OUT/ncu_${kern}_$fmt.txt" | head -30
      done ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "=== $stage done rc=$? $(date -u +%H:%M:%S)"
done
