"""Corpora: where documents come from, and which split each one belongs to.

A corpus spec (``--corpus`` on the command line) is one of

* ``"stdlib"`` (the default): the ``.py`` files of the running Python's standard library, found
  through ``sysconfig.get_paths()["stdlib"]`` -- present on every Python install, so the default
  run needs no download.  Every file is a document; folders named ``site-packages`` or
  ``dist-packages`` are skipped (they hold installed third-party code, different on every
  machine); the standard library's own tests are kept;
* a folder: every regular file below it, recursively, except names starting with ``.``;
* a glob (``"data/**/*.txt"``, recursive ``**`` allowed); its root is the longest leading part
  without wildcards;
* a single file (its root is its folder).  A single *text* file (nanoGPT's ``input.txt``) is
  split by position instead of by hash: see :func:`position_cuts`.

Each file is read by its extension: ``.jsonl`` / ``.ndjson`` hold one JSON object per line, the
document is its ``text_field`` (default ``"text"``); ``.parquet`` holds a table whose
``text_field`` column gives the documents (needs ``pyarrow``); anything else is a text file that
is one document.  Text is decoded as strict UTF-8 from the raw bytes (line endings kept as they
are).  A file that cannot be read, contains a NUL byte or is not UTF-8 is skipped and counted
(``SkipStats.unreadable``; the last two also in ``SkipStats.not_text``), as is a malformed JSON
line; empty documents are skipped and counted (``SkipStats.empty``); records without a string
``text_field`` are counted in ``SkipStats.missing_field``.  A corpus that *is* one text file is
not skipped but refused: :func:`open_corpus` (from its first 64 KiB) and the reading raise
:class:`DataError` saying the file is not UTF-8 text.

Split rule (see :func:`split_of`): a document's split is a pure function of its *key* -- the
POSIX path of its file relative to the corpus root, plus ``#<line>`` (1-based JSONL line) or
``#<row>`` (0-based parquet row) for records.  The same relative path lands in the same split
on every machine, whatever the root is, and independently of which other files exist.  A
corpus that is one text file is one document, which the hash would put whole into one split; it
is cut by position instead (:func:`position_cuts`): its first ``1 - val_fraction - test_fraction``
is train, then validation, then test, each piece one document keyed ``<name>@<split>``.
"""

from __future__ import annotations

import codecs
import glob as globlib
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal

from .errors import DataError, require

SPLITS = ("train", "validation", "test")
SplitName = Literal["train", "validation", "test"]
_SKIP_DIRS_STDLIB = {"site-packages", "dist-packages", "__pycache__"}
_JSONL_EXT = (".jsonl", ".ndjson")
_PARQUET_EXT = (".parquet",)


def split_of(key: str, val_fraction: float = 0.05, test_fraction: float = 0.05) -> SplitName:
    """The split of the document with this key.

    Rule: ``u = int.from_bytes(sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64``
    (uniform in ``[0, 1)``); ``u < test_fraction`` -> ``"test"``; else
    ``u < test_fraction + val_fraction`` -> ``"validation"``; else ``"train"``.  ``key`` is the
    POSIX path relative to the corpus root (``"json/decoder.py"``), with ``#<line>`` /
    ``#<row>`` appended for JSONL / parquet records.  Nothing else (machine, root, order,
    other files, seeds) enters, so the split is the same everywhere.
    """
    u = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "validation"
    return "train"


def position_cuts(text: str, val_fraction: float = 0.05, test_fraction: float = 0.05) -> dict[str, tuple[int, int]]:
    """Character ranges ``{split: (start, stop)}`` of a single-file corpus, in file order: train,
    then validation, then test.

    Rule: with ``n = len(text)``, the nominal cuts are ``a = floor(n * (1 - val_fraction - test_fraction))``
    and ``b = floor(n * (1 - test_fraction))``; each moves forward to just after the next newline
    (so no line is cut in two), or stays where it is when no newline follows.  Train is
    ``[0, a)``, validation ``[a, b)``, test ``[b, n)``.  A pure function of the text and fractions.
    """
    n = len(text)

    def snap(x: int) -> int:
        if x <= 0 or x >= n or text[x - 1] == "\n":
            return min(max(x, 0), n)
        nl = text.find("\n", x)
        return x if nl < 0 else nl + 1

    a = snap(int(n * (1 - val_fraction - test_fraction)))
    b = max(a, snap(int(n * (1 - test_fraction))))
    return {"train": (0, a), "validation": (a, b), "test": (b, n)}


