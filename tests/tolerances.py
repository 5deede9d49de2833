"""Numerical comparison helpers shared by lintime's tests (importable as ``tolerances``: pytest puts tests/ on the path).

The tolerance rule, stated once:

* Comparisons are by **relative RMS error** ``rms(out - ref) / rms(ref)`` (a tensor whose
  reference is all zeros is compared by absolute RMS instead).
* Two exact forms of the same math (naive / chunked / recurrent) computed in the same dtype
  must agree to ``EXACT_TOL[dtype]``: float64 ``1e-10``, float32 ``5e-6``.  These are a few
  hundred ulps of accumulated rounding, far below any real bug (a wrong mask, a missing
  normaliser, a misplaced chunk boundary shows up at >= 1e-3).
* A half-precision path (bf16 / fp16) is compared against the float64 reference: its error
  must be at most ``HALF_FACTOR`` (= 2) times the error of the naive reference run in the same
  half dtype, plus a small floor ``HALF_FLOOR[dtype]`` (bf16 ``2**-10``, fp16 ``2**-13``: a quarter
  of the dtype's unit roundoff) so a comparison whose naive half error happens to be tiny is not
  held to zero.  The floor is deliberately far below the output's own rounding error (bf16 about
  ``2e-3`` relative RMS): a path that accumulated in half precision instead of fp32 must fail.
  This is FlashAttention's rule.

* A parameter's gradient of a few numbers (a scalar's: every token's contribution summed into one value) is the
  exception to the exact rule: its terms cancel, so two exact paths that associate the sum differently (eager and a
  compiled graph, whose GEMMs the CPU library blocks differently) differ by ~1e-5 relative in fp32, eager's own error
  against float64 being of the same size.  Gradients of fewer than ``REDUCED_NUMEL`` elements are held to
  ``REDUCED_TOL[dtype]`` (float32 ``1e-4``, float64 ``1e-8``): still ten times below a real bug's ``1e-3``
  (:func:`assert_exact_grad`).

Every helper raises ``AssertionError`` with the name, the measured error and the bound: it
fails, it never warns.
"""

from __future__ import annotations

import torch

EXACT_TOL = {torch.float64: 1e-10, torch.float32: 5e-6}
HALF_FACTOR = 2.0
HALF_FLOOR = {torch.bfloat16: 2.0**-10, torch.float16: 2.0**-13}


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Relative RMS error of ``out`` against ``ref`` (absolute RMS when ``ref`` is zero)."""
    ref = ref.detach().double()
    out = out.detach().double()
    if ref.shape != out.shape:
        raise AssertionError(f"shape mismatch: ref {tuple(ref.shape)} vs out {tuple(out.shape)}")
    if not torch.isfinite(out).all():
        return float("inf")
    err = (out - ref).pow(2).mean().sqrt().item() if out.numel() else 0.0
    scale = ref.pow(2).mean().sqrt().item() if ref.numel() else 0.0
    return err / scale if scale > 0 else err


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> None:
    """Fail unless ``rel_rms(ref, out) <= tol``."""
    err = rel_rms(ref, out)
    if not err <= tol:
        raise AssertionError(f"{name}: relative RMS error {err:.3e} exceeds {tol:.1e}")


def assert_exact(name: str, ref: torch.Tensor, out: torch.Tensor) -> None:
    """Two exact forms in the same dtype (fp32 / fp64) agree to ``EXACT_TOL``."""
    assert_close(name, ref, out, EXACT_TOL[out.dtype if out.dtype in EXACT_TOL else torch.float32])


REDUCED_NUMEL = 16
REDUCED_TOL = {torch.float64: 1e-8, torch.float32: 1e-4}


def assert_exact_grad(name: str, ref: torch.Tensor, out: torch.Tensor) -> None:
    """Two exact paths' gradients of one parameter: :func:`assert_exact`, or ``REDUCED_TOL`` for a gradient of
    fewer than ``REDUCED_NUMEL`` elements (the module docstring says why)."""
    if out.numel() >= REDUCED_NUMEL:
        assert_exact(name, ref, out)
        return
    assert_close(name, ref, out, REDUCED_TOL[out.dtype if out.dtype in REDUCED_TOL else torch.float32])


def assert_half_rule(name: str, ref64: torch.Tensor, out: torch.Tensor, base: torch.Tensor) -> None:
    """Half-precision rule: ``err(out) <= HALF_FACTOR * err(base) + HALF_FLOOR``, both against
    the float64 reference ``ref64``; ``base`` is the naive form run in ``out``'s dtype."""
    e_out = rel_rms(ref64, out)
    e_base = rel_rms(ref64, base)
    bound = HALF_FACTOR * e_base + HALF_FLOOR[out.dtype]
    if not e_out <= bound:
        raise AssertionError(
            f"{name}: {out.dtype} error {e_out:.3e} exceeds {HALF_FACTOR} x naive-{out.dtype} error "
            f"{e_base:.3e} + {HALF_FLOOR[out.dtype]:.1e} = {bound:.3e}"
        )

