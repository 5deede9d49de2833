"""Transformer-VQ attention layer (seed ``transformer-vq.txt``: Definition 3.1, Eqs. 5-15 and
35-37, Theorems 3.6-3.7, Appendix C and E).

Notation: ``B`` batch, ``T`` tokens, ``d`` model width, ``H`` heads (1 in the seed: a single-head
gated attention unit, Remark 3.2), ``K`` key width per head (``D_k`` = 128), ``E`` value width per
head (``D_v / H``, ``D_v = 2d``), ``S`` codes, ``L`` block length, ``N`` sequences,
``tau = sqrt(K)`` (the seed's fixed constant of Eqs. 8-9; the authors' code uses ``d_k ** 0.5``).

The layer (the block owns the pre-norm ``x~ = RMSNorm(x)`` of Eq. 7 and the residual of Eq. 15)::

    q     = tau^-1/2 RMS(x~ W_Q)                    # Eq. 8: RMS norm, unit gain, no bias
    k     = tau^-1/2 RMS(x~ W_K)                    # Eq. 9
    v, g  = silu(x~ W_V), silu(x~ W_G)              # Eqs. 10-11 (App. C: phi_v = phi_g = SiLU)
    z     = argmin_s ||k - C_s||^2                  # Eq. 5, per head
    k_hat = STVQ(k) = k + sg(C_z - k)               # Eq. 6 / 12 (forward value exactly C_z)
    o     = softmax_j((q + u') . k_hat_j + b_ij) v  # Eq. 13, computed by vq_attention (Thm 3.7)
    y     = (o * g) W_O                             # Eqs. 14-15

Positions (Transformer-XL relative bias, the seed's ``XLBiasProducer``, App. C "dropout to the
flipped sinusoidal embeddings used for (local) relative positional biases")::

    r_m   = tau^-1/2 (sin(m) W_R),  m = 0..L        # sinusoid of width d, max wavelength 1e5 (App. C)
    u'    = tau^-1/2 u,  v' = tau^-1/2 v_xl         # XL's global content / position biases [H, K]
    b_ij  = (q_i + v') . r_{i-j}   if 0 <= i - j <= L, else 0     # Theorem 3.6: no bias beyond L

``q + u'`` is the query of *every* key score, window and cache alike (XL's content term
``u . k_j``), so it is what the op receives as ``q``; ``b`` goes to the op as its relative table
``rel_bias = (q + v', r)`` (the op shifts ``(q + v') . r_m`` into its window layout, column ``r`` of
query ``i`` in block ``n`` being the key at ``(n-1) L + r``, at distance ``i - (n-1) L - r``).  Keys
further back than ``L`` get no positional bias, as in Theorem 3.6 and the authors' code (their
locality mask).  Distances count from the op's positions (from each sequence's start, continued
from the state), which are the model's ``positions``.

Codebook (seed Section 3.4.1, "EMA-smoothed k-means", van den Oord et al. 2017 / Razavi et al.
2019).  Per head the layer keeps two **buffers** (not parameters: the optimizer never sees them,
they are saved in the ``state_dict``): ``codebook_count [H, S]`` and ``codebook_sum [H, S, K]``;
the codebook is ``C_s = sum_s / max(count_s, 0.01)`` (the authors' clip).  In **training mode
only**, every forward call updates them, under ``torch.no_grad``, *after* the call has used the
current codebook, from the ``n_s`` keys of the call assigned to code ``s``::

    count_s <- gamma count_s + (1 - gamma) n_s
    sum_s   <- gamma sum_s   + (1 - gamma) sum_{t: z_t = s} k_t          (gamma = 0.99)

so each used codeword moves to the count-weighted mean of its old value and the mean of its
assigned keys; an unused one keeps its value (both statistics decay by ``gamma``).  Eval mode
(and so decoding with ``model.eval()``) never changes the codebook.  A training-mode call that
continues a state (truncated backprop, seed Section 3.4.2) updates it too, as the seed updates
its codebooks while carrying its cache; the cache stores counts and mean *values* per code and
always scores the current codewords, exactly like the seed's.  With gradient accumulation each
micro-batch's forward is one update.

Commitment loss (Eq. 37): ``mean over the call's tokens of sum over heads ||k_t - sg(C_{z_t})||^2``,
**added unweighted** to ``aux_losses["vq_commit"]`` when the caller passes ``aux_losses``; summed
over layers by that key (Eq. 37 sums over layers).  Its weight ``beta`` (1e-4, Eq. 35, App. C) is
applied once, by the training loop (``TrainConfig.aux_weight``, the ``vq`` recipe's 1e-4).  Its
gradient reaches ``k`` (hence ``W_K`` and what feeds it) only.

Gradients through the quantiser.  ``k_hat`` is straight-through (Eq. 6): ``d k = d k_hat``.  The
op scores a key inside the query's two-block window through ``k_hat`` and a key older than that
through the ``codebook`` argument (the compressed cache, Theorem 3.7).  The layer passes the EMA
codebook **detached**, as the seed's implementation does (its ``get_codebook`` returns
``sg(c_sum / c_count)``; the EMA codebook receives no gradient): so the cross-entropy reaches ``k``
from the window keys only, while ``q``, ``u`` and the values ``v`` of cached keys get their full
gradient (seed Section 3.4.2: "a learning signal is sent through any value vectors added to the
compressed cache").  Routing a cached key's gradient to ``k`` exactly is not possible through a
shared ``[H, S, K]`` codebook: it would need each key's own value (the cache only holds per-code
means) and would mix the gradients of different sequences that share a code.  The quadratic
``backend="naive"`` of the op gives the exact straight-through gradient of every key (tests use it
to show the difference is only there).

Decoding state :class:`VQAttentionState`: the op's :class:`~lintime.ops.VQState` (per-code count
``[N, H, S]`` and mean value ``[N, H, S, E]`` of the cache, the two-block window of ``k_hat``,
``v``, codes ``[N, 2L, H, *]``, and ``pos``): constant size in ``T``.  The XL bias counts
distances from the state's ``pos`` (the model's ``positions`` continue from it), so block
boundaries agree.  A one-token step
in eval mode on a *static* state (:meth:`VQAttentionState.with_capacity`, what
:func:`lintime.layers.base.static_state` makes) on CUDA updates the state in place through
:func:`lintime.ops.vq_decode_step_` (three fused kernels: attention over window and cache, the
block-end merge, the window shift) and returns the state it was given: a fixed-shape step with no
host read, which a CUDA graph replays.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn as nn

from lintime.layers._split_linear import multi_linear
from lintime.layers.base import BatchState, Mixer, static_state
from lintime.layers.positional import sinusoid
from lintime.modules import normalize
from lintime.ops import VQState, vq_attention, vq_decode_step_
from lintime.ops.utils import mark_checked
from lintime.ops.vq.gate import vq_gate, vq_value_silu
from lintime.ops.vq.sums import code_sums

REDUCTIONS = ("serial", "matmul", "assoc")
COUNT_CLIP = 0.01  # C_s = sum_s / max(count_s, 0.01), the authors' clip


@dataclasses.dataclass
class VQAttentionState(BatchState):
    """Decoding state of :class:`VQAttention` (``N`` sequences).

    ``vq``  :class:`~lintime.ops.VQState`: ``cache_mean [N, H, S, E]`` and ``cache_count [N, H, S]``
            (fp32; fp64 for fp64 models) summarise every key older than the window;
            ``k_hat [N, 2L, H, K]``, ``v [N, 2L, H, E]``, ``codes [N, 2L, H]`` hold the previous
            and the current block; ``pos [N]`` tokens seen.  Constant size in ``T``.
    ``static`` ``True`` for the form made by :meth:`with_capacity`: one-token steps may update its
            tensors in place and return it.
    """

    vq: VQState
    static: bool = False

    def with_capacity(self, capacity: int) -> VQAttentionState:
        """The static form (:func:`lintime.layers.base.static_state`): fresh contiguous buffers that a one-token
        step updates in place (the size is constant in ``T``: ``capacity`` changes nothing)."""
        return VQAttentionState(static_state(self.vq, capacity), static=True)


def _quantisation_range():
    """A ``vq_quantisation`` profiler range while a profiler runs (``benchmarks/profile_step.py`` puts the
    kernels inside it in its quantisation category); nothing otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function("vq_quantisation")
    return contextlib.nullcontext()


