#!/usr/bin/env bash
# `lintime bench model` on one GPU, every family's ~110M preset, in one call of < 8 minutes wall:
#   for each preset, two processes -- training (T = 1k..128k at 32k tokens per batch, 2 warm-up +
#   3 timed steps) and decoding (L = 1k..128k, batch 1, 8 timed tokens) -- each under its own
#   `timeout`, so a hang or a slow compile costs that piece only (the JSON is rewritten after every
#   row, so a killed piece keeps what it measured); then one merge (`--from-json`): the tables,
#   $OUT/bench_model.json and, when matplotlib is installed, the two plots.
# Inside a process: the timed steps of a case stop after CASE_BUDGET_S seconds, a preset whose
# median timed step (or prefill after the first context) takes longer skips its longer contexts
# (warm-up steps, which hold Triton's compilation and autotuning, are never judged), and after an OOM the longer contexts of that preset are skipped (rows say so).
# Budget: TOTAL_S (default 450 s) for the measuring; each preset gets TRAIN_S + DECODE_S
# (default 28 + 14 s) or what is left.  Usage: benchmarks/gpu_model.sh [preset ...]
# (default: lintime.bench.model.DEFAULT_PRESETS -- one ~110M preset per family, then the anchors
# hf:llama-base and fla:gla-base, each in its own processes like ours; a missing preset gives
# "skipped: unknown preset" rows).  Environment: OUT (default ./gpu_model_out), CONTEXTS,
# DECODE_CONTEXTS, TOKENS_PER_BATCH, STEPS, DECODE_STEPS, DECODE_PATH (auto: eager and graph rows on CUDA),
# DECODE_BATCH (decoding batch sizes, e.g. 1,64; default 1), preset names '<preset>@graph' for the captured
# training step (train part only),
# CASE_BUDGET_S, TRAIN_S, DECODE_S, TOTAL_S,
# DEVICE and DTYPE (a CPU dry run of this script: DEVICE=cpu DTYPE=fp32 CONTEXTS=32,64 ... tiny presets).
# Results record the commit from git; a copied working tree may carry a stale .git, so pass the real one:
#   LINTIME_GIT_COMMIT=<sha of the local HEAD> benchmarks/<this script> ...
set -uo pipefail
OUT=${OUT:-./gpu_model_out}
mkdir -p "$OUT/parts"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# the anchors (hf:llama-base: transformers; fla:gla-base: fla + einops) need their packages: wheels in
# .whl/ are installed when present; an anchor whose package is missing gives "skipped: ..." rows.
# fla autotunes its kernels for minutes on a fresh machine: TRITON_CACHE_AUTOTUNING=1 keeps the results
# in the Triton cache for the next call on the same machine.
export TRITON_CACHE_AUTOTUNING=1
# benchmarks/anchors/fla-0.6.0-autotune.tgz holds the results of one such run (fla 0.6.0, Triton 3.6, H200): Triton
# finds them under the same keys on a fresh machine of that kind and skips the minutes of autotuning.
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
mkdir -p "$TRITON_CACHE" && tar -xzf benchmarks/anchors/fla-0.6.0-autotune.tgz -C "$TRITON_CACHE" 2>/dev/null \
  || echo "fla autotune cache not extracted: fla autotunes in its warm-up steps"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed: anchors without their package will be skipped"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>&1 | tail -1
  python3 -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
  python3 -c "import fla.models; import fla; print('fla', fla.__version__)" 2>&1 | tail -1
  git rev-parse HEAD 2>/dev/null || true
  date -u
} | tee "$OUT/gpu.txt"

if [[ $# -gt 0 ]]; then
  PRESETS=("$@")
else
  mapfile -t PRESETS < <(python3 -c "from lintime.bench.model import DEFAULT_PRESETS as P; print('\n'.join(P))")
fi
CONTEXTS=${CONTEXTS:-1k,2k,4k,8k,16k,32k,64k,128k}
DECODE_CONTEXTS=${DECODE_CONTEXTS:-$CONTEXTS}
COMMON=(--device "${DEVICE:-cuda}" --dtype "${DTYPE:-bf16}" --case-budget-s "${CASE_BUDGET_S:-6}")
TRAIN_S=${TRAIN_S:-28}
DECODE_S=${DECODE_S:-14}
TOTAL_S=${TOTAL_S:-450}
start=$SECONDS
rc=0
n=${#PRESETS[@]}
i=0
for p in "${PRESETS[@]}"; do
  left=$(( TOTAL_S - (SECONDS - start) ))
  share=$(( left / (n - i) ))  # the presets still to run share what is left
  i=$(( i + 1 ))
  t_train=$(( share * TRAIN_S / (TRAIN_S + DECODE_S) ))
  (( t_train > TRAIN_S )) && t_train=$TRAIN_S
  (( t_train < 5 )) && { echo "[$p] no time left: skipped" | tee -a "$OUT/bench.log"; continue; }
  echo "=== [$p] train (timeout ${t_train} s)" | tee -a "$OUT/bench.log"
  timeout -k 5 "$t_train" python3 -m lintime bench model --presets "$p" --parts train --contexts "$CONTEXTS" \
    --tokens-per-batch "${TOKENS_PER_BATCH:-32768}" --steps "${STEPS:-3}" --warmup 2 --no-plots "${COMMON[@]}" \
    --out "$OUT/parts/$p-train" >>"$OUT/bench.log" 2>&1
  r=$?; (( r == 124 || r == 137 )) && echo "[$p] train: timed out after ${t_train} s (rows so far kept)" | tee -a "$OUT/bench.log"
  (( r != 0 )) && rc=1
  left=$(( TOTAL_S - (SECONDS - start) ))
  t_dec=$(( left / (n - i + 1) ))
  (( t_dec > DECODE_S )) && t_dec=$DECODE_S
  (( t_dec < 5 )) && { echo "[$p] decode: no time left" | tee -a "$OUT/bench.log"; continue; }
  echo "=== [$p] decode (timeout ${t_dec} s)" | tee -a "$OUT/bench.log"
  timeout -k 5 "$t_dec" python3 -m lintime bench model --presets "$p" --parts decode --decode-contexts "$DECODE_CONTEXTS" \
    --decode-steps "${DECODE_STEPS:-8}" --decode-path "${DECODE_PATH:-auto}" --decode-batch "${DECODE_BATCH:-1}" --no-plots "${COMMON[@]}" --out "$OUT/parts/$p-decode" >>"$OUT/bench.log" 2>&1
  r=$?; (( r == 124 || r == 137 )) && echo "[$p] decode: timed out after ${t_dec} s (rows so far kept)" | tee -a "$OUT/bench.log"
  (( r != 0 )) && rc=1
  echo "[$p] done at $(( SECONDS - start )) s" | tee -a "$OUT/bench.log"
done

# one result: every part that wrote a JSON, in preset order (train then decode)
parts=()
for p in "${PRESETS[@]}"; do
  for kind in train decode; do
    [[ -f "$OUT/parts/$p-$kind/bench_model.json" ]] && parts+=("$OUT/parts/$p-$kind")
  done
done
if (( ${#parts[@]} )); then
  IFS=, ; joined="${parts[*]}"; unset IFS
  python3 -m lintime bench model --from-json "$joined" --out "$OUT" 2>&1 | tee "$OUT/summary.txt" || rc=1
else
  echo "no part wrote a result: see $OUT/bench.log" | tee "$OUT/summary.txt"
  rc=1
fi
echo "measuring took $(( SECONDS - start )) s"
exit $rc
