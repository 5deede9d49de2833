"""Launch configuration of the Transformer-VQ Triton kernels: :class:`VQLaunch` and :func:`default_launch`, for the
attention kernels (:mod:`.kernels`), the cache scan and the block sums' gradient (:mod:`.scan`), the output gate
(:mod:`.gate`), quantisation (:mod:`.quantize`) and the decoding step (:mod:`.decode`) alike, and the config's rules
of a call's shapes (:meth:`VQLaunch.decode_tiles`, :meth:`VQLaunch.decode_splits`, :meth:`VQLaunch.quantize_tiles`,
:meth:`VQLaunch.gate_tiles`, :meth:`VQLaunch.scan_tiles`, :meth:`VQLaunch.sums_tiles`).

What chose the defaults: ``docs/design/kernels.md`` (Transformer-VQ).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lintime.ops.utils.launching import LaunchConfig, block, cdiv, interpreting, next_pow2, sm_count


@dataclass(frozen=True)
class VQLaunch(LaunchConfig):
    """Tiles and launch settings of every VQ kernel.  The field defaults are the GPU's, with the attention products'
    fp32 tiles; :func:`default_launch` picks larger product tiles for half inputs and 16-wide tiles for the
    interpreter.  A tile a kernel fits to a head width is ``min(field, block(width))``."""

    # Each product kernel's tiles: rows per program, the columns it writes, the reduction step, warps.  The defaults
    # are the exact (fp32, IEEE) path's and not tuned: 64-wide tiles with 32-deep steps, modest for fp32 operands;
    # half inputs take the tuned tiles of default_launch.
    bm_p: int = 64  # probabilities: query rows per program (more rows: each loaded key tile serves more queries)
    bn_p: int = 64  # probabilities: window columns / cache codes per step (wider steps hold more scores in registers)
    warps_p: int = 4  # probabilities: 4 warps for a [64, 64] score tile (the half tuning's variants were within 2 %)
    bm_o: int = 64  # P [v; mean] and dS [k; codebook]: query rows per program (more rows: fewer value re-reads)
    bd_o: int = 64  # ... output columns per program (wider tiles re-read P fewer times; 256 won for half inputs)
    bk_o: int = 32  # ... window columns / codes per step (the reduction step: fp32 operands keep it short)
    warps_o: int = 4  # ... 4 warps for 64 x 64 fp32 tiles, 8 for the half path's 128 x 256
    bm_d: int = 64  # dS: query rows per program (rows share each loaded v tile)
    bn_d: int = 64  # dS: window columns / codes per program (256 won for half inputs: fewer re-reads of do)
    bk_d: int = 32  # dS: value columns per step of do . v^T (the reduction step, short for fp32 operands)
    warps_d: int = 4  # dS: 4 warps for 64 x 64 fp32 tiles, 8 for the half path's 128 x 256
    bn_k: int = 64  # backward key kernel: key rows per program (rows share each loaded query tile)
    bi_k: int = 32  # backward key kernel: query rows per step (the reduction step)
    bd_k: int = 64  # backward key kernel: output columns per program (the whole head up to 128 for half inputs)
    warps_k: int = 8  # backward key kernel: 8 warps for its [64, 64] fp32 accumulator (kept by the half tuning)
    stages: int = 2  # software pipelining depth of every product (3 for half inputs: their tiles take half the bytes)
    # the backward's two row passes, memory-bound (one read, one small write), not timed: [32, 128] tiles, 4 warps
    delta_br: int = 32  # rowsum(do o): rows per program
    delta_bd: int = 128  # ... value columns per step of its loop over V
    delta_warps: int = 4  # ... warps (Triton's default)
    rel_br: int = 32  # relative table's gradient: rows of dS per program
    rel_bt: int = 128  # ... table columns per program
    rel_warps: int = 4  # ... warps (Triton's default)
    # cache scan (:mod:`.scan`, not timed): [32, 64] fp32 tiles, 384 programs per layout row at vq-base (S = 512,
    # V = 1536), each walking its row's blocks in sequence
    scan_bs: int = 32  # (head, code) rows per program
    scan_bv: int = 64  # value columns per program
    # the block sums' value gradient (:mod:`.scan`, not timed): a gather of one fp32 row per slot, memory-bound
    sums_br: int = 16  # slot rows per program (rows gather different codes' rows: nothing shared between them)
    sums_bv: int = 256  # value columns per program (wide: each gathered row is read in few pieces)
    sums_warps: int = 4  # warps (Triton's default)
    # output gate y = o * silu(g) and the SiLU's backward (:mod:`.gate`): memory-bound elementwise passes, not timed
    gate_bm: int = 16  # rows per program (16 x 128 tiles)
    gate_be: int = 128  # columns per program
    # training-time quantisation (:func:`.quantize.assign_codes`): the fastest of the 32-128 x 32-128 tiles that fit
    # the shared memory
    asg_bm: int = 64  # keys per program
    asg_bs: int = 64  # codes per step (128 x 64 and 64 x 128 exceed the shared memory)
    asg_warps: int = 4  # 4 warps for 64 x 64 TF32 products
    # one decoding step's quantisation (:meth:`quantize_tiles`): a chain of dependent loads, split over programs
    q_split_per_sm: int = 2  # code splits to about this many programs per SM (0: one program walks every code)
    q_split_codes: int = 32  # at least this many codes per split (32-code chunks at batch 1)
    q_walk_elems: int = 16384  # one-program walk: codes x key columns per tile (wider tiles: fewer dependent steps)
    q_split_elems: int = 8192  # a split's tile, in codes x key columns (its chunk is short: half the walk's)
    q_min_codes: int = 32  # at least 32 codes per tile (wide keys would otherwise get tiles of a few codes)
    q_fixed_codes: int = 0  # codes per tile fixed (cut to a split's chunk), 0: from the two element counts above
    q_warp_elems: int = 2048  # warps grow with the tile: one per this many elements ...
    q_warps_min: int = 4  # ... at least 4 ...
    q_warps_max: int = 8  # ... at most 8 (reached by the walk's 16k-element tiles)
    # decoding step (:meth:`decode_tiles`; tiles and splits swept at vq-base: none beat these): a scores kernel reads
    # each sequence's keys, relative table rows and codebook once, in blocks; a values kernel per value tile weights
    # the values
    dec_bt: int = 32  # scores kernel: keys per program (three [32, K] fp32 tiles -- keys, table rows, codewords)
    dec_warps_scores: int = 4  # ... warps (Triton's default; one dependent load round per program)
    dec_bn: int = 32  # values kernel: window slots per step (a [32, 128] fp32 accumulator, summed once at the end)
    dec_bs: int = 32  # ... cache codes per step (the fp32 means: twice the bytes of a window tile of as many rows)
    dec_bv: int = 128  # ... value columns per program (12 programs per sequence at vq-base before the key splits)
    dec_br: int = 2048  # ... score row chunk of the softmax's max and denominator (vq-base's 1,536 keys in one)
    dec_warps_values: int = 4  # ... warps (Triton's default)
    dec_bj: int = 32  # the block-end shift: window slots per program
    dec_bsm: int = 64  # the block-end merge: codes per program and slots per step of its one-hot product
    dec_bvm: int = 64  # ... value columns per step ([64, 64] x [64, 64] fp32 products)
    dec_warps_merge: int = 8  # ... 8 warps: with 4 its fp32 tiles spilled registers
    dec_stages_merge: int = 1  # ... one stage (no spills with 8 warps); it runs once per L tokens, not tuned
    # flash-decoding key splits of the values kernel (:meth:`decode_splits`): a program's key tiles are a chain of
    # dependent loads, so shorter chains on more programs finish sooner (fewer, longer splits were slower)
    dec_split_per_sm: int = 4  # splits to about this many programs per SM (0: every split dec_split_tiles long)
    dec_split_tiles: int = 2  # each split walks at least this many key tiles

    def decode_tiles(self, K: int, V: int) -> dict:
        """The decoding step's tiles for ``K``-wide keys and ``V``-wide values: the scores kernel's ``BT`` keys and
        ``BK`` (the whole key), the values kernel's ``BN`` (window slots), ``BS`` (codes), ``BV`` (value columns)
        and ``BR`` (score row chunk), the shift's ``BJ`` slots, the merge's ``BSM`` codes (and slots per step) and
        ``BVM`` value columns."""
        return dict(BT=self.dec_bt, BN=self.dec_bn, BS=self.dec_bs, BV=min(self.dec_bv, block(V)), BR=self.dec_br,
                    BJ=self.dec_bj, BK=block(K), BSM=self.dec_bsm, BVM=min(self.dec_bvm, block(V)))

    def decode_splits(self, programs: int, keys: int, BN: int, device, splits: int | None = None) -> tuple[int, int]:
        """``(CH, NSPLIT)``: the values kernel's ``keys`` (``2L + S``) in ``NSPLIT`` chunks of ``CH`` (a multiple
        of ``BN``).  ``splits`` given: that many (tests; 1: one program walks every key).  Else ``programs``
        (sequences x heads x value tiles) take about ``dec_split_per_sm`` programs per SM, each split walking at least
        ``dec_split_tiles`` key tiles (vq-base at batch 1: 12 programs, 24 splits of 64 keys; at batch 64 none);
        with ``dec_split_per_sm = 0`` every chunk is ``dec_split_tiles`` tiles long."""
        if splits is not None:
            ch = cdiv(cdiv(keys, splits), BN) * BN
            return ch, cdiv(keys, ch)
        if not self.dec_split_per_sm:
            ch = self.dec_split_tiles * BN
            return ch, cdiv(keys, ch)
        ns = max(1, min(cdiv(self.dec_split_per_sm * sm_count(device), max(programs, 1)),
                        cdiv(keys, self.dec_split_tiles * BN)))
        ch = cdiv(cdiv(keys, ns), BN) * BN
        return ch, cdiv(keys, ch)

    def quantize_tiles(self, NH: int, S: int, K: int, device, splits: int | None = None
                       ) -> tuple[int, int, int, int, int]:
        """``(splits, CH, BS, BK, warps)`` of one decoding step's quantisation of ``NH`` (sequence, head) keys of
        ``K`` columns against ``S`` codes: the codes in ``splits`` chunks of ``CH`` (``splits`` given: that many;
        else about ``q_split_per_sm`` programs per SM, at least ``q_split_codes`` codes each), ``BS`` codes per
        tile, ``BK`` the whole key."""
        BK = block(K)
        if splits is None:
            splits = 1 if not self.q_split_per_sm else max(1, min(cdiv(S, self.q_split_codes),
                                                                  cdiv(self.q_split_per_sm * sm_count(device), NH)))
        if splits == 1:  # one program walks every code in wide tiles
            CH, BS = S, self.q_fixed_codes or min(next_pow2(S), max(self.q_min_codes, self.q_walk_elems // BK))
        else:
            CH = cdiv(S, splits)
            BS = min(next_pow2(CH), self.q_fixed_codes or max(self.q_min_codes, self.q_split_elems // BK))
        warps = max(self.q_warps_min, min(self.q_warps_max, BS * BK // self.q_warp_elems))
        return splits, CH, BS, BK, warps

    def gate_tiles(self, E: int) -> tuple[int, int]:
        """``(BM, BE)``: the gate's and the SiLU backward's rows and columns per program for rows of ``E``."""
        return self.gate_bm, min(self.gate_be, block(E))

    def scan_tiles(self, HS: int, V: int) -> tuple[int, int]:
        """``(BS, BV)``: the cache scan's (head, code) rows and value columns per program."""
        return min(self.scan_bs, block(HS)), min(self.scan_bv, block(V))

    def sums_tiles(self, V: int) -> tuple[int, int]:
        """``(BR, BV)``: the block sums' value gradient's slot rows and value columns per program."""
        return self.sums_br, min(self.sums_bv, block(V))


