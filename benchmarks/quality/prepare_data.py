#!/usr/bin/env python3
"""Data of the quality study: the corpus, its byte-level token cache and one archive to carry.

Corpus (text nobody in this project wrote), one document per file:

* ``linux-doc/``: the Linux kernel's ``Documentation/`` tree from Debian's ``linux-doc``
  package (``apt-get install linux-doc``; files land gzipped under
  ``/usr/share/doc/linux-doc-<version>/Documentation``), decompressed; images and fonts left out;
* ``python-stdlib/``: the ``.py`` files of the running Python's standard library, exactly the
  files of lintime's ``stdlib`` corpus (third-party ``site-packages`` skipped).

The split is lintime's path-hash rule (5 % validation, 5 % test), fixed by the file paths, so it
is the same on every machine.  Every file gets the same fixed modification time, so the cache
identity (paths, sizes, mtimes: ``docs/data.md``) is reproducible too.  Only the text travels:
tokenising it with the byte tokenizer takes a few seconds, and ``--unpack`` checks that the
unpacked text is byte for byte the text prepared here (``content_sha256`` of ``corpus.json``).

Output (under ``--data``, default ``benchmarks/quality/data``, git-ignored)::

    corpus/            the documents
    corpus.json        where they came from (package version, Python version, counts, bytes)
    cache/             lintime token cache (train, validation, test), byte tokenizer
    quality_data.tar.xz   corpus/ + corpus.json (~12 MiB), what the GPU machine gets

Usage::

    apt-get install -y linux-doc && python3 benchmarks/quality/prepare_data.py
    python3 benchmarks/quality/prepare_data.py --unpack      # GPU machine: archive -> corpus/ + cache/
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import lzma
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent.parent) not in sys.path:  # lintime from this checkout when it is not installed
    sys.path.insert(0, str(HERE.parent.parent))
DEFAULT_DATA = HERE / "data"
ARCHIVE = "quality_data.tar.xz"
FIXED_MTIME = 1_767_225_600  # 2026-01-01T00:00:00Z: every corpus file's mtime (reproducible cache identity)
SKIP_EXT = {".svg", ".png", ".jpg", ".jpeg", ".gif", ".ico", ".pdf", ".ttf", ".woff", ".woff2", ".eps", ".xcf"}
XZ_PRESET = 9
STUDY_SPLITS = ("train", "validation")  # what the study reads (the test split is never looked at)


def linux_doc_root() -> Path:
    found = sorted(glob.glob("/usr/share/doc/linux-doc-*/Documentation"))
    if not found:
        sys.exit("prepare_data: no /usr/share/doc/linux-doc-*/Documentation; install it first: "
                 "apt-get update && apt-get install -y linux-doc")
    return Path(found[-1])


def package_version(name: str) -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def build_corpus(corpus: Path) -> dict:
    """Write the documents under ``corpus`` (replacing it); return the provenance record."""
    from lintime.data import open_corpus

    if corpus.exists():
        shutil.rmtree(corpus)
    doc_root = linux_doc_root()
    counts = {"linux-doc": [0, 0], "python-stdlib": [0, 0]}  # files, bytes
    for src in sorted(doc_root.rglob("*")):
        if not src.is_file():
            continue
        rel = src.relative_to(doc_root)
        if rel.suffix == ".gz":
            rel = rel.with_suffix("")
            data = gzip.decompress(src.read_bytes())
        else:
            data = src.read_bytes()
        if rel.suffix.lower() in SKIP_EXT:
            continue
        _write(corpus / "linux-doc" / rel, data)
        counts["linux-doc"][0] += 1
        counts["linux-doc"][1] += len(data)
    for s in open_corpus("stdlib").sources:  # lintime's own stdlib file list
        data = Path(s.path).read_bytes()
        _write(corpus / "python-stdlib" / s.key, data)
        counts["python-stdlib"][0] += 1
        counts["python-stdlib"][1] += len(data)
    linux_pkg = doc_root.parent.name  # linux-doc-6.1
    return {
        "parts": {
            "linux-doc": {"source": str(doc_root), "package": linux_pkg, "version": package_version(linux_pkg),
                          "files": counts["linux-doc"][0], "bytes": counts["linux-doc"][1],
                          "left_out": sorted(SKIP_EXT)},
            "python-stdlib": {"source": str(open_corpus("stdlib").root), "python": platform.python_version(),
                              "files": counts["python-stdlib"][0], "bytes": counts["python-stdlib"][1]},
        },
        "mtime": FIXED_MTIME,
        "split_rule": "lintime path-hash rule (docs/data.md), val_fraction 0.05, test_fraction 0.05",
    }


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, (FIXED_MTIME, FIXED_MTIME))


def archive_members(data: Path) -> list[Path]:
    return [data / "corpus.json"] + sorted(p for p in (data / "corpus").rglob("*") if p.is_file())


def write_archive(data: Path) -> Path:
    """Deterministic tar (sorted members, fixed owner; corpus mtimes kept: the cache identity needs them)."""
    out = data / ARCHIVE
    tmp = out.with_suffix(".tmp")
    with lzma.open(tmp, "wb", format=lzma.FORMAT_XZ, preset=XZ_PRESET) as xz, \
            tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in archive_members(data):
            info = tar.gettarinfo(str(path), arcname=path.relative_to(data).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)
    tmp.replace(out)
    return out


def unpack(data: Path) -> None:
    src = data / ARCHIVE
    if not src.exists():
        sys.exit(f"prepare_data --unpack: {src} not found (carry benchmarks/quality/data/{ARCHIVE})")
    for sub in ("corpus", "cache"):
        if (data / sub).exists():
            shutil.rmtree(data / sub)
    with tarfile.open(src, "r:xz") as tar:
        tar.extractall(data, filter="data")  # keeps the mtimes


def check_and_cache(data: Path, splits=STUDY_SPLITS) -> dict:
    """Check the unpacked text against ``corpus.json`` and build its token cache; return
    ``{split: {docs, tokens}}`` (they must equal the counts recorded here)."""
    from lintime.data import prepare

    record = json.loads((data / "corpus.json").read_text())
    digest = _corpus_digest(data / "corpus")
    if digest != record["content_sha256"]:
        raise SystemExit(f"prepare_data: the unpacked corpus differs from the prepared one (sha256 {digest[:12]} "
                         f"vs {record['content_sha256'][:12]})")
    result = prepare(data / "corpus", "byte", data / "cache", splits=splits, quiet=True)
    got = {s: {"docs": ds.n_docs, "tokens": ds.n_tokens} for s, ds in result.items()}
    for s, v in got.items():
        want = record["splits"][s]
        if (v["docs"], v["tokens"]) != (want["docs"], want["tokens"]):
            raise SystemExit(f"prepare_data: split {s} has {v} here, {want} where it was prepared")
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="output folder (default %(default)s)")
    ap.add_argument("--unpack", action="store_true", help="unpack the archive into corpus/ + cache/ and check it")
    ap.add_argument("--no-archive", action="store_true", help="build corpus and cache only")
    args = ap.parse_args(argv)
    data: Path = args.data
    t0 = time.perf_counter()
    if args.unpack:
        unpack(data)
        splits = check_and_cache(data)
        print(f"prepare_data: unpacked {data / ARCHIVE} in {time.perf_counter() - t0:.1f} s; "
              + ", ".join(f"{s} {v['tokens']:,} tokens" for s, v in splits.items()))
        return 0
    from lintime.data import prepare

    data.mkdir(parents=True, exist_ok=True)
    record = build_corpus(data / "corpus")
    splits = prepare(data / "corpus", "byte", data / "cache")
    record["splits"] = {s: {"docs": ds.n_docs, "tokens": ds.n_tokens, "bytes": ds.n_bytes}
                        for s, ds in splits.items()}
    record["content_sha256"] = _corpus_digest(data / "corpus")
    (data / "corpus.json").write_text(json.dumps(record, indent=2) + "\n")
    os.utime(data / "corpus.json", (FIXED_MTIME, FIXED_MTIME))
    print(f"prepare_data: corpus {sum(p['files'] for p in record['parts'].values()):,} files, "
          f"{sum(p['bytes'] for p in record['parts'].values()) / 1e6:.1f} MB; "
          + ", ".join(f"{s} {v['tokens']:,} tokens" for s, v in record["splits"].items()))
    if not args.no_archive:
        out = write_archive(data)
        print(f"prepare_data: {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.0f} s")
    return 0


def _corpus_digest(corpus: Path) -> str:
    """sha256 over (path, bytes) of every document: one number that says the text is the same."""
    h = hashlib.sha256()
    for p in sorted(corpus.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(corpus).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


if __name__ == "__main__":
    sys.exit(main())
