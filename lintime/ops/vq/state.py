"""The Transformer-VQ decoding state and the cache arithmetic shared by every form.

The compressed cache (seed Remark 3.9) keeps, per head and per code ``s``, the number of keys
``count_s`` older than the attention window that were quantised to ``s`` and the running mean
``mean_s`` of their values.  Attending to it is attending to ``count_s`` copies of the key
``codebook[s]`` with value ``mean_s``: the score of code ``s`` is ``q . codebook[s] + log(count_s)``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from lintime.ops.utils import acc_dtype


@dataclass
class VQState:
    """Where a sequence stands after ``pos`` tokens, for ``N`` sequences.

    Canonical form (the only one the ops produce and accept): with ``n = pos // L`` the block of
    the next token,

    * the cache holds every key of blocks ``<= n - 2`` (positions ``< (n - 1) * L``):
      ``cache_mean`` ``[N, H, S, V]`` running mean of their values per code and
      ``cache_count`` ``[N, H, S]`` their number per code (both fp32; fp64 for fp64 inputs);
    * the window buffers hold the previous block ``n - 1`` in slots ``[0, L)`` and the first
      ``pos % L`` tokens of the current block ``n`` in slots ``[L, L + pos % L)``; unused slots
      (and the previous block while ``n == 0``) are zero:
      ``k_hat`` ``[N, 2L, H, K]`` and ``v`` ``[N, 2L, H, V]`` (the input dtype),
      ``codes`` ``[N, 2L, H]`` (int64);
    * ``pos`` ``[N]`` (int64) tokens seen, so block boundaries continue across calls.

    Slot ``r`` of the buffers is the key that bias column ``r`` of the next query of block ``n``
    addresses.  Memory is O(1) in the sequence length.  Queries and biases are not stored.
    """

    cache_mean: torch.Tensor
    cache_count: torch.Tensor
    k_hat: torch.Tensor
    v: torch.Tensor
    codes: torch.Tensor
    pos: torch.Tensor

    @property
    def N(self) -> int:
        return self.pos.shape[0]

    @property
    def block_len(self) -> int:
        return self.k_hat.shape[1] // 2

    @classmethod
    def initial(
        cls, N: int, H: int, S_codes: int, K: int, V: int, block_len: int, *,
        dtype: torch.dtype = torch.float32, device=None,
    ) -> VQState:
        """The state before the first token (empty cache and window, ``pos = 0``).  ``dtype`` is
        the buffers' dtype; the cache is fp32 (fp64 when ``dtype`` is fp64)."""
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        L2 = 2 * block_len
        return cls(
            cache_mean=torch.zeros(N, H, S_codes, V, dtype=cdt, device=device),
            cache_count=torch.zeros(N, H, S_codes, dtype=cdt, device=device),
            k_hat=torch.zeros(N, L2, H, K, dtype=dtype, device=device),
            v=torch.zeros(N, L2, H, V, dtype=dtype, device=device),
            codes=torch.zeros(N, L2, H, dtype=torch.long, device=device),
            pos=torch.zeros(N, dtype=torch.long, device=device),
        )

    def live(self) -> torch.Tensor:
        """``[N, 2L]`` bool: the window slots that hold a key."""
        L = self.block_len
        slot = torch.arange(2 * L, device=self.pos.device)
        prev = (self.pos >= L)[:, None]
        return torch.where(slot[None] < L, prev, (slot[None] - L) < (self.pos % L)[:, None])

    def canonical(self) -> VQState:
        """Zero what no form reads: the mean of an empty code and the unused window slots
        (every op returns canonical states; this makes any input state one)."""
        live = self.live()
        z = lambda x, m: torch.where(m, x, torch.zeros_like(x))
        return VQState(
            cache_mean=z(self.cache_mean, (self.cache_count > 0)[..., None]),
            cache_count=self.cache_count,
            k_hat=z(self.k_hat, live[..., None, None]),
            v=z(self.v, live[..., None, None]),
            codes=z(self.codes, live[..., None]),
            pos=self.pos,
        )

    def _map(self, fn_float, fn_int) -> VQState:
        out = {}
        for f in fields(self):
            x = getattr(self, f.name)
            out[f.name] = fn_float(x) if x.is_floating_point() else fn_int(x)
        return VQState(**out)

    def to(self, device=None, dtype: torch.dtype | None = None) -> VQState:
        """Move every field to ``device``; ``dtype`` (if given) converts the floating fields."""
        return self._map(lambda x: x.to(device=device, dtype=dtype), lambda x: x.to(device=device))

    def select(self, index) -> VQState:
        """The states of sequences ``index`` (int, slice, list or index tensor) along ``N``."""
        if isinstance(index, int):
            index = [index]
        if isinstance(index, (list, tuple)):
            index = torch.tensor(index, dtype=torch.long, device=self.pos.device)
        return self._map(lambda x: x[index], lambda x: x[index])

    def detach(self) -> VQState:
        """Cut the autograd graph (truncated backpropagation across calls)."""
        return self._map(lambda x: x.detach(), lambda x: x)


