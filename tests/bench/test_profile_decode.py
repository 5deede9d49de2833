"""benchmarks/profile_decode.py: the decode step's groups on the kernel / op names the profiler records, a replayed
graph's kernels split by the eager step's shares (fake CUDA events), and one real profile of two tiny models on CPU
(``--device cpu``)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "profile_decode.py")


@pytest.fixture(scope="module")
def pd():
    had = "profile_step" in sys.modules
    spec = importlib.util.spec_from_file_location("profile_decode", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)
    if not had:  # it loaded benchmarks/profile_step.py by path
        sys.modules.pop("profile_step", None)


COPY = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>"


@pytest.mark.parametrize("frames, group", [
    (("vq_decode_attn_kernel",), "vq decode"),
    (("vq_decode_merge_kernel",), "vq decode"),
    (("vq_quantize_kernel",), "vq quantize"),
    (("vq_quantisation", "aten::baddbmm", "aten::bmm"), "vq quantize"),  # the layer's range beats the GEMM
    (("decode_scores_kernel",), "mixer kernels"),  # FLASH's fused step
    (("decode_values_kernel",), "mixer kernels"),
    (("gla_recurrent_kernel",), "mixer kernels"),
    (("aten::linear", "aten::to", "aten::_to_copy", "aten::copy_", COPY), "casts / copies"),  # autocast's weight cast
    ((COPY,), "casts / copies"),  # the same kernel replayed, by its name
    (("Memset (Device)",), "casts / copies"),
    (("aten::linear", "aten::addmm", "nvjet_tst_64x8_64x16_2x1_v_bz_TNT"), "GEMMs"),
    (("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, float, 128, 16, 4, 4, false, true>",), "GEMMs"),
    (("aten::addmm",), "GEMMs"),  # CPU: the op itself
    (("norm_fwd_kernel",), "norms"),
    (("aten::topk", "void at::native::sbtopk::gatherTopK<float>"), "elementwise"),  # not "aten::to"
    (("aten::argmax", "void at::native::reduce_kernel<512, 1>"), "elementwise"),
    (("aten::silu", "vectorized_elementwise_kernel"), "elementwise"),
])
def test_groups(pd, frames, group):
    assert pd.group_of(frames) == group


def _event(name, start, end):
    from torch.autograd import DeviceType

    rng = types.SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return types.SimpleNamespace(name=name, device_type=DeviceType.CUDA, time_range=rng)


def test_replayed_kernels_split_by_the_eager_shares(pd):
    ref = pd.Profile(steps=1)
    ref.add("k_mm", ("GEMMs", "GEMMs"), 30.0, calls=1)
    ref.add("k_mm", ("quantisation", "vq quantize"), 10.0, calls=1)
    # two replays of [k_mm 8 us, vq_decode_attn_kernel 2 us (not in the eager profile)], 10 us gap inside, 80 after
    events = []
    for t in (0.0, 100.0):
        events += [_event("k_mm", t, t + 8), _event("vq_decode_attn_kernel", t + 18, t + 20)]
    prof = types.SimpleNamespace(events=lambda: events[::-1])  # any order
    out, spans = pd.replay_profile(prof, 2, ref)
    assert spans == [20.0, 20.0]
    s = out.summary(basis_ms=0.05)  # 50 us per token
    assert s["busy_us"] == 10.0 and s["kernel_us"] == 10.0 and s["launches_per_token"] == 2.0
    g = s["groups"]
    assert g["GEMMs"] == pytest.approx(6.0) and g["vq quantize"] == pytest.approx(2.0)
    assert g["vq decode"] == pytest.approx(2.0) and g["host gaps / idle"] == pytest.approx(40.0)
    assert s["categories"]["quantisation"] == pytest.approx(2.0)
    assert s["categories"]["GEMMs"] == pytest.approx(6.0)
    assert [(k["name"], k["calls"], k["group"]) for k in s["kernels"]] == [
        ("k_mm", 1.0, "GEMMs"), ("vq_decode_attn_kernel", 1.0, "vq decode")]
    # kernels that do not divide into the replays give no spans
    assert pd.replay_profile(types.SimpleNamespace(events=lambda: events[:3]), 2, ref)[1] == []


def _check_breakdown(pd, part: dict, basis_ms: float) -> None:
    for key, names in (("categories", pd.ps.CATEGORIES), ("groups", pd.GROUPS)):
        cats = part[key]
        assert set(cats) == set(names), key
        assert all(v >= 0 for v in cats.values()), key
        work = sum(v for k, v in cats.items() if k != pd.GAPS)
        assert work == pytest.approx(part["busy_us"], rel=1e-6), key  # CPU: busy = the ops' own time
        assert cats[pd.GAPS] == pytest.approx(max(0.0, basis_ms * 1e3 - part["busy_us"]), rel=1e-6, abs=1e-6)
    us = [k["us"] for k in part["kernels"]]
    assert us == sorted(us, reverse=True) and all(k["calls"] > 0 for k in part["kernels"])
    assert sum(us) == pytest.approx(part["busy_us"], rel=1e-6)
    assert part["launches_per_token"] == pytest.approx(sum(k["calls"] for k in part["kernels"]))


def test_cpu_profile_of_tiny_models(pd, tmp_path, capsys):
    rows = pd.main(["--presets", "vq-tiny,flash-tiny,no-such-tiny", "--contexts", "64", "--replays", "2",
                    "--eager-steps", "1", "--kernels", "0", "--device", "cpu", "--out", str(tmp_path)])
    with open(tmp_path / "profile_decode.json") as f:
        saved = json.load(f)
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["env"]["device"].startswith("cpu")
    vq, flash, missing = rows
    assert missing["status"].startswith("skipped: unknown preset 'no-such-tiny'")
    for r in (vq, flash):
        assert r["status"] == "ok" and (r["L"], r["batch"], r["path"]) == (64, 1, "eager"), r["status"]
        assert "no CUDA graphs" in r["note"] and r["b2b_token_ms"] is None and r["span_us"] is None
        assert r["token_p10_ms"] <= r["token_ms"] <= r["token_p90_ms"] and r["basis_ms"] == r["profiled_token_ms"]
        assert r["layers"] == 4 and r["params"] > 0 and r["state_mib"] > 0
        _check_breakdown(pd, r, r["basis_ms"])
        _check_breakdown(pd, r["eager"], r["eager"]["profiled_token_ms"])
        assert r["groups"]["GEMMs"] > 0  # the projections
        ops = r["eager"]["cpu_ops"]
        assert 0 < len(ops) <= 15 and ops[0]["self_us"] >= ops[-1]["self_us"]
    assert vq["groups"]["vq quantize"] > 0 and vq["categories"]["quantisation"] > 0  # the layer's range
    assert flash["groups"]["vq quantize"] == flash["groups"]["vq decode"] == 0
    out = capsys.readouterr().out
    assert "vq-tiny" in out and "top ops by self CPU" in out
