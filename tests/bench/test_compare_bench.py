"""benchmarks/compare_bench.py: two tiny synthetic bench_model.json files, one planted regression, named."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "compare_bench.py"


def _module():
    spec = importlib.util.spec_from_file_location("compare_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train(preset, T, tps, status="ok"):
    return {"preset": preset, "T": T, "rows": 32768 // T, "status": status,
            "tokens_per_s": tps if status == "ok" else None}


def _decode(preset, L, batch, tps, path="graph"):
    return {"preset": preset, "L": L, "batch": batch, "path": path, "status": "ok", "tokens_per_s": tps}


def _write(path, commit, train, decode=()):
    path.write_text(json.dumps({"schema": 3, "env": {"date": "2026-12-02", "git_commit": commit, "device": "X"},
                                "settings": {"dtype": "bf16", "tokens_per_batch": 32768},
                                "train": list(train), "decode": list(decode)}))
    return str(path)


def _pair(tmp_path):
    old = _write(tmp_path / "old.json", "aaaaaaa",
                 [_train("flash-base", 2048, 500e3), _train("flash-base", 8192, 500e3), _train("gla-base", 2048, 400e3),
                  _train("vq-base", 2048, 300e3)],
                 [_decode("flash-base", 1024, 64, 30e3)])
    new = _write(tmp_path / "new.json", "bbbbbbb",
                 [_train("flash-base", 2048, 490e3),        # -2 %: within the threshold
                  _train("flash-base", 8192, 400e3),        # -20 %: the planted regression
                  _train("gla-base", 2048, 450e3),          # +12.5 %
                  _train("flash-base@eager", 2048, 300e3),  # no counterpart
                  _train("flash-base", 32768, None, status="OOM")],
                 [_decode("flash-base", 1024, 64, 20e3), _decode("flash-base", 1024, 256, 40e3)])
    return old, new


def test_planted_regression_is_named(tmp_path):
    mod = _module()
    old, new = _pair(tmp_path)
    entries = mod.compare(mod.load(old), mod.load(new))
    verdict = {mod.label(e["key"]): e["verdict"] for e in entries}
    assert verdict == {
        "train  flash-base T=2048": "same",
        "train  flash-base T=8192": "REGRESSION",
        "train  gla-base T=2048": "faster",
        "train  flash-base@eager T=2048": "new row",
        "train  flash-base T=32768": "new row",
        "decode flash-base L=1024 B=64 graph": "REGRESSION",
        "decode flash-base L=1024 B=256 graph": "new row",
        "train  vq-base T=2048": "not re-run",
    }
    ratio = {mod.label(e["key"]): e["ratio"] for e in entries}
    assert abs(ratio["train  flash-base T=8192"] - 0.8) < 1e-9
    only = mod.compare(mod.load(old), mod.load(new), part="train", new_only=True)
    assert {e["key"][0] for e in only} == {"train"} and all(e["verdict"] != "not re-run" for e in only)


def test_command_line_names_the_regression_and_fails(tmp_path):
    old, new = _pair(tmp_path)
    res = subprocess.run([sys.executable, str(SCRIPT), old, new], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("slower than the old run by more than 5%")
    assert "flash-base T=8192 (0.800)" in last and "flash-base L=1024 B=64 graph (0.667)" in last
    assert "flash-base T=2048" not in last and "gla-base" not in last
    assert "commit aaaaaaa" in res.stdout and "commit bbbbbbb" in res.stdout
    # a looser threshold lets the decode row (-33 %) stay named and the training row (-20 %) pass
    res = subprocess.run([sys.executable, str(SCRIPT), old, new, "--threshold", "0.25", "--markdown"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "| train  flash-base T=8192 | 500.0k | 400.0k | 0.800 | same |" in res.stdout
    # no regression: exit status 0
    res = subprocess.run([sys.executable, str(SCRIPT), old, old], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "no row slower" in res.stdout


def test_rows_beside_other_results_are_read(tmp_path):
    """A file holding bench-model rows under ``bench_model_rows`` (docs/results/train_default.json) compares too."""
    mod = _module()
    prev = tmp_path / "train_default.json"
    prev.write_text(json.dumps({"commit": "ccccccc", "bench_model_env": {"git_commit": "ccccccc"},
                                "bench_model_rows": [_train("flash-base", 2048, 600e3)]}))
    _, new = _pair(tmp_path)
    entries = mod.compare(mod.load(str(prev)), mod.load(new), new_only=True)
    assert [e["verdict"] for e in entries if e["key"] == ("train", "flash-base", 2048)] == ["REGRESSION"]
