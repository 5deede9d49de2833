"""The token cache: one memory-mapped file plus one JSON manifest per split.

Layout of a cache folder (``prepare`` writes it, :func:`open_prepared` reads it)::

    <cache_dir>/train.bin         header + tokens + document offsets
    <cache_dir>/train.json        manifest (human-readable; decides reuse)
    <cache_dir>/validation.bin / .json, test.bin / .json
    <cache_dir>/tokenizer-bpe<N>-<hash>/    a BPE trained on this corpus (``get_tokenizer("bpe:N")``)

``<split>.bin`` (all integers little-endian)::

    offset 0   64-byte header: struct "<8sIIQQ32s"
               magic b"LTTOKENS", format version (uint32, = 1), token itemsize (uint32: 1, 2 or 4),
               n_docs (uint64), n_tokens (uint64), sha256 of the manifest's "identity" (32 bytes)
    offset 64  tokens: n_tokens ids, uint8 (byte tokenizer) / uint16 (vocab <= 65536) / uint32;
               documents back to back, no separators (bos/eos are added at packing time)
    offset 64 + round_up(n_tokens * itemsize, 8)
               document offsets: int64[n_docs + 1]; document i is tokens[offsets[i]:offsets[i+1]]

The manifest's ``identity`` (format version, split, source hash and its mode, tokenizer name,
split rule, text field) says what the tokens were made from.  A split is reused only when the
stored identity equals the one asked for *and* the ``.bin`` header carries the same identity
digest and the expected size; anything else rebuilds it.  Each file is written atomically
(temporary file in the same folder, flush + fsync, rename, fsync of the folder), the ``.bin``
first: a crash leaves either the old pair, or a new ``.bin`` whose digest does not match the
old manifest (so it is rebuilt) -- never a half-written file under a final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import IO

import numpy as np

from .errors import DataError
from .tokenizer import Tokenizer

FORMAT_VERSION = 1
MAGIC = b"LTTOKENS"
HEADER = struct.Struct("<8sIIQQ32s")
HEADER_SIZE = 64
assert HEADER.size == HEADER_SIZE
_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}


def identity_digest(identity: dict) -> bytes:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).digest()


def _tokens_nbytes(n_tokens: int, itemsize: int) -> int:
    return (n_tokens * itemsize + 7) // 8 * 8


def expected_size(n_docs: int, n_tokens: int, itemsize: int) -> int:
    return HEADER_SIZE + _tokens_nbytes(n_tokens, itemsize) + 8 * (n_docs + 1)


class SplitWriter:
    """Streams one split's documents into an open (temporary) ``.bin`` file."""

    def __init__(self, f: IO[bytes], dtype: np.dtype, identity: dict):
        self.f = f
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype.itemsize not in _DTYPES:
            raise ValueError(f"unsupported token dtype {dtype}")
        self.digest = identity_digest(identity)
        self.offsets = [0]
        f.write(b"\0" * HEADER_SIZE)  # placeholder, rewritten by finish()

    def add(self, tokens: np.ndarray) -> None:
        arr = np.ascontiguousarray(tokens, dtype=self.dtype)
        self.f.write(memoryview(arr).cast("B"))
        self.offsets.append(self.offsets[-1] + len(arr))

    def finish(self) -> tuple[int, int]:
        n_docs, n_tokens = len(self.offsets) - 1, self.offsets[-1]
        itemsize = self.dtype.itemsize
        self.f.write(b"\0" * (_tokens_nbytes(n_tokens, itemsize) - n_tokens * itemsize))
        self.f.write(np.asarray(self.offsets, dtype="<i8").tobytes())
        self.f.seek(0)
        self.f.write(HEADER.pack(MAGIC, FORMAT_VERSION, itemsize, n_docs, n_tokens, self.digest))
        return n_docs, n_tokens


