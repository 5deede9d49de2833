#!/usr/bin/env bash
# Linear attention / GLA Triton kernels on a GPU machine, in one call:
#   1. install the anchor wheels (.whl/, carried: fla-core + flash-linear-attention 0.6.0),
#   2. `tests`: the CUDA tests of tests/ops/test_{linear,gla}_triton.py (real sizes, bf16/fp16/fp32,
#      against the naive / chunked PyTorch references),
#   3. `tune`: per-kernel profile, launch configurations and segment lengths of the walk kernels (no anchors),
#   4. `bench`: `lintime bench ops --cases linear_gla` (ours, fla 0.6.0, SDPA), `quick` = T in 2k/8k/32k.
# Every step has its own time limit so that a slow one leaves the others' results: on a cold
# machine the linear case (with fla 0.6.0's autotuning of chunk_linear_attn: hundreds of Triton
# configs compiled one by one) took ~3 min, and the GLA case (our kernels' first compile plus fla's
# chunk_gla autotuning) did not finish in the 4 min left, so the cheap cases run first.  Logs and JSON go to $OUT (default ./gpu_linear_gla_out).
# Usage: benchmarks/gpu_linear_gla.sh [tests] [tune] [bench] [quick]   (default: tests tune bench quick;
# split over two calls on a warm machine when the whole exceeds one call: compiled kernels persist)
set -uo pipefail
OUT=${OUT:-./gpu_linear_gla_out}
mkdir -p "$OUT"
STEPS=" ${*:-tests tune bench quick} "
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed: anchors will be skipped"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import fla; print('fla', getattr(fla, '__version__', '?'))" 2>&1 | tail -1
  date -u
} | tee "$OUT/gpu.txt"
rc=0
if [[ "$STEPS" == *" tests "* ]]; then
  timeout "${TESTS_S:-240}" python3 -m pytest -q -m cuda -n 4 -p no:cacheprovider --durations=15 \
    tests/ops/test_linear_triton.py tests/ops/test_gla_triton.py 2>&1 | tee "$OUT/tests.log" || rc=1
fi
if [[ "$STEPS" == *" tune "* ]]; then
  timeout "${TUNE_S:-120}" python3 -m lintime bench ops --cases "${TUNE_CASES:-linear_gla.profile,linear_gla.kernel_configs,linear_gla.segments}" \
    --out "$OUT/tune" 2>&1 | tee "$OUT/tune.log" || rc=1
fi
if [[ "$STEPS" == *" bench "* ]]; then
  QUICK=""
  [[ "$STEPS" == *" quick "* ]] && QUICK="--quick"
  timeout "${BENCH_S:-420}" python3 -m lintime bench ops --cases "${CASES:-linear_gla.decode,linear_gla.linear,linear_gla.gla}" $QUICK --out "$OUT" 2>&1 \
    | tee "$OUT/bench.log" || rc=1
fi
exit $rc
