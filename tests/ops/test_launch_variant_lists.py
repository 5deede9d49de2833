"""The named launch variants of the Triton kernels are well-formed on any machine: every override names
a setting the launchers read.  (Variants that only change warps, stages or register caps run on CUDA
only, so without this a misspelt key would go unnoticed until a GPU run -- or be silently ignored.)"""

import pytest
import torch

pytest.importorskip("triton")


def test_gla_variant_keys_are_read_by_the_launchers():
    from lintime.ops.gla.triton.ops import CFG_KEYS, LAUNCH_VARIANTS

    names = [n for n, _ in LAUNCH_VARIANTS]
    assert len(names) == len(set(names)) and names[0] == "default"
    for name, cfg in LAUNCH_VARIANTS[1:]:
        assert cfg, f"GLA variant {name}: empty overrides"
        unknown = set(cfg) - CFG_KEYS
        assert not unknown, f"GLA variant {name}: keys {sorted(unknown)} are read by no launcher"


@pytest.mark.parametrize("module", ["lintime.ops.mixed_chunk.triton.mixed_chunk", "lintime.ops.gau.triton.gau"])
def test_flash_variant_overrides_are_block_fields(module):
    import importlib

    from lintime.ops.gau.triton.plan import Blocks, variant_blocks

    variants = importlib.import_module(module).LAUNCH_VARIANTS
    names = [n for n, _ in variants]
    assert len(names) == len(set(names)) and names[0] == "default" and not variants[0][1]
    C = 256 if "mixed_chunk" in module else None
    for name, overrides in variants[1:]:
        assert overrides, f"{module} variant {name}: empty overrides"
        blocks = variant_blocks(overrides, 128, 2048, torch.bfloat16, C)  # TypeError on an unknown field
        assert isinstance(blocks, Blocks)
        assert all(getattr(blocks, k) == v for k, v in overrides.items()), f"{module} variant {name}"
