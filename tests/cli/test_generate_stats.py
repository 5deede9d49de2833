"""``lintime generate``'s end-of-run line on stderr: tokens generated, ms per token (decode time /
decoding steps) and the decoding path (eager on the CPU by default; --decode static)."""

from __future__ import annotations

import re

import pytest

from lintime.cli import main
from lintime.cli.generate import stats_line
from lintime.data import ByteTokenizer
from tiny_presets import saved_preset_run

LINE = re.compile(r"\[prefill (\d+) tokens in [\d.]+ s; (decoder set-up [\d.]+ s; )?(\d+) new tokens in ([\d.]+) s \(([\d.]+) ms per token, "
                  r"(\w+) path, [\d.]+ tokens/s\); decoding state per sample")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return saved_preset_run(tmp_path_factory.mktemp("gen") / "run", "gla-tiny")


@pytest.mark.parametrize("decode", ["auto", "static"])
def test_stats_line_names_tokens_ms_per_token_and_path(run_dir, capsys, decode):
    args = ["generate", str(run_dir), "--prompt", "ab", "--max-new-tokens", "20", "--temperature", "0",
            "--device", "cpu", "--decode", decode]
    assert main(args) == 0
    cap = capsys.readouterr()
    (line,) = [ln for ln in cap.err.splitlines() if ln.startswith("[prefill")]
    m = LINE.fullmatch(line[: line.index("decoding state per sample") + len("decoding state per sample")])
    assert m, line
    prompt, setup, new, seconds, ms, path = int(m[1]), m[2], int(m[3]), float(m[4]), float(m[5]), m[6]
    assert prompt == 3 and path == {"auto": "eager", "static": "static"}[decode]  # bos + "ab"; the CPU decodes eagerly
    assert (setup is not None) == (decode == "static")  # the static buffers (and a graph's capture) timed apart
    drawn = len(ByteTokenizer().encode(cap.out[len("ab"):].rstrip("\n")))
    assert new <= 20 and (new == 20 or new == drawn + 1)  # 20 tokens, or fewer ending at eos
    assert abs(ms * new / 1e3 - seconds) <= 0.005 + new * 0.005 / 1e3  # both printed to 2 decimals


def test_stats_line_with_several_samples_is_per_step():
    info = {"prompt_tokens": 4, "prefill_s": 0.01, "new_tokens": 30, "decode_s": 0.2, "steps": 10,
            "decode_path": "graph", "state_bytes_prefill": 2048, "state_bytes_final": 2048}
    line = stats_line(info, 3)
    assert "30 new tokens in 0.20 s (20.00 ms per step of 3 samples, graph path, 150.0 tokens/s)" in line
    assert "(20.00 ms per token, graph path" in stats_line(dict(info, new_tokens=10), 1)
    assert "; decoder set-up 1.50 s; 30 new tokens in 0.20 s" in stats_line(dict(info, setup_s=1.5), 3)


def test_bad_decode_value_is_one_line(run_dir, capsys):
    assert main(["generate", str(run_dir), "--decode", "fast", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "decode must be one of" in err
