#!/usr/bin/env bash
# Linear attention / GLA Triton kernels on a GPU machine, in one call:
#   1. install the anchor wheels (.whl/, carried: fla-core + flash-linear-attention 0.6.0),
#   2. `tests`: the CUDA tests of tests/ops/{linear,gla}/test_{linear,gla}_triton.py (real sizes, bf16/fp16/fp32,
#      against the naive / chunked PyTorch references),
#   3. `bench`: `lintime bench ops --cases linear_gla` (ours, fla, SDPA; eager and CUDA-graph device
#      time; decode steps) -> $OUT/bench_ops.json; `quick` = T in 2k/8k/32k.
# Every step has its own time limit so that a slow one leaves the others' results: on a cold machine
# fla's autotuning (hundreds of Triton configs compiled one by one) takes minutes; TRITON_CACHE_AUTOTUNING=1
# keeps its results in the Triton cache for the next call on the same machine.  Logs go to $OUT
# (default ./gpu_linear_gla_out).
# Usage: benchmarks/gpu_linear_gla.sh [tests] [bench] [quick]   (default: tests bench quick)
#        benchmarks/gpu_linear_gla.sh gla   -- GLA only in one call of < 6 min: the CUDA GLA tests, then ours
#   vs fla chunk_gla at T = 8k / 2k / 32k, one T at a time, each saved as soon as measured
#   (-> $OUT/gla_bench/bench_ops.json; a global deadline of GLA_DEADLINE_S, default 330 s, caps every step).
# Results record the commit from git; a copied working tree may carry a stale .git, so pass the real one:
#   LINTIME_GIT_COMMIT=<sha of the local HEAD> benchmarks/<this script> ...
set -uo pipefail
OUT=${OUT:-./gpu_linear_gla_out}
mkdir -p "$OUT"
STEPS=" ${*:-tests bench quick} "
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
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
if [[ "$STEPS" == *" gla "* ]]; then
  T0=$SECONDS
  left() {  # seconds left for a step: min(cap, deadline - elapsed), at least 1
    local l=$(( ${GLA_DEADLINE_S:-330} - (SECONDS - T0) ))
    (( l > $1 )) && l=$1
    (( l < 1 )) && l=1
    echo $l
  }
  if [[ ${GLA_TESTS:-1} == 1 ]]; then  # GLA_TESTS=0: the caller ran the CUDA tests already
    timeout "$(left 110)" python3 -m pytest -q -m cuda -n 4 -p no:cacheprovider --durations=10 \
      tests/ops/gla/test_gla_triton.py 2>&1 | tee "$OUT/gla_tests.log" || rc=1
  fi
  # ours vs fla chunk_gla, one T at a time, each row printed and saved as soon as it is measured
  mkdir -p "$OUT/gla_bench"
  timeout "$(left ${GLA_BENCH_S:-380})" python3 - "$OUT/gla_bench/bench_ops.json" <<'PY' 2>&1 | tee "$OUT/gla_bench.log" || rc=1
import json, sys, time, traceback
from lintime.bench import as_row
from lintime.bench.cases_linear_gla import case_gla
from lintime.bench.measure import environment
rows, path, env = [], sys.argv[1], environment()
for T in (8192, 2048, 32768):
    t0, res = time.time(), []
    try:
        case_gla(res, Ts=(T,))
    except Exception:
        traceback.print_exc()
    for r in res:
        rows.append(as_row(r))
        x = r.extra
        print(f"T={T} {r.impl:<16} eager fwd {r.fwd_ms:.3f} fb {r.fwdbwd_ms:.3f} | graph fwd {x.get('fwd_graph_ms')} "
              f"fb {x.get('fwdbwd_graph_ms')} | speedup fb {x.get('speedup_fwdbwd')} graph "
              f"{x.get('speedup_fwdbwd_graph')} rel_vs_fla {x.get('rel_vs_fla')}", flush=True)
    print(f"T={T}: {time.time() - t0:.0f} s", flush=True)
    with open(path, "w") as f:
        json.dump({"env": env, "results": rows}, f, indent=1)
PY
  echo "gla steps took $(( SECONDS - T0 )) s"
fi
if [[ "$STEPS" == *" tests "* ]]; then
  timeout "${TESTS_S:-240}" python3 -m pytest -q -m cuda -n 4 -p no:cacheprovider --durations=15 \
    tests/ops/linear/test_linear_triton.py tests/ops/gla/test_gla_triton.py 2>&1 | tee "$OUT/tests.log" || rc=1
fi
if [[ "$STEPS" == *" bench "* ]]; then
  QUICK=""
  [[ "$STEPS" == *" quick "* ]] && QUICK="--quick"
  timeout "${BENCH_S:-420}" python3 -m lintime bench ops --cases "${CASES:-linear_gla.decode,linear_gla.linear,linear_gla.gla}" $QUICK --out "$OUT" 2>&1 \
    | tee "$OUT/bench.log" || rc=1
fi
exit $rc
