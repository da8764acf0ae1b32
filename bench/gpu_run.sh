#!/usr/bin/env bash
# One-call GPU batches for the H200 (device tool): `bash bench/gpu_run.sh tests|bench-quant|bench-attn|bench-index|...`.
# Logs and JSON reports go to $OUT (or bench/out when run elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT="${OUT:-bench/out}"; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    tests-store) python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_store.py tests/test_kernel_codecs.py tests/test_formats.py 2>&1 | tail -25 ;;
    tests-attn) python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attn.py tests/test_attention.py 2>&1 | tail -25 ;;
    tests-index) python3 -m pytest -q -p no:cacheprovider tests/test_kernels_index.py tests/test_indexer.py 2>&1 | tail -25 ;;
    tests-rest) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_container.py tests/test_decode.py tests/test_models.py 2>&1 | tail -25 ;;
    bench-quant) python3 -m kvtool bench quant --device cuda --sizes 64M,256M,1G --formats nvfp4,mxfp4,mxfp4-floor,fp8,fp8-token --json > "$OUT/bench_quant.json"; python3 -c "import json,sys; r=json.load(open('$OUT/bench_quant.json')); print(json.dumps(r)[:200])" ;;
    bench-attn) python3 -m kvtool bench attn --device cuda --json > "$OUT/bench_attn.json" ;;
    bench-attn-sweep) python3 -m kvtool bench attn --device cuda --sweep --json > "$OUT/bench_attn_sweep.json" ;;
    bench-index) python3 -m kvtool bench index --device cuda --json > "$OUT/bench_index.json" ;;
    bench-decode) python3 -m kvtool bench decode --device cuda --json > "$OUT/bench_decode.json" ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "=== $stage done rc=$? $(date -u +%H:%M:%S)"
done
