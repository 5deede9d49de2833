"""Training-step tokens/s (median of 5 after 3 warm-up) and peak memory, one line per preset x T."""
import sys, time, json, torch
sys.path.insert(0, sys.argv[1])
from lintime.bench.model import preset_config, build_model, random_batch, train_step_fn
res = {}
for preset in sys.argv[2].split(","):
    for T in [int(t) for t in sys.argv[3].split(",")]:
        cfg, _ = preset_config(preset, T)
        m = build_model(cfg, torch.device("cuda")); m.train()
        b = random_batch(32768 // T, T, cfg.vocab_size, torch.device("cuda"))
        step, opt = train_step_fn(m, b, torch.bfloat16)
        for _ in range(3): step()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        ts = []
        for _ in range(5):
            t = time.perf_counter(); loss = step(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
        ts.sort(); ms = ts[2] * 1e3
        peak = torch.cuda.max_memory_allocated() / 2**30
        res[f"{preset}/{T}"] = dict(ms=ms, tok_s=32768 / ms * 1e3, peak_gib=peak, loss=float(loss))
        print(f"{sys.argv[1]:8s} {preset:22s} T={T:6d}  {ms:7.1f} ms  {32768/ms:6.0f}k tok/s  peak {peak:5.1f} GiB  loss {float(loss):.4f}", flush=True)
        del m, b, step, opt; torch.cuda.empty_cache()
json.dump(res, open(sys.argv[4], "w"), indent=1)
