"""Packing: document isolation, cu_seqlens, every token once per epoch (over ranks), exact resume."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
import torch

from lintime.data import IGNORE_INDEX, Batch, BatchIterator, DataError, PackedRows, collate

T = 32  # shorter than many documents (1..300 bytes), so documents are split across rows


def _doc_stream(ds, tok, d: int) -> list[int]:
    return [tok.bos_id] + ds[d].tolist() + [tok.eos_id]


def _check_segments(batch: Batch) -> None:
    B, T_ = batch.input_ids.shape
    cu = batch.cu_seqlens
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == B * T_
    assert bool((cu[1:] > cu[:-1]).all())
    assert set(range(0, B * T_, T_)) <= set(cu.tolist())  # every row starts a segment
    docs, pos = batch.doc_ids.reshape(-1), batch.position_ids.reshape(-1)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert bool((docs[s:e] == docs[s]).all()), "a segment mixes documents"
        assert pos[s:e].tolist() == list(range(e - s))
        if s % T_:  # a boundary inside a row separates two different documents (or a doc and padding)
            assert docs[s - 1] != docs[s]
    for b in range(B):
        row_cu = batch.row_cu_seqlens(b)
        assert row_cu[0] == 0 and row_cu[-1] == T_ and row_cu.dtype == torch.int32
    # a target is always the next input of the same segment, except at a row's last position
    tgt, inp = batch.targets, batch.input_ids
    inner = tgt[:, :-1] != IGNORE_INDEX
    assert bool((tgt[:, :-1][inner] == inp[:, 1:][inner]).all())
    assert bool((batch.doc_ids[:, 1:][inner] == batch.doc_ids[:, :-1][inner]).all())
    assert bool((tgt[batch.doc_ids < 0] == IGNORE_INDEX).all())


@pytest.mark.parametrize("world_size", [1, 3])
def test_every_token_once_per_epoch_and_no_target_crosses_documents(byte_splits, world_size):
    ds = byte_splits["train"]
    tok = ds.tokenizer
    seen_in, seen_tgt = defaultdict(list), defaultdict(list)  # doc -> [(row, t, token)]
    rows_seen = []
    for rank in range(world_size):
        it = BatchIterator(ds, batch_size=5, context_len=T, seed=7, epochs=1, rank=rank, world_size=world_size)
        batches = list(it)
        assert len(batches) == it.batches_per_epoch
        for batch in batches:
            assert batch.input_ids.shape == (5, T) and batch.input_ids.dtype == torch.int64
            _check_segments(batch)
            for b in range(5):
                row = int(batch.row_ids[b])
                rows_seen.append(row)
                for t in range(T):
                    d = int(batch.doc_ids[b, t])
                    if d >= 0:
                        seen_in[d].append((row, t, int(batch.input_ids[b, t])))
                        seen_tgt[d].append((row, t, int(batch.targets[b, t])))
                    else:
                        assert batch.input_ids[b, t] == tok.pad_id
    n_rows = len(PackedRows(ds, T, seed=7))
    assert sorted(r for r in rows_seen if r >= 0) == list(range(n_rows))  # each row once, over all ranks
    assert set(seen_in) == set(range(len(ds)))
    spanning = 0
    for d in range(len(ds)):
        stream = _doc_stream(ds, tok, d)
        assert [x for *_, x in sorted(seen_in[d])] == stream  # every token once, in order
        assert [x for *_, x in sorted(seen_tgt[d])] == stream[1:] + [IGNORE_INDEX]  # next token of the same doc
        spanning += len({row for row, *_ in seen_in[d]}) > 1
    assert spanning > 5  # long documents were split across rows


def test_resume_equals_uninterrupted(byte_splits):
    ds = byte_splits["train"]
    for objective in ("clm", "mlm"):
        kw = dict(batch_size=3, context_len=T, seed=11, rank=1, world_size=2, objective=objective)
        full = BatchIterator(ds, **kw)
        n = full.batches_per_epoch * 2 + 3  # crosses two epoch boundaries
        stop = full.batches_per_epoch - 1
        ref = [next(full) for _ in range(n)]
        part = BatchIterator(ds, **kw)
        for _ in range(stop):
            next(part)
        state = json.loads(json.dumps(part.state_dict()))  # a checkpoint goes through JSON
        resumed = BatchIterator(ds, **kw)
        resumed.load_state_dict(state)
        for want in ref[stop:]:
            got = next(resumed)
            for field in ("input_ids", "targets", "cu_seqlens", "doc_ids", "position_ids", "row_ids", "epochs"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (objective, field)
        assert int(ref[-1].epochs.max()) == 2


def test_seed_controls_order_and_epochs_differ(byte_splits):
    ds = byte_splits["train"]
    a = next(BatchIterator(ds, batch_size=4, context_len=T, seed=1))
    b = next(BatchIterator(ds, batch_size=4, context_len=T, seed=1))
    c = next(BatchIterator(ds, batch_size=4, context_len=T, seed=2))
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    assert not np.array_equal(PackedRows(ds, T, epoch=0).doc_order, PackedRows(ds, T, epoch=1).doc_order)


def test_unshuffled_single_pass_is_split_order_with_filler_rows(byte_splits):
    ds = byte_splits["validation"]
    tok = ds.tokenizer
    it = BatchIterator(ds, batch_size=4, context_len=T, shuffle=False, epochs=1)
    batches = list(it)
    first = batches[0]
    assert first.row_ids.tolist() == [0, 1, 2, 3]
    assert first.input_ids[0, : 1 + min(len(ds[0]), T - 1)].tolist() == _doc_stream(ds, tok, 0)[: min(len(ds[0]) + 1, T)]
    last = batches[-1]
    n_fill = 4 * len(batches) - len(PackedRows(ds, T, shuffle=False))
    assert (last.row_ids == -1).sum() == n_fill and n_fill < 4
    assert bool((last.targets[last.row_ids == -1] == IGNORE_INDEX).all())
    with pytest.raises(StopIteration):
        next(it)


def test_collate_of_packed_rows_matches_the_iterator(byte_splits):
    ds = byte_splits["train"]
    rows = PackedRows(ds, T, seed=5)
    got = collate([rows[int(r)] for r in rows.order[:6]], tokenizer=ds.tokenizer, context_len=T, seed=5)
    want = next(BatchIterator(ds, batch_size=6, context_len=T, seed=5))
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.targets, want.targets)
    assert torch.equal(got.cu_seqlens, want.cu_seqlens) and torch.equal(got.doc_ids, want.doc_ids)


def test_without_bos_eos_the_stream_is_the_bare_documents(byte_splits):
    ds = byte_splits["train"]
    rows = PackedRows(ds, T, shuffle=False, add_bos=False, add_eos=False)
    assert rows.n_stream == ds.n_tokens
    batch = collate([rows[r] for r in range(len(rows))], tokenizer=ds.tokenizer, context_len=T)
    stream = np.asarray(ds.tokens, dtype=np.int64)
    doc_of = np.repeat(np.arange(len(ds)), ds.doc_lengths)
    inputs = batch.input_ids.reshape(-1)[: len(stream)].numpy()
    assert np.array_equal(inputs, stream)
    same = doc_of[1:] == doc_of[:-1]
    want = np.append(np.where(same, stream[1:], IGNORE_INDEX), IGNORE_INDEX)
    assert np.array_equal(batch.targets.reshape(-1)[: len(stream)].numpy(), want)
    assert int((want == IGNORE_INDEX).sum()) == len(ds)  # exactly one target lost per document: its last token


def test_resume_state_from_other_settings_is_refused(byte_splits):
    ds = byte_splits["train"]
    state = BatchIterator(ds, batch_size=2, context_len=T, seed=1).state_dict()
    with pytest.raises(DataError, match="context_len"):
        BatchIterator(ds, batch_size=2, context_len=T * 2, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="world_size"):
        BatchIterator(ds, batch_size=2, context_len=T, seed=1, world_size=2).load_state_dict(state)
    BatchIterator(ds, batch_size=7, context_len=T, seed=1).load_state_dict(state)  # batch size may change


def test_bad_arguments(byte_splits):
    ds = byte_splits["train"]
    with pytest.raises(ValueError):
        BatchIterator(ds, batch_size=0, context_len=T)
    with pytest.raises(ValueError):
        BatchIterator(ds, batch_size=1, context_len=T, rank=2, world_size=2)
    with pytest.raises(ValueError):
        PackedRows(ds, 0)
