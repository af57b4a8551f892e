"""Building a static store: tokenize documents, write the stream, sort the reversed
suffixes, record provenance, publish atomically.

Safe to interrupt: everything is written into a hidden sibling directory
``.NAME.building-PID-XXXX`` and renamed onto the target only after meta.json (written
last) is complete, so a killed build never leaves a directory that opens as a store.
Stale build directories of dead processes are removed by the next build of the same
target.

Memory stays bounded while tokenizing (batches are appended to a file); the suffix
array step holds the stream and pydivsufsort's byte-level working arrays in memory
(about 20 bytes per token with 2-byte symbols).
"""
from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pydivsufsort
from tqdm.auto import tqdm

from datastores.common import SEP, DatastoreError, cache_dir
from datastores.fingerprint import tokenizer_fingerprint
from datastores.sources import DocumentSource, iter_documents, python_version_tag
from datastores.static import (
    FORMAT_NAME,
    FORMAT_VERSION,
    META_NAME,
    TOKENS_NAME,
    TokenDatastore,
    file_record,
    index_dtype,
)

BATCH_CHARS = 1 << 20  # text per tokenizer call: big enough to use the Rust threads
BATCH_DOCS = 512

__all__ = ["TooManyTokens", "build_datastore", "build_from_token_documents", "reversed_suffix_array"]


class TooManyTokens(DatastoreError):
    """A build with refuse_past found more tokens than its cap (`limit`)."""

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


def _tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def reversed_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Suffix array of ``tokens[::-1]`` as forward end positions.

    tokens: (N,) uint32, SEP = 0xFFFFFFFF between documents.
    returns (N,) uint32 (uint64 if N >= 2**32): ``sa[r] = i`` means the backward string
    starting at forward position i has rank r.

    pydivsufsort sorts big-endian bytes of the narrowest width holding the symbol range,
    so symbols are first remapped, order-preserving, to a small range: SEP becomes
    max(real token) + 1 (or, for vocabularies past 65535, every symbol becomes its rank
    among the distinct symbols). Half the bytes to sort for any vocabulary under 65535.
    """
    n = int(tokens.size)
    rev = np.ascontiguousarray(tokens[::-1], dtype=np.uint32)  # (N,) reversed stream
    is_sep = rev == SEP
    real_max = int(rev[~is_sep].max()) if (~is_sep).any() else 0
    if real_max + 1 < SEP:
        rev[is_sep] = real_max + 1
    del is_sep
    if int(rev.max()) - int(rev.min()) >= 1 << 16:
        uniq, inv = np.unique(rev, return_inverse=True)
        if uniq.size <= 1 << 16:
            rev = inv.astype(np.uint32)
        del uniq, inv
    j = pydivsufsort.divsufsort(rev)  # (N,) int32/int64 start indices in the reversed stream
    del rev
    out_dtype = np.uint32 if n < 2**32 else np.uint64
    sa = np.empty(n, dtype=out_dtype)
    np.subtract(n - 1, j, out=sa, casting="unsafe")  # forward end position i = N-1-j
    return sa


def _dead_end_ranks(tokens: np.ndarray, sa: np.ndarray) -> np.ndarray:
    """Sorted SA ranks of positions without a continuation (followed by SEP or the end)."""
    dead = np.zeros(tokens.size, dtype=bool)  # (N,)
    dead[-1] = True
    dead[:-1] = tokens[1:] == SEP
    return np.flatnonzero(dead[sa]).astype(sa.dtype)  # (n_dead,) ranks, ascending


def _as_sources(documents) -> list[DocumentSource]:
    if isinstance(documents, DocumentSource):
        return [documents]
    if isinstance(documents, (list, tuple)) and documents and all(isinstance(d, DocumentSource) for d in documents):
        return list(documents)
    return [iter_documents(documents)]


def _clean_stale(parent: Path, name: str) -> None:
    """Remove build directories of this target left by processes that no longer exist."""
    for d in parent.glob(f".{name}.building-*"):
        try:
            pid = int(d.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, IndexError, PermissionError, OSError):
            pass


def _disk_error(exc: OSError, where: Path) -> DatastoreError:
    if exc.errno == errno.ENOSPC:
        free = shutil.disk_usage(where).free if where.exists() else 0
        return DatastoreError(f"out of disk space while building in {where} ({free / 2**30:.1f} GiB free); "
                              "free space (about 12 bytes per token) or build elsewhere / with --max-tokens")
    return DatastoreError(f"I/O error while building in {where}: {exc}")


class _BatchCache:
    """Tokenized batches kept on disk by content hash, so a rerun of an interrupted (or
    repeated) build skips the batches it already tokenized. Keyed by the tokenizer
    fingerprint and the batch's exact texts, so an entry can never be stale."""

    def __init__(self, root: Path, fingerprint: str):
        self.root = Path(root) / fingerprint[:16]
        self.fingerprint = fingerprint
        self.hits = self.misses = 0

    def _path(self, texts: list[str]) -> Path:
        h = hashlib.sha256(self.fingerprint.encode())
        for t in texts:
            h.update(len(t).to_bytes(8, "little"))
            h.update(t.encode("utf-8", "surrogatepass"))
        key = h.hexdigest()
        return self.root / key[:2] / f"{key}.npz"

    def get(self, texts: list[str]) -> list[np.ndarray] | None:
        path = self._path(texts)
        try:
            with np.load(path, allow_pickle=False) as z:
                ids, lengths = z["ids"], z["lengths"]
            if lengths.size != len(texts) or int(lengths.sum()) != ids.size:
                raise ValueError("inconsistent entry")
        except (OSError, ValueError, KeyError):
            self.misses += 1
            return None
        self.hits += 1
        return np.split(ids.astype(np.int64), np.cumsum(lengths)[:-1])

    def put(self, texts: list[str], enc: list[list[int]]) -> None:
        path = self._path(texts)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            ids = [np.asarray(x, dtype=np.uint32) for x in enc]
            np.savez(f, ids=np.concatenate(ids) if ids else np.empty(0, dtype=np.uint32),
                     lengths=np.array([len(ids) for ids in enc], dtype=np.int64))
        os.replace(tmp, path)


