"""Column sums of fp32 partial rows, the second stage of a deterministic reduction over tokens.

A bandwidth-bound backward kernel that owes a parameter gradient summed over every token (a bias, a per-feature
gain) keeps its programs' shares in registers and stores one fp32 partial row per program; :func:`fold_rows` sums
those ``[P, C]`` rows into ``[C]`` in a fixed order (no atomics: deterministic), for up to three such buffers in one
launch.  Narrow column tiles over every row at once: the fold's time is its launch, not its ``P`` serial steps (a
13-program fold of ``256 x 1664`` took 14 us; ``part.sum(0)`` 10-15 us; H200, graph replay, 2026-11-27).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lintime.ops.kernel_launch import cdiv, interpreting, next_pow2

MAX_PARTS = 3


@triton.jit
def fold_rows_kernel(p0, o0, c0, p1, o1, c1, p2, o2, c2, P, BR: tl.constexpr, BC: tl.constexpr):
    """Program ``(i_c, i_k)``: ``o<k>[cols] = sum_r p<k>[r, cols]`` over the ``P`` rows of ``p<k> [P, c<k>]``,
    ``cols = i_c BC ..``; ``BR`` rows a step, summed in a fixed order."""
    i_c, i_k = tl.program_id(0), tl.program_id(1)
    if i_k == 0:
        part, out, C = p0, o0, c0
    elif i_k == 1:
        part, out, C = p1, o1, c1
    else:
        part, out, C = p2, o2, c2
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    if i_c * BC < C:
        b_acc = tl.zeros([BR, BC], dtype=tl.float32)
        for i_r in range(0, P, BR):
            o_r = i_r + tl.arange(0, BR)
            b_acc += tl.load(part + o_r[:, None].to(tl.int64) * C + o_c[None, :],
                             mask=(o_r < P)[:, None] & m_c[None, :], other=0.)
        tl.store(out + o_c, tl.sum(b_acc, 0), mask=m_c)


def fold_rows(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[p.sum(0) for p in parts]`` for up to three contiguous fp32 ``[P, C_k]`` buffers of one ``P`` (each
    ``C_k >= 1``), in one launch, in a fixed order; each result a new fp32 ``[C_k]`` tensor (zeros when ``P = 0``)."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"fold_rows: 1 to {MAX_PARTS} buffers, got {len(parts)}")
    P = parts[0].shape[0]
    outs = [torch.empty(p.shape[1], dtype=torch.float32, device=p.device) for p in parts]
    if P == 0:
        return [o.zero_() for o in outs]
    cs = [p.shape[1] for p in parts]
    small = parts[0].device.type == "cpu" and interpreting()
    bc = 16 if small else 32  # 32 fp32 columns: 128-byte rows, ~50 programs for C = 1664
    br = min(next_pow2(P), 4 if small else 128)
    args = []
    for k in range(MAX_PARTS):
        j = min(k, len(parts) - 1)
        args += [parts[j], outs[j], cs[j]]
    fold_rows_kernel[(cdiv(max(cs), bc), len(parts))](*args, P, BR=br, BC=bc, num_warps=4)
    return outs


__all__ = ["fold_rows"]
