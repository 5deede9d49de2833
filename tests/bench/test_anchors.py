"""``lintime bench model``'s anchors on CPU: HF transformers' Llama at ``transformer-pp-tiny`` size
runs its real training step and ``generate`` (transformers is a test dependency); an anchor whose
library is missing, an unknown anchor, and fla on CPU are ``skipped`` rows with their reason; the
result JSON records the schema, the anchors and, per row, ``impl`` and the decoding ``path``."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from lintime.bench import anchors
from lintime.bench import model as bm
from lintime.models import get_preset

pytest.importorskip("transformers")

HF = "hf:llama-tiny"


def _settings(presets: str, **kw) -> bm.Settings:
    base = {"presets": presets, "contexts": "16", "decode_contexts": "8,24", "tokens_per_batch": 32, "steps": 2,
            "warmup": 1, "decode_steps": 2, "prefill_chunk": 8, "dtype": "fp32", "device": "cpu"}
    base.update(kw)
    return bm.make_settings(**base)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("anchors")
    result = bm.run_model(_settings(f"transformer-pp-tiny,{HF},fla:gla-tiny,hf:nope-base"), str(out),
                          echo=lambda line: None, plots=False)
    with open(out / "bench_model.json") as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(result))
    return saved


def test_llama_is_sized_like_transformer_pp():
    spec = anchors.anchor_spec("hf:llama-base", 4096, torch.device("cpu"))
    ours = get_preset("transformer-pp-base")
    c = spec.config
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["intermediate_size"],
            c["vocab_size"], c["tie_word_embeddings"]) == (768, 12, 12, 2048, 32000, True)
    assert c["hidden_size"] == ours.d_model and c["attn_implementation"] == "sdpa"
    assert spec.family == "softmax" and spec.impl.startswith("transformers ") and spec.model_class == "LlamaForCausalLM"


def test_schema_env_and_anchor_records(run):
    assert run["schema"] == bm.SCHEMA
    for key in ("date", "device", "git_commit", "torch", "triton", "fla", "transformers"):
        assert key in run["env"]
    rec = run["anchors"]
    assert set(rec) == {HF, "fla:gla-tiny", "hf:nope-base"}
    assert rec[HF]["status"] == "ok" and rec[HF]["model"] == "LlamaForCausalLM"
    assert rec[HF]["config"]["hidden_size"] == get_preset("transformer-pp-tiny").d_model
    assert rec["fla:gla-tiny"]["status"] == "skipped: fla's kernels need CUDA (device cpu)"
    assert rec["hf:nope-base"]["status"].startswith("skipped: unknown anchor preset 'hf:nope-base'")


def test_hf_training_rows_match_ours_in_tokens(run):
    rows = {r["preset"]: r for r in run["train"]}
    ours, hf = rows["transformer-pp-tiny"], rows[HF]
    assert ours["impl"] == "lintime" and hf["impl"].startswith("transformers ")
    assert hf["status"] == "ok" and hf["family"] == "softmax"
    assert (hf["T"], hf["rows"], hf["tokens"]) == (ours["T"], ours["rows"], ours["tokens"]) == (16, 2, 32)
    assert hf["steps"] == 2 and 0 < hf["step_p10_ms"] <= hf["step_ms"] <= hf["step_p90_ms"]
    assert hf["tokens_per_s"] == pytest.approx(32 / hf["step_ms"] * 1e3)
    assert hf["params"] > 0
    for name in ("fla:gla-tiny", "hf:nope-base"):
        assert rows[name]["status"].startswith("skipped: ") and rows[name]["step_ms"] is None


def test_hf_decode_rows_record_path_prefill_and_a_growing_cache(run):
    by = {(r["preset"], r["L"]): r for r in run["decode"]}
    for p in ("transformer-pp-tiny", HF):
        for L in (8, 24):
            r = by[p, L]
            assert r["status"] == "ok" and r["path"] == "eager" and r["steps"] == 2
            assert 0 < r["token_p10_ms"] <= r["token_ms"] <= r["token_p90_ms"]
            assert r["prefill_tokens_per_s"] == pytest.approx(r["prefill_tokens"] / r["prefill_s"])
    for p in ("transformer-pp-tiny", HF):  # ours and generate both take a fresh L-token prompt per context
        assert by[p, 24]["prefill_tokens"] == 24
    assert by[HF, 24]["state_mib"] > by[HF, 8]["state_mib"] > 0  # the KV cache grows with L
    assert by["fla:gla-tiny", 8]["path"] is None and by["fla:gla-tiny", 8]["status"].startswith("skipped")


def test_missing_library_is_a_skip_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `from transformers import ...` now fails
    rows = bm.bench_train(_settings(HF, parts="train"))
    assert [r.status.split(" (")[0] for r in rows] == ["skipped: transformers is not importable here"]
    assert anchors.describe(HF, 16, torch.device("cpu"))["status"].startswith("skipped: transformers is not")


def test_hf_static_compiled_asks_generate_for_a_static_cache_of_each_context_and_a_dynamic_compile(monkeypatch):
    """The arguments the static-compiled rows give HF's ``generate`` (run on CUDA only): a static cache sized for
    the call's prompt + new tokens, not by an earlier longer call, and one dynamic-shape compile config."""
    from transformers import CompileConfig

    spec = anchors.anchor_spec(HF, 64, torch.device("cpu"))
    model = spec.build(torch.device("cpu"))
    seen = []

    def fake_generate(ids, **kw):
        seen.append((ids.shape, kw["max_new_tokens"], kw.get("cache_implementation"), kw.get("max_cache_len"),
                     kw.get("compile_config"), model._previous_max_cache_length))
        for proc in kw["logits_processor"]:
            for _ in range(kw["max_new_tokens"]):
                proc(ids, None)
        return type("Out", (), {"past_key_values": None})()

    monkeypatch.setattr(model, "generate", fake_generate)
    model._previous_max_cache_length = 999
    measure = anchors.generate_measure(model, spec, 3, 2, torch.device("cpu"), None, lambda: None, static=True)
    row = type("Row", (), {"L": 24})()
    assert len(measure(row)) == 3 and row.prefill_tokens == 24
    (shape0, new0, impl0, len0, cc0, prev0), (shape, new, impl, length, cc, prev) = seen
    assert (tuple(shape0), impl0, prev0) == ((2, 8), "static", -1) and 8 + new0 <= len0 <= 8 + new0 + 2
    assert (tuple(shape), new, impl, prev) == ((2, 24), 4, "static", -1) and 24 + 4 <= length <= 24 + 4 + 2
    assert cc == CompileConfig(dynamic=True) and cc.mode == "reduce-overhead"


def test_cache_bytes_walk_tensors_once():
    t = torch.zeros(4, 8)
    holder = type("Holder", (), {})()
    holder.layers = [{"k": t, "v": t.clone()}, (t,)]
    holder.module = torch.nn.Linear(100, 100)  # modules are not state
    assert anchors.nbytes(holder) == 2 * t.numel() * 4
