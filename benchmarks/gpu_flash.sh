#!/usr/bin/env bash
# FLASH kernels on a GPU machine: install the anchor wheels (.whl/: fla, flash-pytorch,
# rotary-embedding-torch), run the CUDA tests of the mixed chunk / GAU Triton kernels (real-size
# correctness), then the benchmark cases.  Logs and JSON go to $OUT (default ./gpu_flash_out).
# Usage: benchmarks/gpu_flash.sh [tests|quicktests] [bench] [graph] (default: tests bench).
# `bench` runs the default cases of lintime/bench/cases_flash.py through `lintime bench ops` (eager
# calls, launch overhead included) -> $OUT/bench/bench_ops.json; `graph` times CUDA-graph replays
# (device time) -> $OUT/graph/bench_ops.json.
# Results record the commit from git; a copied working tree may carry a stale .git, so pass the real one:
#   LINTIME_GIT_COMMIT=<sha of the local HEAD> benchmarks/<this script> ...
set -uo pipefail
OUT=${OUT:-./gpu_flash_out}
mkdir -p "$OUT"
STEPS=${*:-tests bench}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed: anchors will be skipped"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
if [[ " $STEPS " == *" tests "* ]]; then
  python3 -m pytest -q -m cuda -p no:cacheprovider tests/ops/gau/test_gau_triton.py tests/ops/mixed_chunk/test_mixed_chunk_triton.py \
    2>&1 | tee "$OUT/tests.log" || rc=1
fi
if [[ " $STEPS " == *" quicktests "* ]]; then
  python3 -m pytest -q -m cuda -p no:cacheprovider -k "fp32_exact or long_sequence or dispatch" \
    tests/ops/gau/test_gau_triton.py tests/ops/mixed_chunk/test_mixed_chunk_triton.py 2>&1 | tee "$OUT/quicktests.log" || rc=1
fi
if [[ " $STEPS " == *" bench "* ]]; then
  python3 -m lintime bench ops --cases flash --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
if [[ " $STEPS " == *" graph "* ]]; then
  python3 -m lintime bench ops --cases flash.graph --out "$OUT/graph" 2>&1 | tee "$OUT/graph.log" || rc=1
fi
exit $rc
