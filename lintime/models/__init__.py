"""Models (above ``ops`` and ``layers``, which never import them): one config dataclass, a registry of
mixer families, a shared pre-norm backbone, causal-LM and masked-LM heads, named presets.

See ``docs/models.md``.
"""

from lintime.models.backbone import Backbone, Block, ModelState
from lintime.models.config import FFNConfig, ModelConfig
from lintime.models.lm import CausalLM, MaskedLM
from lintime.models.presets import all_presets, get_preset, preset_names
from lintime.models.registry import Family, available_families, get_family, register_family

__all__ = [
    "ModelConfig",
    "FFNConfig",
    "CausalLM",
    "MaskedLM",
    "Backbone",
    "Block",
    "ModelState",
    "all_presets",
    "get_preset",
    "preset_names",
    "Family",
    "register_family",
    "get_family",
    "available_families",
]