def _tokenize_to_file(sources: list[DocumentSource], tokenizer, out_file: Path, max_tokens: int | None,
                      progress: bool, cache: _BatchCache | None = None) -> dict:
    """Tokenize every document into out_file (uint32, SEP between documents)."""
    total = sum(s.total_bytes or 0 for s in sources) or None
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not progress, smoothing=0.05)
    state = {"n_tokens": 0, "n_docs": 0, "truncated": False}
    tf_logger = logging.getLogger("transformers.tokenization_utils_base")
    old_level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)  # "sequence longer than model max length" is irrelevant here

    def flush(f: BinaryIO, texts: list[str]) -> None:
        enc = cache.get(texts) if cache is not None else None
        if enc is None:
            enc = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            if cache is not None:
                cache.put(texts, enc)
        parts = []
        for ids in enc:
            if not len(ids):
                continue
            room = None if max_tokens is None else max_tokens - state["n_tokens"] - (state["n_docs"] > 0)
            if room is not None and room <= 0:
                state["truncated"] = True
                break
            arr = np.asarray(ids, dtype=np.int64)
            if room is not None and arr.size > room:
                arr, state["truncated"] = arr[:room], True
            if state["n_docs"] > 0:
                parts.append(np.array([SEP], dtype=np.uint32))
            if arr.size and (arr.min() < 0 or arr.max() >= SEP):
                raise DatastoreError("the tokenizer produced an id outside [0, 2**32 - 1); cannot store it")
            parts.append(arr.astype(np.uint32))
            state["n_tokens"] += arr.size + (state["n_docs"] > 0)
            state["n_docs"] += 1
        if parts:
            np.concatenate(parts).astype("<u4").tofile(f)

    try:
        with open(out_file, "wb") as f:
            for src in sources:
                batch, chars, seen = [], 0, 0
                for _doc_id, text in src:
                    if not text.strip():
                        src.counts["skipped_empty"] += 1
                        continue
                    batch.append(text)
                    chars += len(text)
                    if src.total_bytes is not None:
                        now = src.counts.get("bytes", 0)
                        bar.update(now - seen)
                        seen = now
                    else:
                        bar.update(len(text))
                    if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                        flush(f, batch)
                        batch, chars = [], 0
                        if state["truncated"]:
                            break
                if batch and not state["truncated"]:
                    flush(f, batch)
                bar.set_postfix(tokens=f"{state['n_tokens']:,}")
                if state["truncated"]:
                    break
    finally:
        tf_logger.setLevel(old_level)
        bar.close()
    return state


