"""The on-disk format of a static store: its files, meta.json and the checksums that tie them together.

A store is a directory:

* ``tokens.u32`` -- the token stream, little-endian uint32, documents joined by SEP.
* ``sa.u32`` / ``sa.u64`` -- suffix array of the *reversed* stream, stored as forward
  end positions ``i``; rank order = the order of the backward strings
  ``tokens[i], tokens[i-1], ..., tokens[0]`` (unsigned comparison, SEP = 0xFFFFFFFF,
  a string that runs off the start of the stream sorts before any longer string that
  begins with it).
* ``ends.u32`` / ``ends.u64`` -- sorted SA ranks of the positions with no continuation
  (the last token of each document). They can match but must not count, so a
  lookup subtracts them from each range with two ``searchsorted`` calls.
* ``meta.json`` -- provenance, sizes and checksums; written last, so a directory
  without a valid one is never a store.
* ``first-token-<hash>.i64`` -- derived, not part of the format: per token id t, the first
  rank whose backward string begins with t (ranks ending with t are one block, since the
  newest token leads every key). A lookup binary-searches that block only (~15 probes
  instead of ~26 in a 50M-token store). Written at build time, or computed and saved the
  first time an older store opens; the hash in its name ties it to ``tokens.u32``, and a
  store whose table is missing, stale or unwritable searches every rank (same results).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from datastores.common import DatastoreError
from rest_base.files import write_atomic

FORMAT_NAME = "rest-lab-token-datastore"
FORMAT_VERSION = 1
META_NAME = "meta.json"
TOKENS_NAME = "tokens.u32"
SAMPLE_BLOCKS = 16  # blocks hashed on open (cheap check)
SAMPLE_BLOCK_BYTES = 1 << 16

REQUIRED_META = {"format": str, "format_version": int, "tokenizer": dict, "sources": list,
                 "n_tokens": int, "n_docs": int, "built_at": str, "build": dict, "files": dict}


def rebuild_hint(path: Path | str) -> str:
    return f"rebuild it with `python -m rest_core datastore build {path} ...`"


def index_dtype(n_tokens: int) -> tuple[str, str]:
    """(numpy dtype, file suffix) for positions/ranks of a stream of n_tokens."""
    return ("<u4", "u32") if n_tokens < 2**32 else ("<u8", "u64")


def sample_hash(path: Path, size: int) -> str:
    """sha256 over the size and SAMPLE_BLOCKS evenly spaced blocks: a cheap on-open check
    that catches truncation, swapped files and most overwrites without reading it all."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            h.update(f.read())
        else:
            for off in np.linspace(0, size - SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS).astype(np.int64):
                f.seek(int(off))
                h.update(f.read(SAMPLE_BLOCK_BYTES))
    return h.hexdigest()


def full_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict:
    size = path.stat().st_size
    return {"size": size, "sample_sha256": sample_hash(path, size), "sha256": full_hash(path)}


def read_meta(path: Path) -> dict:
    """meta.json parsed and checked for completeness, else a DatastoreError saying why."""
    if not path.exists():
        raise DatastoreError(f"no datastore at {path}: the directory does not exist; "
                             f"build one with `python -m rest_core datastore build {path} ...`")
    if not path.is_dir():
        raise DatastoreError(f"{path} is a file, not a datastore directory; "
                             f"pass the directory that `python -m rest_core datastore build` created")
    meta_path = path / META_NAME
    if not meta_path.exists():
        raise DatastoreError(f"{path} is not a complete datastore: {META_NAME} is missing "
                             f"(an interrupted build?); {rebuild_hint(path)}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatastoreError(f"{meta_path} is corrupt ({exc}); {rebuild_hint(path)}") from None
    if not isinstance(meta, dict):
        raise DatastoreError(f"{meta_path} is corrupt (not a JSON object); {rebuild_hint(path)}")
    for key, typ in REQUIRED_META.items():
        if not isinstance(meta.get(key), typ):
            raise DatastoreError(f"{meta_path} is corrupt or incomplete (field {key!r} missing "
                                 f"or not a {typ.__name__}); {rebuild_hint(path)}")
    if meta["format"] != FORMAT_NAME:
        raise DatastoreError(f"{path} holds {meta['format']!r}, not a {FORMAT_NAME}; {rebuild_hint(path)}")
    if meta["format_version"] != FORMAT_VERSION:
        raise DatastoreError(f"{path} has format version {meta['format_version']}, this code reads "
                             f"version {FORMAT_VERSION}; {rebuild_hint(path)}")
    if meta["n_tokens"] < 1:
        raise DatastoreError(f"{meta_path} is corrupt (n_tokens < 1); {rebuild_hint(path)}")
    return meta


def save_beside(path: Path, data: bytes) -> None:
    """Save a derived table beside the store (best effort: a read-only store computes it again next time)."""
    try:
        write_atomic(path, data)
    except OSError:
        pass


def describe_store(path: Path, meta: dict) -> str:
    """A store's multi-line human summary from its meta.json (what `python -m rest_core datastore info` prints)."""
    m, b = meta, meta["build"]
    n_tokens, n_docs = int(meta["n_tokens"]), int(meta["n_docs"])
    tok = m["tokenizer"]
    sizes = {k: v["size"] for k, v in m["files"].items()}
    total = sum(sizes.values())
    lines = [f"datastore  {path}",
             f"tokenizer  {tok.get('name')}  (vocab {tok.get('vocab_size')}, "
             f"fingerprint {str(tok.get('fingerprint'))[:16]})",
             f"tokens     {n_tokens:,} in {n_docs:,} documents"
             + ("  (cut at --max-tokens)" if b.get("truncated") else ""),
             f"built      {m['built_at']}"]
    for s in m["sources"]:
        counts = ", ".join(f"{k} {v:,}" for k, v in s.get("counts", {}).items())
        lines.append(f"source     {s.get('kind')}: {', '.join(map(str, s.get('paths', []))) or '-'}  [{counts}]")
    if "tokenize_s" in b:
        lines.append(f"tokenize   {b['tokenize_s']:.1f} s  ({b.get('tokenize_tokens_per_s', 0):,.0f} tokens/s)")
        rate = b.get("suffix_array_tokens_per_s", 0)
        lines.append(f"suffix arr {b['suffix_array_s']:.1f} s  ({rate:,.0f} tokens/s)")
    lines.append("files      " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items())
                 + f"  = {total / n_tokens:.2f} bytes/token")
    return "\n".join(lines)
