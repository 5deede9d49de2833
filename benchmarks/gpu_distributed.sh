#!/usr/bin/env bash
# Distributed training on NGPU GPUs (all of the machine's, or NGPU=<n> from the environment; nvidia-h100-x4 for the
# issue #27 target): flash-base (~110M) tokens/s on 1 GPU vs NGPU GPUs DDP vs NGPU GPUs FSDP2 (same per-GPU batch,
# bf16, `lintime train` under torchrun), with the scaling efficiency tokens/s on N GPUs / (N x one-GPU tokens/s);
# then the longest context that trains (1 step fwd+bwd, 1 row, doubling from 32k) on 1 GPU vs 2-GPU context
# parallelism, for FLASH and GLA.  Every measurement runs in its own guarded invocation with a timeout; stderr tails
# land in $OUT/*.log.  JSON: $OUT/scaling.json, $OUT/context.json, with PROFILE=1 also $OUT/fsdp_profile/fsdp_profile.json
# (lab/fsdp_profile.py: the same step on 1 GPU vs FSDP2 variants in one set of processes, and rank 0's profile).
# Scaling settings (environment): SCALE_TOKENS tokens per GPU per step (default 32768, as `lintime bench model`
# steps), PACKING rows|documents (default rows: one sequence per row, the bench's layout, the same shapes every
# step), SCALE_STEPS (default 30), WARMUP_STEPS untimed steps (default 10), LOG_EVERY (default 5: the trainer reads
# its loss once per logged step), DDP=0 skips the DDP run.
# Usage: OUT=... [NGPU=4] [PROFILE=1] benchmarks/gpu_distributed.sh [scaling] [context]   (default: both)
# Results record the commit from git; a copied working tree may carry a stale .git, so pass the real one:
#   LINTIME_GIT_COMMIT=<sha of the local HEAD> benchmarks/<this script> ...
set -uo pipefail
OUT=${OUT:-./gpu_distributed_out}
mkdir -p "$OUT"
STEPS=${*:-scaling context}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export LINTIME_CACHE=${LINTIME_CACHE:-/tmp/lintime_cache}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
SCALE_STEPS=${SCALE_STEPS:-30}
WARMUP_STEPS=${WARMUP_STEPS:-10}
SCALE_TOKENS=${SCALE_TOKENS:-32768}
PACKING=${PACKING:-rows}
LOG_EVERY=${LOG_EVERY:-5}
RUNS=${RUNS:-/tmp/gpu_distributed_runs}  # run folders (checkpoints: ~1 GB each) stay here; metrics are copied to $OUT
rm -rf "$RUNS"/scale_*  # the trainer refuses a run folder that holds a run
TRAIN="-m lintime train --preset flash-base --corpus stdlib --context-len 2048 --steps $SCALE_STEPS --eval-every 0
  --eval-tokens 4096 --save-every 0 --keep 1 --sample-tokens 0 --no-plots --no-progress --precision bf16
  --device cuda --packing $PACKING --log-every $LOG_EVERY --out $RUNS"
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node"  # + the number of processes
# the token cache once (so no timed run pays for it)
timeout 300 python3 -c "from lintime.data import open_corpus, prepare, default_cache_dir
c = open_corpus('stdlib'); prepare(c, 'byte', default_cache_dir(c.name, 'byte'), splits=('train', 'validation'))" \
  > "$OUT/prepare.log" 2>&1 || echo "corpus preparation failed (see prepare.log)"

run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$OUT/status.txt"
  [[ $rc != 0 ]] && tail -n 25 "$OUT/$name.log"
  return 0
}

