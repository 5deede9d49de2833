#!/usr/bin/env bash
# A/B of the TMA path in the main job: `lintime train --preset flash-small` (bf16 autocast on CUDA, 32k tokens per
# step) with LINTIME_TMA=1 / 0, twice each; prints the median tokens/s after 10 warm-up steps. GPU machine, repo root:
#   OUT=out benchmarks/ab_tma_train.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LINTIME_CACHE=$OUT/cache
for tma in 1 0 1 0; do
  LINTIME_TMA=$tma timeout 200 python3 -m lintime train --device cuda --steps 40 --context-len 1024 --tokens-per-batch 32768 \
    --log-every 1 --eval-every 0 --save-every 0 --no-plots --no-progress --sample-tokens 0 --out $OUT/runs --name fs_tma${tma}_$RANDOM \
    --preset flash-small --recipe flash > $OUT/log_$tma.txt 2>&1; echo "tma=$tma rc=$?"
done
python3 - $OUT/runs <<'PY'
import json, sys, pathlib, statistics
for d in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    rows = [json.loads(l) for l in open(d / "metrics.jsonl") if l.strip()]
    tps = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")][10:]
    print(d.name, "median tokens/s", statistics.median(tps) if tps else None, "ms/step", 32768e3 / statistics.median(tps) if tps else None, "n", len(tps))
PY
