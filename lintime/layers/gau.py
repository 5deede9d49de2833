"""Gated Attention Unit (FLASH seed Section 2, Eqs. 3-5, Code 6): the layer of FLASH-Quad.

Notation: ``B`` batch, ``T`` tokens, ``d`` model width, ``e`` expanded width (``2d``), ``s`` shared
key width (128), ``H`` heads (1 in the seed; >1 only for the Table 1 ablation), ``N`` sequences.

The layer (the block owns the pre-norm and the residual, see :mod:`lintime.layers.base`)::

    u, v, z = split(silu(dense(x)), [e, e, s])         # seed Eq. 1, 4 (Code 6: one dense)
    q, k    = z * gamma[0] + beta[0], z * gamma[1] + beta[1]   # per-dim scale + offset
    q, k    = rope(q), rope(k)                         # seed Code 3, in-sequence positions
    a       = attention(q, k, v)                        # seed Eq. 5, below
    y       = dense(u * a)                              # seed Eq. 3

The first three lines are one call of :func:`lintime.modules.gau_heads` (a fused kernel on CUDA) on the ``v, z`` part
of ``dense(x)``; with gating the ``u`` part is its own product (one parameter,
:func:`lintime.layers._split_linear.split_linear`) and the gate ``silu(u) * a`` one pass each way
(:func:`lintime.modules.gated_activation`).  On the fused path the products run without dense's bias, which the two
ops add (:func:`proj_bias_parts`), so its gradient comes out of their backward kernels; ``out``'s bias is left to
the fused block's next norm the same way (:meth:`GAU.deferrable_bias`, ``forward``'s ``defer_bias``).

Attention (``rel_bias`` ``b`` = Toeplitz bias, seed Code 4; ``N_i`` the normaliser)::

    kernel='relu2', scaling='n'  (seed Code 6):   a_i = sum_j relu(q_i.k_j / N_i + b[i-j])^2 v_j
    kernel='relu2', scaling='ns' (commentary):    a_i = sum_j relu(q_i.k_j / sqrt(s) + b[i-j])^2 v_j / N_i
    kernel='softmax' (Table 1 ablation):          a_i = sum_j softmax_j(q_i.k_j / sqrt(s) + b[i-j]) v_j

``N_i = max_len`` (the fixed ``n`` of the config: the call length must not enter, docs/design/contract.md §2.2, so a
prefix or a decoding step computes exactly what training computed), or with ``causal_norm`` the
commentary's "divide by t": ``N_i = i + 1`` (the keys query ``i`` sees; non-causal: the
sequence length).  ``scaling='ns'`` is the commentary's ``relu^2(QK^T)/(n s)`` with the seed's bias
kept inside the square.

Decoding keeps a :class:`~lintime.layers.attention.KVCache` of the rotated keys and the values:
GAU is quadratic, so the state grows with ``T`` (O(T) memory, as for any Transformer).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lintime.layers._rows import append_kv, bias_diagonals, dense_attention, empty_cache, from_rows, to_rows
from lintime.layers.attention import KVCache
from lintime.layers.base import Mixer
from lintime.layers.positional import ToeplitzRelativeBias
from lintime.layers._split_linear import dense, split_linear
from lintime.modules import gated_activation, gau_heads
from lintime.ops import gau_attention
from lintime.ops.utils import chunk_layout

KERNELS = ("relu2", "softmax")
SCALINGS = ("n", "ns")


class ScaleOffset(nn.Module):
    """Cheap per-dimension heads of a shared representation (seed Code 6 / 8 ``gamma``,
    ``beta``): ``z [..., s] -> [..., heads, s]`` with ``z * gamma[h] + beta[h]``.  ``forward`` is
    the plain formula (the tests' reference); the layers compute the heads inside
    :func:`lintime.modules.gau_heads` (with SiLU and RoPE) from these parameters.

    ``gamma`` is initialised ``N(0, std)`` (the seed's ``WEIGHT_INITIALIZER``), ``beta`` 0.  Both
    are excluded from weight decay (they are per-dimension scalars, like a norm's gain)."""

    def __init__(self, heads: int, dim: int, std: float = 0.02):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.gamma = nn.Parameter(torch.randn(heads, dim) * std)
        self.beta = nn.Parameter(torch.zeros(heads, dim))

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.gamma, std=std)
        nn.init.zeros_(self.beta)

    def no_weight_decay(self) -> set[str]:
        return {"gamma", "beta"}

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z[..., None, :] * self.gamma.to(z.dtype) + self.beta.to(z.dtype)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, dim={self.dim}"


def heads_backend(backend: str | None) -> str | None:
    """The :func:`~lintime.modules.gau_heads` backend of a layer built with attention ``backend``: the
    same one where the heads op has it (``naive`` / ``chunk`` / ``triton``), else automatic."""
    return backend if backend in ("naive", "chunk", "triton") else None


def proj_bias_parts(bias: torch.Tensor | None, e: int, fold: bool) -> tuple[torch.Tensor | None, ...]:
    """The input projection's bias split by who adds it: ``(the product's, the gate's, the heads op's)``.  When
    ``fold`` (the fused path) the ops add it, the gate ``bias[:e]`` (``e = 0``: no gate) and the heads op ``bias[e:]``,
    and their backward kernels give its gradient as column sums they already hold in registers (no bias GEMVs over
    the output gradients); else the product adds it: ``(bias, None, None)``."""
    if not fold or bias is None:
        return bias, None, None
    return None, (bias[:e] if e else None), bias[e:]


def longest_sequence(T: int, cu_seqlens: torch.Tensor | None) -> int:
    """Length of the longest sequence of a ``[B, T]`` batch or a packed one (host int)."""
    if cu_seqlens is None:
        return T
    return int(cu_seqlens.diff().max()) if cu_seqlens.numel() > 1 else 0


def sequence_lengths(B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """``[B, T]`` length of the sequence each token belongs to."""
    if cu_seqlens is None:
        return torch.full((B, T), T, dtype=torch.long, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    seq = torch.searchsorted(cu, torch.arange(T, device=device), right=True) - 1
    return cu.diff().index_select(0, seq)[None]


class GAU(Mixer):
    """Gated attention unit, seed Code 6 (see the module docstring for the math).

    Args:
        dim: model width ``d``.
        expansion_dim: ``e`` (the seed: ``2d``).
        key_dim: ``s``, width of the shared ``z`` (the seed: 128).
        max_len: ``n`` of the ``1/n`` scalings (a fixed length, normally the training context)
            and the size of the direct relative-bias table (``max_len < 512``: a table of
            ``2 max_len - 1`` offsets, sequences may not be longer; otherwise the RoPE-built
            bias of seed Code 4, any length).
        causal: attend to earlier tokens only.
        kernel: ``'relu2'`` (seed) or ``'softmax'`` (Table 1 ablation, ``1/sqrt(s)``).
        scaling: ``'n'`` (seed Code 6) or ``'ns'`` (commentary), relu2 only.
        causal_norm: ``N_i = i + 1`` instead of ``max_len`` (commentary, "divide by t"), relu2 only.
        n_heads: heads (Table 1 ablation "multi-head"): ``q, k`` split into ``n_heads`` heads of
            ``s / n_heads``, ``v`` into heads of ``e / n_heads``; same parameters as one head
            (plus one bias table per head).
        gating: ``y = dense(u * a)``; ``False`` (Table 1 "no gating") drops ``u``: ``y = dense(a)``.
        rel_bias: add the Toeplitz relative bias (``False``: RoPE only, the commentary's choice).
        rope_base: RoPE base.
        bias: biases on the two dense layers (the seed's ``tf.layers.dense`` default).
        backend: passed to :func:`lintime.ops.gau_attention` (``None`` = automatic).
    """

    def __init__(
        self,
        dim: int,
        *,
        expansion_dim: int,
        key_dim: int = 128,
        max_len: int,
        causal: bool = True,
        kernel: str = "relu2",
        scaling: str = "n",
        causal_norm: bool = False,
        n_heads: int = 1,
        gating: bool = True,
        rel_bias: bool = True,
        rope_base: float = 10000.0,
        bias: bool = True,
        backend: str | None = None,
    ):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"GAU: kernel must be one of {KERNELS}, got {kernel!r}")
        if scaling not in SCALINGS:
            raise ValueError(f"GAU: scaling must be one of {SCALINGS}, got {scaling!r}")
        if kernel == "softmax" and causal_norm:
            raise ValueError("GAU: causal_norm applies to the relu2 kernel (softmax normalises itself)")
        e, s, H = expansion_dim, key_dim, n_heads
        if e % H or s % H or (s // H) % 2:
            raise ValueError(f"GAU: n_heads={H} must divide e={e} and s={s} into heads of even key width")
        if max_len < 1:
            raise ValueError(f"GAU: max_len must be >= 1, got {max_len}")
        self.dim, self.e, self.s, self.n_heads, self.max_len = dim, e, s, H, max_len
        self.causal, self.kernel, self.scaling, self.causal_norm = causal, kernel, scaling, causal_norm
        self.gating, self.rope_base, self.backend = gating, rope_base, backend
        self.fused = True  # the heads op's fused kernel where it has one; False: its chunked PyTorch form
        self.proj = nn.Linear(dim, (2 * e if gating else e) + s, bias=bias)  # seed Code 6 `uv`
        self.qk = ScaleOffset(2, s)
        self.rel_bias = ToeplitzRelativeBias(max_len, H) if rel_bias else None
        self.out = nn.Linear(e, dim, bias=bias)

    # ------------------------------------------------------------------ pieces
    def _check_length(self, longest: int) -> None:
        if self.rel_bias is not None and self.rel_bias.mode == "direct" and longest > self.max_len:
            raise ValueError(
                f"GAU: a sequence reaches {longest} tokens but the direct relative bias holds "
                f"max_len={self.max_len} (seed Code 4 builds a table below 512); raise max_len"
            )

    def _inner_scale(self) -> float:
        """Score scale inside the kernel when ``N`` is the fixed ``max_len``."""
        hs = self.s // self.n_heads
        if self.kernel == "relu2" and self.scaling == "n":
            return 1.0 / self.max_len
        return hs**-0.5

    def _attention(self, attend, q, norm_i):
        """Apply the scaling rule around ``attend(q, scale) -> a``; ``norm_i`` ``[..]`` is the
        per-query ``N_i`` (broadcast over ``[B, T]`` / ``[N, Lq]``) when ``causal_norm``."""
        if self.kernel == "softmax":
            return attend(q, self._inner_scale())
        if not self.causal_norm:
            a = attend(q, self._inner_scale())
            return a / self.max_len if self.scaling == "ns" else a
        n = norm_i.to(q.dtype)[..., None, None]
        if self.scaling == "n":  # relu(q.k / N_i + b): divide the query, scale 1
            return attend(q / n, 1.0)
        return attend(q, self._inner_scale()) / n

    def _norm_full(self, B, T, positions, cu_seqlens, device):
        if not self.causal_norm:
            return None
        if self.causal:
            return positions + 1  # keys seen by each query
        return sequence_lengths(B, T, cu_seqlens, device)

    def _full(self, q, k, v, positions, cu_seqlens):
        """Attention of a whole call (no cache): the op for relu2, the dense form for softmax."""
        B, T = q.shape[:2]
        norm_i = self._norm_full(B, T, positions, cu_seqlens, q.device)
        if self.kernel == "relu2":
            # packed lengths are values of cu_seqlens: checked in eager calls only (a compiled graph cannot read them)
            if cu_seqlens is None or not torch.compiler.is_compiling():
                self._check_length(longest_sequence(T, cu_seqlens))
            diag = bias_diagonals(self.rel_bias, T) if self.rel_bias is not None else None

            def attend(qq, scale):
                return gau_attention(qq, k, v, causal=self.causal, rel_bias=diag, scale=scale,
                                     cu_seqlens=cu_seqlens, backend=self.backend)

            return self._attention(attend, q, norm_i)
        # softmax ablation: no op takes a relative bias, so one row per sequence, dense T x T
        longest = longest_sequence(T, cu_seqlens)
        self._check_length(longest)
        L = max(longest, 1)
        layout = chunk_layout(B, T, L, cu_seqlens, q.device)
        qr, kr, vr = (layout.to_chunks(x).flatten(0, 1) for x in (q, k, v))  # [rows, L, H, *]
        slot = torch.arange(L, device=q.device).expand(qr.shape[0], L)
        diag = bias_diagonals(self.rel_bias, L) if self.rel_bias is not None else None
        o = dense_attention(qr, kr, vr, slot, layout.valid.flatten(0, 1), kernel="softmax",
                            scale=self._inner_scale(), bias=diag, causal=self.causal)
        return layout.from_chunks(o.view(layout.R, layout.NC, L, *o.shape[2:]))

    def _cached(self, q, k, v, cache: KVCache, positions, cu_seqlens):
        """Causal attention of the new tokens over the cache plus themselves."""
        if not self.causal:
            raise ValueError("GAU: a decoding state needs causal attention")
        B, T = q.shape[:2]
        N = cache.k.shape[0]
        old_lengths = cache.lengths
        new, row, t, Lq = append_kv(cache, k, v, cu_seqlens, "GAU")
        L = new.max_length  # an upper bound of every row's length
        if self.rel_bias is not None and self.rel_bias.mode == "direct" and L > self.max_len:
            self._check_length(int(new.lengths.max()))
        if cache.max_length == 0:  # nothing cached yet: exactly the training computation
            return self._full(q, k, v, positions, cu_seqlens), new
        qr = to_rows(q, row, t, N, Lq)  # [N, Lq, H, s/H]
        qslot = old_lengths[:, None] + torch.arange(Lq, device=q.device)  # position of each query
        kvalid = torch.arange(L, device=q.device) < new.lengths[:, None]
        diag = bias_diagonals(self.rel_bias, L) if self.rel_bias is not None else None

        def attend(qq, scale):
            return dense_attention(qq, new.k[:, :L], new.v[:, :L], qslot, kvalid, kernel=self.kernel,
                                   scale=scale, bias=diag, causal=True)

        o = self._attention(attend, qr, qslot + 1 if self.causal_norm else None)
        return from_rows(o, row, t, B, T), new

    # ------------------------------------------------------------------ mixer protocol
    def forward(
        self,
        x: torch.Tensor,
        state: KVCache | None = None,
        *,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        aux_losses: dict[str, torch.Tensor] | None = None,
        defer_bias: bool = False,
    ) -> tuple[torch.Tensor, KVCache | None]:
        """``defer_bias``: return ``y`` without ``out``'s bias (:meth:`deferrable_bias`; the block's next norm adds
        it)."""
        B, T, _ = x.shape
        H, e, s = self.n_heads, self.e, self.s
        # silu, split, the scale + offset heads and RoPE per attention head: one fused op; with gating the gate's
        # part of dense(x) is its own product, its silu taken by the gate below (as in FLASH).  Fused, the two ops
        # add dense's bias (its gradient comes out of their backward kernels)
        bias, b_u, b_vz = proj_bias_parts(self.proj.bias, e if self.gating else 0, self.fused)
        hu, hvz = (split_linear(x, self.proj.weight, bias, e) if self.gating
                   else (None, dense(x, self.proj.weight, bias)))
        _, v, qk = gau_heads(hvz, self.qk.gamma, self.qk.beta, positions, e=e, s=s, gating=False,
                             rope_base=self.rope_base, rope_heads=H, bias=b_vz,
                             backend=heads_backend(self.backend) if self.fused else "chunk")
        q, k = (qk[:, :, i].reshape(B, T, H, s // H) for i in range(2))  # [B, T, H, s/H] views
        v = v.reshape(B, T, H, e // H)
        if state is None:
            a, new_state = self._full(q, k, v, positions, cu_seqlens), None
        else:
            a, new_state = self._cached(q, k, v, state, positions, cu_seqlens)
        a = a.reshape(B, T, e)
        if self.gating:
            a = gated_activation(hu, a, bias=b_u, backend=None if self.fused else "chunk")  # silu(u) * a, one pass
        return dense(a, self.out.weight, None if defer_bias else self.out.bias), new_state

    def deferrable_bias(self) -> torch.Tensor | None:
        """``out``'s bias on the fused path (``fused``), for the fused block's next norm to add (its gradient out of
        the norm's backward kernel, :func:`lintime.modules.add_normalize`)."""
        return self.out.bias if self.fused else None

    def init_state(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> KVCache:
        H = self.n_heads
        return empty_cache(batch_size, H, self.s // H, self.e // H, device, dtype)

    def extra_repr(self) -> str:
        return (f"e={self.e}, s={self.s}, heads={self.n_heads}, max_len={self.max_len}, causal={self.causal}, "
                f"kernel={self.kernel}, scaling={self.scaling}, causal_norm={self.causal_norm}, "
                f"gating={self.gating}")


__all__ = ["GAU", "ScaleOffset"]