class _StraightThrough(torch.autograd.Function):
    """Seed Eq. 6, ``k + sg(c_z - k)``: the value is exactly the codeword ``c_z`` in ``k``'s dtype (so window and
    cache agree bit for bit), the gradient the identity to ``k`` -- one cast forward and nothing backward, where
    ``c_z + (k - sg(k))`` in autograd is three passes over the keys."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, c_z: torch.Tensor) -> torch.Tensor:
        return c_z.to(k.dtype) if c_z.dtype != k.dtype else c_z.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CommitLoss(torch.autograd.Function):
    """Seed Eq. 37 for one layer, ``sum ||k - sg(c_z)||^2 / (B T)``: the difference formed once in at least fp32 (the
    type promotion of ``k - c_z``: no separate cast of ``k``), its square sum as one dot product; backward one
    product written in ``k``'s dtype, ``d k = 2 g (k - c_z) / (B T)`` (was cast, subtraction, power, sums, mean and
    their gradients: about ten passes over the keys)."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, c_z: torch.Tensor) -> torch.Tensor:
        d = torch.sub(k, c_z.to(torch.promote_types(torch.promote_types(k.dtype, c_z.dtype), torch.float32)))
        n = max(k[..., 0, 0].numel(), 1)  # tokens
        ctx.save_for_backward(d)
        ctx.n, ctx.k_dtype = n, k.dtype
        flat = d.reshape(-1)
        with torch.autocast(k.device.type, enabled=False):  # the sum in d's precision
            return torch.dot(flat, flat) / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        (d,) = ctx.saved_tensors
        dk = torch.empty(d.shape, dtype=ctx.k_dtype, device=d.device)
        torch.mul(d, grad * (2.0 / ctx.n), out=dk)
        return dk, None


