"""``lintime data``: tokenise a corpus into the token cache (maps to :func:`lintime.data.prepare`)."""

from __future__ import annotations

import sys

from lintime.cli import check_writable, command


@command
def data(
    corpus: str = "stdlib",
    tokenizer: str = "byte",
    cache_dir: str | None = None,
    splits: str = "train,validation,test",
    text_field: str = "text",
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
    source_hash: str = "stat",
    rebuild: bool = False,
    quiet: bool = False,
) -> None:
    """Tokenise a corpus into the memory-mapped token cache that `lintime train` reads.

    A split whose cache matches (same files, tokenizer and split rule) is reused; otherwise it is
    rebuilt atomically.  Reports each split on stderr and prints only the cache folder on stdout
    (`--cache-dir "$(lintime data ...)"` works).

    Args:
        corpus: stdlib (the Python standard library), a folder, a file (.txt, .jsonl, .parquet, ...) or a glob.
        tokenizer: byte, bpe:N (train an N-token byte-level BPE on the train split) or bpe:FOLDER (load one).
        cache_dir: cache folder (default: $LINTIME_CACHE/data/<corpus>-<tokenizer>, LINTIME_CACHE defaulting to ~/.cache/lintime).
        splits: comma-separated splits to prepare (train, validation, test).
        text_field: JSONL field / parquet column holding the text.
        val_fraction: fraction of documents in the validation split (hash rule, see docs/data.md).
        test_fraction: fraction of documents in the test split.
        source_hash: stat (paths, sizes, mtimes: cheap) or content (hash the bytes) to decide cache reuse.
        rebuild: rebuild even when the cache matches.
        quiet: no progress bar or per-split lines on stderr.
    """
    from lintime.data import EmptySplitError, prepare

    wanted = tuple(s.strip() for s in splits.split(",") if s.strip())
    if not wanted:
        raise ValueError("--splits names no split; use e.g. train,validation,test")
    if source_hash not in ("stat", "content"):
        raise ValueError(f"--source-hash must be 'stat' or 'content', got {source_hash!r}")
    if cache_dir is not None:  # a complete cache is only read; anything else is written
        check_writable(cache_dir, "--cache-dir",
                       ok_if=lambda p: not rebuild and all((p / f"{s}.json").is_file() for s in wanted))
    try:
        result = prepare(
            corpus, tokenizer, cache_dir, splits=wanted, text_field=text_field, val_fraction=val_fraction,
            test_fraction=test_fraction, source_hash=source_hash, rebuild=rebuild, quiet=quiet,
        )
    except EmptySplitError as err:
        raise EmptySplitError(f"{err}, or other --val-fraction / --test-fraction") from None
    # stdout gets the folder alone, so `--cache-dir "$(lintime data ...)"` works; the summary goes to stderr
    folder = next(iter(result.values())).path.parent
    tokens = sum(ds.n_tokens for ds in result.values())
    if not quiet:
        print(f"lintime data: {', '.join(result)}: {tokens:,} tokens, tokenizer {next(iter(result.values())).tokenizer.name}",
              file=sys.stderr)
    print(folder)
