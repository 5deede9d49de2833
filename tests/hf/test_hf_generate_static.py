"""HF ``generate`` through lintime's static state (``lintime.hf.generation``): greedy output equals
lintime's eager generation token for token for every family; eos / pad / left padding / several
eos ids give exactly what HF's own loop gives; sampling is seeded by torch's generator; arguments
the lintime loop does not take run HF's loop after one warning; on CUDA (marked) the default is the
graph path."""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_helpers import FAMILY_PRESETS, tiny_hf

from lintime.data import ByteTokenizer
from lintime.generation import GenerationConfig, generate
from lintime.generation.tokens import generate_tokens
from lintime.hf import hf_tokenizer
from lintime.hf.generation import resolve_decode

TOK = ByteTokenizer()
HF_TOK = hf_tokenizer(TOK)
PROMPT = "The state of a linear model "


def _static(model, *args, **kwargs):
    """``model.generate`` on the lintime loop, failing on any fallback warning."""
    stats: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(*args, lintime_decode="static", lintime_stats=stats, **kwargs)
    assert stats["decode_path"] == "static" and stats["new_tokens"] > 0
    return out


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_greedy_static_equals_lintime_eager_generate(preset):
    model = tiny_hf(preset)
    ref = generate(model.lintime, TOK, PROMPT, GenerationConfig(max_new_tokens=12, temperature=0, decode="eager"))
    ids = HF_TOK(PROMPT, return_tensors="pt").input_ids
    out = _static(model, ids, max_new_tokens=12, do_sample=False)
    assert out[0, : ids.shape[1]].tolist() == ids[0].tolist()
    assert out[0, ids.shape[1]:].tolist() == ref[0].token_ids


@pytest.mark.parametrize("preset", ["transformer-pp-tiny", "flash-tiny"])
def test_eos_pad_and_left_padding_equal_hf_loop(preset):
    """Rows end at different steps on one of three eos ids: the same ids, padding and length as HF's
    loop (which runs every step through LintimeCache)."""
    model = tiny_hf(preset)
    batch = HF_TOK(["ab", "a longer prompt crossing chunks", "middle size!"], return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any()
    free = model.generate(**batch, max_new_tokens=10, do_sample=False, lintime_decode="hf")
    new = free[:, batch.input_ids.shape[1]:]
    eos = [int(new[r, 2 * r + 2]) for r in range(3)]  # row r stops at step 2r + 2 at the latest
    kw = dict(max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=TOK.pad_id)
    hf = model.generate(**batch, lintime_decode="hf", **kw)
    ours = _static(model, **batch, **kw)
    assert hf.shape[1] < free.shape[1]  # every row ended before max_new_tokens
    assert torch.equal(ours, hf)


def test_max_length_and_positional_config():
    model = tiny_hf("gla-tiny")
    ids = HF_TOK("abc", return_tensors="pt").input_ids
    ref = model.generate(ids, max_length=ids.shape[1] + 5, lintime_decode="hf")
    assert torch.equal(_static(model, ids, max_length=ids.shape[1] + 5), ref)
    assert ref.shape[1] == ids.shape[1] + 5


def test_sampling_is_seeded_by_torch_and_top_k_1_is_greedy():
    model = tiny_hf("gla-tiny")
    ids = HF_TOK("some prompt", return_tensors="pt").input_ids
    greedy = _static(model, ids, max_new_tokens=9, do_sample=False)
    assert torch.equal(_static(model, ids, max_new_tokens=9, do_sample=True, top_k=1, temperature=0.7), greedy)
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        draws.append(_static(model, ids, max_new_tokens=9, do_sample=True, top_p=0.95, num_return_sequences=3))
    assert torch.equal(*draws) and draws[0].shape == (3, ids.shape[1] + 9)
    assert len({tuple(r) for r in draws[0].tolist()}) > 1  # the three samples draw from different seeds
    # the draws are generate_tokens' for the seed taken from torch's generator
    torch.manual_seed(0)
    seed = int(torch.randint(0, 2**62, ()).item())
    direct = generate_tokens(model.lintime, [ids[0].tolist()], 9, repeats=3, eos_ids=(TOK.eos_id,), temperature=1.0,
                             top_k=50, top_p=0.95, seed=seed, graph=False)
    assert [r[ids.shape[1]:] for r in draws[0].tolist()] == direct


def test_unsupported_arguments_fall_back_to_hf_loop_with_one_warning():
    model = tiny_hf("gla-tiny")
    batch = HF_TOK(["one", "a second prompt"], return_tensors="pt", padding=True)
    for kw, name in ((dict(num_beams=2), "num_beams"), (dict(repetition_penalty=1.3), "repetition_penalty"),
                     (dict(return_dict_in_generate=True), "return_dict_in_generate")):
        stats: dict = {}
        with pytest.warns(RuntimeWarning, match=f"HF's own loop \\({name}") as rec:
            out = model.generate(**batch, max_new_tokens=4, lintime_decode="static", lintime_stats=stats, **kw)
        assert len(rec) == 1 and stats["decode_path"] == "hf" and name in stats["fallback"]
        ref = model.generate(**batch, max_new_tokens=4, lintime_decode="hf", **kw)
        seq = out.sequences if kw.get("return_dict_in_generate") else out
        assert torch.equal(seq, ref.sequences if kw.get("return_dict_in_generate") else ref)


def test_default_path_by_device():
    assert resolve_decode("auto", torch.device("cpu")) == "hf"
    assert resolve_decode("auto", torch.device("cuda")) == "graph"
    with pytest.raises(ValueError, match="lintime_decode"):
        resolve_decode("fast", torch.device("cpu"))
    model = tiny_hf("linear-tiny")
    stats: dict = {}
    model.generate(HF_TOK("x", return_tensors="pt").input_ids, max_new_tokens=2, lintime_stats=stats)
    assert stats == {"decode_path": "hf"}  # the CPU keeps HF's eager loop by default


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_cuda_default_is_the_graph_path_and_equals_eager(preset):
    import dataclasses

    from lintime.hf import LintimeForCausalLM
    from lintime.models import CausalLM

    small = tiny_hf(preset, torch.float32).lintime
    # chunk / block sizes of 16: the Triton kernels' smallest tiles
    mixer = {f.name: 16 for f in dataclasses.fields(small.config.mixer) if f.name in ("chunk_size", "block_len")}
    cfg = dataclasses.replace(small.config, mixer=dataclasses.replace(small.config.mixer, **mixer))
    torch.manual_seed(0)
    lt = CausalLM(cfg).to("cuda").eval()
    model = LintimeForCausalLM.from_lintime(lt, bos_token_id=TOK.bos_id, eos_token_id=TOK.eos_id,
                                            pad_token_id=TOK.pad_id).eval()
    ref = generate(lt, TOK, PROMPT, GenerationConfig(max_new_tokens=40, temperature=0, decode="eager"))
    ids = HF_TOK(PROMPT, return_tensors="pt").input_ids.cuda()
    stats: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture failure (eager fallback) fails the test
        out = model.generate(ids, max_new_tokens=40, do_sample=False, lintime_stats=stats)
    assert stats["decode_path"] == "graph"
    assert out[0, ids.shape[1]:].tolist() == ref[0].token_ids