@dataclass(frozen=True)
class Source:
    """One file of a corpus."""

    path: Path
    key: str  # POSIX path relative to the corpus root
    size: int
    mtime_ns: int
    kind: Literal["text", "jsonl", "parquet"]


@dataclass(frozen=True)
class Document:
    key: str  # split key (see split_of)
    text: str


@dataclass
class SkipStats:
    """What was skipped while reading (counts of files for text, of lines/rows for records)."""

    unreadable: int = 0  # unreadable, binary (NUL byte) or non-UTF-8 files; malformed JSON lines
    empty: int = 0  # empty documents
    missing_field: int = 0  # JSONL/parquet records without a string text field
    not_text: int = 0  # of ``unreadable``: files that are binary (NUL byte) or not UTF-8 (not in as_dict)
    examples: list[str] = field(default_factory=list)  # a few skipped keys, for messages

    def note(self, what: str, key: str) -> None:
        setattr(self, what, getattr(self, what) + 1)
        if len(self.examples) < 3:
            self.examples.append(key)

    def as_dict(self) -> dict[str, int]:
        return {"unreadable": self.unreadable, "empty": self.empty, "missing_field": self.missing_field}

    def describe(self) -> str:
        parts = [f"{n} {what.replace('_', ' ')}" for what, n in self.as_dict().items() if n]
        return ", ".join(parts) if parts else "nothing"


