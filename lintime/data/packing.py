"""Document packing: fixed-length rows, isolated documents, a resumable batch iterator.

Notation: ``B`` rows per batch, ``T`` = ``context_len`` tokens per row, ``W`` tokens read per
row (``T + 1`` for the causal objective, whose targets are the inputs shifted by one; ``T`` for
MLM).

One epoch (:class:`PackedRows`):

1. every document becomes ``[bos] + tokens + [eos]`` (each optional);
2. documents are put in a seeded random order (``shuffle=False``: split order) and concatenated
   into one *stream* of ``S`` tokens;
3. row ``r`` reads stream positions ``[r*T, r*T + W)``, for ``r < ceil(S / T)``; so each stream
   token is an input exactly once, long documents continue in the next row, and positions past
   the end of the stream are ``pad``;
4. the rows are visited in a second seeded order; with ``world_size`` ranks, rank ``k`` takes
   visiting positions ``k, k + world_size, ...``, and ranks that come up short get empty rows
   (all padding, no targets) so every rank sees the same number of rows.

A batch (:class:`Batch`) never lets a document see another one: the ``[B, T]`` rows are cut
into *segments* -- maximal runs of one document's tokens, plus one segment for a row's padding
-- and ``cu_seqlens`` lists the segment boundaries over the flattened ``B*T`` tokens (every row
start is a boundary), which is what the ops take with the packed ``[1, B*T]`` layout;
:meth:`Batch.row_cu_seqlens` gives the per-row form.  A causal target is the next token *of
the same document*: the last token of a document (its ``eos``) and padding get ``-100``.

The iterator (:class:`BatchIterator`) walks rows in order across epochs (a batch may hold the
last rows of one epoch and the first of the next); its position is ``{"epoch", "index"}`` and
the row order is a pure function of ``(seed, epoch)``, so a run restarted from
``state_dict()`` sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterator, Literal, NamedTuple, Sequence

import numpy as np
import torch

from .cache import TokenDataset, identity_digest
from .errors import DataError
from .mlm import IGNORE_INDEX, corrupt
from .tokenizer import Tokenizer

Objective = Literal["clm", "mlm"]
STATE_VERSION = 1


@dataclass
class Batch:
    """One training batch; ``N`` is the number of segments (documents or their pieces, and padding)."""

    input_ids: torch.Tensor  # [B, T] int64
    targets: torch.Tensor  # [B, T] int64; IGNORE_INDEX (-100) where nothing is predicted
    cu_seqlens: torch.Tensor  # [N + 1] int32; segment starts over the flattened B*T tokens, then B*T
    doc_ids: torch.Tensor  # [B, T] int64; document index in the split, -1 for padding
    position_ids: torch.Tensor  # [B, T] int64; position inside the token's segment
    row_ids: torch.Tensor  # [B] int64; row index in its epoch (stream order), -1 for an empty row
    epochs: torch.Tensor  # [B] int64; epoch of each row

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[B, T]`` bool, true where there is a target."""
        return self.targets != IGNORE_INDEX

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def row_cu_seqlens(self, b: int) -> torch.Tensor:
        """``cu_seqlens`` of row ``b`` alone (int32, starts at 0, ends at ``T``), for the ``[B, T]`` + per-row form."""
        T = self.input_ids.shape[1]
        cu = self.cu_seqlens.long()
        inside = cu[(cu >= b * T) & (cu <= (b + 1) * T)]
        return (inside - b * T).to(torch.int32)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})


class PackedRow(NamedTuple):
    """One row as read from the stream: ``W`` tokens and their document ids (-1 = padding)."""

    tokens: np.ndarray  # [W] int64
    doc_ids: np.ndarray  # [W] int64
    row: int  # row index in the epoch, -1 for an empty row
    epoch: int


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, stream]))


