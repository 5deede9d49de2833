"""benchmarks/profile_step.py on a Transformer-VQ step: the layer's quantisation (codebook, distances, argmin,
straight-through, commitment loss, EMA update) is its own category, the op with its PyTorch glue and its Triton
kernels is the attention op -- the rules on the names the profiler records on CUDA, the split of a replayed graph's
kernels, and one real CPU profile of a narrow vq-tiny."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "profile_step.py")


@pytest.fixture(scope="module")
def ps():
    spec = importlib.util.spec_from_file_location("profile_step_vq", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks the module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


_LAYER = "lintime/layers/vq.py(241): forward"


@pytest.mark.parametrize("frames, py, category", [
    (("aten::einsum", "aten::bmm", "nvjet_tst_128x64"), (_LAYER, "lintime/layers/vq.py(200): quantize"),
     "quantisation"),  # the distance GEMM
    (("aten::argmin", "reduce_kernel<ArgMinOps>"), (_LAYER, "lintime/layers/vq.py(201): quantize"), "quantisation"),
    (("aten::index_add_", "indexFuncLargeIndex"), (_LAYER, "lintime/layers/vq.py(230): update_codebook"),
     "quantisation"),  # EMA statistics
    (("aten::pow", "vectorized_elementwise_kernel"), (_LAYER, "lintime/layers/vq.py(220): commit_loss"),
     "quantisation"),
    (("aten::index_add", "indexFuncLargeIndex"), (_LAYER, "lintime/ops/vq/__init__.py(150): vq_attention",
                                                  "lintime/ops/vq/triton/vq.py(120): scatter_sums"),
     "attention op"),  # the op's per-code sums
    # the layer's profiler range, without Python stacks (what the profiler gives on CUDA)
    (("vq_quantisation", "aten::baddbmm", "sm80_xmma_gemm_f32f32"), (), "quantisation"),
    (("vq_quantisation", "aten::index_add_", "indexFuncLargeIndex"), (), "quantisation"),
    (("aten::linear", "aten::addmm", "nvjet_tst_128x256"), (_LAYER,), "GEMMs"),  # the layer's projections
    (("aten::silu", "vectorized_elementwise_kernel"), (_LAYER,), "elementwise"),
    (("vq_pv_kernel",), (), "attention op"),  # unlinked, by the kernel's name
    (("autograd::engine::evaluate_function: Eager_vq_fwdBackward", "Eager_vq_fwdBackward", "aten::einsum",
      "aten::bmm", "nvjet_tst_64x64"), (), "attention op"),  # the cache's gradients in the op's backward
    (("vq_dp_kernel",), (), "attention op"),
    (("vq_scan_bwd_kernel",), (), "attention op"),
    (("lintime::vq_fwd", "vq_pv_kernel"), (), "attention op"),
    (("Optimizer.step#AdamW.step", "aten::_fused_adamw_", "multi_tensor_apply_kernel"),
     ("torch/optim/adamw.py(100): step",), "optimizer"),
])
def test_rules(ps, frames, py, category):
    assert ps.categorize(frames, py) == category


def test_python_frames_are_not_ops(ps):
    assert ps._is_py("lintime/layers/vq.py(200): quantize") and ps._is_py("nn.Module: RMSNorm_0")
    assert ps._is_py("<built-in method einsum of type object at 0x7f>")
    assert not ps._is_py("aten::einsum") and not ps._is_py("autograd::engine::evaluate_function: MmBackward0")
    # a norm module's Python frame does not make its GEMMs norms
    assert ps.categorize(("aten::mm", "gemm"), ("nn.Module: RMSNorm_0",)) == "GEMMs"


def test_replayed_kernels_split_by_the_eager_body(ps):
    P = ps.Piece
    reference = [P(("aten::argmin", "argmin_k"), 2.0, ("lintime/layers/vq.py(1): quantize",)),
                 P(("aten::add", "add_k"), 3.0, ("lintime/layers/vq.py(2): commit_loss",)),
                 P(("aten::add", "add_k"), 1.0, ()),
                 P(("vq_pv_kernel",), 5.0)]
    replay = [P(("argmin_k",), 4.0), P(("add_k",), 8.0), P(("vq_pv_kernel",), 10.0), P(("gemm_new",), 1.0)]
    out = ps.breakdown(ps.replayed(replay, reference), busy_us=23.0, step_ms=0.023, steps=1)
    assert out["quantisation"] == pytest.approx((4.0 + 6.0) / 1e3)
    assert out["elementwise"] == pytest.approx(2.0 / 1e3)
    assert out["attention op"] == pytest.approx(10.0 / 1e3)
    assert out["GEMMs"] == pytest.approx(1.0 / 1e3)  # not in the reference: by its name


def test_cpu_profile_of_a_vq_step(ps, tmp_path):
    rows = ps.main(["--presets", "vq-tiny,vq-tiny@graph", "--contexts", "128", "--tokens-per-batch", "256",
                    "--steps", "1", "--warmup", "1", "--device", "cpu", "--out", str(tmp_path)])
    ok, graph = rows
    assert graph["status"].startswith("skipped") and "CUDA" in graph["status"]
    assert ok["status"] == "ok"
    cats = ok["categories"]
    for name in ("quantisation", "attention op", "GEMMs", "loss", "optimizer"):
        assert cats[name] > 0, (name, cats)
    assert sum(cats.values()) >= ok["basis_ms"] * 0.999
