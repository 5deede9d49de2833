#!/usr/bin/env bash
# The quality study (docs/results.md) on one GPU machine, in one call:
#   1. install the carried wheels (.whl/, if any) into /tmp/site,
#   2. unpack the carried corpus (benchmarks/quality/data/quality_data.tar.xz, made here by
#      `python3 benchmarks/quality/prepare_data.py`), check it byte for byte and build its token cache,
#   3. print the plan's predicted cost on these GPUs against DEADLINE_S, then run it on every visible
#      GPU (one run per GPU at a time; the main table first, seed 0 of every model before seed 1), every
#      run logged to $OUT/logs/<run>.log, its result.json / metrics.jsonl / config.json to
#      $OUT/runs/<run>/ (no checkpoints), everything still running killed at DEADLINE_S s after the start,
#   4. write the report into $OUT/report/ (results.md, plots, quality.json) when matplotlib is there,
#      and print a compact summary.
# Environment: OUT (default ./quality_out), MODE (full | smoke-gpu; default full), TOKENS (training tokens
# per run, default 4194304 = 2^22), SEEDS (default 0,1,2), TABLES (main[,context,chunk]; default main),
# DEADLINE_S (default 540, counted from the start of this script), RUN_CAP_S (training-time cap per run,
# default none), GPU_IDS (which GPUs, as CUDA_VISIBLE_DEVICES: e.g. 1,2,3; default all), GPUS (all | N:
# how many of them), ONLY (comma-separated run ids or groups: flash-1024-s2, flash-1024), PACK (write
# OUT as one .tar.gz there at the end: the results of a call come back as one file), QUALITY_KEEP_CHECKPOINTS=1
# (keep each run's last checkpoint in the work folder, OUT/../quality_work/<run>/, ~300 MB each, for a later
# evaluation such as benchmarks/passkey_sweep.py on the same machine).
# Expected (quality_plan.py --gpus N --deadline-s 540): the default plan (8 models x 3 seeds, 2^22 tokens)
# ~360 s on 3 H200s, ~530 s on 2 (use TOKENS=3145728 there: ~460 s); smoke-gpu on 1 GPU ~3-4 min.
set -uo pipefail
T0=$(date +%s)
if [[ -n "${GPU_IDS:-}" ]]; then export CUDA_VISIBLE_DEVICES=$GPU_IDS; fi
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
ARGS=(all --out "$OUT" --work /tmp/quality_work --mode "${MODE:-full}" --tokens "${TOKENS:-4194304}"
      --seeds "${SEEDS:-0,1,2}" --tables "${TABLES:-main}" --deadline-s "$LEFT" --gpus "${GPUS:-all}")
echo "GPUs: CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}; ${LEFT} s left for the runs"
[[ -n "${RUN_CAP_S:-}" ]] && ARGS+=(--run-cap-s "$RUN_CAP_S")
[[ -n "${ONLY:-}" ]] && ARGS+=(--only "$ONLY")
python3 benchmarks/quality/quality_run.py "${ARGS[@]}" 2>&1 | tee "$OUT/study.log"
rc=${PIPESTATUS[0]}
if python3 -c "import matplotlib" 2>/dev/null; then
  mkdir -p "$OUT/report"
  timeout 45 python3 benchmarks/quality/quality_report.py --results "$OUT" --doc "$OUT/report/results.md" \
    2>&1 | tail -3 || echo "report: failed (run quality_report.py on the fetched results)"
else
  echo "report: no matplotlib here; run quality_report.py --results <fetched OUT> where it is installed"
fi
if [[ -n "${PACK:-}" ]]; then  # one archive of the whole results folder (a device may return few files)
  tar -czf "$PACK" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "packed $OUT into $PACK ($(du -h "$PACK" | cut -f1))"
fi
echo "total $(( $(date +%s) - T0 )) s"
exit $rc