# ----------------------------------------------------------------------------------------------
# cache arithmetic (seed Appendix E, Codes 2-4): (count, mean) pairs merged by weighted means


def _nonzero(c: torch.Tensor) -> torch.Tensor:
    """``c`` where positive, else 1: a denominator that is exact for any count >= 0 (the
    numerators it divides are zero where the count is)."""
    return torch.where(c > 0, c, torch.ones_like(c))


def merge(ca: torch.Tensor, ma: torch.Tensor, cb: torch.Tensor, mb: torch.Tensor):
    """Merge two caches: counts add, means combine weighted by their counts (seed Code 2
    ``scan_func`` / Code 4 ``merge_func``).  ``c*`` ``[..., S]``, ``m*`` ``[..., S, V]``."""
    tot = ca + cb
    d = _nonzero(tot)
    return tot, (ca / d)[..., None] * ma + (cb / d)[..., None] * mb


def block_sums(codes: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, S: int):
    """Per-code count and sum of values of a group of keys (seed Code 2 ``delta1_by_block``,
    ``deltav_by_block``).

    ``codes`` ``[..., L, H]`` (int), ``v`` ``[..., L, H, V]``, ``valid`` ``[..., L]`` (bool).
    Returns ``count [..., H, S]`` and ``sum [..., H, S, V]`` in ``v``'s dtype, also under
    autocast: the callers pass fp32 (the accumulation dtype) and merge these sums into the fp32
    cache, and a bf16 einsum would both round the sums and hand a bf16 tensor to the fp32 cache
    arithmetic (on CUDA, ``index_copy`` of the fp32 initial cache into it then fails).
    """
    delta = F.one_hot(codes, S).to(v.dtype) * valid[..., None, None].to(v.dtype)  # [..., L, H, S]
    with torch.autocast(v.device.type, enabled=False):
        return delta.sum(-3), torch.einsum("...lhs,...lhv->...hsv", delta, v)


def scatter_sums(codes: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, S: int):
    """:func:`block_sums` as scatter-adds: each key's value added to its block's row of its code, O(L * V) work
    per block instead of the one-hot product's O(L * S * V) (vq-base: 1536 against 786k flops per key).
    ``codes`` ``[..., L, H]`` in ``[0, S)``, ``v`` ``[..., L, H, V]`` zero in the slots ``valid`` ``[..., L]`` marks
    empty (as the block layout and a canonical state's window leave them: their values are added as the zeros
    they are, no mask pass; their counts are not); returns ``count [..., H, S]``, ``sum [..., H, S, V]`` in the
    accumulation dtype (fp32 for half ``v``, converted row by row as it is added: no fp32 copy of ``v`` is kept;
    atomic adds on CUDA: the order of a sum's terms is not fixed).  The Triton path's training calls take
    :func:`lintime.ops.vq.triton.scan.block_sums_cuda` instead."""
    *lead, L, H = codes.shape
    V = v.shape[-1]
    G = codes[..., 0, 0].numel()  # groups (blocks)
    grp = torch.arange(G, device=codes.device).view(*lead, 1, 1)
    rows = ((grp * H + torch.arange(H, device=codes.device)) * S + codes).reshape(-1)  # [... * L * H]
    dt = acc_dtype(v)
    ones = valid[..., None].expand(codes.shape).reshape(-1).to(dt)
    cnt = v.new_zeros(G * H * S, dtype=dt).index_add(0, rows, ones)
    sumv = v.new_zeros(G * H * S, V, dtype=dt).index_add(0, rows, v.reshape(-1, V).to(dt))
    return cnt.view(*lead, H, S), sumv.view(*lead, H, S, V)


def block_summary(codes: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, S: int):
    """Per-code count and mean value of a group of keys (seed Code 2 ``delta1_by_block``,
    ``deltav_by_block_normalized``): :func:`scatter_sums` with the sum divided by the count (the
    decoding step forms one every token: O(L * V), not the one-hot product's O(L * S * V)).
    ``v`` need not be zero in the empty slots (they are masked here).

    Returns ``count [..., H, S]`` and ``mean [..., H, S, V]`` in the accumulation dtype of ``v``.
    """
    count, sumv = scatter_sums(codes, v * valid[..., None, None].to(v.dtype), valid, S)
    return count, sumv / _nonzero(count)[..., None]


def log_count(c: torch.Tensor) -> torch.Tensor:
    """``log(count)`` added to a code's score (seed Remark 3.9); ``-inf`` for an empty code."""
    pos = c > 0
    return torch.where(pos, torch.log(_nonzero(c)), torch.full_like(c, float("-inf")))
