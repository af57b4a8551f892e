"""Where documents come from: Python source trees, text files, JSONL.

Each source is a `DocumentSource`: iterating it yields ``(doc_id, text)`` pairs and
fills ``counts`` as it goes (documents yielded, files skipped and why), so a build can
record exactly what it ingested. Unreadable, binary, undecodable or oversized files
are skipped and counted, never fatal: a corpus of thousands of files always has a few.
Traversal is sorted, so the same tree always yields the same stream.
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from datastores.common import DatastoreError

MAX_FILE_BYTES = 4 << 20  # larger files are nearly always generated tables, poor drafts
SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".tox", ".mypy_cache", ".pytest_cache"}

__all__ = [
    "DocumentSource",
    "default_python_roots",
    "iter_documents",
    "iter_jsonl",
    "iter_python_sources",
    "iter_text_files",
    "site_packages_roots",
    "stdlib_root",
]


class DocumentSource:
    """An iterable of ``(doc_id, text)`` that counts what it read and skipped.

    ``kind`` and ``paths`` describe it in meta.json; ``total_bytes`` (when known) sizes
    the progress bar; ``counts`` is a Counter filled during iteration.
    """

    def __init__(self, kind: str, paths: Sequence[str], produce: Callable[[DocumentSource], Iterator[tuple[str, str]]],
                 total_bytes: int | None = None):
        self.kind = kind
        self.paths = [str(p) for p in paths]
        self._produce = produce
        self.total_bytes = total_bytes
        self.counts: Counter = Counter()

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for doc in self._produce(self):
            self.counts["documents"] += 1
            yield doc

    def record(self) -> dict:
        """What meta.json keeps about this source."""
        return {"kind": self.kind, "paths": self.paths, "counts": dict(sorted(self.counts.items()))}

    def __repr__(self) -> str:
        return f"DocumentSource({self.kind!r}, {self.paths!r})"


def iter_documents(pairs: Iterable[tuple[str, str]], kind: str = "documents") -> DocumentSource:
    """Wrap any iterable of (doc_id, text) pairs so a build can count it."""
    def produce(src: DocumentSource) -> Iterator[tuple[str, str]]:
        for doc_id, text in pairs:
            yield str(doc_id), text
    return DocumentSource(kind, [], produce)


def _read_text(path: Path, counts: Counter, max_bytes: int) -> str | None:
    """File contents as text, or None (counted under the reason) when it is not usable text."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            counts["skipped_too_large"] += 1
            return None
        data = path.read_bytes()
    except OSError:
        counts["skipped_unreadable"] += 1
        return None
    if b"\x00" in data[:8192]:
        counts["skipped_binary"] += 1
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        counts["skipped_undecodable"] += 1
        return None
    counts["files"] += 1
    counts["bytes"] += len(data)
    return text


def _walk_files(roots: Sequence[Path], suffixes: tuple[str, ...] | None, prune: Callable[[Path, Path], bool],
                counts: Counter) -> list[Path]:
    """Sorted, de-duplicated (by real path) files under roots that end in one of suffixes."""
    seen: set[str] = set()
    out: list[Path] = []

    def take(p: Path) -> None:
        if suffixes and not p.name.endswith(suffixes):
            return
        try:
            real = os.path.realpath(p)
        except OSError:
            counts["skipped_unreadable"] += 1
            return
        if real not in seen:
            seen.add(real)
            out.append(p)

    for root in roots:
        root = Path(root)
        if root.is_file():
            take(root)
            continue
        if not root.is_dir():
            raise DatastoreError(f"source path {root} does not exist; pass an existing file or folder")
        for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: counts.update(["skipped_unreadable_dirs"])):
            d = Path(dirpath)
            dirnames[:] = sorted(x for x in dirnames if x not in SKIP_DIRS and not prune(root, d / x))
            for name in sorted(filenames):
                take(d / name)
    return out


def _file_source(kind: str, roots: Sequence[Path], suffixes: tuple[str, ...] | None,
                 prune: Callable[[Path, Path], bool], max_bytes: int) -> DocumentSource:
    counts: Counter = Counter()
    files = _walk_files(roots, suffixes, prune, counts)
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError:
            pass

    def produce(src: DocumentSource) -> Iterator[tuple[str, str]]:
        src.counts.update(counts)
        for f in files:
            text = _read_text(f, src.counts, max_bytes)
            if text is not None:
                yield str(f), text
    return DocumentSource(kind, roots, produce, total_bytes=total)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return _dedupe_existing([Path(paths["purelib"]), Path(paths["platlib"])])


def _dedupe_existing(paths: Iterable[Path]) -> list[Path]:
    out, seen = [], set()
    for p in paths:
        real = os.path.realpath(p)
        if real not in seen and Path(p).is_dir():
            seen.add(real)
            out.append(Path(p))
    return out


def default_python_roots() -> list[Path]:
    """The running interpreter's stdlib and site-packages, de-duplicated, existing only."""
    return _dedupe_existing([stdlib_root(), *site_packages_roots()])


def _prune_nested_site_packages(root: Path, d: Path) -> bool:
    """Inside the stdlib tree, skip the interpreter-wide site-packages: those are third
    party code; `--site-packages` covers the active environment's."""
    return d.parent == root and d.name in ("site-packages", "dist-packages")


def iter_python_sources(roots: Sequence[Path | str] | None = None,
                        max_file_bytes: int = MAX_FILE_BYTES) -> DocumentSource:
    """Every ``*.py`` file under roots (default: `default_python_roots()`)."""
    roots = [Path(r) for r in (default_python_roots() if roots is None else roots)]
    return _file_source("python", roots, (".py",), _prune_nested_site_packages, max_file_bytes)


def iter_text_files(paths: Sequence[Path | str], suffixes: Sequence[str] | None = None,
                    max_file_bytes: int = MAX_FILE_BYTES) -> DocumentSource:
    """Files (or every file under folders) in paths, optionally only those ending in suffixes."""
    sfx = tuple(suffixes) if suffixes else None
    return _file_source("files", [Path(p) for p in paths], sfx, lambda root, d: False, max_file_bytes)


def iter_jsonl(path: Path | str, field: str = "text") -> DocumentSource:
    """One document per JSON line, its text under ``field``; bad lines are counted and skipped."""
    path = Path(path)
    if not path.is_file():
        raise DatastoreError(f"JSONL file {path} does not exist; pass an existing .jsonl file")

    def produce(src: DocumentSource) -> Iterator[tuple[str, str]]:
        try:
            f = open(path, "rb")
        except OSError:
            src.counts["skipped_unreadable"] += 1
            return
        with f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    text = json.loads(raw.decode("utf-8")).get(field)
                except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                    src.counts["skipped_bad_lines"] += 1
                    continue
                if not isinstance(text, str):
                    src.counts["skipped_missing_field"] += 1
                    continue
                src.counts["bytes"] += len(raw)
                yield f"{path}:{lineno}", text
    return DocumentSource("jsonl", [path], produce, total_bytes=path.stat().st_size)


def python_version_tag() -> str:
    return f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