def build_datastore(out_path: str | Path, tokenizer: Any,
                    documents: Iterable[tuple[str, str]] | DocumentSource | list[DocumentSource], *,
                    progress: bool = True, max_tokens: int | None = None, overwrite: bool = False,
                    resume: bool = False, refuse_past: bool = False) -> TokenDatastore:
    """Tokenize documents into a new store at out_path and open it.

    documents: an iterable of ``(doc_id, text)``, a `DocumentSource` (see
    ``iter_python_sources`` / ``iter_text_files`` / ``iter_jsonl``) or a list of them.
    max_tokens caps the stream (separators included); the last document is cut to fit, or, with
    refuse_past, the build stops there (tokenizing ends with the batch that reached the cap) and
    raises `TooManyTokens` without sorting or publishing anything.
    overwrite replaces an existing store at out_path (never a non-store directory).
    resume keeps tokenized batches under ``cache_dir()/token-batches`` (about 4 bytes per
    token) so rerunning an interrupted or repeated build skips finished batches.
    """
    out = _check_target(out_path, overwrite, max_tokens)
    sources = _as_sources(documents)
    tok_info = {"name": _tokenizer_name(tokenizer), "fingerprint": tokenizer_fingerprint(tokenizer),
                "vocab_size": len(tokenizer.get_vocab())}

    cache = _BatchCache(cache_dir() / "token-batches", tok_info["fingerprint"]) if resume else None

    def write_tokens(path: Path) -> dict:
        state = _tokenize_to_file(sources, tokenizer, path, max_tokens, progress, cache)
        if cache is not None:
            state["cached_batches"] = cache.hits
        return state

    return _build(out, write_tokens, tok_info, lambda: [s.record() for s in sources], max_tokens, refuse_past)


def build_from_token_documents(out_path: str | Path, documents: Iterable[Sequence[int]], tokenizer: Any = None, *,
                               tokenizer_info: dict | None = None, overwrite: bool = False,
                               max_tokens: int | None = None) -> TokenDatastore:
    """A store from already tokenized documents (lists/arrays of ids in [0, 2**32-1)).

    The tokenizer (or ``tokenizer_info`` = {"name", "fingerprint", "vocab_size"}) is
    recorded so that opening with a tokenizer can still refuse a mismatch.
    """
    out = _check_target(out_path, overwrite, max_tokens)
    if tokenizer is not None:
        tok_info = {"name": _tokenizer_name(tokenizer), "fingerprint": tokenizer_fingerprint(tokenizer),
                    "vocab_size": len(tokenizer.get_vocab())}
    else:
        tok_info = {"name": "pre-tokenized", "fingerprint": None, "vocab_size": None, **(tokenizer_info or {})}
    state = {"n_tokens": 0, "n_docs": 0, "truncated": False}

    def write_tokens(path: Path) -> dict:
        with open(path, "wb") as f:
            for doc in documents:
                arr = np.asarray(doc, dtype=np.int64)  # (len,)
                if arr.size == 0:
                    continue
                if arr.min() < 0 or arr.max() >= SEP:
                    raise DatastoreError("a document holds a token id outside [0, 2**32 - 1); "
                                         "ids must be non-negative and below the separator 0xFFFFFFFF")
                room = None if max_tokens is None else max_tokens - state["n_tokens"] - (state["n_docs"] > 0)
                if room is not None and room < arr.size:
                    state["truncated"] = True
                    if room <= 0:
                        break
                    arr = arr[:room]
                if state["n_docs"]:
                    np.array([SEP], dtype="<u4").tofile(f)
                arr.astype("<u4").tofile(f)
                state["n_tokens"] += arr.size + (state["n_docs"] > 0)
                state["n_docs"] += 1
        return state

    return _build(out, write_tokens, tok_info,
                  lambda: [{"kind": "token-documents", "paths": [], "counts": {"documents": state["n_docs"]}}],
                  max_tokens)


