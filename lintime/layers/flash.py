"""FLASH layer: the GAU with mixed chunk attention (FLASH seed Section 3.2, Code 8).

Notation: ``B`` batch, ``T`` tokens, ``d`` model width, ``e`` expanded width (``2d``), ``s`` shared
key width (128), ``C`` chunk size (256), ``N`` sequences.

The layer (the block owns the pre-norm and the residual)::

    u, v, z = split(silu(dense(x)), [e, e, s])                      # as GAU (Code 8)
    qq, kq, ql, kl = z * gamma[h] + beta[h], h = 0..3              # four scale+offset heads
    qq, kq, ql, kl = rope(.) with the token's in-sequence position  # Code 8: rope(base, axis=[1, 2])
    a = mixed_chunk_attention(qq, kq, ql, kl, v)                    # seed Eqs. 6-8, docs/design/contract.md §2.3
    y = dense(u * a)                                                # seed Section 3.2, O_g

``dense(x)`` runs as two products (:func:`lintime.layers._split_linear.split_linear`, one parameter): the ``u``
part goes to the gate, ``silu(u) * a`` in one pass each way (:func:`lintime.modules.gated_activation`); the ``v, z``
part to :func:`lintime.modules.gau_heads` (silu, the heads and RoPE: one fused kernel on CUDA).  On the fused path
(``fused``, the default) the products run without dense's bias and the two ops add it (``bias[:e]`` the gate,
``bias[e:]`` the heads op), so its gradient comes out of their backward kernels; ``fused = False`` keeps it in the
products (the unfused reference of the fused curve).  Likewise ``out``'s bias: on the fused path the layer offers it
(:meth:`FLASH.deferrable_bias`) and a fused block calls it with ``defer_bias=True`` and lets the next norm add it
(:func:`lintime.modules.add_normalize`'s ``branch_bias``), whose backward kernel gives its gradient.

Inside a chunk ``a`` is ``sum_j relu(q.k * scale + b[i-j])^2 v_j`` with the chunk-local Toeplitz
bias (seed Code 4, ``max_len = C``: a direct table below 512, RoPE-built from 512); across chunks
it is the linear attention over the earlier chunks' tokens, divided by ``linear_norm``:
``'tokens'`` (Code 8's normalised segment mask = the commentary's "divide by t"), ``'chunk'``
(Code 8 without the mask: ``/C``), ``'none'`` (Code 1).  ``scaling='n'`` is Code 8's
``relu(qk / C + b)^2``; ``scaling='ns'`` the commentary's ``relu(qk / sqrt(s) + b)^2 / C`` (passed to
the op as scale ``1/sqrt(sC)`` and bias ``b / sqrt(C)``, the same function).

``first_to_all`` (seed Table 4): two more scale+offset heads ``qf, kf`` (rotated like the others)
and, for the **first token of every chunk** (in-sequence position ``p`` with ``p % C == 0``), a
single-head softmax attention ``softmax_j(qf_p . kf_j / sqrt(s)) v_j`` over every token ``j <= p``
of its sequence (every token of the sequence when non-causal), *added* to that token's ``a``
before the gate.  The other tokens are unchanged.

Decoding state :class:`FLASHState`: the op's :class:`~lintime.ops.MixedChunkState` (the linear
sum ``[N, 1, s, e]`` and the current partial chunk: O(C) per sequence, constant in ``T``); RoPE
reads the model's positions.  With ``first_to_all`` a chunk's first token needs every earlier key,
so the state also keeps a :class:`~lintime.layers.attention.KVCache` of ``kf`` and ``v`` for all
tokens: that variant's decoding memory is O(T).

A one-token step on a *static* state (:meth:`FLASHState.with_capacity`, what
:func:`lintime.layers.base.static_state` makes) on CUDA is ``proj``, one in-place op
(:func:`lintime.ops.mixed_chunk_decode_step_`: two fused kernels for the heads, both attention
parts, the gate and the state update) and ``out``, and returns the state it was given; other steps
(eager states, the CPU, ``first_to_all``, autograd) take the path above.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from lintime.layers._rows import append_kv, dense_attention, empty_cache, from_rows, step_backend, to_rows
from lintime.layers.attention import KVCache
from lintime.layers.base import BatchState, Mixer, static_state
from lintime.layers.gau import ScaleOffset, heads_backend, longest_sequence, proj_bias_parts
from lintime.layers.positional import ToeplitzRelativeBias
from lintime.layers._split_linear import dense, split_linear
from lintime.modules import gated_activation, gau_heads
from lintime.ops import MixedChunkState, mixed_chunk_attention, mixed_chunk_decode_step_
from lintime.ops.utils import chunk_layout

LINEAR_NORMS = ("tokens", "chunk", "none")
SCALINGS = ("n", "ns")


@dataclasses.dataclass
class FLASHState(BatchState):
    """Decoding state of :class:`FLASH` (``N`` sequences, ``H = 1``).

    ``mc``   :class:`~lintime.ops.MixedChunkState`: ``kv [N, 1, s, e]`` (fp32) linear sum of the
             completed chunks, ``count [N]``, partial-chunk buffers ``k_quad / k_lin [N, C, 1, s]``,
             ``v [N, C, 1, e]``, ``fill [N]``.  Constant size in ``T``.
    ``fta``  ``None``, or with ``first_to_all`` a :class:`~lintime.layers.attention.KVCache` of the
             first-to-all keys ``[N, S, 1, s]`` and values ``[N, S, 1, e]`` of every token (O(T)).
    ``static`` ``True`` for the form made by :meth:`with_capacity`: one-token steps may update its
             tensors in place and return it.
    """

    mc: MixedChunkState
    fta: KVCache | None = None
    static: bool = False

    def with_capacity(self, capacity: int) -> FLASHState:
        """The static form: fresh contiguous buffers (the first-to-all cache at a fixed capacity of
        ``capacity`` tokens), which a one-token step updates in place."""
        return FLASHState(static_state(self.mc, capacity), static_state(self.fta, capacity), static=True)


class FLASH(Mixer):
    """FLASH layer, seed Code 8 (see the module docstring for the math).

    Args:
        dim: model width ``d``.
        expansion_dim: ``e`` (the seed: ``2d``).
        key_dim: ``s`` (the seed: 128).
        chunk_size: ``C`` (the seed: 256; 512 for PG-19).
        causal: causal mixed chunk attention (Eq. 8) or the bidirectional one (Eq. 7).
        linear_norm: ``'tokens'`` | ``'chunk'`` | ``'none'``, the linear part's normaliser.
        scaling: ``'n'`` (Code 8) | ``'ns'`` (commentary), the quadratic part's scale.
        first_to_all: seed Table 4 "first-to-all" (see the module docstring).
        rel_bias: the chunk-local Toeplitz bias (``False``: RoPE only).
        rope_base: RoPE base.
        bias: biases on the two dense layers.
        backend: passed to :func:`lintime.ops.mixed_chunk_attention` (``None`` = automatic).
    """

    def __init__(
        self,
        dim: int,
        *,
        expansion_dim: int,
        key_dim: int = 128,
        chunk_size: int = 256,
        causal: bool = True,
        linear_norm: str = "tokens",
        scaling: str = "n",
        first_to_all: bool = False,
        rel_bias: bool = True,
        rope_base: float = 10000.0,
        bias: bool = True,
        backend: str | None = None,
    ):
        super().__init__()
        if linear_norm not in LINEAR_NORMS:
            raise ValueError(f"FLASH: linear_norm must be one of {LINEAR_NORMS}, got {linear_norm!r}")
        if scaling not in SCALINGS:
            raise ValueError(f"FLASH: scaling must be one of {SCALINGS}, got {scaling!r}")
        if chunk_size < 1:
            raise ValueError(f"FLASH: chunk_size must be >= 1, got {chunk_size}")
        if key_dim % 2:
            raise ValueError(f"FLASH: RoPE needs an even key_dim, got {key_dim}")
        e, s, C = expansion_dim, key_dim, chunk_size
        self.dim, self.e, self.s, self.chunk_size = dim, e, s, C
        self.causal, self.linear_norm, self.scaling, self.first_to_all = causal, linear_norm, scaling, first_to_all
        self.rope_base, self.backend = rope_base, backend
        self.fused = True  # the heads op's fused kernel where it has one; False: its chunked PyTorch form
        self.proj = nn.Linear(dim, 2 * e + s, bias=bias)  # seed Code 8 `uv`
        self.heads = ScaleOffset(6 if first_to_all else 4, s)  # quad_q, quad_k, lin_q, lin_k[, fta_q, fta_k]
        self.rel_bias = ToeplitzRelativeBias(C, 1) if rel_bias else None
        self.out = nn.Linear(e, dim, bias=bias)

    def _quad_scale_and_bias(self):
        C, s = self.chunk_size, self.s
        diag = self.rel_bias.diagonals(C) if self.rel_bias is not None else None
        if self.scaling == "n":
            return 1.0 / C, diag  # seed Code 8: relu(quad_qk / n + bias) ** 2, n = C
        # relu(qk / sqrt(s) + b)^2 / C == relu(qk / sqrt(sC) + b / sqrt(C))^2
        return (s * C) ** -0.5, None if diag is None else diag * C**-0.5

    # ------------------------------------------------------------------ first-to-all
    def _fta_full(self, qf, kf, v, cu_seqlens):
        """First-to-all term of a whole call: ``[B, T, 1, e]``, zero except at chunk starts."""
        B, T = qf.shape[:2]
        C = self.chunk_size
        L = max(longest_sequence(T, cu_seqlens), 1)
        layout = chunk_layout(B, T, L, cu_seqlens, qf.device)  # one row per sequence
        kr, vr = (layout.to_chunks(x).flatten(0, 1) for x in (kf, v))  # [rows, L, 1, *]
        qr = layout.to_chunks(qf).flatten(0, 1)[:, ::C]  # [rows, G, 1, s]: the chunks' first tokens
        first = torch.arange(0, L, C, device=qf.device)
        qslot = first.expand(qr.shape[0], -1)
        o = dense_attention(qr, kr, vr, qslot, layout.valid.flatten(0, 1), kernel="softmax",
                            scale=self.s**-0.5, causal=self.causal)  # [rows, G, 1, e]
        out = o.new_zeros(vr.shape).index_copy(1, first, o)
        return layout.from_chunks(out.view(layout.R, layout.NC, L, *out.shape[2:]))

    def _fta_cached(self, qf, kf, v, cache: KVCache, cu_seqlens):
        B, T = qf.shape[:2]
        N = cache.k.shape[0]
        old_lengths = cache.lengths
        new, row, t, Lq = append_kv(cache, kf, v, cu_seqlens, "FLASH")
        if cache.max_length == 0:  # nothing cached yet: exactly the training computation
            return self._fta_full(qf, kf, v, cu_seqlens), new
        L = new.max_length
        qr = to_rows(qf, row, t, N, Lq)
        qslot = old_lengths[:, None] + torch.arange(Lq, device=qf.device)
        kvalid = torch.arange(L, device=qf.device) < new.lengths[:, None]
        o = dense_attention(qr, new.k[:, :L], new.v[:, :L], qslot, kvalid, kernel="softmax",
                            scale=self.s**-0.5, causal=True)
        o = torch.where((qslot % self.chunk_size == 0)[:, :, None, None], o, o.new_zeros(()))
        return from_rows(o, row, t, B, T), new

    # ------------------------------------------------------------------ mixer protocol
    def forward(
        self,
        x: torch.Tensor,
        state: FLASHState | None = None,
        *,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        aux_losses: dict[str, torch.Tensor] | None = None,
        defer_bias: bool = False,
    ) -> tuple[torch.Tensor, FLASHState | None]:
        """``defer_bias``: return ``y`` without ``out``'s bias (:meth:`deferrable_bias`; the block's next norm adds
        it), on every path."""
        B, T, _ = x.shape
        e, s = self.e, self.s
        out_bias = None if defer_bias else self.out.bias
        if self._fused_step(x, state, cu_seqlens):
            return self._decode_step_(x, state, positions, out_bias), state
        # dense(x) as its gate part and its v, z part; silu of v, z, the scale + offset heads and RoPE: one fused
        # op (v [B, T, e] and 4 or 6 heads [B, T, 1, s]); silu of the gate part is taken by the gate below.  Fused,
        # the two ops add dense's bias (its gradient comes out of their backward kernels, no pass over du, dv, dz)
        bias, b_u, b_vz = proj_bias_parts(self.proj.bias, e, self.fused)
        hu, hvz = split_linear(x, self.proj.weight, bias, e)
        _, v, parts = gau_heads(hvz, self.heads.gamma, self.heads.beta, positions, e=e, s=s, gating=False,
                                rope_base=self.rope_base, split_heads=True, bias=b_vz,
                                backend=heads_backend(self.backend) if self.fused else "chunk")
        qq, kq, ql, kl = parts[:4]  # [B, T, 1, s] each, contiguous (the attention ops take contiguous inputs)
        v = v[:, :, None]  # [B, T, 1, e]
        scale, diag = self._quad_scale_and_bias()
        kwargs = dict(chunk_size=self.chunk_size, causal=self.causal, rel_bias=diag, scale=scale,
                      linear_norm=self.linear_norm, cu_seqlens=cu_seqlens,
                      backend=step_backend(self.backend, T, cu_seqlens, state))
        if state is None:
            a, _ = mixed_chunk_attention(qq, kq, ql, kl, v, **kwargs)
            new_state = None
        else:
            if not self.causal:
                raise ValueError("FLASH: a decoding state needs causal attention")
            a, mc = mixed_chunk_attention(qq, kq, ql, kl, v, initial_state=state.mc, output_final_state=True,
                                          **kwargs)
            new_state = FLASHState(mc, None)
        if self.first_to_all:
            qf, kf = parts[4], parts[5]
            if state is None:
                a = a + self._fta_full(qf, kf, v, cu_seqlens)
            else:
                if state.fta is None:
                    raise ValueError("FLASH: first_to_all needs a state made by this layer's init_state")
                o_f, new_state.fta = self._fta_cached(qf, kf, v, state.fta, cu_seqlens)
                a = a + o_f
        # squeeze, not a[:, :, 0]: select's backward is a zero fill + a copy of the whole gradient
        gated = gated_activation(hu, a.squeeze(2), bias=b_u,  # silu(u) * a, one pass
                                 backend=None if self.fused else "chunk")
        return dense(gated, self.out.weight, out_bias), new_state

    def static_packing(self) -> bool:
        """Mixed chunk attention plans a static ``cu_seqlens`` on the device; first-to-all's cache does not."""
        return not self.first_to_all

    def deferrable_bias(self) -> torch.Tensor | None:
        """``out``'s bias on the fused path (``fused``), for the fused block's next norm to add: its gradient then
        comes out of the norm's backward kernel instead of a GEMV over the output gradient."""
        return self.out.bias if self.fused else None

    def _fused_step(self, x, state, cu_seqlens) -> bool:
        """Whether this call is a one-token step that :meth:`_decode_step_` takes: a static state, no
        first-to-all, no gradient, the fused op's device (CUDA; the CPU only with ``backend='triton'``,
        through Triton's interpreter), and the step's dtype (the weights', or autocast's) = the state's."""
        if not (isinstance(state, FLASHState) and state.static and x.shape[1] == 1 and cu_seqlens is None
                and self.causal and not self.first_to_all and self.backend in (None, "triton")
                and (x.is_cuda or self.backend == "triton")
                and not (torch.is_grad_enabled() and (x.requires_grad or self.proj.weight.requires_grad))):
            return False
        dev = x.device.type
        step_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.proj.weight.dtype
        return state.mc.v.dtype == step_dtype

    def _decode_step_(self, x, state: FLASHState, positions, out_bias) -> torch.Tensor:
        """One token per sequence, ``state`` updated in place: ``[B, 1, d] -> [B, 1, d]`` (``out_bias``: the bias
        added by ``out``, ``None`` when deferred)."""
        B = x.shape[0]
        scale, diag = self._quad_scale_and_bias()
        h = self.proj(x).view(B, -1)  # under autocast in the autocast dtype, like the state's buffers
        y = mixed_chunk_decode_step_(h, self.heads.gamma, self.heads.beta,
                                     positions.reshape(B), state.mc, rel_bias=diag, scale=scale,
                                     linear_norm=self.linear_norm, rope_base=self.rope_base, backend="triton")
        return F.linear(y.view(B, 1, self.e), self.out.weight, out_bias)

    def init_state(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> FLASHState:
        mc = MixedChunkState.zeros(batch_size, self.chunk_size, 1, self.s, self.e, dtype=dtype, device=device)
        fta = empty_cache(batch_size, 1, self.s, self.e, device, dtype) if self.first_to_all else None
        return FLASHState(mc, fta)

    def extra_repr(self) -> str:
        return (f"e={self.e}, s={self.s}, chunk_size={self.chunk_size}, causal={self.causal}, "
                f"linear_norm={self.linear_norm}, scaling={self.scaling}, first_to_all={self.first_to_all}")


__all__ = ["FLASH", "FLASHState"]