def read_header(path: Path) -> dict | None:
    """The ``.bin`` header as a dict, or None if the file is missing or not a lintime token file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(raw) != HEADER_SIZE:
        return None
    magic, version, itemsize, n_docs, n_tokens, digest = HEADER.unpack(raw)
    if magic != MAGIC or version != FORMAT_VERSION or itemsize not in _DTYPES:
        return None
    return {"itemsize": itemsize, "n_docs": n_docs, "n_tokens": n_tokens, "digest": digest, "size": size}


def read_manifest(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def consistent(bin_path: Path, manifest: dict | None) -> bool:
    """True when ``bin_path`` is complete and was written for ``manifest``."""
    if manifest is None or manifest.get("format_version") != FORMAT_VERSION:
        return False
    head = read_header(bin_path)
    return (
        head is not None
        and head["digest"] == identity_digest(manifest["identity"])
        and head["n_docs"] == manifest["n_docs"]
        and head["n_tokens"] == manifest["n_tokens"]
        and head["size"] == expected_size(head["n_docs"], head["n_tokens"], head["itemsize"])
    )


class TokenDataset:
    """One prepared split: memory-mapped tokens and document offsets, plus its manifest.

    ``dataset[i]`` is document ``i`` (a 1-D numpy view, dtype uint8/uint16/uint32);
    ``len(dataset)`` is the number of documents.  ``tokenizer`` is the tokenizer the split was
    made with when known (``prepare`` sets it).  ``reused`` tells whether ``prepare`` found it
    in the cache.
    """

    def __init__(self, path: str | os.PathLike, manifest: dict, tokenizer: Tokenizer | None = None, *, reused: bool = False):
        self.path = Path(path)
        if not consistent(self.path, manifest):
            raise DataError(f"token file {self.path} is missing, incomplete or does not match its manifest; prepare it again")
        head = read_header(self.path)
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.reused = reused
        self.split: str = manifest["identity"]["split"]
        self.n_docs: int = head["n_docs"]
        self.n_tokens: int = head["n_tokens"]
        self.n_bytes: int = manifest["n_bytes"]
        dtype = _DTYPES[head["itemsize"]]
        if self.n_tokens:
            self.tokens = np.memmap(self.path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(self.n_tokens,))
        else:
            self.tokens = np.zeros(0, dtype=dtype)
        off_at = HEADER_SIZE + _tokens_nbytes(self.n_tokens, head["itemsize"])
        self.offsets = np.array(np.memmap(self.path, dtype="<i8", mode="r", offset=off_at, shape=(self.n_docs + 1,)))

    def __len__(self) -> int:
        return self.n_docs

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.n_docs <= i < self.n_docs:
            raise IndexError(f"document {i} out of range for {self.n_docs} documents")
        i %= self.n_docs
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def doc_lengths(self) -> np.ndarray:
        """Tokens per document, int64 ``[n_docs]``."""
        return np.diff(self.offsets)

    def __repr__(self) -> str:
        return f"TokenDataset(split={self.split!r}, docs={self.n_docs}, tokens={self.n_tokens}, path={str(self.path)!r})"


def split_paths(cache_dir: str | os.PathLike, split: str) -> tuple[Path, Path]:
    cache_dir = Path(cache_dir)
    return cache_dir / f"{split}.bin", cache_dir / f"{split}.json"


def open_prepared(cache_dir: str | os.PathLike, split: str, tokenizer: Tokenizer | None = None) -> TokenDataset:
    """Open a split that ``prepare`` wrote, without looking at the corpus (e.g. for evaluation)."""
    bin_path, man_path = split_paths(cache_dir, split)
    manifest = read_manifest(man_path)
    if manifest is None:
        raise DataError(f"no prepared split {split!r} in {cache_dir} (missing {man_path.name}); prepare the data first")
    if tokenizer is not None and tokenizer.name != manifest["identity"]["tokenizer"]:
        raise DataError(
            f"split {split!r} in {cache_dir} was made with tokenizer {manifest['identity']['tokenizer']!r}, not {tokenizer.name!r}"
        )
    return TokenDataset(bin_path, manifest, tokenizer)