class PackedRows:
    """The rows of one epoch (see the module docstring); a map-style dataset of :class:`PackedRow`.

    ``rows[r]`` is row ``r`` in stream order; ``rows.order`` is the epoch's visiting order
    (a permutation of ``range(len(rows))``, the identity when ``shuffle=False``).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        context_len: int,
        *,
        tokenizer: Tokenizer | None = None,
        objective: Objective = "clm",
        epoch: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        add_bos: bool = True,
        add_eos: bool = True,
    ):
        if context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {context_len}")
        if objective not in ("clm", "mlm"):
            raise ValueError(f"objective must be 'clm' or 'mlm', got {objective!r}")
        tok = tokenizer if tokenizer is not None else dataset.tokenizer
        if tok is None:
            raise ValueError("the dataset carries no tokenizer; pass tokenizer=")
        if len(dataset) == 0:
            raise DataError(f"split {dataset.split!r} has no documents to pack")
        self.dataset, self.tokenizer = dataset, tok
        self.context_len, self.objective, self.epoch = context_len, objective, epoch
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
        self.window = context_len + (objective == "clm")

        self._content_len = dataset.doc_lengths  # [n_docs]
        lengths = self._content_len + self.add_bos + self.add_eos
        n_docs = len(dataset)
        self.doc_order = _rng(seed, epoch, 0).permutation(n_docs) if shuffle else np.arange(n_docs)
        self._starts = np.concatenate([[0], np.cumsum(lengths[self.doc_order])])  # [n_docs + 1] stream offsets
        self.n_stream = int(self._starts[-1])
        self.n_rows = math.ceil(self.n_stream / context_len)
        self.order = _rng(seed, epoch, 1).permutation(self.n_rows) if shuffle else np.arange(self.n_rows)

    def __len__(self) -> int:
        return self.n_rows

    def __getitem__(self, r: int) -> PackedRow:
        if not 0 <= r < self.n_rows:
            raise IndexError(f"row {r} out of range for {self.n_rows} rows")
        tokens, doc_ids = self.gather(np.array([r]))
        return PackedRow(tokens[0], doc_ids[0], r, self.epoch)

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and document ids of ``rows`` (stream order; -1 = empty row): two ``[n, W]`` int64 arrays."""
        rows = np.asarray(rows, dtype=np.int64)
        pos = rows[:, None] * self.context_len + np.arange(self.window)  # [n, W] stream positions
        valid = (rows[:, None] >= 0) & (pos < self.n_stream)
        p = np.clip(np.searchsorted(self._starts, pos, side="right") - 1, 0, len(self.doc_order) - 1)
        doc = self.doc_order[p]
        local = pos - self._starts[p]  # position inside [bos] + tokens + [eos]
        idx = local - self.add_bos  # position inside the stored tokens
        ds = self.dataset
        flat = np.clip(ds.offsets[doc] + idx, 0, max(ds.n_tokens - 1, 0))
        tokens = np.asarray(ds.tokens[flat], dtype=np.int64)
        if self.add_bos:
            tokens = np.where(local == 0, self.tokenizer.bos_id, tokens)
        if self.add_eos:
            tokens = np.where(idx == self._content_len[doc], self.tokenizer.eos_id, tokens)
        tokens = np.where(valid, tokens, self.tokenizer.pad_id)
        doc_ids = np.where(valid, doc, -1)
        return tokens, doc_ids


def collate(
    rows: Sequence[PackedRow],
    *,
    tokenizer: Tokenizer,
    context_len: int,
    objective: Objective = "clm",
    seed: int = 0,
    mlm_prob: float = 0.15,
) -> Batch:
    """Stack rows from :class:`PackedRows` into a :class:`Batch` (usable as a DataLoader ``collate_fn``)."""
    return _collate(
        np.stack([r.tokens for r in rows]),
        np.stack([r.doc_ids for r in rows]),
        np.array([r.row for r in rows], dtype=np.int64),
        np.array([r.epoch for r in rows], dtype=np.int64),
        tokenizer=tokenizer,
        context_len=context_len,
        objective=objective,
        seed=seed,
        mlm_prob=mlm_prob,
    )


