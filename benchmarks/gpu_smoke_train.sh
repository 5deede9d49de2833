#!/usr/bin/env bash
# CUDA smoke of the whole training path: `lintime train` (bf16 autocast, Triton kernels picked by the
# dispatcher) for every family's -small preset, a few steps each, then eval and generate on one run,
# and one `--compile` run. Reports ms per step from metrics.jsonl. Usage (GPU machine, repo root):
#   OUT=out benchmarks/gpu_smoke_train.sh [STEPS] [CONTEXT] [TOKENS_PER_BATCH]
set -uo pipefail
OUT=${OUT:-./gpu_smoke_out}; mkdir -p "$OUT"
STEPS=${1:-30}; CTX=${2:-1024}; TPB=${3:-32768}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LINTIME_CACHE=$OUT/cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
run() {  # name, extra args...
  local name=$1; shift
  local t0=$SECONDS
  timeout 240 python3 -m lintime train --device cuda --steps "$STEPS" --context-len "$CTX" \
    --tokens-per-batch "$TPB" --log-every 1 --eval-every 0 --save-every 0 --no-plots --no-progress \
    --sample-tokens 32 --out "$OUT/runs" --name "$name" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc wall=$((SECONDS - t0))s"; tail -n 4 "$OUT/$name.log"
}
for p in flash-small flash-quad-small transformer-pp-small transformer-p-small mc-tfm-pp-small \
         linear-small gla-small performer-small combiner-small vq-small; do
  recipe=flash; [[ $p == gla-* ]] && recipe=gla; [[ $p == vq-* ]] && recipe=vq
  run "$p" --preset "$p" --recipe "$recipe"
done
run flash-small-compile --preset flash-small --compile
python3 - "$OUT/runs" <<'PY' | tee "$OUT/steps.txt"
import json, sys, pathlib, statistics
for d in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    f = d / "metrics.jsonl"
    if not f.exists():
        print(f"{d.name:24s} no metrics"); continue
    rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    tr = [r for r in rows if "loss" in r and "time_s" in r]
    if len(tr) < 3:
        print(f"{d.name:24s} {len(tr)} rows: {rows[-1] if rows else None}"); continue
    dt = [(b["time_s"] - a["time_s"]) / max(1, b["step"] - a["step"]) for a, b in zip(tr[1:], tr[2:])]
    print(f"{d.name:24s} loss {tr[0]['loss']:.3f} -> {tr[-1]['loss']:.3f}  median {1e3*statistics.median(dt):.1f} ms/step")
PY
d=$OUT/runs/flash-small
timeout 120 python3 -m lintime eval "$d" --device cuda --context-lens 1024,4096 >"$OUT/eval.log" 2>&1; echo "eval rc=$?"; tail -n 5 "$OUT/eval.log"
timeout 120 python3 -m lintime generate "$d" --device cuda --prompt "def " --max-new-tokens 64 >"$OUT/gen.log" 2>&1; echo "generate rc=$?"; tail -n 5 "$OUT/gen.log"
