"""Column sums of fp32 partial rows, the second stage of a deterministic reduction over tokens.

A bandwidth-bound backward kernel that owes a parameter gradient summed over every token (a bias, a per-feature
gain) keeps its programs' shares in registers and stores one fp32 partial row per program; :func:`fold_rows` sums
those ``[P, C]`` rows into ``[C]`` in a fixed order (no atomics: deterministic), for up to four such buffers in one
launch.  Narrow column tiles (32 fp32 columns, ~50 programs for 1664 columns) spread a fold over enough programs
to be faster than a few wide ones or ``part.sum(0)`` (``docs/design/kernels.md``, the heads op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lintime.ops.utils.launching import cdiv, interpreting, next_pow2

MAX_PARTS = 4


@triton.jit
def fold_rows_kernel(p0, o0, r0, c0, p1, o1, r1, c1, p2, o2, r2, c2, p3, o3, r3, c3, BR: tl.constexpr,
                     BC: tl.constexpr):
    """Program ``(i_c, i_k)``: ``o<k>[cols] = sum_r p<k>[r, cols]`` over the ``r<k>`` rows of ``p<k> [r<k>, c<k>]``,
    ``cols = i_c BC ..``; ``BR`` rows a step, summed in a fixed order."""
    i_c, i_k = tl.program_id(0), tl.program_id(1)
    if i_k == 0:
        part, out, P, C = p0, o0, r0, c0
    elif i_k == 1:
        part, out, P, C = p1, o1, r1, c1
    elif i_k == 2:
        part, out, P, C = p2, o2, r2, c2
    else:
        part, out, P, C = p3, o3, r3, c3
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    if i_c * BC < C:
        b_acc = tl.zeros([BR, BC], dtype=tl.float32)
        for i_r in range(0, P, BR):
            o_r = i_r + tl.arange(0, BR)
            b_acc += tl.load(part + o_r[:, None].to(tl.int64) * C + o_c[None, :],
                             mask=(o_r < P)[:, None] & m_c[None, :], other=0.)
        tl.store(out + o_c, tl.sum(b_acc, 0), mask=m_c)


def fold_rows(parts: list[torch.Tensor], outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``[p.sum(0) for p in parts]`` for up to four contiguous fp32 ``[P_k, C_k]`` buffers (``C_k >= 1``), in one
    launch, in a fixed order: into ``outs`` (fp32 ``[C_k]`` with unit stride, views welcome) or new tensors (zeros
    where ``P_k = 0``)."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"fold_rows: 1 to {MAX_PARTS} buffers, got {len(parts)}")
    if outs is None:
        outs = [torch.empty(p.shape[1], dtype=torch.float32, device=p.device) for p in parts]
    if len(outs) != len(parts) or any(o.shape != (p.shape[1],) or o.stride(0) != 1 for o, p in zip(outs, parts)):
        raise ValueError("fold_rows: one fp32 [C_k] output with unit stride per buffer")
    for p, o in zip(parts, outs):
        if p.shape[0] == 0:
            o.zero_()
    live = [(p, o) for p, o in zip(parts, outs) if p.shape[0]]
    if not live:
        return outs
    small = parts[0].device.type == "cpu" and interpreting()
    bc = 16 if small else 32  # 32 fp32 columns: 128-byte rows, ~50 programs for C = 1664
    br = min(next_pow2(max(p.shape[0] for p, _ in live)), 4 if small else 128)
    args = []
    for k in range(MAX_PARTS):
        p, o = live[min(k, len(live) - 1)]
        args += [p, o, p.shape[0], p.shape[1]]
    fold_rows_kernel[(cdiv(max(p.shape[1] for p, _ in live), bc), len(live))](*args, BR=br, BC=bc, num_warps=4)
    return outs


__all__ = ["fold_rows"]