if [[ " $STEPS " == *" scaling "* ]]; then
  # SCALE_TOKENS / 2048 rows per GPU per step (SCALE_TOKENS x NGPU global), one micro-batch.
  # Fair baseline (the 2026-11-22 run read 1.27 "efficiency" without these): every run under the
  # same launcher (torchrun sets OMP_NUM_THREADS=1 for its workers; --nproc-per-node 1 is the
  # plain single-process trainer) and the first WARMUP_STEPS steps untimed.  With document packing
  # every step has other cuts, and a new cut can need a new kernel variant at any step: an
  # untimed warm-up run first, so the timed runs find the common ones compiled.
  [[ $PACKING == documents ]] && run scale_warmup 300 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    $TRAIN --tokens-per-batch $SCALE_TOKENS --steps 6 --name scale_warmup
  run scale_1gpu 240 python3 -m torch.distributed.run --standalone --nproc-per-node 1 $TRAIN \
    --tokens-per-batch $SCALE_TOKENS --name scale_1gpu
  if [[ $NGPU -ge 2 ]]; then
    [[ ${DDP:-1} == 1 ]] && run scale_ddp 200 $TORCHRUN $NGPU $TRAIN --tokens-per-batch $((SCALE_TOKENS * NGPU)) --parallel ddp --name scale_ddp
    run scale_fsdp 200 $TORCHRUN $NGPU $TRAIN --tokens-per-batch $((SCALE_TOKENS * NGPU)) --parallel fsdp --name scale_fsdp
  fi
  for m in "$RUNS"/scale_*/metrics.jsonl; do [[ -f $m ]] && cp "$m" "$OUT/metrics_$(basename "$(dirname "$m")").jsonl"; done
  python3 - "$OUT" "$WARMUP_STEPS" "$NGPU" "$SCALE_TOKENS" "$PACKING" "$LOG_EVERY" <<'PY'
import json, statistics, sys
from pathlib import Path
out, warm, ngpu, per_gpu = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]); res = {}
for name, gpus in (("scale_1gpu", 1), ("scale_ddp", ngpu), ("scale_fsdp", ngpu)):
    if gpus < 1 or (name != "scale_1gpu" and gpus < 2) or not (out / ("%s.log" % name)).exists():
        continue  # not run (one GPU, or DDP=0)
    m = out / ("metrics_%s.jsonl" % name)
    if not m.is_file():
        res[name] = {"error": "no metrics (see %s.log)" % name}; continue
    rows = [json.loads(l) for l in m.read_text().splitlines()]
    rows = [r for r in rows if r.get("tokens_per_s")]  # one row per LOG_EVERY steps
    # a row's tokens_per_s: the global batch (all ranks) over rank 0's wall time of the steps since
    # the last row: batch fetch, forward + backward + optimizer step, and the one read of the
    # steps' losses at the row, which waits for the device (no validation or checkpoint inside:
    # --eval-every 0 --save-every 0, the final ones come after the loop); "tokens" and "time_s" are
    # cumulative.  Reported: tokens / seconds after the first row at or past the warm-up
    # (compiles, allocator growth), and the spread of the rows after it.
    start = next((r for r in rows if r["step"] >= warm), None)
    timed = [r for r in rows if start is not None and r["step"] > start["step"]]
    if start is None or not timed:
        res[name] = {"error": "fewer than %d steps (see %s.log)" % (warm + 1, name)}; continue
    per_row = [r["tokens_per_s"] for r in timed]
    res[name] = {"gpus": gpus,
                 "tokens_per_s": (timed[-1]["tokens"] - start["tokens"]) / (timed[-1]["time_s"] - start["time_s"]),
                 "median_row_tokens_per_s": statistics.median(per_row),
                 "min_row_tokens_per_s": min(per_row), "max_row_tokens_per_s": max(per_row),
                 "steps_timed": timed[-1]["step"] - start["step"], "warmup_steps": start["step"]}
base = res.get("scale_1gpu", {}).get("tokens_per_s")
for k, v in res.items():
    if base and v.get("tokens_per_s"):
        # tokens/s on N GPUs / (N x one-GPU tokens/s); issue #27's target: FSDP2 >= 0.90 on 4 GPUs
        v["scaling_efficiency"] = v["tokens_per_s"] / (v["gpus"] * base)
res["ngpu"] = ngpu
res["per_gpu_tokens_per_step"] = per_gpu
res["packing"], res["log_every"] = sys.argv[5], int(sys.argv[6])
(out / "scaling.json").write_text(json.dumps(res, indent=2))
res = {k: v for k, v in res.items() if isinstance(v, dict)}
print("%-12s %5s %14s %11s" % ("run", "gpus", "tokens/s", "efficiency"))
for k, v in res.items():
    print("%-12s %5s %14s %11s" % (k, v.get("gpus", "-"), "%.0f" % v["tokens_per_s"] if v.get("tokens_per_s") else v.get("error"),
                                   "%.2f" % v["scaling_efficiency"] if "scaling_efficiency" in v else "-"))