def _collate(
    tokens: np.ndarray,  # [B, W]
    doc_ids: np.ndarray,  # [B, W]
    row_ids: np.ndarray,  # [B]
    epochs: np.ndarray,  # [B]
    *,
    tokenizer: Tokenizer,
    context_len: int,
    objective: Objective,
    seed: int,
    mlm_prob: float,
) -> Batch:
    B, T = tokens.shape[0], context_len
    inputs, in_docs = tokens[:, :T], doc_ids[:, :T]  # [B, T]
    if objective == "clm":
        same_doc = (doc_ids[:, 1 : T + 1] == in_docs) & (in_docs >= 0)
        targets = torch.from_numpy(np.where(same_doc, tokens[:, 1 : T + 1], IGNORE_INDEX))
        input_ids = torch.from_numpy(np.ascontiguousarray(inputs))
    else:
        input_ids, targets = _mlm_rows(inputs, in_docs, row_ids, epochs, tokenizer, seed, mlm_prob)

    # segments: a new one wherever the document id changes, and at every row start
    t = np.arange(T)
    starts = np.ones((B, T), dtype=bool)
    starts[:, 1:] = in_docs[:, 1:] != in_docs[:, :-1]
    seg_start = np.maximum.accumulate(np.where(starts, t, 0), axis=1)  # [B, T]
    cu = np.concatenate([np.flatnonzero(starts.reshape(-1)), [B * T]]).astype(np.int32)
    return Batch(
        input_ids=input_ids,
        targets=targets,
        cu_seqlens=torch.from_numpy(cu),
        doc_ids=torch.from_numpy(np.ascontiguousarray(in_docs)),
        position_ids=torch.from_numpy(t - seg_start),
        row_ids=torch.from_numpy(row_ids.copy()),
        epochs=torch.from_numpy(epochs.copy()),
    )


def _mlm_rows(inputs, in_docs, row_ids, epochs, tokenizer, seed, mlm_prob) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.from_numpy(np.ascontiguousarray(inputs))  # [B, T]
    # Randomness keyed by (seed, epoch, row): the same row is masked the same way on any rank,
    # at any position of any batch, before or after a resume.
    uniforms = torch.empty((3,) + tuple(ids.shape))
    for b in range(ids.shape[0]):
        row_seed = int(np.random.SeedSequence([seed, int(epochs[b]), int(row_ids[b]) + 1, 2]).generate_state(1, np.uint64)[0])
        uniforms[:, b] = torch.rand((3, ids.shape[1]), generator=torch.Generator().manual_seed(row_seed))
    return corrupt(
        ids,
        uniforms,
        mask_id=tokenizer.mask_id,
        vocab_size=tokenizer.vocab_size,
        special_ids=tokenizer.special_ids,
        mask_prob=mlm_prob,
        maskable=torch.from_numpy(in_docs >= 0),
    )