def _check_target(out_path, overwrite: bool, max_tokens: int | None) -> Path:
    out = Path(out_path).absolute()
    if max_tokens is not None and max_tokens < 1:
        raise DatastoreError(f"max_tokens={max_tokens}: pass a positive token limit (or none)")
    if out.exists():
        if not out.is_dir() or (any(out.iterdir()) and not (out / META_NAME).exists()):
            raise DatastoreError(f"{out} exists and is not a datastore; choose another output path")
        if (out / META_NAME).exists() and not overwrite:
            raise DatastoreError(f"a datastore already exists at {out}; pass --force (overwrite=True) to replace it")
    return out


def _build(out: Path, write_tokens, tok_info: dict, source_records, max_tokens: int | None,
           refuse_past: bool = False) -> TokenDatastore:
    """Shared tail of every build: stream file -> suffix array -> checksums -> meta -> publish."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _disk_error(exc, out.parent) from None
    _clean_stale(out.parent, out.name)
    tmp = out.parent / f".{out.name}.building-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        t0 = time.perf_counter()
        state = write_tokens(tmp / TOKENS_NAME)
        tokenize_s = time.perf_counter() - t0
        n = state["n_tokens"]
        if refuse_past and state["truncated"]:
            raise TooManyTokens(f"the documents hold more than {max_tokens:,} tokens", max_tokens or 0)
        if n == 0:
            detail = "; ".join(f"{r['kind']} {r['paths']}: {r['counts']}" for r in source_records())
            raise DatastoreError(f"the corpus is empty: no document produced a token ({detail}); "
                                 "check the source paths, --suffix filters and --field")
        need = 12 * n
        if shutil.disk_usage(tmp).free < need:
            raise DatastoreError(f"not enough disk space in {out.parent} for the suffix array "
                                 f"(need about {need / 2**30:.2f} GiB); free space or build elsewhere")
        t1 = time.perf_counter()
        tokens = np.fromfile(tmp / TOKENS_NAME, dtype="<u4")  # (N,)
        sa = reversed_suffix_array(tokens)  # (N,) forward end positions in reversed-suffix order
        suffix_array_s = time.perf_counter() - t1
        _, suffix = index_dtype(n)
        sa.tofile(tmp / f"sa.{suffix}")
        _dead_end_ranks(tokens, sa).tofile(tmp / f"ends.{suffix}")
        del tokens, sa
        files = {name: file_record(tmp / name) for name in (TOKENS_NAME, f"sa.{suffix}", f"ends.{suffix}")}
        total_bytes = sum(r["size"] for r in files.values())
        build = {
            "tokenize_s": round(tokenize_s, 3),
            "suffix_array_s": round(suffix_array_s, 3),
            "tokenize_tokens_per_s": round(n / max(tokenize_s, 1e-9), 1),
            "suffix_array_tokens_per_s": round(n / max(suffix_array_s, 1e-9), 1),
            "bytes_per_token": round(total_bytes / n, 3),
            "total_bytes": total_bytes,
            "truncated": bool(state["truncated"]),
            "max_tokens": max_tokens,
            "cached_batches": state.get("cached_batches"),
            "python": python_version_tag(),
        }
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "tokenizer": tok_info,
            "sources": source_records(),
            "n_tokens": n,
            "n_docs": state["n_docs"],
            "sep": SEP,
            "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "build": build,
            "files": files,
        }
        (tmp / (META_NAME + ".part")).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(tmp / (META_NAME + ".part"), tmp / META_NAME)
        _publish(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _disk_error(exc, out.parent) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    store = TokenDatastore.open(out)
    store.pair_bits(wait=True)  # its first-token table and pair bits built and saved with it, for its first lookups
    return store


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished build onto out; an older store there is replaced, not merged."""
    if out.exists():
        trash = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
        os.rename(out, trash)
        os.rename(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, out)
