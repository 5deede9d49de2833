"""Tokenizers: byte-level (the default) and byte-level BPE.

Both expose the same small interface (:class:`Tokenizer`):

* ``vocab_size`` (including the special tokens), ``pad_id`` / ``bos_id`` / ``eos_id`` / ``mask_id``;
* ``encode(text) -> list[int]`` and ``decode(ids) -> str``; ``decode(encode(s)) == s`` for every
  string (special tokens are never produced by ``encode``: a literal ``"<eos>"`` in the text is
  encoded as ordinary text);
* ``name``: a spec string for manifests that changes whenever the encoding would change
  (``"byte"``; ``"bpe-8192-<12 hex of the tokenizer file's sha256>"``);
* ``bits_per_byte``: True when one token is one byte, so the mean loss per target token in bits
  *is* the bits-per-byte score (byte tokenizer).  For BPE, bits per byte is the summed loss
  divided by the byte count the cache manifest records;
* ``save(directory)`` / ``load_tokenizer(directory)``.

Byte tokenizer ids (``vocab_size == 260``)::

    0..255  the byte values of the UTF-8 encoding
    256     <pad>     257 <bos>     258 <eos>     259 <mask>

The specials sit *after* the bytes so a byte keeps its own value as id, and a cache holds
only byte ids (``uint8``): specials are added at packing time, never stored.

BPE needs the optional package ``tokenizers`` (extra ``bpe``); without it every BPE entry
point raises :class:`~lintime.data.errors.MissingDependencyError`.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Iterable, Sequence

import numpy as np

from lintime.utils.io import atomic_write_json, temp_dir

from .errors import DataError, require

if TYPE_CHECKING:  # pragma: no cover
    from .corpus import Corpus

SPECIAL_ROLES = ("pad", "bos", "eos", "mask")
META_FILE = "lintime_tokenizer.json"


class Tokenizer(abc.ABC):
    """Interface shared by all tokenizers (see the module docstring)."""

    kind: ClassVar[str]
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    mask_id: int
    bits_per_byte: bool

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Spec string for manifests; equal names encode every text identically."""

    @property
    def special_ids(self) -> tuple[int, ...]:
        """``(pad_id, bos_id, eos_id, mask_id)``."""
        return (self.pad_id, self.bos_id, self.eos_id, self.mask_id)

    @property
    def token_dtype(self) -> np.dtype:
        """Smallest unsigned dtype that holds every id ``encode`` can return (used by the cache)."""
        return np.dtype(np.uint16) if self.vocab_size <= 2**16 else np.dtype(np.uint32)

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Encode several texts; one 1-D array of dtype :attr:`token_dtype` per text."""
        return [np.asarray(self.encode(t), dtype=self.token_dtype) for t in texts]

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special ids are dropped."""

    @abc.abstractmethod
    def save(self, directory: str | os.PathLike) -> Path:
        """Write the tokenizer into ``directory`` (created if needed); return the directory."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, specials 256..259 (pad, bos, eos, mask); ``vocab_size`` 260."""

    kind = "byte"
    vocab_size = 260
    pad_id, bos_id, eos_id, mask_id = 256, 257, 258, 259
    bits_per_byte = True

    @property
    def name(self) -> str:
        return "byte"

    @property
    def token_dtype(self) -> np.dtype:
        # encode() only ever returns byte values; the specials above 255 are never stored.
        return np.dtype(np.uint8)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_json(directory / META_FILE, {"kind": self.kind, "format": 1})
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ByteTokenizer":
        return cls()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(self.kind)


# ----------------------------------------------------------------------------------------------
# BPE


# Names under which a folder's tokenizer may already carry a role; the first one found is used,
# and a role with none of them is added as a new special token (the lintime name, first entry).
_ROLE_ALIASES = {
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "bos": ("<bos>", "<s>", "[CLS]", "<|endoftext|>"),
    "eos": ("<eos>", "</s>", "[SEP]", "<|endoftext|>"),
    "mask": ("<mask>", "[MASK]", "<|mask|>"),
}


def _tokenizers():
    return require("tokenizers", "a BPE tokenizer", extra="bpe")


