"""Feed-forward blocks (FLASH seed Section 2): the vanilla ``MLP`` and the gated ``GLU`` family.

``MLP``: ``O = phi(X W_u) W_o`` with ``W_u [d, e]``, ``W_o [e, d]``.
``GLU`` (seed Eq. 1-2, Shazeer 2020): ``O = (phi_u(X W_u) * phi_v(X W_v)) W_o``.  The variants
are picked by the two activations: ``phi_u = gelu, phi_v = identity`` is GEGLU (Transformer++),
``silu / identity`` is SwiGLU (GLA, LLaMA), ``sigmoid / identity`` the original GLU,
``relu / identity`` ReGLU, ``silu / silu`` GAU's own ``u, v`` pair.

Like the mixers these take the block's normalised input and own no residual.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lintime.modules import glu_activation
from lintime.modules.glu import ACTIVATIONS as GLU_OP_ACTIVATIONS

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose from {sorted(ACTIVATIONS)}") from None


class MLP(nn.Module):
    """``dense(d -> e) -> activation -> dropout -> dense(e -> d)``."""

    def __init__(self, dim: int, hidden: int, *, activation_name: str = "gelu", bias: bool = True,
                 dropout: float = 0.0):
        super().__init__()
        self.act_name = activation_name
        self.act = activation(activation_name)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(self.act(self.up(x))))

    def extra_repr(self) -> str:
        return f"activation={self.act_name}"


class GLU(nn.Module):
    """``dense_o(phi_u(dense_u(x)) * phi_v(dense_v(x)))`` (seed Eq. 1-2); ``u`` and ``v`` come
    from one fused ``[d, 2e]`` projection.  SwiGLU and GEGLU (``phi_u`` silu or gelu, ``phi_v`` the
    identity) take :func:`lintime.modules.glu_activation`: one fused pass each way on CUDA (``fused``; ``False``: its
    PyTorch form)."""

    def __init__(self, dim: int, hidden: int, *, activation_name: str = "gelu",
                 value_activation: str = "identity", bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.hidden = hidden
        self.act_name, self.value_act_name = activation_name, value_activation
        self.act_u, self.act_v = activation(activation_name), activation(value_activation)
        self.up = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        self.drop = nn.Dropout(dropout)
        self.fused = True  # the glu_activation op's fused kernel where it has one; False: its PyTorch form
        self._op = value_activation == "identity" and activation_name in GLU_OP_ACTIVATIONS  # SwiGLU / GEGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self._op:
            a = glu_activation(h, activation=self.act_name, backend=None if self.fused else "chunk")
            return self.down(self.drop(a))
        u, v = h.split(self.hidden, dim=-1)
        return self.down(self.drop(self.act_u(u) * self.act_v(v)))

    def extra_repr(self) -> str:
        return f"activation={self.act_name}, value_activation={self.value_act_name}"
