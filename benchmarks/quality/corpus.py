#!/usr/bin/env python3
"""The study's corpus (issue 43): the largest real-text corpus this machine can assemble offline.

Sources (text nobody in this project wrote), one document per file, in a fixed order (the
``SOURCES`` order, then each package's file paths sorted):

==========================  ==================================================================
``linux-doc``               the Linux kernel's ``Documentation/`` (reST, plain text, YAML
                            bindings; the package's ``html/`` rendering of the same reST is left out)
``python-doc``              Python 3.11's documentation, its reST sources (``_sources/*.txt``)
``perl-doc``                Perl's ``.pod`` manuals (the man-page renderings of the same pods are
                            left out)
``postgresql-doc``          PostgreSQL 15's manual (HTML, stripped to text)
``git-doc``                 git's manual pages and guides (AsciiDoc sources, ``.txt``)
``cmake-doc``               CMake's manual (reST sources, ``_sources/*.txt``)
``sqlite-doc``              SQLite's documentation (HTML, stripped to text)
``rust-doc``                Rust's books (the book, reference, nomicon, Rust by Example, edition
                            guide, ...; HTML stripped to text, navigation removed); the generated
                            API reference (``std``, ``core``, ...) and ``print.html`` copies are left out
``tcl-doc``, ``manpages``   roff sources of the Tcl, Linux and POSIX manual pages, as they are
``debian-reference``        the Debian Reference (plain text)
``golang-doc``              Go 1.19's specification and memory model (HTML stripped to text)
``python-stdlib``           the running Python's standard library ``.py`` files (lintime's
                            ``stdlib`` corpus)
==========================  ==================================================================

Packages: ``apt-get update && apt-get install -y --no-install-recommends`` + :data:`PACKAGES`
(``--install`` does it).  A package that is not installed is skipped with a line saying so (the
manifest records what was there).

Split: lintime's path-hash rule (``docs/data.md``: 5 % validation, 5 % test, by the sha256 of a
document's path relative to the corpus root, ``<source>/<path>``), so the split is fixed by the
document names alone, the same on every machine and whatever else the corpus holds.  Byte
tokenizer: 1 byte = 1 token (``<eos>`` between documents is added at packing time).

Output (``--data``, default ``benchmarks/quality/data/``, git-ignored)::

    corpus/              the documents (every file's mtime fixed: the token cache's identity)
    cache/               lintime's token cache (byte tokenizer; train, validation, test)
    corpus.tar.xz        corpus/ as one deterministic archive: what a GPU call carries

and ``benchmarks/quality/corpus_manifest.json`` (committed): package versions, file counts and
bytes per source, what was skipped and why, tokens per split, the content sha256 and the
archive's sha256 and size.

Usage::

    python3 benchmarks/quality/corpus.py --install    # apt-get the packages, then build (here, with network)
    python3 benchmarks/quality/corpus.py              # build from what is installed
    python3 benchmarks/quality/corpus.py --unpack     # GPU machine: corpus.tar.xz -> corpus/ + cache/, checked
    python3 benchmarks/quality/corpus.py --smoke      # a tiny corpus (a few sources, ~2 MB) for the CPU smoke
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import html.parser
import json
import lzma
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent.parent) not in sys.path:  # lintime from this checkout when it is not installed
    sys.path.insert(0, str(HERE.parent.parent))
DEFAULT_DATA = HERE / "data"
MANIFEST = HERE / "corpus_manifest.json"
ARCHIVE = "corpus.tar.xz"
FIXED_MTIME = 1_767_225_600  # 2026-01-01T00:00:00Z: every document's mtime (reproducible cache identity)
VAL_FRACTION = TEST_FRACTION = 0.05  # lintime's defaults (docs/data.md)
XZ_PRESET = 6  # xz -9 gains ~1 % here at twice the time and 10x the memory
PACKAGES = ("linux-doc", "python3.11-doc", "perl-doc", "postgresql-doc-15", "git-doc", "cmake-doc", "sqlite3-doc",
            "rust-doc", "tcl8.6-doc", "manpages", "manpages-dev", "debian-reference-en", "golang-1.19-doc")
MIN_DOC_BYTES = 64  # shorter documents (stubs, redirects) are left out
RUST_BOOKS = ("book", "reference", "nomicon", "rust-by-example", "edition-guide", "embedded-book", "cargo",
              "rustc", "rustdoc", "unstable-book", "style-guide")


# ------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    """One part of the corpus: the files of Debian package ``package`` under ``root`` whose path
    (relative to ``root``) ``keep`` accepts, converted by ``convert`` (``text``: as they are; ``html``:
    stripped to text; ``py``: lintime's stdlib corpus)."""

    name: str
    package: str | None
    root: str
    keep: object  # callable(rel: str) -> bool
    convert: str = "text"
    smoke: bool = False  # part of the --smoke corpus


def _ext(rel: str) -> str:
    base = rel[:-3] if rel.endswith(".gz") else rel
    return os.path.splitext(base)[1].lower()


def _linux(rel: str) -> bool:
    return rel.startswith("Documentation/") and _ext(rel) in (".rst", ".txt", ".yaml", "")


def _rust(rel: str) -> bool:
    parts = rel.split("/")
    if not rel.endswith(".html") or parts[-1] in ("print.html", "404.html", "toc.html"):
        return False
    return parts[0] in RUST_BOOKS or (len(parts) == 1 and rel != "index.html")


SOURCES: tuple[Source, ...] = (
    Source("linux-doc", "linux-doc-6.1", "/usr/share/doc/linux-doc-6.1", _linux),
    Source("python-doc", "python3.11-doc", "/usr/share/doc/python3.11/html/_sources",
           lambda r: _ext(r) == ".txt", smoke=True),
    Source("perl-doc", "perl-doc", "/usr/share/perl/5.36.0/pod", lambda r: _ext(r) == ".pod"),
    Source("postgresql-doc", "postgresql-doc-15", "/usr/share/doc/postgresql-doc-15/html",
           lambda r: _ext(r) == ".html", "html", smoke=True),
    Source("git-doc", "git-doc", "/usr/share/doc/git-doc", lambda r: _ext(r) == ".txt"),
    Source("cmake-doc", "cmake-doc", "/usr/share/doc/cmake-data/html/_sources", lambda r: _ext(r) == ".txt"),
    Source("sqlite-doc", "sqlite3-doc", "/usr/share/doc/sqlite3", lambda r: _ext(r) == ".html", "html"),
    Source("rust-doc", "rust-doc", "/usr/share/doc/rust-doc/html", _rust, "html"),
    Source("tcl-doc", "tcl8.6-doc", "/usr/share/man/man3", lambda r: r.endswith(".3tcl.gz")),
    Source("manpages", "manpages", "/usr/share/man", lambda r: True),
    Source("manpages-dev", "manpages-dev", "/usr/share/man", lambda r: True),
    Source("debian-reference", "debian-reference-en", "/usr/share/debian-reference", lambda r: _ext(r) == ".txt"),
    Source("golang-doc", "golang-1.19-doc", "/usr/share/doc/golang-1.19-doc/html", lambda r: _ext(r) == ".html", "html"),
    Source("python-stdlib", None, "", lambda r: True, "py"),
)


def package_version(name: str) -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def package_files(package: str) -> list[str]:
    """The regular files (not links) a Debian package installed, sorted."""
    try:
        out = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted(p for p in out.splitlines() if p and os.path.isfile(p) and not os.path.islink(p))


def source_files(src: Source) -> list[tuple[str, Path]]:
    """``[(document name, file)]`` of one source, in document order."""
    if src.convert == "py":
        from lintime.data import open_corpus

        stdlib = open_corpus("stdlib")
        return sorted((f"{src.name}/{s.key}", Path(s.path)) for s in stdlib.sources)
    root = src.root.rstrip("/") + "/"
    out = []
    for path in package_files(src.package):
        if not path.startswith(root):
            continue
        rel = path[len(root):]
        if src.keep(rel):
            name = rel[:-3] if rel.endswith(".gz") else rel
            out.append((f"{src.name}/{name}", Path(path)))
    return sorted(out)


# ------------------------------------------------------------------------------------------- HTML -> text


class _TextExtractor(html.parser.HTMLParser):
    """Visible text of an HTML page: scripts, styles, navigation, headers/footers and sidebars
    dropped; block elements end lines; runs of blank lines collapsed."""

    SKIP = {"script", "style", "nav", "head", "header", "footer", "noscript", "svg", "button", "form"}
    BLOCK = {"p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "pre", "section", "article",
             "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "hr", "title", "td", "th", "caption", "figure"}
    VOID = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "track", "wbr"}
    SKIP_CLASS = {"sidebar", "navbar", "navheader", "navfooter", "nav-chapters", "menu-bar", "toc", "breadcrumb",
                  "breadcrumbs", "mobile-nav-chapters", "search-wrapper", "searchbar-outer", "headerlink",
                  "sphinxsidebar", "related", "footer"}  # whole class / id tokens

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.stack: list[tuple[str, bool]] = []  # (tag, opened a skipped region)
        self.skip = 0
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            if tag == "br" and not self.skip:
                self.parts.append("\n")
            return
        a = dict(attrs)
        names = f"{a.get('class') or ''} {a.get('id') or ''}".lower().split()
        skipped = tag in self.SKIP or any(n in self.SKIP_CLASS for n in names)
        self.stack.append((tag, skipped))
        self.skip += skipped
        if tag == "pre":
            self.pre += 1
        if not self.skip and tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        # pop to the matching tag (HTML in the wild leaves some unclosed)
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                for t, s in self.stack[i:]:
                    self.skip -= s
                    if t == "pre":
                        self.pre -= 1
                del self.stack[i:]
                break
        if not self.skip and tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if self.skip:
            return
        if self.pre:
            self.parts.append(data)
        else:
            data = re.sub(r"[ \t\r\n\f\v]+", " ", data)
            if not self.parts or self.parts[-1].endswith("\n"):
                data = data.lstrip(" ")
            if data:
                self.parts.append(data)

    def text(self) -> str:
        out = "".join(self.parts)
        out = re.sub(r"[ \t]+\n", "\n", out)
        out = re.sub(r"\n{3,}", "\n\n", out)
        return out.strip() + "\n"


def html_to_text(page: str) -> str:
    p = _TextExtractor()
    p.feed(page)
    p.close()
    return p.text()


# ------------------------------------------------------------------------------------------- build


def split_of(name: str) -> str:
    """lintime's path-hash split of a document name (``docs/data.md``)."""
    u = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64
    return "test" if u < TEST_FRACTION else "validation" if u < TEST_FRACTION + VAL_FRACTION else "train"


def read_document(path: Path, convert: str) -> tuple[bytes | None, str]:
    """The document's bytes, or ``(None, why it was left out)``."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError):
            return None, "bad gzip"
    if b"\0" in raw:
        return None, "binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    if convert == "html":
        text = html_to_text(text)
        raw = text.encode("utf-8")
    if len(raw.strip()) < MIN_DOC_BYTES:
        return None, f"under {MIN_DOC_BYTES} bytes"
    return raw, ""


def build(data: Path, *, smoke: bool = False, echo=print) -> dict:
    """Write ``data/corpus/`` (replacing it) and return the manifest's ``sources`` / ``splits``."""
    corpus = data / "corpus"
    if corpus.exists():
        shutil.rmtree(corpus)
    corpus.mkdir(parents=True)
    sources, splits, missing = {}, {s: {"docs": 0, "bytes": 0} for s in ("train", "validation", "test")}, []
    seen: set[str] = set()
    for src in SOURCES:
        if smoke and not src.smoke:
            continue
        version = platform.python_version() if src.convert == "py" else package_version(src.package)
        if version is None:
            missing.append(src.package)
            echo(f"corpus: {src.name}: package {src.package} is not installed, skipped")
            continue
        t0 = time.perf_counter()
        rec = {"package": src.package or f"python{platform.python_version()} stdlib", "version": version,
               "root": src.root or "stdlib", "convert": src.convert, "files": 0, "bytes": 0, "skipped": {}}
        files = source_files(src)
        if smoke:
            files = files[:: max(1, len(files) // 120)][:120]
        for name, path in files:
            if name in seen:  # two packages sharing a man-page folder list only their own files; defensive
                continue
            body, why = read_document(path, src.convert)
            if body is None:
                rec["skipped"][why] = rec["skipped"].get(why, 0) + 1
                continue
            seen.add(name)
            dest = corpus / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(body)
            os.utime(dest, (FIXED_MTIME, FIXED_MTIME))
            rec["files"] += 1
            rec["bytes"] += len(body)
            s = splits[split_of(name)]
            s["docs"] += 1
            s["bytes"] += len(body)
        sources[src.name] = rec
        echo(f"corpus: {src.name:16s} {rec['files']:6,} files {rec['bytes'] / 1e6:8.2f} MB "
             f"({src.package or 'python'} {version}; {time.perf_counter() - t0:.0f} s"
             + (f"; skipped {rec['skipped']}" if rec["skipped"] else "") + ")")
    return {"sources": sources, "missing_packages": missing, "split_bytes": splits}


def content_sha256(corpus: Path) -> str:
    """sha256 over (name, sha256 of bytes) of every document in name order."""
    h = hashlib.sha256()
    for p in sorted(corpus.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(corpus).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def write_archive(data: Path) -> Path:
    """corpus/ as a deterministic tar.xz (sorted members, fixed owner and mtime)."""
    out = data / ARCHIVE
    tmp = out.with_suffix(".tmp")
    members = sorted(p for p in (data / "corpus").rglob("*") if p.is_file())
    with lzma.open(tmp, "wb", format=lzma.FORMAT_XZ, preset=XZ_PRESET) as xz, \
            tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in members:
            info = tar.gettarinfo(str(path), arcname=path.relative_to(data).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o644
            info.mtime = FIXED_MTIME
            info.pax_headers = {}
            with open(path, "rb") as f:
                tar.addfile(info, f)
    tmp.replace(out)
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def token_cache(data: Path, quiet: bool = True) -> dict:
    """Build (or reuse) lintime's byte-tokenizer cache of ``data/corpus``; ``{split: {docs, tokens, bytes}}``."""
    from lintime.data import prepare

    result = prepare(data / "corpus", "byte", data / "cache", quiet=quiet)
    return {s: {"docs": ds.n_docs, "tokens": ds.n_tokens, "bytes": ds.n_bytes} for s, ds in result.items()}


def unpack(data: Path, manifest: dict | None) -> dict:
    """The GPU machine's step: unpack ``corpus.tar.xz``, check it against the manifest, build the cache."""
    src = data / ARCHIVE
    if not src.exists():
        raise SystemExit(f"corpus --unpack: {src} not found (carry benchmarks/quality/data/{ARCHIVE})")
    if (data / "corpus").exists():
        shutil.rmtree(data / "corpus")
    if (data / "cache").exists():
        shutil.rmtree(data / "cache")
    with tarfile.open(src, "r:xz") as tar:
        tar.extractall(data, filter="data")  # keeps the fixed mtimes
    splits = token_cache(data)
    if manifest is not None:
        digest = content_sha256(data / "corpus")
        if digest != manifest["content_sha256"]:
            raise SystemExit(f"corpus --unpack: the unpacked text differs from the manifest's "
                             f"(sha256 {digest[:12]} vs {manifest['content_sha256'][:12]})")
        for s, v in splits.items():
            want = manifest["splits"][s]
            if (v["docs"], v["tokens"]) != (want["docs"], want["tokens"]):
                raise SystemExit(f"corpus --unpack: split {s} has {v}, the manifest {want}")
    return splits


def install(echo=print) -> None:
    subprocess.run(["apt-get", "update"], check=True, stdout=subprocess.DEVNULL)
    have = [p for p in PACKAGES if subprocess.run(["apt-cache", "show", p], capture_output=True).returncode == 0]
    echo(f"corpus: apt-get install {' '.join(have)}")
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *have], check=True,
                   env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="output folder (default %(default)s)")
    ap.add_argument("--manifest", type=Path, default=None,
                    help=f"manifest to write / check (default {MANIFEST.name} beside this script; "
                         "--smoke: data/corpus_manifest_smoke.json)")
    ap.add_argument("--install", action="store_true", help="apt-get the packages first (needs network, root)")
    ap.add_argument("--unpack", action="store_true", help="unpack the archive into corpus/ + cache/ and check it")
    ap.add_argument("--smoke", action="store_true", help="a tiny corpus (~240 documents) for the CPU smoke")
    ap.add_argument("--no-archive", action="store_true", help="build the corpus and cache only")
    args = ap.parse_args(argv)
    data: Path = args.data
    manifest_path = args.manifest or (data / "corpus_manifest_smoke.json" if args.smoke else MANIFEST)
    t0 = time.perf_counter()
    if args.unpack:
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
        splits = unpack(data, manifest)
        print(f"corpus: unpacked {data / ARCHIVE} in {time.perf_counter() - t0:.1f} s; "
              + ", ".join(f"{s} {v['tokens']:,} tokens" for s, v in splits.items())
              + ("" if manifest else " (no manifest to check against)"))
        return 0
    if args.install:
        install()
    data.mkdir(parents=True, exist_ok=True)
    built = build(data, smoke=args.smoke)
    splits = token_cache(data, quiet=False)
    manifest = {
        "what": "issue 43's corpus: real text from Debian documentation packages and the Python standard library "
                "(benchmarks/quality/corpus.py)",
        "smoke": args.smoke,
        "built_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "python": platform.python_version(),
        "split_rule": f"lintime path-hash rule on '<source>/<path>' (docs/data.md): validation {VAL_FRACTION}, "
                      f"test {TEST_FRACTION}",
        "tokenizer": "byte (1 byte = 1 token; <eos> between documents added at packing)",
        "documents": sum(v["files"] for v in built["sources"].values()),
        "bytes": sum(v["bytes"] for v in built["sources"].values()),
        "sources": built["sources"],
        "missing_packages": built["missing_packages"],
        "splits": splits,
        "content_sha256": content_sha256(data / "corpus"),
    }
    if not args.no_archive:
        out = write_archive(data)
        manifest["archive"] = {"file": f"benchmarks/quality/data/{ARCHIVE}", "bytes": out.stat().st_size,
                               "sha256": file_sha256(out), "xz_preset": XZ_PRESET}
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    train = splits["train"]["tokens"]
    print(f"corpus: {manifest['documents']:,} documents, {manifest['bytes'] / 1e6:.1f} MB; "
          + ", ".join(f"{s} {v['tokens']:,} tokens" for s, v in splits.items())
          + (f"; archive {manifest['archive']['bytes'] / 2**20:.1f} MiB" if "archive" in manifest else "")
          + f"; {time.perf_counter() - t0:.0f} s; manifest {manifest_path}")
    if not args.smoke and train < 60_000_000:
        print(f"corpus: WARNING: the train split has {train:,} tokens, below issue 43's 60M", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
