"""lintime: linear-time transformers (FLASH / GAU, linear attention, GLA, Transformer-VQ).

Importing the package imports none of its subpackages; the HF transformers integration
registers itself with transformers' Auto classes on ``import lintime.hf``."""

__version__ = "0.1.0"
