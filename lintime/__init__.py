"""lintime: linear-time transformers (FLASH / GAU, linear attention, GLA, Transformer-VQ)."""

__version__ = "0.1.0"

# HF transformers integration: registers lintime's config and causal LM with AutoConfig /
# AutoModelForCausalLM when (and if) transformers' auto modules are imported; imports nothing now.
from lintime.hf._hook import install as _install_hf_hook  # noqa: E402

_install_hf_hook()
del _install_hf_hook
