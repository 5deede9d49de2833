"""The one model config (``docs/design/conventions.md`` §4): :class:`ModelConfig`, with the feed-forward sub-config
:class:`FFNConfig` and the mixer family's own sub-config (see :mod:`lintime.models.registry`).

Configs are frozen dataclasses, validated in ``__post_init__`` with messages that name the field,
and serialise to plain dicts / JSON by *names* (the family name and field values, never classes):
``ModelConfig.from_dict(cfg.to_dict()) == cfg``.  Change a field with ``dataclasses.replace``
(which validates again).

The config is objective-agnostic: the same config builds a :class:`~lintime.models.CausalLM`
or a :class:`~lintime.models.MaskedLM` (the head decides whether the mixers are causal).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from lintime.utils.checks import is_int, is_number
from lintime.models.registry import get_family

NORMS = ("layernorm", "scalenorm", "rmsnorm")
POSITIONS = ("none", "scaled_sin", "learned")
FFN_KINDS = ("mlp", "glu")
# The byte tokenizer's vocabulary (lintime.data.ByteTokenizer): 256 byte values + pad, bos, eos,
# mask.  Every family's CPU-sized presets use it; tests/models check the two agree.
BYTE_VOCAB = 260
FFN_ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "relu2", "sigmoid", "identity")


def _fail(where: str, msg: str) -> None:
    raise ValueError(f"{where}: {msg}")


@dataclasses.dataclass(frozen=True)
class FFNConfig:
    """The feed-forward half of a block (seed Section 2).

    ``kind``            ``'mlp'`` (``phi(x W_u) W_o``) or ``'glu'`` (``(phi(x W_u) * phi_v(x W_v)) W_o``);
    ``expansion``       hidden width of the MLP as a multiple of ``d_model`` (the seed's
                        "expansion rate", 4 for the Transformers);
    ``hidden``          explicit hidden width; ``None`` derives it: ``expansion * d`` for the MLP,
                        ``round(2/3 * expansion * d)`` for the GLU, so that an MLP and a GLU with the
                        same expansion hold the same parameters (Shazeer 2020).  This is the reading
                        of the seed's Tables 8-10 under which Transformer++ (GLU, "expansion 4")
                        has the same 110M / 486M as Transformer+ (MLP);
    ``activation``      ``phi`` (``phi_u`` of the GLU): gelu for the seed's Transformers;
    ``value_activation`` ``phi_v`` of the GLU (identity: GEGLU / SwiGLU);
    ``bias``            dense layers with biases (the seed's ``tf.layers.dense`` default);
    ``dropout``         dropout on the hidden activation (the seed's "GELU dropout", 0).
    """

    kind: str = "mlp"
    expansion: float = 4.0
    hidden: int | None = None
    activation: str = "gelu"
    value_activation: str = "identity"
    bias: bool = True
    dropout: float = 0.0

    def __post_init__(self):
        w = "FFNConfig"
        if self.kind not in FFN_KINDS:
            _fail(w, f"kind must be one of {FFN_KINDS}, got {self.kind!r}")
        if not is_number(self.expansion) or self.expansion <= 0:
            _fail(w, f"expansion must be a positive number, got {self.expansion!r}")
        if self.hidden is not None and (not is_int(self.hidden) or self.hidden < 1):
            _fail(w, f"hidden must be a positive int or None, got {self.hidden!r}")
        for name in ("activation", "value_activation"):
            if getattr(self, name) not in FFN_ACTIVATIONS:
                _fail(w, f"{name} must be one of {FFN_ACTIVATIONS}, got {getattr(self, name)!r}")
        if not isinstance(self.bias, bool):
            _fail(w, f"bias must be a bool, got {self.bias!r}")
        if not is_number(self.dropout) or not 0 <= self.dropout < 1:
            _fail(w, f"dropout must be in [0, 1), got {self.dropout!r}")

    def hidden_size(self, d_model: int) -> int:
        if self.hidden is not None:
            return self.hidden
        width = self.expansion * d_model
        return max(1, round(2 * width / 3)) if self.kind == "glu" else max(1, round(width))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A language model: token embedding, ``n_layers`` pre-norm residual blocks, final norm,
    output projection.

    Block layout: ``x = x + mixer(norm(x))``, then, when ``ffn`` is set,
    ``x = x + ffn(norm(x))``.  ``ffn=None`` gives mixer-only blocks (GAU / FLASH, whose layer
    already contains its feed-forward).  A seed "12+12 layers" Transformer is ``n_layers=12``
    blocks with an FFN; a "24 layers" FLASH is ``n_layers=24`` mixer-only blocks.

    ``vocab_size``     tokens;
    ``d_model``        residual width;
    ``n_layers``       blocks;
    ``family``         mixer family name (:func:`lintime.models.registry.available_families`);
    ``mixer``          that family's sub-config (``None`` = the family's defaults);
    ``ffn``            :class:`FFNConfig` or ``None`` (mixer-only blocks);
    ``norm``           ``layernorm`` | ``scalenorm`` | ``rmsnorm`` (every block norm and the final one);
    ``norm_eps``       epsilon of the norms (seed Code 5: 1e-5);
    ``position``       absolute position embedding added to the token embedding: ``none`` |
                       ``scaled_sin`` (seed Code 2) | ``learned`` (needs ``max_positions``);
                       relative positions (RoPE, biases) belong to the mixer's sub-config;
    ``max_positions``  size of the learned position table (0 unless ``position='learned'``);
    ``final_norm``     norm before the output projection (pre-norm models need it);
    ``tie_embeddings`` output projection = token embedding transposed;
    ``dropout``        dropout on the embedding and on every residual branch;
    ``init_std``       std of the normal init of every dense / embedding weight (seed: 0.02).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    family: str = "softmax"
    mixer: Any = None
    ffn: FFNConfig | None = FFNConfig()
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    position: str = "none"
    max_positions: int = 0
    final_norm: bool = True
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_std: float = 0.02

    def __post_init__(self):
        w = "ModelConfig"
        for name in ("vocab_size", "d_model", "n_layers"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                _fail(w, f"{name} must be a positive int, got {v!r}")
        family = get_family(self.family)  # raises with the list of registered families
        if self.mixer is None:
            object.__setattr__(self, "mixer", family.config_cls())
        if not isinstance(self.mixer, family.config_cls):
            _fail(w, f"family {self.family!r} takes a {family.config_cls.__name__} as `mixer`, "
                     f"got {type(self.mixer).__name__}")
        if self.ffn is not None and not isinstance(self.ffn, FFNConfig):
            _fail(w, f"ffn must be an FFNConfig or None, got {type(self.ffn).__name__}")
        if self.norm not in NORMS:
            _fail(w, f"norm must be one of {NORMS}, got {self.norm!r}")
        if not is_number(self.norm_eps) or self.norm_eps <= 0:
            _fail(w, f"norm_eps must be > 0, got {self.norm_eps!r}")
        if self.position not in POSITIONS:
            _fail(w, f"position must be one of {POSITIONS}, got {self.position!r}")
        if not is_int(self.max_positions) or self.max_positions < 0:
            _fail(w, f"max_positions must be an int >= 0, got {self.max_positions!r}")
        if self.position == "learned" and self.max_positions < 1:
            _fail(w, "position='learned' needs max_positions >= 1 (the size of the position table)")
        if self.position != "learned" and self.max_positions:
            _fail(w, f"max_positions={self.max_positions} only applies to position='learned' "
                     f"(got position={self.position!r}); set it to 0")
        if self.position == "scaled_sin" and self.d_model % 2:
            _fail(w, f"position='scaled_sin' needs an even d_model, got {self.d_model}")
        for name in ("final_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                _fail(w, f"{name} must be a bool, got {getattr(self, name)!r}")
        if not is_number(self.dropout) or not 0 <= self.dropout < 1:
            _fail(w, f"dropout must be in [0, 1), got {self.dropout!r}")
        if not is_number(self.init_std) or self.init_std <= 0:
            _fail(w, f"init_std must be > 0, got {self.init_std!r}")
        check = getattr(self.mixer, "check", None)
        if check is not None:
            check(self)  # the family's checks that involve the model config

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain dict of names and numbers (JSON-able); ``from_dict`` inverts it."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise TypeError(f"ModelConfig.from_dict needs a dict, got {type(d).__name__}")
        d = dict(d)
        family = get_family(d.get("family", "softmax"))
        mixer = d.get("mixer")
        if mixer is not None:
            d["mixer"] = _from_fields(family.config_cls, mixer, f"mixer ({family.name})")
        if d.get("ffn") is not None:
            d["ffn"] = _from_fields(FFNConfig, d["ffn"], "ffn")
        return _from_fields(cls, d, "ModelConfig")

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))


def _from_fields(cls: type, d: Any, where: str):
    """Build dataclass ``cls`` from dict ``d``: unknown keys are errors, JSON lists come back as
    tuples where the field is a tuple."""
    if not isinstance(d, dict):
        raise TypeError(f"{where}: expected a dict, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in d.items():
        if isinstance(v, list) and "tuple" in str(hints.get(k, "")).lower():
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)
