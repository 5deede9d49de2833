"""lintime as an HF transformers model: Auto classes, save / load, tokenizer ids, generate()
(greedy == lintime generate, beam search through the state == recompute, left padding == rows
alone), lintime export + pipeline, and the trust_remote_code route without lintime installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hf_helpers import FAMILY_PRESETS, HIDE_LINTIME, tiny_hf, write_run
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lintime.cli import main as cli_main
from lintime.data import BPETokenizer, ByteTokenizer
from lintime.generation import GenerationConfig, generate
from lintime.hf import LintimeCache, LintimeConfig, LintimeForCausalLM, hf_tokenizer
from tolerances import assert_exact

TEXT = "héllo <eos> wörld 🙂\n\tline two <bos><pad>"


# ---------------------------------------------------------------------------------------------- tokenizer
def test_byte_tokenizer_ids_equal_lintime(tmp_path):
    lt = ByteTokenizer()
    hf = hf_tokenizer(lt)
    hf.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for tok in (hf, loaded):
        assert tok(TEXT).input_ids == [lt.bos_id] + lt.encode(TEXT)
        assert tok(TEXT, add_special_tokens=False).input_ids == lt.encode(TEXT)
        assert tok.decode(tok(TEXT).input_ids, skip_special_tokens=True) == lt.decode(lt.encode(TEXT)) == TEXT
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id) == lt.special_ids
        assert len(tok) == lt.vocab_size and tok.padding_side == "left"


def test_bpe_tokenizer_ids_equal_lintime(tmp_path):
    texts = ["the cat sat on the mat", "linear attention keeps a state", "héllo wörld"] * 20
    lt = BPETokenizer.train(texts, vocab_size=300, min_frequency=1)
    hf = hf_tokenizer(lt)
    hf.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in (TEXT, "the cat sat on the <eos> mat"):
        assert loaded(text).input_ids == [lt.bos_id] + lt.encode(text)
        assert loaded.decode(loaded(text).input_ids, skip_special_tokens=True) == lt.decode(lt.encode(text))
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.mask_token_id) == lt.special_ids


# ---------------------------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_save_load_identical_logits(tmp_path, preset):
    model = tiny_hf(preset, torch.float32)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(cfg, LintimeConfig) and cfg.model_config == model.lintime.config
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LintimeForCausalLM
    ids = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    # the wrapped model is lintime's own: the same logits as the plain CausalLM
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, loaded.lintime(ids))


def test_loss_and_bad_inputs():
    model = tiny_hf("gla-tiny")
    ids = torch.randint(0, 256, (2, 9))
    out = model(ids, labels=ids)
    logits = model.lintime(ids)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert torch.allclose(out.loss.double(), ref) and out.past_key_values is None
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match="LintimeCache"):
        model(ids, past_key_values=object())


# ---------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_greedy_generate_equals_lintime_generate(preset):
    """HF generate (greedy) gives exactly the tokens of lintime's own generate, prompt and all."""
    tok = ByteTokenizer()
    model = tiny_hf(preset)
    hf_tok = hf_tokenizer(tok)
    prompt = "The state of a linear model "
    ref = generate(model.lintime, tok, prompt, GenerationConfig(max_new_tokens=14, temperature=0, prefill_chunk=5))
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=14, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == ref[0].token_ids


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_left_padded_batch_equals_rows_alone(preset):
    """Padded positions never enter the state: a left-padded batch gives each row's logits and
    greedy continuation exactly as that row alone."""
    model = tiny_hf(preset)
    tok = hf_tokenizer(ByteTokenizer())
    prompts = ["ab", "a longer prompt crossing chunks", "middle size!"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any()
    with torch.no_grad():
        full = model(**batch).logits
        gen = model.generate(**batch, max_new_tokens=10, do_sample=False)
    width = batch.input_ids.shape[1]
    for r, p in enumerate(prompts):
        ids = tok(p, return_tensors="pt").input_ids
        n = ids.shape[1]
        with torch.no_grad():
            alone = model(ids).logits
            alone_gen = model.generate(ids, max_new_tokens=10, do_sample=False)
        assert_exact(f"{preset} row {r} logits", alone[0], full[r, width - n:])
        assert not full[r, : width - n].any()  # padded positions: logits 0
        assert gen[r, width:].tolist() == alone_gen[0, n:].tolist()


@pytest.mark.parametrize("preset", ["transformer-pp-tiny", "flash-tiny", "gla-tiny", "vq-tiny", "linear-tiny"])
def test_beam_search_through_state_equals_recompute(preset):
    """Beam search with the state (reordered by select each step) equals beam search that
    recomputes every prefix from scratch (use_cache=False), on a left-padded batch."""
    model = tiny_hf(preset)
    tok = hf_tokenizer(ByteTokenizer())
    batch = tok(["one", "a second prompt"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=7, num_beams=3, num_return_sequences=2, do_sample=False, early_stopping=True)
    with torch.no_grad():
        cached = model.generate(**batch, **kw)
        recomputed = model.generate(**batch, use_cache=False, **kw)
    assert cached.tolist() == recomputed.tolist()


def test_sampling_topk1_is_greedy_and_state_is_constant_size():
    model = tiny_hf("gla-tiny")
    ids = hf_tokenizer(ByteTokenizer())("some prompt", return_tensors="pt").input_ids
    greedy = model.generate(ids, max_new_tokens=9, do_sample=False)
    sampled = model.generate(ids, max_new_tokens=9, do_sample=True, top_k=1, top_p=0.9, temperature=0.7)
    assert sampled.tolist() == greedy.tolist()
    torch.manual_seed(0)
    a = model.generate(ids, max_new_tokens=9, do_sample=True, top_k=50, top_p=0.95)
    torch.manual_seed(0)
    b = model.generate(ids, max_new_tokens=9, do_sample=True, top_k=50, top_p=0.95)
    assert a.tolist() == b.tolist()
    # the cache returned by generate is lintime's state: its size does not grow with tokens
    short = model.generate(ids, max_new_tokens=2, return_dict_in_generate=True).past_key_values
    long = model.generate(ids, max_new_tokens=30, return_dict_in_generate=True).past_key_values
    assert isinstance(short, LintimeCache) and short.nbytes() == long.nbytes()
    assert long.state.offset.tolist() == [ids.shape[1] + 29]


# ---------------------------------------------------------------------------------------------- export
def test_export_cli_pipeline_and_errors(tmp_path, capsys):
    from transformers import pipeline

    from lintime.training.checkpoint import load_model

    run = write_run(tmp_path / "run", "flash-tiny")
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "modeling_lintime.py", "configuration_lintime.py", "lintime_bundle.py"} <= names
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == \
        "modeling_lintime.LintimeForCausalLM"
    loaded = load_model(run)
    ref = generate(loaded.model, loaded.tokenizer, "hello", GenerationConfig(max_new_tokens=12, temperature=0))
    pipe = pipeline("text-generation", model=str(out))
    text = pipe("hello", max_new_tokens=12, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert text == ref[0].text
    # a second export into the same folder is refused with one line, exit 2
    capsys.readouterr()
    assert cli_main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["export", str(run), str(tmp_path / "x"), "--dtype", "int8"]) == 2


def test_trust_remote_code_without_lintime(tmp_path):
    """A machine without lintime (and without Triton, as a CPU build of PyTorch leaves it) loads the exported
    folder with trust_remote_code=True (the bundled sources) and computes the same logits."""
    run = write_run(tmp_path / "run", "vq-tiny")
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), str(out)]) == 0
    script = HIDE_LINTIME + r'''
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTriton())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained(sys.argv[1])
import lintime
assert "lintime_src_" in lintime.__file__, lintime.__file__
assert "triton" not in sys.modules
ids = tok(["remote code", "x"], return_tensors="pt", padding=True)
with torch.no_grad():
    torch.save(m(**ids).logits, sys.argv[2])
'''
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"))
    res = subprocess.run([sys.executable, "-c", script, str(out), str(tmp_path / "logits.pt")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = AutoTokenizer.from_pretrained(out)(["remote code", "x"], return_tensors="pt", padding=True)
    with torch.no_grad():
        # the same fp32 code in two processes: equal up to rounding (the subprocess may use another number of
        # threads, so another reduction order -- seen: 3e-9 on logits of 0.02), hence the exact-form rule
        assert_exact("remote-code logits", model(**ids).logits, torch.load(tmp_path / "logits.pt"))


def test_import_lintime_hf_registers_the_auto_classes():
    """One fresh interpreter: without transformers, lintime works and lintime export fails with
    exit code 2; then with transformers, import lintime registers nothing and import lintime.hf
    registers both Auto classes (transformers imported before it)."""
    script = r'''
import sys
class Block:
    def find_spec(self, name, path, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
blocker = Block()
sys.meta_path.insert(0, blocker)
import lintime
from lintime.cli import main
rc = main(["export", "nowhere", "out"])
assert rc == 2, rc
assert "transformers" not in sys.modules and "lintime.hf" not in sys.modules
sys.meta_path.remove(blocker)

import transformers
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
assert "lintime" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING
from lintime.hf import LintimeConfig, LintimeForCausalLM
assert type(AutoConfig.for_model("lintime")) is LintimeConfig
assert MODEL_FOR_CAUSAL_LM_MAPPING[LintimeConfig] is LintimeForCausalLM
'''
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
