"""Shared pieces of the HF integration tests: tiny models of every family, a run folder on disk,
and a subprocess prelude that hides the installed lintime."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_presets import FAMILY_TINY_PRESETS as FAMILY_PRESETS  # noqa: F401  (re-exported)
from tiny_presets import small_chunks

from lintime.data import ByteTokenizer
from lintime.models import CausalLM, get_preset


def tiny_config(preset: str):
    return small_chunks(get_preset(preset, vocab_size=ByteTokenizer.vocab_size))


def tiny_lintime(preset: str, dtype=torch.float64, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(preset)).to(dtype).eval()


def tiny_hf(preset: str, dtype=torch.float64, seed: int = 0):
    from lintime.hf import LintimeForCausalLM

    tok = ByteTokenizer()
    m = tiny_lintime(preset, dtype, seed)
    return LintimeForCausalLM.from_lintime(m, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                           pad_token_id=tok.pad_id).eval()


def write_run(run_dir, preset: str = "gla-tiny", tokenizer=None, seed: int = 0):
    """A run folder with one (untrained) checkpoint, as ``lintime train`` writes it."""
    from lintime.training.checkpoint import save_checkpoint, write_run_config

    tokenizer = tokenizer or ByteTokenizer()
    torch.manual_seed(seed)
    cfg = dataclasses.replace(tiny_config(preset), vocab_size=tokenizer.vocab_size)
    model = CausalLM(cfg)
    write_run_config(run_dir, model_config=cfg, objective="clm", tokenizer=tokenizer, train={})
    save_checkpoint(run_dir, 0, model, {})
    return run_dir


# Run first in a subprocess: makes the installed lintime invisible (drops the meta-path finders
# that can find it -- an editable install's -- and sys.path entries holding a lintime package),
# then checks that `import lintime` really fails.
HIDE_LINTIME = r'''
import importlib, importlib.util, sys
from pathlib import Path
for f in list(sys.meta_path):
    fs = getattr(f, "find_spec", None)
    if fs is not None and getattr(f, "__name__", type(f).__name__) != "PathFinder":
        try:
            if fs("lintime", None) is not None:
                sys.meta_path.remove(f)
        except Exception:
            pass
sys.path[:] = [p for p in sys.path if not (Path(p or ".") / "lintime" / "__init__.py").exists()]
importlib.invalidate_caches()
assert importlib.util.find_spec("lintime") is None, "lintime is still importable"
'''


def require_lm_eval() -> None:
    """Skip unless lm-eval imports.  Not ``pytest.importorskip``: since pytest 9 it skips only on
    ``ModuleNotFoundError``, and a broken or partial lm-eval install raises a plain ``ImportError``."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        pytest.skip(f"lm-eval is the `eval` extra (pip install -e '.[eval]'): {err}")
