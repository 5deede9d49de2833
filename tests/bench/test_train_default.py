"""benchmarks/train_default.py on the CPU: it runs `lintime train` as a user does, records the trainer's figure and
the line about its step, and compares each row with the committed result (a regression is named)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_rows_are_compared_with_the_previous_result(tmp_path):
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps({"commit": "abc1234", "train_default": [
        {"preset": "transformer-pp-tiny", "T": 32, "flags": "(default)", "tokens_per_s": 10**9}]}))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "train_default.py"), "--out", str(tmp_path / "out"),
                          "--configs", "transformer-pp-tiny@32 transformer-pp-tiny@32:--compile,off",
                          "--tokens-per-batch", "128", "--steps", "4", "--log-every", "1", "--skip", "1",
                          "--previous", str(prev)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "train_default.json").read_text())["rows"]
    assert [r["flags"] for r in rows] == ["(default)", "--compile off"]
    assert all(r["rc"] == 0 and r["tokens_per_s"] > 0 for r in rows)
    # the default row has a committed counterpart (absurdly fast): compared and named as slower; the other has none
    assert rows[0]["previous"]["commit"] == "abc1234" and rows[0]["previous"]["ratio"] < 0.95
    assert "previous" not in rows[1]
    assert "slower than abc1234" in res.stdout and "transformer-pp-tiny@32 (default)" in res.stdout
    log = (tmp_path / "out" / "train_default.log").read_text()
    assert log.count("$ lintime train --preset transformer-pp-tiny") == 2 and "done: 4 steps" in log