PY
  if [[ ${PROFILE:-0} == 1 && $NGPU -ge 2 ]]; then
    # the same step in one set of processes: one GPU (rank 0 alone) vs FSDP2 layouts, rank 0 profiled
    run fsdp_profile 200 $TORCHRUN $NGPU lab/fsdp_profile.py --preset flash-base --context-len 2048 \
      --tokens-per-gpu $SCALE_TOKENS --vocab 260 --packing $PACKING --configs ${PROFILE_CONFIGS:-single,u1,u1-sync,u1-dtopt,u4-keep} \
      --profile ${PROFILE_RUNS:-single,u1} --steps 10 --warmup 3 --profile-steps 2 --out "$OUT/fsdp_profile"
    grep -E " GPU |wrote|Error" "$OUT/fsdp_profile.log" | tail -n 12
  fi
fi

if [[ " $STEPS " == *" context "* ]]; then
  cat > "$OUT/cp_probe.py" <<'PY'
"""One fwd+bwd of 1 row of T tokens (bf16 autocast); under torchrun: context parallel over the ranks.
Prints 'OK <T> <peak GiB> <seconds>' on success."""
import os, sys, time, torch
from lintime.models import CausalLM, get_preset
preset, T = sys.argv[1], int(sys.argv[2])
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    from lintime.training.context_parallel import ContextParallel
    from lintime.training.parallel import init_distributed
    env = init_distributed("cuda", "none", world)
    dev = env.device
else:
    dev = torch.device("cuda")
torch.manual_seed(0)
model = CausalLM(get_preset(preset, vocab_size=256)).to(dev)
ids = torch.randint(0, 256, (1, T), device=dev)
cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
torch.cuda.reset_peak_memory_stats(dev)
t0 = time.perf_counter()
with torch.autocast("cuda", dtype=torch.bfloat16):
    if world > 1:
        cp = ContextParallel(model, env)
        i, tg, c, off = cp.shard(ids, ids[0], cu, 1)
        logits = cp.forward(model, i, c, off, None)
    else:
        logits = model(ids, cu_seqlens=cu)
        tg = ids[0]
loss = torch.nn.functional.cross_entropy(logits[0].float(), tg)
loss.backward()
torch.cuda.synchronize(dev)
dt = time.perf_counter() - t0
peak = torch.cuda.max_memory_allocated(dev) / 2**30
if world > 1:
    t = torch.tensor([peak], device=dev); torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX); peak = t.item()
if int(os.environ.get("RANK", "0")) == 0:
    print(f"OK {T} {peak:.2f} {dt:.2f}", flush=True)
if world > 1:
    torch.distributed.destroy_process_group()
PY
  for preset in flash-base gla-base; do
    for mode in 1gpu cp2; do
      [[ $mode == cp2 && $NGPU -lt 2 ]] && continue
      T=32768
      while [[ $T -le 4194304 ]]; do
        name="ctx_${preset}_${mode}_$T"
        if [[ $mode == 1gpu ]]; then
          run "$name" 120 python3 "$OUT/cp_probe.py" $preset $T
        else
          run "$name" 120 $TORCHRUN 2 "$OUT/cp_probe.py" $preset $T
        fi
        grep -q "^OK $T" "$OUT/$name.log" || break
        T=$((T * 2))
      done
    done
  done
  python3 - "$OUT" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1]); res = {}
for log in sorted(out.glob("ctx_*.log")):
    _, preset, mode, T = log.stem.split("_")
    m = re.search(r"^OK (\d+) ([\d.]+) ([\d.]+)", log.read_text(), re.M)
    key = f"{preset} {mode}"
    res.setdefault(key, {"ok": [], "failed": None})
    if m:
        res[key]["ok"].append({"T": int(T), "peak_gib": float(m.group(2)), "s": float(m.group(3))})
    else:
        tail = log.read_text().strip().splitlines()[-1:] or ["?"]
        res[key]["failed"] = {"T": int(T), "why": tail[0][:200]}
(out / "context.json").write_text(json.dumps(res, indent=2))
print("%-18s %12s %10s  %s" % ("model / mode", "longest T", "peak GiB", "first failure"))
for k, v in res.items():
    best = max(v["ok"], key=lambda r: r["T"]) if v["ok"] else None
    print("%-18s %12s %10s  %s" % (k, best["T"] if best else "-", best["peak_gib"] if best else "-",
                                   (v["failed"] or {}).get("why", "")[:80]))
PY
fi
cat "$OUT/status.txt" 2>/dev/null
