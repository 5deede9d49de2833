"""``LintimeConfig``: the HF ``PretrainedConfig`` of a lintime causal LM.

It stores the lintime :class:`~lintime.models.ModelConfig` whole, as its JSON dict
(``lintime_model``), so ``config.json`` round-trips every family and field exactly; the usual HF
attribute names (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, and
``max_position_embeddings`` for a learned position table) are derived from it for tools that read
them (lm-eval, pipelines).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from lintime.models import ModelConfig

MODEL_TYPE = "lintime"


class LintimeConfig(PretrainedConfig):
    """HF config of a lintime causal LM.

    Args:
        lintime_model: ``ModelConfig.to_dict()`` of the model (``None``: an empty placeholder
            config, as HF builds one for defaults; a model cannot be built from it).
        **kwargs: the usual ``PretrainedConfig`` fields (``bos_token_id``, ``eos_token_id``,
            ``pad_token_id``, ``use_cache``, ...).
    """

    model_type = MODEL_TYPE

    def __init__(self, lintime_model: dict[str, Any] | None = None, **kwargs):
        if isinstance(lintime_model, ModelConfig):
            lintime_model = lintime_model.to_dict()
        if lintime_model is not None:
            mc = ModelConfig.from_dict(lintime_model)  # validates (ValueError naming the field)
            lintime_model = mc.to_dict()
            kwargs.setdefault("vocab_size", mc.vocab_size)
            kwargs.setdefault("hidden_size", mc.d_model)
            kwargs.setdefault("num_hidden_layers", mc.n_layers)
            if mc.position == "learned":
                kwargs.setdefault("max_position_embeddings", mc.max_positions)
        self.lintime_model = lintime_model
        # lintime ties the output projection inside the model (no lm_head tensor when tied):
        # HF must not tie anything itself.
        kwargs["tie_word_embeddings"] = False
        self.use_cache = bool(kwargs.pop("use_cache", True))
        super().__init__(**kwargs)

    @property
    def model_config(self) -> ModelConfig:
        """The lintime :class:`ModelConfig` (a fresh, validated object)."""
        if self.lintime_model is None:
            raise ValueError("this LintimeConfig holds no lintime model config (lintime_model is None)")
        return ModelConfig.from_dict(self.lintime_model)

    @property
    def family(self) -> str:
        return (self.lintime_model or {}).get("family", "softmax")
