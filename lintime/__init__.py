"""lintime: linear-time transformers (FLASH / GAU, linear attention, GLA, Transformer-VQ)."""

__version__ = "0.1.0"