class BPETokenizer(Tokenizer):
    """Byte-level BPE backed by HF ``tokenizers`` (optional dependency, extra ``bpe``).

    Build one with :meth:`train` (on an iterable of texts) or :meth:`load` (a folder holding
    ``tokenizer.json``, or GPT-2 style ``vocab.json`` + ``merges.txt``).  A loaded tokenizer
    keeps its own special tokens where it has them under a known name (``<|endoftext|>`` serves
    as both bos and eos for GPT-2); missing roles are added as new tokens at the end of the
    vocabulary.
    """

    kind = "bpe"
    bits_per_byte = False

    def __init__(self, hf_tokenizer, special_tokens: dict[str, str]):
        self._tok = hf_tokenizer
        # A literal "<eos>" in a document is text, not the special token: encode must be exact.
        self._tok.encode_special_tokens = True
        self.special_tokens = dict(special_tokens)
        ids = {}
        for role in SPECIAL_ROLES:
            tid = self._tok.token_to_id(self.special_tokens[role])
            if tid is None:
                raise DataError(f"BPE tokenizer has no token {self.special_tokens[role]!r} for role {role}")
            ids[role] = tid
        self.pad_id, self.bos_id, self.eos_id, self.mask_id = (ids[r] for r in SPECIAL_ROLES)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._name = f"bpe-{self.vocab_size}-{hashlib.sha256(self._tok.to_str().encode('utf-8')).hexdigest()[:12]}"

    @property
    def name(self) -> str:
        return self._name

    @property
    def hf_tokenizer(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int = 8192,
        *,
        min_frequency: int = 2,
        length: int | None = None,
        show_progress: bool = False,
    ) -> "BPETokenizer":
        """Train a byte-level BPE of ``vocab_size`` ids (4 specials + 256 bytes + merges) on ``texts``."""
        tk = _tokenizers()
        if vocab_size < 260 + 1:
            raise ValueError(f"BPE vocab_size must exceed 260 (4 specials + 256 bytes), got {vocab_size}")
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        specials = {role: _ROLE_ALIASES[role][0] for role in SPECIAL_ROLES}
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[specials[r] for r in SPECIAL_ROLES],
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        tok.train_from_iterator(texts, trainer, length=length)
        return cls(tok, specials)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "BPETokenizer":
        """Load from ``directory``: lintime's own save, ``tokenizer.json``, or ``vocab.json`` + ``merges.txt``."""
        tk = _tokenizers()
        directory = Path(directory)
        meta_path = directory / META_FILE
        if (directory / "tokenizer.json").is_file():
            tok = tk.Tokenizer.from_file(str(directory / "tokenizer.json"))
        elif (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
            # GPT-2 layout: byte-level BPE without a saved pipeline, so set the byte-level one.
            tok = tk.Tokenizer(tk.models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt")))
            tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = tk.decoders.ByteLevel()
        else:
            raise DataError(f"no tokenizer in {directory}: expected tokenizer.json, or vocab.json + merges.txt")
        if meta_path.is_file():
            specials = json.loads(meta_path.read_text())["special_tokens"]
        else:
            specials = {}
            for role in SPECIAL_ROLES:
                found = next((a for a in _ROLE_ALIASES[role] if tok.token_to_id(a) is not None), None)
                if found is None:
                    found = _ROLE_ALIASES[role][0]
                # an existing token keeps its id and is only marked special (so decode drops it)
                tok.add_special_tokens([found])
                specials[role] = found
        return cls(tok, specials)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self.token_dtype) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: str | os.PathLike) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / "tokenizer.json"))
        atomic_write_json(directory / META_FILE, {"kind": self.kind, "format": 1, "special_tokens": self.special_tokens})
        return directory

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BPETokenizer) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


# ----------------------------------------------------------------------------------------------
# Loading and building from a spec string

_KINDS: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer, "bpe": BPETokenizer}


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer saved with ``save`` (any kind), or a foreign BPE folder."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"tokenizer folder not found: {directory}")
    meta = directory / META_FILE
    kind = json.loads(meta.read_text())["kind"] if meta.is_file() else "bpe"
    if kind not in _KINDS:
        raise DataError(f"unknown tokenizer kind {kind!r} in {meta}")
    return _KINDS[kind].load(directory)


DEFAULT_BPE_VOCAB = 8192


def get_tokenizer(
    spec: str | Tokenizer = "byte",
    *,
    corpus: "Corpus | None" = None,
    cache_dir: str | os.PathLike | None = None,
    quiet: bool = False,
) -> Tokenizer:
    """Tokenizer from a spec string (what ``--tokenizer`` takes on the command line).

    * ``"byte"`` -- :class:`ByteTokenizer`;
    * ``"bpe:DIR"`` or an existing folder ``DIR`` -- load a BPE tokenizer from that folder;
    * ``"bpe"`` or ``"bpe:N"`` -- train a byte-level BPE with ``N`` ids (default 8192) on the
      *train* split of ``corpus`` (so validation/test text never shapes the vocabulary).  With
      ``cache_dir`` the trained tokenizer is kept in ``cache_dir/tokenizer-bpe<N>-<hash>/``
      (hash of the train split's source hash and the split rule) and reused next time.

    A :class:`Tokenizer` instance is returned unchanged.
    """
    if isinstance(spec, Tokenizer):
        return spec
    if spec == "byte":
        return ByteTokenizer()
    kind, _, arg = spec.partition(":")
    if kind == "bpe" and (arg == "" or arg.isdigit()):
        vocab = int(arg) if arg else DEFAULT_BPE_VOCAB
        if corpus is None:
            raise DataError(f"tokenizer {spec!r} is trained on a corpus, but none was given")
        return _train_cached_bpe(corpus, vocab, cache_dir, quiet)
    path = Path(arg if kind == "bpe" else spec).expanduser()
    if path.is_dir():
        return load_tokenizer(path)
    raise DataError(f"unknown tokenizer {spec!r}: use 'byte', 'bpe', 'bpe:<vocab size>' or 'bpe:<folder>'")


def _train_cached_bpe(corpus: "Corpus", vocab: int, cache_dir, quiet: bool) -> Tokenizer:
    ident = {"vocab_size": vocab, "train_source": corpus.source_hash("train"), "split_rule": corpus.split_rule()}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    target = None if cache_dir is None else Path(cache_dir) / f"tokenizer-bpe{vocab}-{digest}"
    if target is not None and target.is_dir():
        return load_tokenizer(target)
    _tokenizers()  # fail with the install hint before reading the corpus
    texts = (doc.text for doc in corpus.documents("train"))
    tok = BPETokenizer.train(texts, vocab, length=corpus.count_hint("train"), show_progress=not quiet)
    if target is not None:
        _save_dir_atomically(tok.save, target)
    return tok


# ----------------------------------------------------------------------------------------------
# small file helpers (atomic: a reader never sees a half-written file or folder)


def _save_dir_atomically(save: Callable[[Path], Path], target: Path) -> None:
    """Run ``save`` into a temporary sibling folder, then rename it to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(target.parent, f".{target.name}.tmp-")  # an ordinary folder's mode, not mkdtemp's 0700
    try:
        save(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # lost a race to an identical save: keep theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

