"""Data: tokenizers, corpora, the token cache, document packing and MLM masking.

Typical use (the ``lintime data`` subcommand maps to :func:`prepare`)::

    from lintime.data import prepare, BatchIterator
    splits = prepare("stdlib", "byte", "runs/cache/stdlib-byte")
    it = BatchIterator(splits["train"], batch_size=8, context_len=512, seed=0)
    batch = next(it)        # Batch: input_ids/targets/doc_ids/position_ids [B, T], cu_seqlens [N+1]
    state = it.state_dict() # save with the checkpoint; it.load_state_dict(state) resumes exactly

See ``docs/data.md`` for the corpus, split, cache and packing rules.
"""

from __future__ import annotations

from lintime.utils.io import atomic_write

from .cache import FORMAT_VERSION, TokenDataset, open_prepared
from .corpus import SPLITS, Corpus, Document, SkipStats, open_corpus, split_of, stdlib_root
from .errors import DataError, EmptySplitError, MissingDependencyError
from .mlm import IGNORE_INDEX, mask_tokens
from .packing import Batch, BatchIterator, PackedRow, PackedRows, collate
from .build import default_cache_dir, prepare
from .tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, get_tokenizer, load_tokenizer

__all__ = [
    "FORMAT_VERSION",
    "IGNORE_INDEX",
    "SPLITS",
    "BPETokenizer",
    "Batch",
    "BatchIterator",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "EmptySplitError",
    "Document",
    "MissingDependencyError",
    "PackedRow",
    "PackedRows",
    "SkipStats",
    "TokenDataset",
    "Tokenizer",
    "atomic_write",
    "collate",
    "default_cache_dir",
    "get_tokenizer",
    "load_tokenizer",
    "mask_tokens",
    "open_corpus",
    "open_prepared",
    "prepare",
    "split_of",
    "stdlib_root",
]
