"""MLM masking: BERT's 15 % / 80-10-10 rates within statistical bounds, seeding, special tokens."""

from __future__ import annotations

import math

import pytest
import torch

from lintime.data import IGNORE_INDEX, BatchIterator, ByteTokenizer, mask_tokens

TOK = ByteTokenizer()


def _within(count: int, n: int, p: float, z: float = 6.0) -> bool:
    # a binomial count is within z standard deviations of n*p (z=6: a chance failure is < 1e-8)
    return abs(count - n * p) <= z * math.sqrt(n * p * (1 - p))


def _mask(ids, seed, **kw):
    return mask_tokens(
        ids, mask_id=TOK.mask_id, vocab_size=TOK.vocab_size, special_ids=TOK.special_ids,
        generator=torch.Generator().manual_seed(seed), **kw,
    )


def test_rates_are_15_percent_and_80_10_10():
    n = 400_000
    ids = torch.randint(0, 256, (4, n // 4), generator=torch.Generator().manual_seed(0))
    out, tgt = _mask(ids, seed=1)
    sel = tgt != IGNORE_INDEX
    n_sel = int(sel.sum())
    assert _within(n_sel, n, 0.15)
    assert torch.equal(tgt[sel], ids[sel])  # targets are the originals at selected positions
    assert torch.equal(out[~sel], ids[~sel])  # nothing else changes
    masked = int((out[sel] == TOK.mask_id).sum())
    same = int((out[sel] == ids[sel]).sum())
    random = n_sel - masked - same
    # a random replacement equals the original with probability 1/256
    assert _within(masked, n_sel, 0.8)
    assert _within(same, n_sel, 0.1 + 0.1 / 256)
    assert _within(random, n_sel, 0.1 * 255 / 256)
    assert int(out.max()) < 256 or bool((out[out >= 256] == TOK.mask_id).all())  # random ids are never specials


def test_seeded_and_special_tokens_never_masked():
    ids = torch.randint(0, 260, (8, 512), generator=torch.Generator().manual_seed(3))
    keep = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)) < 0.5
    a, ta = _mask(ids, seed=5, maskable=keep)
    b, tb = _mask(ids, seed=5, maskable=keep)
    c, tc = _mask(ids, seed=6, maskable=keep)
    assert torch.equal(a, b) and torch.equal(ta, tb)
    assert not torch.equal(ta, tc)
    special = ids >= 256
    assert bool((ta[special | ~keep] == IGNORE_INDEX).all())
    assert torch.equal(a[special], ids[special])
    assert _within(int((ta != IGNORE_INDEX).sum()), int((~special & keep).sum()), 0.15)


def test_mask_prob_bounds():
    with pytest.raises(ValueError):
        _mask(torch.zeros(3, dtype=torch.long), seed=0, mask_prob=1.5)


def test_mlm_batches_corrupt_only_document_tokens(byte_splits):
    ds = byte_splits["train"]
    kw = dict(batch_size=8, context_len=64, seed=2)
    clm = next(BatchIterator(ds, objective="clm", **kw))
    mlm = next(BatchIterator(ds, objective="mlm", **kw))
    assert torch.equal(mlm.cu_seqlens, clm.cu_seqlens) and torch.equal(mlm.doc_ids, clm.doc_ids)
    sel = mlm.targets != IGNORE_INDEX
    assert sel.any()
    assert torch.equal(mlm.targets[sel], clm.input_ids[sel])  # targets are the uncorrupted tokens
    assert torch.equal(mlm.input_ids[~sel], clm.input_ids[~sel])
    assert bool((clm.input_ids[sel] < 256).all())  # never bos/eos/pad
    assert not bool(sel[clm.doc_ids < 0].any())


def test_mlm_masks_a_row_the_same_in_any_batch(byte_splits):
    ds = byte_splits["train"]
    big = next(BatchIterator(ds, objective="mlm", batch_size=4, context_len=64, seed=9))
    small = BatchIterator(ds, objective="mlm", batch_size=2, context_len=64, seed=9)
    halves = [next(small), next(small)]
    assert torch.equal(big.input_ids, torch.cat([h.input_ids for h in halves]))
    assert torch.equal(big.targets, torch.cat([h.targets for h in halves]))