def default_launch(K: int, V: int, dtype: torch.dtype) -> VQLaunch:
    """The launch configuration for ``K``-wide keys, ``V``-wide values and ``dtype`` inputs (cached: part of a
    call's host time).  Only the attention products' fields depend on the dtype and the head sizes; a caller that
    reads none of those (the gate, the cache scan, quantisation) may pass ``K = 0`` and any of its widths.

    The interpreter gets 16-wide tiles so small test shapes cross several tiles in every dimension (and every
    loop of the kernels runs more than once), one program per quantised key and decoding splits of two key tiles
    (the tests then cross split boundaries inside the window, the cache and between them)."""
    return _default_launch(K, V, dtype, interpreting())


@functools.lru_cache(maxsize=64)
def _default_launch(K: int, V: int, dtype: torch.dtype, interp: bool) -> VQLaunch:
    if interp:
        return VQLaunch(bm_p=16, bn_p=16, warps_p=1, bm_o=16, bd_o=16, bk_o=16, warps_o=1, bm_d=16, bn_d=16,
                        bk_d=16, warps_d=1, bn_k=16, bi_k=16, bd_k=16, warps_k=1, stages=1, scan_bs=16, scan_bv=16,
                        sums_bv=16, gate_bm=4, gate_be=16, asg_bm=16, asg_bs=16, asg_warps=1, q_split_per_sm=0,
                        q_fixed_codes=16, q_warps_max=4, dec_bt=16, dec_bn=16, dec_bs=16, dec_bv=16, dec_br=16,
                        dec_bj=16, dec_bsm=16, dec_bvm=16, dec_split_per_sm=0)
    if dtype == torch.float32:
        return VQLaunch()  # the exact path (IEEE products), not the fast one: not tuned
    # half inputs: the fastest tiles at vq-base, one axis at a time from 128 x 128 x 64 products (256-wide value
    # tiles of P [v; mean] and 256 score columns per dS program won; ``docs/design/kernels.md``, Transformer-VQ)
    return VQLaunch(bm_o=128, bd_o=256, bk_o=64, warps_o=8, bm_d=128, bn_d=256, bk_d=64, warps_d=8, bn_k=128,
                    bi_k=64, bd_k=min(128, block(max(K, V))), stages=3)
