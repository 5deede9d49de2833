"""``lintime eval`` and ``lintime generate`` end to end on a tiny checkpoint written through the
run-folder contract (lintime.training.checkpoint), plus their one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from lintime.cli import main
from lintime.data import ByteTokenizer
from lintime.evaluation import evaluate, load_split
from lintime.generation import GenerationConfig, generate
from lintime.models import CausalLM, get_preset
from lintime.training import load_model
from lintime.training.checkpoint import save_checkpoint, write_run_config

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i % 3}\n" * (1 + i % 4) for i in range(60)]



@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """runs/tiny: config.json + tokenizer/ + checkpoints/step_00000007 of an (untrained) gla-tiny."""
    root = tmp_path_factory.mktemp("cli")
    for i, text in enumerate(TEXTS):
        (root / "corpus" / f"m{i:02d}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / "corpus" / f"m{i:02d}.py").write_text(text, encoding="utf-8")
    tok = ByteTokenizer()
    torch.manual_seed(0)
    model = CausalLM(get_preset("gla-tiny", vocab_size=tok.vocab_size))
    run = root / "runs" / "tiny"
    train = {"corpus": str(root / "corpus"), "cache_dir": str(root / "cache"), "context_len": 32, "text_field": "text"}
    write_run_config(run, model_config=model.config, objective="clm", tokenizer=tok, train=train)
    save_checkpoint(run, 7, model, {"step": 7})
    return run


def test_eval_prints_a_table_and_writes_json(run_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", str(run_dir), "--context-lens", "16,64", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "step 7, gla family, byte tokenizer, trained at context 32" in text
    assert "bits/byte" in text and "* longer than the training context (32)" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()[:2] in ("16", "64")}
    assert set(lines) == {"16", "64*"}
    data = json.loads(out.read_text())
    assert data["step"] == 7 and data["split"] == "validation" and data["trained_context_len"] == 32
    assert [r["context_len"] for r in data["results"]] == [16, 64]
    # the same numbers as the library on the same split
    loaded = load_model(run_dir)
    ds = load_split(loaded.config, loaded.tokenizer, "validation")
    ref = evaluate(loaded.model, ds, [16, 64])
    assert data["n_docs"] == ref.n_docs > 0 and data["n_bytes"] == ref.n_bytes
    for got, want in zip(data["results"], ref.results):
        assert got["bits_per_byte"] == pytest.approx(want.bits_per_byte, rel=1e-9)
        assert f"{want.bits_per_byte:.4f}" in lines[f"{want.context_len}" + ("*" if want.context_len > 32 else "")]


def test_eval_test_split_max_tokens_and_prepared_data(run_dir, capsys):
    assert main(["eval", str(run_dir), "--split", "test", "--context-lens", "2k", "--max-tokens", "50",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "test split, its first 1 of " in out and "(--max-tokens 50)" in out and "2048*" in out
    # --data: the prepared cache folder, read without the corpus
    cache = json.loads((run_dir / "config.json").read_text())["train"]["cache_dir"]
    assert main(["eval", str(run_dir / "checkpoints" / "step_00000007"), "--data", cache, "--context-lens", "8",
                 "--no-progress"]) == 0
    assert "validation split" in capsys.readouterr().out


def test_generate_streams_the_library_text(run_dir, capsys):
    args = ["generate", str(run_dir), "--prompt", "def f", "--max-new-tokens", "24", "--seed", "3",
            "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--prefill-chunk", "2", "--no-stats"]
    assert main(args) == 0
    out = capsys.readouterr().out
    loaded = load_model(run_dir)
    cfg = GenerationConfig(max_new_tokens=24, seed=3, temperature=0.9, top_k=40, top_p=0.95, prefill_chunk=2)
    (s,) = generate(loaded.model, loaded.tokenizer, "def f", cfg)
    assert out == "def f" + s.text + "\n"
    assert main(args) == 0 and capsys.readouterr().out == out  # same seed, same text


def test_generate_several_samples_stop_string_and_stats(run_dir, capsys):
    assert main(["generate", str(run_dir), "--prompt", "x", "--num-samples", "3", "--max-new-tokens", "30",
                 "--stop", "\\n", "--no-echo", "--temperature", "1.0"]) == 0
    cap = capsys.readouterr()
    loaded = load_model(run_dir)
    samples = generate(loaded.model, loaded.tokenizer, "x", GenerationConfig(
        max_new_tokens=30, num_samples=3, stop=("\n",), temperature=1.0))
    for s in samples:
        assert f"=== sample {s.sample_index} ({s.finish_reason}) ===\n{s.text}\n" in cap.out
        assert "\n" not in s.text
    assert "new tokens in" in cap.err and "decoding state per sample" in cap.err


@pytest.mark.parametrize(
    "args,message",
    [
        (["eval", "{missing}"], "checkpoint not found"),
        (["eval", "{run}", "--context-lens", "512,abc"], "--context-lens"),
        (["eval", "{run}", "--split", "train"], "split must be one of"),
        (["eval", "{run}", "--max-tokens", "0"], "--max-tokens"),
        (["eval", "{run}", "--precision", "fp8"], "--precision"),
        (["generate", "{missing}", "--prompt", "a"], "checkpoint not found"),
        (["generate", "{run}", "--top-p", "2"], "top_p"),
        (["generate", "{run}", "--temperature", "-1"], "temperature"),
        (["generate", "{run}", "--num-samples", "0"], "num_samples"),
        (["generate", "{run}", "--device", "cuda:0"] if not torch.cuda.is_available() else ["generate", "{missing}"], ""),
    ],
)
def test_errors_are_one_line_and_exit_2(run_dir, tmp_path, capsys, args, message):
    args = [a.format(run=run_dir, missing=tmp_path / "nope") for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("lintime: error: ") and err.count("\n") == 1 and message in err


def test_bad_flag_type_exits_2(run_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", str(run_dir), "--max-new-tokens", "many"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
