"""benchmarks/profile_step.py: the categories of a training step's time -- the rules on the names that the
profiler records on CUDA, and one real profile of a tiny model on CPU (``--device cpu``)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "profile_step.py")


@pytest.fixture(scope="module")
def ps():
    spec = importlib.util.spec_from_file_location("profile_step", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks the module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("frames, category", [
    (("aten::linear", "aten::addmm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"), "GEMMs"),
    (("autograd::engine::evaluate_function: MmBackward0", "MmBackward0", "aten::mm", "nvjet_tst_128x256"), "GEMMs"),
    (("lintime::mixed_chunk_fwd", "mc_gemm_kernel"), "attention op"),  # a GEMM inside the op is the op's
    (("lintime::gau_bwd", "gau_bwd_kernel"), "attention op"),
    (("lintime::gla_fwd", "chunk_fwd_kernel"), "attention op"),
    (("lintime::gau_heads_fwd", "heads_fwd_kernel"), "elementwise"),  # the FLASH prologue is not the op
    (("ScaledDotProductFlashAttentionBackward0", "aten::_scaled_dot_product_flash_attention_backward",
      "flash_bwd_kernel"), "attention op"),
    (("chunk_gla_fwd_kernel_o",), "attention op"),  # fla, by the kernel's name alone
    (("mc_gemm_kernel",), "attention op"),  # ours, unlinked
    (("ce_rows_kernel",), "loss"),
    (("aten::layer_norm", "aten::native_layer_norm", "vectorized_layer_norm_kernel"), "norms"),
    (("NativeLayerNormBackward0", "aten::native_layer_norm_backward", "layer_norm_grad_input_kernel"), "norms"),
    (("lintime::normalize_bwd", "norm_bwd_kernel"), "norms"),  # lintime's fused norm
    (("norm_fwd_kernel",), "norms"),  # unlinked, by the kernel's name
    (("aten::cross_entropy_loss", "aten::log_softmax", "cunn_SoftMaxForward"), "loss"),
    (("NllLossBackward0", "aten::nll_loss_backward", "nll_loss_backward_reduce_cuda_kernel_2d"), "loss"),
    (("lintime::linear_cross_entropy_triton", "aten::mm", "ampere_bf16_s16816gemm"), "loss"),
    (("Optimizer.step#AdamW.step", "aten::_fused_adamw_", "multi_tensor_apply_kernel"), "optimizer"),
    (("aten::_foreach_norm", "multi_tensor_apply_kernel"), "optimizer"),  # gradient clipping
    (("Optimizer.zero_grad#AdamW.zero_grad",), "optimizer"),
    (("aten::silu", "vectorized_elementwise_kernel"), "elementwise"),
    (("aten::copy_", "Memcpy DtoD (Device -> Device)"), "elementwise"),
])
def test_rules(ps, frames, category):
    assert ps.categorize(frames) == category


def test_breakdown_gaps_and_union(ps):
    pieces = [ps.Piece(("aten::mm", "gemm"), 3000.0), ps.Piece(("aten::add", "elementwise"), 1000.0)]
    out = ps.breakdown(pieces, busy_us=4000.0, step_ms=3.0, steps=2)  # 2 steps: 2 ms busy per step
    assert out["GEMMs"] == 1.5 and out["elementwise"] == 0.5 and out["host gaps / idle"] == pytest.approx(1.0)
    assert set(out) == set(ps.CATEGORIES)
    assert ps.breakdown(pieces, 4000.0, 1.0, 2)["host gaps / idle"] == 0.0  # never negative
    assert ps._union_us([(0, 10), (5, 12), (20, 25)]) == 17


def test_cpu_profile_of_a_tiny_model(ps, tmp_path, capsys):
    rows = ps.main(["--presets", "transformer-pp-tiny,no-such-tiny", "--contexts", "32", "--tokens-per-batch", "64",
                    "--steps", "1", "--warmup", "1", "--device", "cpu", "--out", str(tmp_path)])
    with open(tmp_path / "profile_step.json") as f:
        saved = json.load(f)
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["env"]["device"].startswith("cpu")
    ok, missing = rows
    assert missing["status"].startswith("skipped: unknown preset 'no-such-tiny'")
    assert ok["status"] == "ok" and (ok["rows"], ok["tokens"]) == (2, 64)
    cats = ok["categories"]
    assert set(cats) == set(ps.CATEGORIES)
    for name in ("GEMMs", "attention op", "loss", "optimizer"):  # SDPA on CPU; the fused loss; AdamW
        assert cats[name] > 0, name
    assert sum(cats.values()) >= ok["basis_ms"] * 0.999
    assert ok["basis_ms"] == ok["profiled_step_ms"] and ok["busy_ms"] > 0
    assert all(c in ps.CATEGORIES for _, _, c in ok["top"]) and ok["top"][0][1] >= ok["top"][-1][1]
    assert "host gaps" in capsys.readouterr().out