class BatchIterator:
    """Endless (or ``epochs``-long) iterator of :class:`Batch` es of ``batch_size`` rows of ``context_len`` tokens.

    Args:
        dataset: a prepared split.
        batch_size: rows per batch (``B``) on this rank.
        context_len: tokens per row (``T``).
        tokenizer: defaults to ``dataset.tokenizer``.
        objective: ``"clm"`` (next-token targets) or ``"mlm"`` (BERT masking, :func:`mask_tokens`).
        seed: seeds the document order, the row order and the MLM masks.
        shuffle: False visits documents and rows in split order (evaluation).
        epochs: stop after this many epochs (the last batch is filled with empty rows); None = forever.
        rank, world_size: data-parallel sharding of the rows (each row used once per epoch over all ranks).
        add_bos, add_eos: wrap each document in bos/eos.
        mlm_prob: selection probability for MLM.

    ``state_dict()`` / ``load_state_dict()`` save and restore the position (a small dict).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        *,
        batch_size: int,
        context_len: int,
        tokenizer: Tokenizer | None = None,
        objective: Objective = "clm",
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        add_bos: bool = True,
        add_eos: bool = True,
        mlm_prob: float = 0.15,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {epochs}")
        self.dataset = dataset
        self.tokenizer = tokenizer if tokenizer is not None else dataset.tokenizer
        self.batch_size, self.context_len = batch_size, context_len
        self.objective, self.seed, self.shuffle, self.epochs = objective, seed, shuffle, epochs
        self.rank, self.world_size = rank, world_size
        self.add_bos, self.add_eos, self.mlm_prob = add_bos, add_eos, mlm_prob
        self._layouts: dict[int, PackedRows] = {}
        first = self._layout(0)
        self.rows_per_epoch = math.ceil(first.n_rows / world_size)  # per rank
        self.epoch, self.index = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        """Batches per epoch on this rank (the last may straddle into the next epoch)."""
        return math.ceil(self.rows_per_epoch / self.batch_size)

    def _layout(self, epoch: int) -> PackedRows:
        if epoch not in self._layouts:
            if len(self._layouts) >= 2:
                self._layouts.pop(min(self._layouts))
            self._layouts[epoch] = PackedRows(
                self.dataset,
                self.context_len,
                tokenizer=self.tokenizer,
                objective=self.objective,
                epoch=epoch,
                seed=self.seed,
                shuffle=self.shuffle,
                add_bos=self.add_bos,
                add_eos=self.add_eos,
            )
        return self._layouts[epoch]

    def _rank_rows(self, epoch: int, index: np.ndarray) -> np.ndarray:
        layout = self._layout(epoch)
        visit = self.rank + index * self.world_size  # positions in the epoch's visiting order
        return np.where(visit < layout.n_rows, layout.order[np.minimum(visit, layout.n_rows - 1)], -1)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        toks, docs, rows, eps = [], [], [], []
        n = 0
        while n < self.batch_size:
            if self.index == self.rows_per_epoch:
                self.epoch, self.index = self.epoch + 1, 0
                if self.epochs is not None and self.epoch >= self.epochs:
                    break
            take = min(self.batch_size - n, self.rows_per_epoch - self.index)
            r = self._rank_rows(self.epoch, self.index + np.arange(take))
            t, d = self._layout(self.epoch).gather(r)
            toks.append(t), docs.append(d), rows.append(r), eps.append(np.full(take, self.epoch))
            self.index += take
            n += take
        if n < self.batch_size:  # end of the last epoch: fill with empty rows
            fill = self.batch_size - n
            t, d = self._layout(self.epoch - 1).gather(np.full(fill, -1))
            toks.append(t), docs.append(d), rows.append(np.full(fill, -1)), eps.append(np.full(fill, self.epoch - 1))
        if self.index == self.rows_per_epoch:  # normalise, so a finished last epoch stops the next call
            self.epoch, self.index = self.epoch + 1, 0
        return _collate(
            np.concatenate(toks),
            np.concatenate(docs),
            np.concatenate(rows).astype(np.int64),
            np.concatenate(eps).astype(np.int64),
            tokenizer=self.tokenizer,
            context_len=self.context_len,
            objective=self.objective,
            seed=self.seed,
            mlm_prob=self.mlm_prob,
        )

    # ------------------------------------------------------------------------------------------
    # resume

    def _fingerprint(self) -> dict:
        return {
            "data": identity_digest(self.dataset.manifest["identity"]).hex()[:16],
            "n_tokens": self.dataset.n_tokens,
            "context_len": self.context_len,
            "objective": self.objective,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "world_size": self.world_size,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
        }

    def state_dict(self) -> dict:
        """Position of the iterator: ``{"version", "epoch", "index", "fingerprint"}`` (JSON-serialisable)."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "index": self.index, "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict, reshard: bool = False) -> None:
        """Continue from ``state``; raises :class:`DataError` if it belongs to other data or settings.

        ``reshard=True`` also accepts a state saved with another ``world_size`` (a run resumed on
        another number of processes): the ranks had visited ``index * old_world_size`` positions
        of the epoch's visiting order, which become ``index = visited / world_size`` here (they
        must divide evenly, as they do when the global batch is a multiple of both world sizes
        and the epoch has not been wrapped mid-batch; else :class:`DataError`)."""
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data iterator state version {state.get('version')!r} is not {STATE_VERSION}")
        mine, theirs = self._fingerprint(), state.get("fingerprint", {})
        old_ws = theirs.get("world_size")
        if reshard and isinstance(old_ws, int) and old_ws >= 1 and old_ws != self.world_size:
            visited = int(state["index"]) * old_ws
            if visited % self.world_size:
                raise DataError(f"cannot resume the data iterator on {self.world_size} processes: "
                                f"{visited} rows of epoch {state['epoch']} were read by {old_ws} processes")
            # past the end of the epoch (padding visits of the old layout): the epoch is done
            index = min(visited // self.world_size, self.rows_per_epoch)
            state = dict(state, index=index, fingerprint=dict(theirs, world_size=self.world_size))
            theirs = state["fingerprint"]
        diff = [k for k in mine if mine[k] != theirs.get(k)]
        if diff:
            detail = ", ".join(f"{k}: saved {theirs.get(k)!r}, now {mine[k]!r}" for k in diff)
            raise DataError(f"cannot resume the data iterator: it was saved for other data or settings ({detail})")
        if not (0 <= state["index"] <= self.rows_per_epoch and state["epoch"] >= 0):
            raise DataError(f"data iterator state out of range: {state}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
