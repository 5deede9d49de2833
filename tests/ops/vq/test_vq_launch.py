"""VQLaunch (lintime/ops/vq/triton/launch.py), the one launch configuration of the VQ Triton path: every config
:func:`default_launch` gives -- GPU and interpreter, every dtype, head widths that are and are not powers of two --
crosses a custom op as ints unchanged, and every tile it sets or fits to a call is a power of two (``tl.arange``),
at least 16 where ``tl.dot`` takes it, with power-of-two warps; the split rules cover every key / code once.
Invariants only: the numbers themselves are the GPU's tuning (docs/design/kernels.md)."""

import dataclasses
import itertools

import pytest
import torch

import lintime.ops.vq.triton.launch as launch_mod
from lintime.ops.utils.launching import block, cdiv
from lintime.ops.vq.triton.launch import VQLaunch, default_launch

WIDTHS = (1, 3, 16, 17, 48, 64, 100, 128, 129, 200, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# tiles that meet tl.dot: the attention products (.kernels), training-time quantisation, the decoding step's merge
DOT = ("bm_p", "bn_p", "bm_o", "bd_o", "bk_o", "bm_d", "bn_d", "bk_d", "bn_k", "bi_k", "bd_k", "asg_bm", "asg_bs",
       "dec_bsm", "dec_bvm")
# tiles that only meet tl.arange
ARANGE = ("delta_br", "delta_bd", "rel_br", "rel_bt", "scan_bs", "scan_bv", "sums_br", "sums_bv", "gate_bm",
          "gate_be", "dec_bt", "dec_bn", "dec_bs", "dec_bv", "dec_br", "dec_bj")
WARPS = [f.name for f in dataclasses.fields(VQLaunch) if "warps" in f.name]


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@pytest.fixture(params=["0", "1"], ids=["gpu", "interpreter"])
def interp(request, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", request.param)
    return request.param == "1"


def _configs():
    for K, V, dt in itertools.product((0, *WIDTHS), WIDTHS, DTYPES):
        yield K, V, default_launch(K, V, dt)


def test_fields_are_ints_with_defaults():
    for f in dataclasses.fields(VQLaunch):
        assert type(f.default) in (int, bool), f.name
    names = {f.name for f in dataclasses.fields(VQLaunch)}
    assert set(DOT) | set(ARANGE) <= names


def test_every_config_round_trips_through_ints(interp):
    for _, _, cfg in _configs():
        ints = cfg.to_ints()
        assert all(type(x) is int for x in ints)
        assert VQLaunch.from_ints(ints) == cfg
        assert VQLaunch.of(ints) == cfg and VQLaunch.of(cfg) is cfg


def test_tiles_are_powers_of_two(interp):
    for K, V, cfg in _configs():
        for name in DOT:
            assert _pow2(getattr(cfg, name)) and getattr(cfg, name) >= 16, (name, K, V, cfg)
        for name in ARANGE:
            assert _pow2(getattr(cfg, name)), (name, K, V, cfg)
        for name in WARPS:
            assert _pow2(getattr(cfg, name)), (name, cfg)
        assert cfg.stages >= 1 and cfg.dec_stages_merge >= 1
        # the tiles the launchers fit to a head width: min(field, block(width)) keeps both properties
        for D in WIDTHS:
            for name in DOT:
                t = min(getattr(cfg, name), block(D))
                assert _pow2(t) and t >= 16
        t = cfg.decode_tiles(max(K, 1), V)
        assert all(_pow2(x) for x in t.values()), t
        assert t["BK"] >= max(K, 1) and t["BSM"] >= 16 and t["BVM"] >= 16  # the merge's tl.dot
        assert all(_pow2(x) for x in (*cfg.gate_tiles(V), *cfg.scan_tiles(V, V), *cfg.sums_tiles(V)))


@pytest.mark.parametrize("sms", [4, 132])
def test_split_rules_cover_every_key_once(interp, sms, monkeypatch):
    monkeypatch.setattr(launch_mod, "sm_count", lambda device: sms)
    for K, dt in itertools.product(WIDTHS, DTYPES):
        cfg = default_launch(K, 0, dt)
        for NH, S, splits in itertools.product((1, 3, 12, 64, 1536), (1, 5, 32, 33, 512, 1000), (None, 1, 2, 7)):
            n, CH, BS, BK, warps = cfg.quantize_tiles(NH, S, K, None, splits)
            assert n >= 1 and (splits is None or n == splits)
            assert CH * n >= S  # every code in a chunk; the rule's chunks are none of them empty
            assert splits is not None or n == 1 or CH * (n - 1) < S
            assert _pow2(BS) and _pow2(BK) and BK >= K and _pow2(warps)
    for V, dt in itertools.product(WIDTHS, DTYPES):
        cfg = default_launch(64, V, dt)
        BN = cfg.decode_tiles(64, V)["BN"]
        for programs, keys, splits in itertools.product((1, 12, 1000), (2, 7, 33, 1024 + 512), (None, 1, 3)):
            CH, ns = cfg.decode_splits(programs, keys, BN, None, splits)
            assert CH % BN == 0 and ns == cdiv(keys, CH)  # whole key tiles, every key in one split
