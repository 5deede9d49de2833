"""``prepare``: corpus + tokenizer -> a token cache per split (what ``lintime data`` runs)."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Literal, Sequence

from lintime.utils.io import atomic_write

from .cache import FORMAT_VERSION, SplitWriter, TokenDataset, consistent, read_manifest, split_paths
from .corpus import SPLITS, Corpus, SkipStats, open_corpus
from .errors import DataError, EmptySplitError
from .progress import Progress
from .tokenizer import Tokenizer, get_tokenizer

_ENCODE_BATCH_CHARS = 4 << 20  # texts handed to the tokenizer at once (BPE encodes a batch in parallel)
_ENCODE_BATCH_DOCS = 1024


def default_cache_dir(corpus: str, tokenizer: str) -> Path:
    """``$LINTIME_CACHE/data/<corpus>-<tokenizer>`` (``LINTIME_CACHE`` defaults to ``~/.cache/lintime``)."""
    root = Path(os.environ.get("LINTIME_CACHE", Path.home() / ".cache" / "lintime"))
    return root / "data" / f"{_slug(corpus)}-{_slug(tokenizer)}"


def _slug(text: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-.")[-40:] or "x"
    if clean == text:
        return clean
    return f"{clean}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def prepare(
    corpus: str | os.PathLike | Corpus = "stdlib",
    tokenizer: str | Tokenizer = "byte",
    cache_dir: str | os.PathLike | None = None,
    *,
    splits: Sequence[str] = SPLITS,
    text_field: str = "text",
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
    source_hash: Literal["stat", "content"] = "stat",
    rebuild: bool = False,
    quiet: bool = False,
) -> dict[str, TokenDataset]:
    """Tokenise ``corpus`` into a memory-mapped cache, one file per split; return ``{split: TokenDataset}``.

    Args:
        corpus: a corpus spec -- ``"stdlib"`` (default), a folder, a glob, a ``.jsonl`` /
            ``.parquet`` / text file (see :mod:`lintime.data.corpus`) -- or an opened :class:`Corpus`.
        tokenizer: a :class:`Tokenizer`, or a spec for :func:`get_tokenizer` (``"byte"``,
            ``"bpe:8192"`` to train one on the train split, ``"bpe:<folder>"`` to load one).
        cache_dir: folder of the cache (one prepared dataset per folder); default
            :func:`default_cache_dir` of the corpus and tokenizer specs.
        splits: the splits to prepare.
        text_field: field / column holding the text in JSONL and parquet files (spec corpora only).
        val_fraction, test_fraction: split fractions of the hash rule (spec corpora only).
        source_hash: ``"stat"`` hashes paths, sizes and mtimes (cheap); ``"content"`` hashes the bytes.
        rebuild: rebuild even when the cache matches.
        quiet: no progress bar and no summary lines on stderr.

    A split is reused when its manifest matches (same files, tokenizer, split rule, format);
    otherwise it is rebuilt and written atomically.  Raises :class:`DataError` for a missing or
    empty corpus, and when a requested split ends up with no documents.
    """
    if isinstance(corpus, Corpus):
        corp = corpus
    else:
        corp = open_corpus(corpus, text_field=text_field, val_fraction=val_fraction, test_fraction=test_fraction)
    if cache_dir is None:
        tok_spec = tokenizer.name if isinstance(tokenizer, Tokenizer) else str(tokenizer)
        cache_dir = default_cache_dir(corp.name, tok_spec)
    cache_dir = Path(cache_dir)
    tok = get_tokenizer(tokenizer, corpus=corp, cache_dir=cache_dir, quiet=quiet)
    for split in splits:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; splits are {SPLITS}")

    out = {}
    for split in splits:
        identity = {
            "format_version": FORMAT_VERSION,
            "split": split,
            "source_hash": corp.source_hash(split, source_hash),
            "source_hash_mode": source_hash,
            "tokenizer": tok.name,
            "split_rule": corp.split_rule(),
            "text_field": corp.text_field,
        }
        bin_path, man_path = split_paths(cache_dir, split)
        manifest = read_manifest(man_path)
        if not rebuild and manifest is not None and manifest.get("identity") == identity and consistent(bin_path, manifest):
            ds = TokenDataset(bin_path, manifest, tok, reused=True)
            _say(quiet, f"{split}: reusing {ds.n_docs} documents, {ds.n_tokens} tokens from {bin_path}")
        else:
            ds = _build(corp, tok, split, identity, bin_path, man_path, quiet)
        out[split] = ds
    return out


def _build(corp: Corpus, tok: Tokenizer, split: str, identity: dict, bin_path: Path, man_path: Path, quiet: bool) -> TokenDataset:
    stats = SkipStats()
    n_bytes = 0
    total = sum(s.size for s in corp.sources_for(split))
    with Progress(total, f"{split} ({tok.name})", quiet=quiet) as bar, atomic_write(bin_path, "wb") as f:
        writer = SplitWriter(f, tok.token_dtype, identity)
        batch: list[str] = []
        chars = 0

        def flush() -> None:
            for ids in tok.encode_batch(batch):
                if len(ids) and int(ids.max()) >= tok.vocab_size:
                    raise DataError(f"tokenizer {tok.name} produced id {int(ids.max())} >= its vocab_size {tok.vocab_size}")
                writer.add(ids)
            batch.clear()

        for doc in corp.documents(split, stats, bar.update):
            batch.append(doc.text)
            chars += len(doc.text)
            n_bytes += len(doc.text.encode("utf-8"))
            if chars >= _ENCODE_BATCH_CHARS or len(batch) >= _ENCODE_BATCH_DOCS:
                flush()
                chars = 0
        flush()
        if len(writer.offsets) == 1:
            # Raising inside atomic_write discards the temporary file: no empty split is written.
            n_files = len(corp.sources_for(split))
            if stats.not_text and stats.not_text == n_files:  # no text remains: say so, not "use a larger corpus"
                raise DataError(
                    f"split {split!r} of corpus {corp.name!r} has no text: "
                    f"{'its file is' if n_files == 1 else f'all its {n_files} files are'} not UTF-8 text "
                    f"(binary, or another encoding) and {'was' if n_files == 1 else 'were'} skipped "
                    f"(skipped: {stats.describe()}{_examples(stats)}); lintime trains on UTF-8 text files"
                )
            raise EmptySplitError(
                f"split {split!r} of corpus {corp.name!r} has no documents ({len(corp.sources_for(split))} files "
                f"considered, skipped: {stats.describe()}{_examples(stats)}); use a larger corpus"
                + (f", or check --text-field (now {corp.text_field!r})" if stats.missing_field else "")
            )
        n_docs, n_tokens = writer.finish()
    manifest = {
        "format_version": FORMAT_VERSION,
        "identity": identity,
        "split": split,
        "corpus": {"name": corp.name, "root": str(corp.root), "n_files": len(corp.sources_for(split))},
        "tokenizer": {
            "name": tok.name,
            "kind": tok.kind,
            "vocab_size": tok.vocab_size,
            "bits_per_byte": tok.bits_per_byte,
            "pad_id": tok.pad_id,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "mask_id": tok.mask_id,
        },
        "dtype": writer.dtype.name,
        "n_docs": n_docs,
        "n_tokens": n_tokens,
        "n_bytes": n_bytes,
        "skipped": stats.as_dict(),
        "data_file": bin_path.name,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with atomic_write(man_path, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    skipped = "" if not any(stats.as_dict().values()) else f" (skipped {stats.describe()})"
    _say(quiet, f"{split}: {n_docs} documents, {n_tokens} tokens, {n_bytes} bytes -> {bin_path}{skipped}")
    return TokenDataset(bin_path, manifest, tok, reused=False)


def _examples(stats: SkipStats) -> str:
    return f"; e.g. {', '.join(stats.examples)}" if stats.examples else ""


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        print(f"lintime data: {line}", file=sys.stderr)
