"""Transformer-VQ under bf16 autocast, as ``lintime bench model`` and ``lintime train`` run it on a
GPU.  On the H200 (2026-11-22) vq-base decoding failed at its first context with
``index_copy_(): self and source expected to have the same dtype, (self) BFloat16 and (source)
Float``: autocast ran the per-code value sums (an einsum) in bf16, and the chunked form then
copied the fp32 cache of the incoming state into them.  CPU autocast hides this (it promotes
``index_copy`` to the wider dtype; CUDA autocast does not), so these tests make ``index_copy``
as strict as on CUDA and check the sums' dtype and values directly."""

import pytest
import torch

from lintime.ops import vq_attention
from lintime.ops.vq.state import block_sums
from tolerances import EXACT_TOL, assert_close

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


@pytest.fixture
def strict_index_copy(monkeypatch):
    """``Tensor.index_copy`` raising on a dtype mismatch, as it does under CUDA autocast."""
    orig = torch.Tensor.index_copy

    def strict(self, dim, index, source):
        if self.dtype != source.dtype:
            raise RuntimeError(f"index_copy_(): self and source expected to have the same dtype, but got "
                               f"(self) {self.dtype} and (source) {source.dtype}")
        return orig(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy", strict)


def test_block_sums_keep_the_value_dtype_under_autocast():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 5, (2, 16, 3), generator=g)
    v = torch.randn(2, 16, 3, 7, generator=g)
    valid = torch.rand(2, 16, generator=g) > 0.2
    ref_c, ref_s = block_sums(codes, v, valid, 5)
    with torch.autocast(**BF16):
        c, s = block_sums(codes, v, valid, 5)
    assert c.dtype == s.dtype == torch.float32
    assert_close("count", ref_c, c, EXACT_TOL[torch.float32])
    assert_close("sum", ref_s, s, EXACT_TOL[torch.float32])


def _inputs(T, H=2, K=8, V=6, S=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=g)
    codebook = torch.randn(H, S, K, generator=g)
    codes = torch.randint(0, S, (1, T, H), generator=g)
    k_hat = torch.stack([codebook[h][codes[..., h]] for h in range(H)], 2)
    v = torch.randn(1, T, H, V, generator=g)
    return q, k_hat, codes, v, codebook


def test_chunked_continuation_under_autocast_keeps_an_fp32_cache(strict_index_copy):
    """Two chunked calls (the second continues the first's state: the path that failed) and a
    decoding step under bf16 autocast: no dtype clash, the cache stays fp32 and equals the cache
    without autocast (it depends only on the codes and the fp32 values)."""
    L = 4
    q, k_hat, codes, v, cb = _inputs(24)
    with torch.autocast(**BF16):
        _, st = vq_attention(q[:, :13], k_hat[:, :13], codes[:, :13], v[:, :13], cb, block_len=L,
                             output_final_state=True, backend="chunk")
        _, st = vq_attention(q[:, 13:23], k_hat[:, 13:23], codes[:, 13:23], v[:, 13:23], cb, block_len=L,
                             initial_state=st, output_final_state=True, backend="chunk")
        _, st = vq_attention(q[:, 23:], k_hat[:, 23:], codes[:, 23:], v[:, 23:], cb, block_len=L,
                             initial_state=st, output_final_state=True, backend="recurrent")
    _, ref = vq_attention(q, k_hat, codes, v, cb, block_len=L, output_final_state=True, backend="chunk")
    assert st.cache_mean.dtype == st.cache_count.dtype == torch.float32
    assert_close("cache_count", ref.cache_count, st.cache_count, EXACT_TOL[torch.float32])
    assert_close("cache_mean", ref.cache_mean, st.cache_mean, EXACT_TOL[torch.float32])


def test_model_prefill_and_decode_under_autocast(strict_index_copy):
    """The bench's sequence on vq-tiny: chunked prefill, a decoding step, a second prefill that
    continues the state (``lintime bench model``'s next context)."""
    from lintime.generation import decode_one_token, prefill
    from lintime.models import CausalLM, get_preset

    torch.manual_seed(0)
    cfg = get_preset("vq-tiny")
    model = CausalLM(cfg).eval()
    L = cfg.mixer.block_len
    ids = torch.randint(0, cfg.vocab_size, (1, 2 * L + 3))
    with torch.no_grad(), torch.autocast(**BF16):
        _, st = prefill(model, ids, None, chunk_size=L)
        logits, st = decode_one_token(model, ids[:, 0], st)
        _, st = prefill(model, ids, st, chunk_size=L)
    assert torch.isfinite(logits.float()).all()
