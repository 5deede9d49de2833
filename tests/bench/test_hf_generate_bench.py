"""benchmarks/hf_generate_bench.py on the CPU with a tiny Llama (2 prompts x 8 tokens, 4 new tokens): every row gets
exactly the new tokens although the model's eos is the first greedy token of a row (eos disabled, no early stop); the
static-cache greedy output, with a new cache per call and with one reused cache, equals HF's default dynamic-cache
greedy output and a plain argmax loop over whole sequences (independent computations); the reported throughput and
latencies are the returned timings'; the command writes its JSON (versions, model record, a skipped row for a
compiled mode on a CPU)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "hf_generate_bench.py")
B, P, NEW, ROUNDS, VOCAB = 2, 8, 4, 2, 64


@pytest.fixture(scope="module")
def hgb():
    spec = importlib.util.spec_from_file_location("hf_generate_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def setup(hgb):
    torch.manual_seed(0)
    model, record = hgb.build_llama("tiny", VOCAB, P + NEW, torch.device("cpu"), torch.float32)
    prompts = hgb.make_prompts("random", B, P, VOCAB, seed=3)
    with torch.no_grad():  # the reference: argmax over the whole sequence's forward, no cache at all
        ids = prompts
        for _ in range(NEW):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    reference = ids[:, P:]
    # a trap for early stops: the model's eos is row 0's first greedy token (HF's defaults would stop that row there)
    model.generation_config.eos_token_id = int(reference[0, 0])
    return model, record, prompts, reference


def test_model_is_the_tiny_llama(setup):
    model, record, _, _ = setup
    c = record["config"]
    assert type(model).__name__ == "LlamaForCausalLM" and record["size_of"] == "transformer-pp-tiny"
    assert c["vocab_size"] == VOCAB == model.config.vocab_size and c["attn_implementation"] == "sdpa"
    assert record["params"] == sum(p.numel() for p in model.parameters()) and record["dtype"] == "float32"


def test_dynamic_cache_reference_is_the_argmax_loop(setup):
    from transformers import DynamicCache

    model, _, prompts, reference = setup
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, DynamicCache)  # HF's default cache, not the static one
    assert torch.equal(out.sequences[:, P:], reference)
    # the trap is armed: with the model's own eos, HF stops row 0 after its first token
    stopped = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
    assert not torch.equal(stopped[:, P:], reference)


@pytest.mark.parametrize("mode", ["static", "static-reused"])
def test_static_cache_rows(hgb, setup, mode):
    model, _, prompts, reference = setup
    row, new = hgb.bench_generate(model, prompts, NEW, mode, rounds=ROUNDS, name="hf:llama-tiny")
    # every row got exactly the new tokens, greedy, equal to the independent computations
    assert new.shape == (B, NEW) and torch.equal(new, reference)
    assert row["status"] == "ok" and row["mode"] == mode and not row["compiled"]
    assert row["clients"] == B and row["requests"] == B * ROUNDS and row["failed"] == 0
    assert row["finish"] == {"length": B * ROUNDS, "stop": 0}
    assert row["output_tokens"] == row["output_pieces"] == B * NEW * ROUNDS
    rounds = row["rounds"]
    assert len(rounds) == ROUNDS
    for r in rounds:
        assert r["tokens"] == r["streamed_tokens"] == B * NEW and r["tokens_per_row"] == NEW
        times = r["token_times_s"]
        assert len(times) == NEW and times == sorted(times)
        assert 0 < r["ttft_s"] == pytest.approx(times[0], abs=1e-6) and times[-1] <= r["wall_s"]
    # the reported figures are the returned timings'
    wall = sum(r["wall_s"] for r in rounds)
    assert row["wall_s"] == round(wall, 3)
    assert row["tokens_per_s"] == row["pieces_per_s"] == round(row["output_tokens"] / wall, 1)
    ttfts = sorted(round(1e3 * r["ttft_s"], 2) for r in rounds)
    assert set(row["ttft_ms"].values()) <= set(ttfts) and row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
    gaps = [b - a for r in rounds for a, b in zip(r["token_times_s"], r["token_times_s"][1:])]
    assert len(gaps) == ROUNDS * (NEW - 1)
    assert row["itl_ms"]["mean"] == round(1e3 * sum(gaps) / len(gaps), 2)
    assert row["itl_ms"]["p50"] <= row["itl_ms"]["p99"] <= round(1e3 * max(gaps), 2)
    assert row["decode_ms_per_token"] == pytest.approx(row["itl_ms"]["mean"], abs=0.011)
    assert row["warmup_s"] > 0 and row["first_token_call_ms"] > 0
    assert row["dynamo_graphs"] == {"warmup": 0, "timed": 0}  # eager: nothing compiled


def test_text_prompt_is_the_serve_bench_prompt(hgb):
    ids = hgb.make_prompts("text", 3, 40, 260)
    assert ids.shape == (3, 40) and torch.equal(ids[0], ids[2])
    assert ids[0, 0] == 257 and bytes(ids[0, 1:].tolist()).decode() == (hgb.PROMPT_TEXT * 2)[:39]
    with pytest.raises(ValueError, match="at least 260"):
        hgb.make_prompts("text", 1, 8, 64)


def test_command_writes_json(hgb, tmp_path, capsys):
    hgb.main(["--out", str(tmp_path), "--size", "tiny", "--vocab-size", str(VOCAB), "--clients", str(B),
              "--prompt-tokens", str(P), "--new-tokens", str(NEW), "--rounds", "1", "--prompt", "random",
              "--dtype", "fp32", "--device", "cpu", "--modes", "static,static+compile"])
    saved = json.loads((tmp_path / "hf_generate_bench.json").read_text())
    assert saved["env"]["transformers"] and saved["env"]["torch"] == torch.__version__
    assert saved["model"]["model"] == "LlamaForCausalLM" and saved["model"]["config"]["vocab_size"] == VOCAB
    ok, skipped = saved["rows"]
    assert ok["status"] == "ok" and ok["output_tokens"] == B * NEW and ok["rows_equal_first_mode"] == B
    assert ok["impl"].startswith("transformers ") and ok["dtype"] == "float32" and ok["device"] == "cpu"
    assert ok["versions"] == {"torch": torch.__version__, "transformers": transformers.__version__}
    assert skipped["mode"] == "static+compile"
    assert skipped["status"].startswith("skipped: generate compiles only on CUDA")
    assert "hf generate static" in capsys.readouterr().out
