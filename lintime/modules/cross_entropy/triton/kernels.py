"""Triton kernel of the fused linear + cross-entropy: the per-row step of one chunk of logits.

Notation: ``z [n, V]`` one chunk's logits (in the compute dtype, row stride ``stride_z``), ``y [n]``
targets, ``eps`` the label smoothing.  One program per row, two sweeps over the row in blocks of
``BV`` columns (no ``tl.dot``)::

    sweep 1 (online softmax):  m = max_j z_j,  s = sum_j exp(z_j - m),  sz = sum_j z_j (eps > 0)
    lse = m + log s,   loss = (1 - eps) (lse - z_y) + eps (lse - sz / V)       0 on ignored rows
    sweep 2 (gradient):        z_j <- scale * (exp(z_j - lse) - eps / V - (1 - eps) [j == y])

so the chunk's logits buffer becomes the gradient of ``scale * loss`` with respect to the logits,
in place.  ``scale`` is read at ``scale_ptr + row * scale_stride`` (stride 0: one scalar).  When one
block holds the whole row (``V <= BV``, ``ONE_BLOCK``) sweep 2 reuses sweep 1's registers: the row is
read once instead of twice.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ce_rows_kernel(
    z, y, loss, scale, stride_z, scale_stride, V, ignore_index, eps,
    BV: tl.constexpr, SMOOTH: tl.constexpr, WANT_GRAD: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    """Loss of row ``i_n`` (and its gradient over the row's logits); grid ``(n,)``."""
    i_n = tl.program_id(0).to(tl.int64)
    p_z = z + i_n * stride_z
    b_y = tl.load(y + i_n)
    valid = b_y != ignore_index
    m = float("-inf")
    s = 0.0
    sz = 0.0
    if ONE_BLOCK:
        o_v = tl.arange(0, BV)
        b_row = tl.load(p_z + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)  # kept for sweep 2
        m = tl.max(b_row, 0)
        s = tl.sum(tl.exp(b_row - m), 0)
        if SMOOTH:
            sz = tl.sum(tl.where(o_v < V, b_row, 0.0), 0)
    else:
        b_row = tl.zeros([BV], dtype=tl.float32)  # unused
        for v0 in range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            m_v = o_v < V
            b_z = tl.load(p_z + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(b_z, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(b_z - m_new), 0)
            m = m_new
            if SMOOTH:
                sz += tl.sum(tl.where(m_v, b_z, 0.0), 0)
    lse = m + tl.log(s)
    m_y = valid & (b_y >= 0) & (b_y < V)
    z_y = tl.load(p_z + tl.where(m_y, b_y, 0), mask=m_y, other=0.0).to(tl.float32)
    b_loss = lse - z_y
    if SMOOTH:
        b_loss = (1.0 - eps) * b_loss + eps * (lse - sz / V)
    tl.store(loss + i_n, tl.where(valid, b_loss, 0.0))
    if WANT_GRAD:
        b_s = tl.load(scale + i_n * scale_stride).to(tl.float32)
        b_s = tl.where(valid, b_s, 0.0)
        if ONE_BLOCK:  # sweep 1's registers hold the row
            o_v = tl.arange(0, BV)
            b_g = tl.exp(b_row - lse) - tl.where(o_v == b_y, 1.0 - eps, 0.0)
            if SMOOTH:
                b_g -= eps / V
            tl.store(p_z + o_v, (b_s * b_g).to(z.dtype.element_ty), mask=o_v < V)
        else:
            for v0 in range(0, V, BV):
                o_v = v0 + tl.arange(0, BV)
                m_v = o_v < V
                b_z = tl.load(p_z + o_v, mask=m_v, other=0.0).to(tl.float32)
                b_g = tl.exp(b_z - lse) - tl.where(o_v == b_y, 1.0 - eps, 0.0)
                if SMOOTH:
                    b_g -= eps / V
                tl.store(p_z + o_v, (b_s * b_g).to(z.dtype.element_ty), mask=m_v)
