"""Finding the held-out split a checkpoint should be scored on."""

from __future__ import annotations

from pathlib import Path

from lintime.data import DataError, open_prepared, prepare

HELD_OUT = ("validation", "test")


def _is_prepared(folder: Path, split: str) -> bool:
    return folder.is_dir() and (folder / f"{split}.json").is_file()


def load_split(run_config: dict, tokenizer, split: str = "validation", data: str | None = None, *, quiet: bool = True):
    """The ``split`` (``validation`` or ``test``) as a :class:`lintime.data.TokenDataset`
    tokenised with ``tokenizer`` (the checkpoint's).

    ``data``: a prepared cache folder (holding ``<split>.json``) or a corpus spec for
    :func:`lintime.data.prepare` (default cache folder).  ``None``: the run's own training data
    (``config.json`` -> ``train.corpus`` / ``train.cache_dir``), re-prepared when the corpus is
    here (so a changed corpus is re-tokenised), else read from the run's cache folder alone.
    The split rule is the hash of each document's path, so the held-out documents of a corpus
    are the same on every machine and were never trained on.
    """
    if split not in HELD_OUT:
        raise ValueError(f"split must be one of {HELD_OUT} (held-out data), got {split!r}")
    if data is not None:
        path = Path(data).expanduser()
        if _is_prepared(path, split):
            return open_prepared(path, split, tokenizer)
        return prepare(data, tokenizer, splits=(split,), quiet=quiet)[split]
    train = run_config.get("train") or {}
    corpus, cache_dir = train.get("corpus"), train.get("cache_dir")
    if corpus is None and cache_dir is None:
        raise ValueError("the run's config.json names no training data: pass --data (a corpus or a prepared cache folder)")
    try:
        return prepare(corpus, tokenizer, cache_dir, splits=(split,), text_field=train.get("text_field", "text"),
                       quiet=quiet)[split]
    except DataError:
        if cache_dir is not None and _is_prepared(Path(cache_dir), split):
            return open_prepared(cache_dir, split, tokenizer)
        raise
