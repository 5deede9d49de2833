#!/usr/bin/env bash
# The quality study (docs/results.md) on one GPU machine, in one call:
#   1. install the carried wheels (.whl/, if any) into /tmp/site,
#   2. unpack the carried corpus (benchmarks/quality/data/quality_data.tar.xz, made here by
#      `python3 benchmarks/quality/prepare_data.py`), check it byte for byte and build its token cache,
#   3. run the plan on every visible GPU (one run per GPU at a time, the main table first), every run
#      logged to $OUT/logs/<run>.log, its result.json / metrics.jsonl / config.json to $OUT/runs/<run>/
#      (no checkpoints), everything still running killed at DEADLINE_S seconds after the start,
#   4. write the report into $OUT/report/ (results.md, plots, quality.json) when matplotlib is there,
#      and print a compact summary.
# Environment: OUT (default ./quality_out), MODE (full | smoke-gpu; default full), TOKENS (training tokens
# per run, default 8388608 = 2^23), DEADLINE_S (default 540, counted from the start of this script),
# RUN_CAP_S (training-time cap per run, default none), GPUS (all | N), ONLY (comma-separated run ids).
# Expected: full on 4 H200s ~8-9 min; smoke-gpu on 1 GPU ~4-5 min.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-./quality_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed: going on without the carried wheels"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" 2>&1
  date -u
} | tee "$OUT/gpu.txt"
if ! python3 benchmarks/quality/prepare_data.py --unpack 2>&1 | tee "$OUT/data.log"; then
  echo "data: unpacking failed (see $OUT/data.log)"; exit 1
fi
grep -q "^prepare_data: unpacked" "$OUT/data.log" || { echo "data: unpacking failed (see $OUT/data.log)"; exit 1; }
ELAPSED=$(( $(date +%s) - T0 ))
LEFT=$(( ${DEADLINE_S:-540} - ELAPSED - 15 ))   # 15 s for the report
ARGS=(all --out "$OUT" --work /tmp/quality_work --mode "${MODE:-full}" --tokens "${TOKENS:-8388608}"
      --deadline-s "$LEFT" --gpus "${GPUS:-all}")
[[ -n "${RUN_CAP_S:-}" ]] && ARGS+=(--run-cap-s "$RUN_CAP_S")
[[ -n "${ONLY:-}" ]] && ARGS+=(--only "$ONLY")
python3 benchmarks/quality/quality_run.py "${ARGS[@]}" 2>&1 | tee "$OUT/study.log"
rc=${PIPESTATUS[0]}
if python3 -c "import matplotlib" 2>/dev/null; then
  mkdir -p "$OUT/report"
  timeout 60 python3 benchmarks/quality/quality_report.py --results "$OUT" --doc "$OUT/report/results.md" \
    2>&1 | tail -3 || echo "report: failed (run quality_report.py on the fetched results)"
else
  echo "report: no matplotlib here; run quality_report.py --results <fetched OUT> where it is installed"
fi
echo "total $(( $(date +%s) - T0 )) s"
exit $rc