class Corpus:
    """A listed corpus: its sources (files) and the split rule.  Build one with :func:`open_corpus`."""

    def __init__(
        self,
        name: str,
        root: Path,
        sources: list[Source],
        *,
        text_field: str = "text",
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        by_position: bool = False,
    ):
        if not (0 <= val_fraction and 0 <= test_fraction and val_fraction + test_fraction < 1):
            raise ValueError(f"need 0 <= val_fraction, test_fraction and their sum < 1, got {val_fraction}, {test_fraction}")
        self.name = name
        self.root = root
        self.sources = sorted(sources, key=lambda s: s.key)
        self.text_field = text_field
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        # one text file: split by position (position_cuts), not by the hash of its key
        self.by_position = by_position and len(self.sources) == 1 and self.sources[0].kind == "text"

    def __repr__(self) -> str:
        return f"Corpus({self.name!r}, root={str(self.root)!r}, files={len(self.sources)})"

    def split_rule(self) -> dict:
        """What decides the split of a key (stored in manifests)."""
        if self.by_position:
            return {"rule": "position", "val_fraction": self.val_fraction, "test_fraction": self.test_fraction}
        return {"rule": "sha256(key)[:8] / 2**64", "val_fraction": self.val_fraction, "test_fraction": self.test_fraction}

    def split_of(self, key: str) -> SplitName:
        return split_of(key, self.val_fraction, self.test_fraction)

    def sources_for(self, split: str) -> list[Source]:
        """Files that can hold documents of ``split``: text files of that split, and every record file."""
        _check_split(split)
        if self.by_position:
            return list(self.sources)
        return [s for s in self.sources if s.kind != "text" or self.split_of(s.key) == split]

    def count_hint(self, split: str) -> int | None:
        """Number of documents of ``split`` when known without reading (text files only), else None."""
        srcs = self.sources_for(split)
        return None if any(s.kind != "text" for s in srcs) else len(srcs)

    def source_hash(self, split: str, mode: Literal["stat", "content"] = "stat") -> str:
        """Hash of what ``split`` is read from: keys, sizes and mtimes (``"stat"``) or the bytes (``"content"``)."""
        h = hashlib.sha256()
        h.update(json.dumps({"mode": mode, "text_field": self.text_field}).encode())
        for s in self.sources_for(split):
            h.update(json.dumps([s.key, s.kind, s.size] + ([s.mtime_ns] if mode == "stat" else [])).encode())
            if mode == "content":
                with open(s.path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
            h.update(b"\n")
        return h.hexdigest()

    def documents(
        self,
        split: str,
        stats: SkipStats | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Iterator[Document]:
        """Documents of ``split`` in key order; skips are counted into ``stats``.

        ``progress(n)`` is called with the number of source bytes consumed since the last call.
        """
        stats = SkipStats() if stats is None else stats
        progress = progress or (lambda n: None)
        for src in self.sources_for(split):
            if src.kind == "text":
                text = _read_text(src, stats, strict=self.by_position)
                progress(src.size)
                if text is None:
                    continue
                key = src.key
                if self.by_position:
                    start, stop = position_cuts(text, self.val_fraction, self.test_fraction)[split]
                    text, key = text[start:stop], f"{src.key}@{split}"
                if not text:
                    stats.note("empty", key)
                    continue
                yield Document(key, text)
            elif src.kind == "jsonl":
                yield from self._jsonl(src, split, stats, progress)
            else:
                yield from self._parquet(src, split, stats, progress)

    def _keep(self, key: str, split: str, value, stats: SkipStats) -> Document | None:
        if self.split_of(key) != split:
            return None
        if not isinstance(value, str):
            stats.note("missing_field", key)
            return None
        if not value:
            stats.note("empty", key)
            return None
        return Document(key, value)

    def _jsonl(self, src: Source, split: str, stats: SkipStats, progress) -> Iterator[Document]:
        try:
            f = open(src.path, "rb")
        except OSError:
            stats.note("unreadable", src.key)
            progress(src.size)
            return
        with f:
            for lineno, raw in enumerate(f, start=1):
                progress(len(raw))
                if not raw.strip():
                    continue
                key = f"{src.key}#{lineno}"
                if self.split_of(key) != split:
                    continue
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    stats.note("unreadable", key)
                    continue
                doc = self._keep(key, split, rec.get(self.text_field) if isinstance(rec, dict) else None, stats)
                if doc is not None:
                    yield doc

    def _parquet(self, src: Source, split: str, stats: SkipStats, progress) -> Iterator[Document]:
        pq = require("pyarrow.parquet", f"reading the parquet file {src.path}", extra="parquet")
        try:
            pf = pq.ParquetFile(src.path)
        except Exception:  # pyarrow raises its own error types for corrupt files
            stats.note("unreadable", src.key)
            progress(src.size)
            return
        if self.text_field not in pf.schema_arrow.names:
            raise DataError(
                f"parquet file {src.path} has no column {self.text_field!r} "
                f"(columns: {', '.join(pf.schema_arrow.names)}); choose one with --text-field"
            )
        row = 0
        n_rows = max(pf.metadata.num_rows, 1)
        for batch in pf.iter_batches(batch_size=4096, columns=[self.text_field]):
            values = batch.column(0).to_pylist()
            for value in values:
                doc = self._keep(f"{src.key}#{row}", split, value, stats)
                row += 1
                if doc is not None:
                    yield doc
            progress(src.size * len(values) // n_rows)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits are {SPLITS}")


def _read_text(src: Source, stats: SkipStats, strict: bool = False) -> str | None:
    """The file's text, or ``None`` (counted in ``stats``) when it cannot be read or is not UTF-8
    text; ``strict`` (a corpus that is this one file) raises :class:`DataError` for the latter."""
    try:
        data = src.path.read_bytes()
    except OSError:
        stats.note("unreadable", src.key)
        return None
    try:
        if b"\x00" not in data:
            return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    if strict:
        raise not_text_error(src.path, not_text_reason(data, complete=True))
    stats.note("unreadable", src.key)
    stats.not_text += 1
    return None


def not_text_reason(data: bytes, complete: bool) -> str | None:
    """Why ``data`` (a whole file, or its first bytes when not ``complete``) is not UTF-8 text, in a
    few words, or ``None``."""
    if b"\x00" in data:
        return "it holds NUL bytes, like a binary file"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=complete)
    except UnicodeDecodeError as err:
        return f"byte {err.start} (0x{data[err.start]:02x}) is not valid UTF-8"
    return None


def not_text_error(path: Path, why: str) -> DataError:
    return DataError(f"corpus file {path} is not UTF-8 text ({why}); lintime trains on UTF-8 text files "
                     "(convert another encoding first, e.g. iconv -f latin1 -t utf-8)")


def _kind(path: Path) -> Literal["text", "jsonl", "parquet"]:
    name = path.name.lower()
    if name.endswith(_JSONL_EXT):
        return "jsonl"
    if name.endswith(_PARQUET_EXT):
        return "parquet"
    return "text"


def _source(path: Path, root: Path) -> Source | None:
    try:
        st = path.stat()
    except OSError:
        return None
    key = path.relative_to(root).as_posix()
    return Source(path=path, key=key, size=st.st_size, mtime_ns=st.st_mtime_ns, kind=_kind(path))


def _walk(root: Path, skip_dir: Callable[[str], bool], keep_file: Callable[[str], bool]) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not skip_dir(d))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if keep_file(f))
    return [p for p in out if p.is_file()]


