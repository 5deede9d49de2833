#!/usr/bin/env bash
# Session 14's device call: CUDA tests of the candidate variants, then interleaved graph rounds.
# Usage: VARIANTS=red_pointers,one_stream [EXTRA_TESTS=<pytest -k>] [ROUNDS=5] [TS=2048,8192,32768] \
#        benchmarks/s14_try.sh   (results under $OUT)
set -uo pipefail
OUT=${OUT:-./s14_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1  # pass LINTIME_GIT_COMMIT=<local sha>: the device copy's .git is stale
V=${VARIANTS:?}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
ok=default
if [ -n "${EXTRA_TESTS:-}" ]; then
  python3 -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_mixed_chunk_triton.py -k "$EXTRA_TESTS" 2>&1 \
    | tee "$OUT/extra_tests.log" | tail -15
fi
for v in ${V//,/ }; do
  if python3 -m pytest -q -m cuda -p no:cacheprovider "tests/ops/test_mixed_chunk_triton.py::test_launch_variants[$v]" \
      2>&1 | tee "$OUT/test_$v.log" | tail -3 | grep -q " passed" && ! grep -q "failed\|error" "$OUT/test_$v.log"; then
    ok="$ok,$v"
  else
    echo "VARIANT $v FAILED its CUDA test"; tail -30 "$OUT/test_$v.log"
  fi
done
echo "timing: $ok"
python3 benchmarks/ab_mixed_chunk_rounds.py --rounds ${ROUNDS:-5} --variants "$ok" --Ts ${TS:-2048,8192,32768} --out "$OUT/ab.json"