def _quantize_kernel(k: torch.Tensor, codebook: torch.Tensor) -> bool:
    """Whether a decoding step's quantisation runs as one kernel (:mod:`lintime.ops.vq.triton.quantize`): fp16 /
    bf16 / fp32 keys up to 256 wide, an fp32 codebook."""
    return k.dtype in (torch.float16, torch.bfloat16, torch.float32) and codebook.dtype == torch.float32 \
        and k.shape[-1] <= 256


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm with unit gain (seed Eqs. 8-9: "LayerNorms use unit gain and zero bias"), computed
    in at least fp32, returned in ``x``'s dtype: :func:`lintime.modules.normalize` (one fused kernel per
    direction on CUDA, where the PyTorch composite is about six passes)."""
    return normalize(x, kind="rmsnorm", eps=eps)


class VQAttention(Mixer):
    """Transformer-VQ attention (see the module docstring for the math).

    Args:
        dim: model width ``d``.
        key_dim: ``K``, key width per head (seed: 128).
        value_dim: ``D_v``, total value / gate width (seed: ``2d``); split into ``H`` heads.
        n_codes: ``S``, codewords per head (seed: 512).
        block_len: ``L`` (seed: 512).
        n_heads: ``H`` (seed: 1, the single-head gated unit; >1 = the multi-head variant of the
            seed's throughput study, one codebook per head).
        causal: must be ``True``: Transformer-VQ is a decoder (seed Section 3.3).
        gamma: EMA rate of the codebook (seed: 0.99).
        rel_bias: the Transformer-XL relative bias within the window (``False``: no positions
            inside the layer).
        sin_dropout: dropout on the relative sinusoids (seed App. C ``p_dropsin``; one mask per
            call, shared by the batch).
        sin_base: maximum angular wavelength of the sinusoids (seed App. C: 1e5).
        reduction: the op's cross-block cache reduction: ``serial`` | ``matmul`` | ``assoc``.
        bias: biases on the dense projections (the authors' code has none).
        norm_eps: epsilon of the q / k RMS norms.
        backend: passed to :func:`lintime.ops.vq_attention` (``None`` = automatic).
    """

    updates_buffers = True  # the codebook statistics (EMA counts and sums) move with every training forward

    def __init__(
        self,
        dim: int,
        *,
        key_dim: int = 128,
        value_dim: int,
        n_codes: int = 512,
        block_len: int = 512,
        n_heads: int = 1,
        causal: bool = True,
        gamma: float = 0.99,
        rel_bias: bool = True,
        sin_dropout: float = 0.0,
        sin_base: float = 1e5,
        reduction: str = "serial",
        bias: bool = False,
        norm_eps: float = 1e-6,
        backend: str | None = None,
    ):
        super().__init__()
        w = "VQAttention"
        if not causal:
            raise ValueError(f"{w}: Transformer-VQ is causal (a decoder, seed Section 3.3); "
                             f"a bidirectional / masked-LM version is not defined")
        if min(dim, key_dim, value_dim, n_codes, block_len, n_heads) < 1:
            raise ValueError(f"{w}: sizes must be >= 1, got dim={dim}, key_dim={key_dim}, value_dim={value_dim}, "
                             f"n_codes={n_codes}, block_len={block_len}, n_heads={n_heads}")
        if value_dim % n_heads:
            raise ValueError(f"{w}: n_heads={n_heads} must divide value_dim={value_dim}")
        if not 0.0 <= gamma < 1.0:
            raise ValueError(f"{w}: gamma must be in [0, 1), got {gamma}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"{w}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if rel_bias and dim % 2:
            raise ValueError(f"{w}: the relative sinusoids need an even dim, got {dim}")
        H, K, S = n_heads, key_dim, n_codes
        self.dim, self.K, self.e, self.H, self.S, self.L = dim, K, value_dim, H, S, block_len
        self.E = value_dim // H
        self.causal, self.gamma, self.reduction, self.norm_eps = True, float(gamma), reduction, norm_eps
        self.sin_base, self.backend = float(sin_base), backend
        self.tau = K**0.5
        self.q_proj = nn.Linear(dim, H * K, bias=bias)  # W_Q
        self.kvg_proj = nn.Linear(dim, H * K + 2 * value_dim, bias=bias)  # W_K, W_V, W_G
        self.out = nn.Linear(value_dim, dim, bias=bias)  # W_O
        if rel_bias:
            self.r_proj = nn.Linear(dim, H * K, bias=False)  # XL's W_{k,R}
            self.xl_u = nn.Parameter(torch.zeros(H, K))
            self.xl_v = nn.Parameter(torch.zeros(H, K))
            self.sin_drop = nn.Dropout(sin_dropout)
        else:
            self.r_proj = self.xl_u = self.xl_v = self.sin_drop = None
        self.register_buffer("codebook_count", torch.ones(H, S))
        self.register_buffer("codebook_sum", torch.randn(H, S, K) * self.tau**-0.5)
        self._memos: dict = {}  # see _memo: derived tensors kept between decoding steps

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Codebook: ``count = 1``, ``sum ~ N(0, 1 / tau)`` (codewords at the keys' scale: each key
        component has RMS ``tau^-1/2``); XL biases ``u``, ``v`` zero.  Dense weights keep the
        model's ``N(0, std)``."""
        self.codebook_count.fill_(1.0)
        self.codebook_sum.normal_().mul_(self.tau**-0.5)
        if self.xl_u is not None:
            self.xl_u.zero_()
            self.xl_v.zero_()

    def no_weight_decay(self) -> set[str]:
        return {"xl_u", "xl_v"} if self.xl_u is not None else set()

    def codebook(self) -> torch.Tensor:
        """``[H, S, K]`` the current codewords ``sum / max(count, 0.01)`` (no gradient)."""
        return (self.codebook_sum / self.codebook_count.clamp_min(COUNT_CLIP)[..., None]).detach()

    # ------------------------------------------------------------------ pieces
    def project(self, x: torch.Tensor):
        """``x [B, T, d]`` -> ``q, k [B, T, H, K]``, ``v [B, T, H, E]`` (Eqs. 8-10) and ``x W_G [B, T, D_v]``, the
        gate before its SiLU (Eq. 11: :func:`lintime.ops.vq.gate.vq_gate` applies it with the product of Eq. 14)."""
        B, T, _ = x.shape
        H, K, e = self.H, self.K, self.e
        if torch.is_grad_enabled():
            scaled_rms = lambda t: _rms(t, self.norm_eps) * self.tau**-0.5
        else:  # no gradient (decoding): the scale as the norm's scalar gain, one kernel per norm instead of two
            gdt = torch.float64 if x.dtype == torch.float64 else torch.float32
            gain = self._memo("tau_gain", (), (x.device, gdt), lambda: torch.tensor(
                self.tau**-0.5, dtype=gdt, device=x.device), always=True)
            scaled_rms = lambda t: normalize(t, gain, kind="scalenorm", eps=self.norm_eps)
        if torch.is_grad_enabled():  # four contiguous outputs, each part's gradient its own tensor (no split / cat),
            # dx summed in the products' epilogues
            qp, k, v, g = multi_linear(x, [(self.q_proj.weight, self.q_proj.bias, None),
                                           (self.kvg_proj.weight, self.kvg_proj.bias, (H * K, e, e))])
        else:  # a decoding step: two products
            qp = self.q_proj(x)
            k, v, g = self.kvg_proj(x).split([H * K, e, e], dim=-1)
        q = scaled_rms(qp.view(B, T, H, K))  # seed Eq. 8
        k = scaled_rms(k.view(B, T, H, K))  # seed Eq. 9
        return q, k, vq_value_silu(v).view(B, T, H, self.E), g  # seed Eq. 10 (Eq. 11's SiLU: in vq_gate)

    @staticmethod
    def quantize(k: torch.Tensor, codebook: torch.Tensor, sq_norms: torch.Tensor | None = None):
        """STVQ (seed Eqs. 5-6).  ``k [B, T, H, K]``, ``codebook [H, S, K]`` -> ``codes [B, T, H]``
        (int64), ``k_hat [B, T, H, K]`` (value exactly ``codebook[codes]``, gradient straight to
        ``k``), ``c_z [B, T, H, K]`` (the codewords, no gradient, in the codebook's dtype).
        ``sq_norms``: ``||codebook||^2 [H, 1, S]`` when the caller keeps it (a decoding step)."""
        B, T, H, K = k.shape
        # the assignment in the codebook's precision, also under autocast (bf16 distances would
        # flip near-ties between calls)
        with torch.no_grad(), torch.autocast(k.device.type, enabled=False):
            # ||k - c||^2 = ||k||^2 - 2 k.c + ||c||^2; ||k||^2 does not change the argmin
            c2 = codebook.pow(2).sum(-1)[:, None, :] if sq_norms is None else sq_norms
            # CUDA: one kernel for the distances (on the tensor cores, not an fp32 GEMM on the CUDA cores),
            # argmin and codeword; elsewhere one
            # GEMM with ||c||^2 added in its epilogue, the [B*T, S] distances written once and read once by the argmin
            if k.is_cuda and _quantize_kernel(k, codebook):
                from lintime.ops.vq.triton.quantize import assign_codes  # (Triton: imported on first use)

                codes, c_z = assign_codes(k.reshape(B * T, H, K), codebook, c2)
                codes, c_z = codes.view(B, T, H), c_z.view(B, T, H, K)
            else:
                kf = k.to(codebook.dtype).permute(2, 0, 1, 3).reshape(H, B * T, K)  # a view for H = 1
                dist = torch.baddbmm(c2, kf, codebook.transpose(1, 2), alpha=-2.0)
                codes = dist.argmin(-1).view(H, B, T).permute(1, 2, 0).contiguous()  # [B, T, H], seed Eq. 5
                if H == 1:  # one gather, no head index tensor
                    c_z = codebook[0, codes[..., 0]][:, :, None]  # [B, T, 1, K]
                else:
                    c_z = codebook[torch.arange(H, device=k.device), codes]  # [B, T, H, K]
        # seed Eq. 6, k + sg(c_z - k), written c_z + (k - sg(k)): the same gradient (identity to k)
        # and a forward value that is exactly the codeword, so window and cache agree bit for bit;
        # without a gradient to carry, the codeword itself (two kernels fewer per decoding step)
        if torch.is_grad_enabled() and k.requires_grad:
            return codes, _StraightThrough.apply(k, c_z), c_z
        return codes, c_z.to(k.dtype), c_z

    @staticmethod
    def commit_loss(k: torch.Tensor, c_z: torch.Tensor) -> torch.Tensor:
        """Seed Eq. 37 for this layer: the mean over tokens of the sum over heads of ``||k - sg(C_z)||^2``, in at
        least fp32 (0-D); its gradient reaches ``k`` only."""
        return _CommitLoss.apply(k, c_z)

    @torch.no_grad()
    def update_codebook(self, k: torch.Tensor, codes: torch.Tensor) -> None:
        """EMA k-means step from the keys of one call (see the module docstring): the per-code counts and key
        sums by :func:`lintime.ops.vq.sums.code_sums` (two ``index_add``), each statistic moved by
        one ``lerp_`` (``x + (1 - gamma) (new - x)``, the same EMA)."""
        H, S, K = self.H, self.S, self.K
        flat = codes if H == 1 else codes + S * torch.arange(H, device=codes.device)
        n, ksum = code_sums(flat.reshape(-1), k.reshape(-1, K), H * S)  # [H*S], [H*S, K] in [0, H*S)
        dt = self.codebook_sum.dtype
        w = 1 - self.gamma
        self.codebook_count.lerp_(n.view(H, S).to(dt), w)
        self.codebook_sum.lerp_(ksum.view(H, S, K).to(dt), w)

    def xl_terms(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q + v' [..., H, K], r [L+1, H, K])`` in ``q``'s dtype: the XL bias of distance ``m`` is
        ``(q + v') . r_m`` (see the module docstring)."""
        L, H, K = self.L, self.H, self.K
        dt = self.r_proj.weight.dtype

        def table():
            sin = self._memo("sin", (), (q.device, dt), lambda: sinusoid(
                torch.arange(L + 1, device=q.device), self.dim, dt, self.sin_base), always=True)  # [L+1, d]
            r = self.r_proj(self.sin_drop(sin)).view(L + 1, H, K) * self.tau**-0.5  # r_m, m = 0..L
            return r.to(q.dtype)

        r = self._memo("r", (self.r_proj.weight,), (q.device, q.dtype), table)
        return q + self._scaled(self.xl_v, "xl_v", q), r

    def _scaled(self, p: torch.Tensor, name: str, q: torch.Tensor) -> torch.Tensor:
        """``tau^-1/2 p`` in ``q``'s dtype (XL's ``u'``, ``v'``)."""
        return self._memo(name, (p,), (q.device, q.dtype), lambda: (p * self.tau**-0.5).to(q.dtype))

    def _memo(self, name: str, deps, key, fn, always: bool = False) -> torch.Tensor:
        """``fn()``, kept between calls while it cannot change: in eval mode without a gradient (a decoding step),
        until one of the tensors ``deps`` changes (version counter) or ``key`` (device, dtype) does; ``always``:
        ``fn`` depends on ``key`` alone (a constant table; kept in training too).  Saves a decoding step the
        kernels that would rebuild the relative table, the codebook and the scaled XL biases every token."""
        if not always and (self.training or torch.is_grad_enabled()):
            return fn()
        tag = (key, tuple((id(t), t._version) for t in deps))
        hit = self._memos.get(name)
        if hit is not None and hit[0] == tag:
            return hit[1]
        val = fn()
        self._memos[name] = (tag, val)
        return val

    # ------------------------------------------------------------------ mixer protocol
    def forward(
        self,
        x: torch.Tensor,
        state: VQAttentionState | None = None,
        *,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        aux_losses: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, VQAttentionState | None]:
        B, T, _ = x.shape
        q, k, v, g = self.project(x)
        fused = self._fused_step(q, v, state, cu_seqlens)  # one token, the static state updated in place
        with _quantisation_range():
            # [H, S, K], the one this call uses throughout (and its squared norms, kept between decoding steps)
            cb_deps, cb_key = (self.codebook_sum, self.codebook_count), (k.device,)
            codebook = self._memo("codebook", cb_deps, cb_key, self.codebook)
            c2 = self._memo("codebook_sq", cb_deps, cb_key, lambda: codebook.pow(2).sum(-1)[:, None, :])
            if fused and aux_losses is None and _quantize_kernel(k, codebook):
                from lintime.ops.vq.triton.quantize import quantize_step  # (Triton: imported on first use)

                codes, k_hat = quantize_step(k[:, 0], codebook, c2)  # one kernel: distances, argmin, codeword
                codes, k_hat = codes[:, None], k_hat[:, None]
            else:
                codes, k_hat, c_z = self.quantize(k, codebook, c2)
                mark_checked(codes)  # an argmin over this codebook: the op need not read its range back
                if aux_losses is not None and T > 0:
                    commit = self.commit_loss(k, c_z)
                    aux_losses["vq_commit"] = aux_losses["vq_commit"] + commit if "vq_commit" in aux_losses \
                        else commit
        qu = q if self.xl_u is None else q + self._scaled(self.xl_u, "xl_u", q)
        if fused:
            # the XL bias from its terms inside the step's kernel (distances from the state's positions)
            rel = None
            if self.r_proj is not None:
                qv, r = self.xl_terms(q)
                rel = (qv[:, 0], r)
            o = vq_decode_step_(qu[:, 0], k_hat[:, 0], codes[:, 0], v[:, 0], codebook, state.vq, rel_bias=rel,
                                backend="triton")
            return self.out(vq_gate(o.reshape(B, T, self.e), g)), state
        # the XL bias as its relative table: the op shifts it into the window (no [T, 2L] index tensors)
        rel = None if self.r_proj is None else self.xl_terms(q)
        o, vq_state = vq_attention(
            qu, k_hat, codes, v, codebook, block_len=self.L, rel_bias=rel, reduction=self.reduction,
            initial_state=None if state is None else state.vq, output_final_state=state is not None,
            cu_seqlens=cu_seqlens, backend=self.backend,
        )  # [B, T, H, E]
        if self.training and T > 0:
            with _quantisation_range():
                self.update_codebook(k, codes)  # after the call used the old codebook
        y = self.out(vq_gate(o.reshape(B, T, self.e), g))  # seed Eqs. 11, 14-15: o * silu(x W_G), W_O
        return y, None if state is None else VQAttentionState(vq_state)

    def _fused_step(self, q, v, state, cu_seqlens) -> bool:
        """Whether this call is a one-token step that :func:`lintime.ops.vq_decode_step_` takes on its kernels: a
        static state, eval mode (no EMA update), no gradient, the fused op's device (CUDA; the CPU only with
        ``backend='triton'``, through Triton's interpreter), and the step's dtype = the state's window buffers'."""
        if not (isinstance(state, VQAttentionState) and state.static and q.shape[1] == 1 and cu_seqlens is None
                and not self.training and self.backend in (None, "triton")
                and (q.is_cuda or self.backend == "triton") and not (torch.is_grad_enabled() and q.requires_grad)):
            return False
        return state.vq.k_hat.dtype == q.dtype and state.vq.v.dtype == v.dtype == q.dtype

    def init_state(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> VQAttentionState:
        return VQAttentionState(VQState.initial(batch_size, self.H, self.S, self.K, self.E, self.L,
                                                dtype=dtype, device=device))

    def extra_repr(self) -> str:
        return (f"K={self.K}, D_v={self.e}, heads={self.H}, codes={self.S}, block_len={self.L}, "
                f"gamma={self.gamma}, rel_bias={self.r_proj is not None}, reduction={self.reduction}")


__all__ = ["VQAttention", "VQAttentionState"]