def stdlib_root() -> Path:
    """Folder of the running Python's standard library (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def open_corpus(
    spec: str | os.PathLike = "stdlib",
    *,
    text_field: str = "text",
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
) -> Corpus:
    """List the corpus named by ``spec`` (see the module docstring).

    Raises :class:`DataError` when the path does not exist or lists no files.  Nothing is read
    yet except file metadata.
    """
    kw = dict(text_field=text_field, val_fraction=val_fraction, test_fraction=test_fraction)
    spec_str = os.fspath(spec)
    if spec_str == "stdlib":
        root = stdlib_root()
        if not root.is_dir():
            raise DataError(f"the standard library folder {root} (from sysconfig) does not exist")
        paths = _walk(root, lambda d: d in _SKIP_DIRS_STDLIB, lambda f: f.endswith(".py"))
    elif globlib.has_magic(spec_str):
        root = _glob_root(spec_str)
        paths = sorted(Path(p) for p in globlib.glob(spec_str, recursive=True) if Path(p).is_file())
        paths = [p.absolute() for p in paths]
        root = root.absolute()
    else:
        path = Path(spec_str).expanduser()
        if path.is_dir():
            root = path.absolute()
            paths = _walk(root, lambda d: d.startswith("."), lambda f: not f.startswith("."))
        elif path.is_file():
            root = path.absolute().parent
            paths = [path.absolute()]
            kw["by_position"] = True
            if _kind(path) == "text":
                _check_text_start(path)
        else:
            raise DataError(f"corpus not found: {spec_str} (expected 'stdlib', a folder, a file or a glob)")
    sources = [s for s in (_source(p, root) for p in paths) if s is not None]
    if not sources:
        raise DataError(f"corpus {spec_str!r} is empty: no files found under {root}")
    return Corpus("stdlib" if spec_str == "stdlib" else spec_str, root, sources, **kw)


def _check_text_start(path: Path, n: int = 64 << 10) -> None:
    """Refuse a one-file corpus whose first ``n`` bytes are not UTF-8 text (the rest is checked when
    it is read), before a tokenizer is trained or a cache written."""
    try:
        with open(path, "rb") as f:
            data = f.read(n + 1)
    except OSError as err:
        raise DataError(f"cannot read corpus file {path}: {err.strerror or err}") from None
    why = not_text_reason(data[:n], complete=len(data) <= n)
    if why is not None:
        raise not_text_error(path, why)


def _glob_root(pattern: str) -> Path:
    parts = Path(pattern).parts
    fixed = []
    for part in parts:
        if globlib.has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")
