"""The dense store: draft from the places of a corpus where the model's hidden state was near (source "dense").

Dense retrieval for speculative decoding (DReSD): for every position of a corpus the store keeps the model's
hidden state there at one layer -- centred, reduced by PCA to a few dozen dimensions, L2-normalised -- beside
the token stream.  At decode time the decoder hands the store the state that predicted the newest committed
token (kept from the verify pass it ran anyway, `see_state`); the store searches the nearest corpus positions
by inner product (faiss) and drafts the tokens that followed each place's next token (that next token stands
for the newest context token), repeated in proportion to similarity so the draft tree's counts rank them.  Asked
to (`match_next`) it keeps only places whose next token is the newest context token too; by default it keeps the
nearest whatever their next token, which covered two to four times as many of the steps the text sources miss.
It matches meaning, not text: a phrase it has never seen verbatim is continued the way a similar state was.

A store is a directory:

* ``tokens.u32`` -- the token stream (documents joined by SEP), little-endian uint32;
* ``keys.f16`` -- (positions, dim) float16, the reduced and normalised state at each stream position (zeros
  where no search may find it: a separator, a document's last token);
* ``pca.npz`` -- the mean (d,) and the axes (d, dim) that reduce a state;
* ``meta.json`` -- the model's name and fingerprint, the tokenizer's fingerprint, the layer, the dimension, the
  sizes and each file's sha256; written last, so a directory without it is never a store.

Building needs the model, which lives above this package: the caller passes `states`, a function from a list of
token id lists to their (len, d) hidden states (rest_core.hidden.state_reader makes one, reading documents of
similar length together in padded passes).
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from datastores.common import (
    SEP,
    DatastoreError,
    Lookup,
    StoreBase,
    check_lookup_args,
    empty_lookup,
    gather_continuations,
)
from datastores.fingerprint import tokenizer_fingerprint
from datastores.store_format import full_hash
from rest_base.files import write_atomic

SOURCE = "dense"
FORMAT_VERSION = 1
DEFAULT_DIM = 64  # measured with the layer, k and the corpus: docs/bench/dense-coverage.md
NEIGHBOURS = 64  # positions searched per step (with `match_next`, the first `keep` of them whose next token fits)
KEEP = 32
ROWS_PER_STEP = 64  # continuation rows per step, shared by the kept neighbours in proportion to their weight
TEMPERATURE = 0.05  # a neighbour's weight is exp((similarity - best similarity) / TEMPERATURE)
FILES = ("tokens.u32", "keys.f16", "pca.npz")
# the search index (`search_index`): exact up to EXACT_UP_TO keys (a flat search there takes ~0.1 ms), else an
# inverted file whose searches scan 1/NPROBE_SHARE of its lists, at least MIN_PROBES
EXACT_UP_TO = 16384
NPROBE_SHARE = 16
MIN_PROBES = 8
TRAIN_PER_LIST = 64

CHUNK_TOKENS = 1024  # document tokens per call of `states` while building: about a second of the model's time on
# 2 cores (docs/bench/dense-build.md), so a server that decodes on the same model waits a second at most
# documents (token id lists) -> their hidden states, one (len, d) float array each, in the order given
States = Callable[[list[list[int]]], list[np.ndarray]]


def fit_pca(states: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The mean (d,) and the top `dim` principal axes (d, dim), largest first, of (n, d) states."""
    if not 1 <= dim <= states.shape[1]:
        raise DatastoreError(f"PCA dimension {dim} must be in 1..{states.shape[1]} (the state's width)")
    mean = states.mean(axis=0, dtype=np.float64)
    centred = states - mean
    cov = centred.T.astype(np.float64) @ centred / max(len(states), 1)
    _, vecs = np.linalg.eigh(cov)  # ascending eigenvalues
    return mean.astype(np.float32), np.ascontiguousarray(vecs[:, ::-1][:, :dim], dtype=np.float32)


def reduce_states(states: np.ndarray, mean: np.ndarray, axes: np.ndarray) -> np.ndarray:
    """(n, d) states -> (n, dim) float32: centred, projected on the axes, L2-normalised."""
    out = (np.asarray(states, dtype=np.float32) - mean) @ axes
    out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def build_dense_store(path: str | Path, documents: Iterable[tuple[Sequence[int], int]], states: States,
                      tokenizer: Any, model: dict, layer: int, dim: int = DEFAULT_DIM, progress: bool = True,
                      corpus: str = "", chunk_tokens: int = CHUNK_TOKENS) -> DenseStore:
    """Run `states` over every document once and write the store at `path` (replacing one there).

    documents: (token ids, first) pairs -- the states from position `first` on are keys, each followed by
    the document's next token (positions before `first` are read for context only, e.g. a request before its
    answer); states: called with chunks of documents of similar length (`chunks`, about `chunk_tokens` tokens
    each), so that it can read each chunk in a few padded passes; model: {"name", "fingerprint"} of the model
    `states` runs (its fingerprint ties the token ids to their embeddings; `tokenizer`, when given, is recorded
    too)."""
    path = Path(path)
    t0 = time.perf_counter()
    docs = [([int(t) for t in ids], first) for ids, first in documents]
    docs = [(ids, first) for ids, first in docs if 0 <= first < len(ids) - 1]  # else no position has a next token
    if not docs:
        raise DatastoreError("no document had a position to keep: pass documents of at least two tokens")
    found: list[Optional[np.ndarray]] = [None] * len(docs)
    done = 0
    for chunk in chunks([len(ids) for ids, _ in docs], chunk_tokens):
        read = list(states([docs[i][0] for i in chunk]))
        if len(read) != len(chunk):
            raise DatastoreError(f"states returned {len(read)} arrays for {len(chunk)} documents")
        for i, rows in zip(chunk, read):
            rows = np.asarray(rows)
            if rows.shape[0] != len(docs[i][0]):
                raise DatastoreError(f"states returned {rows.shape[0]} rows for a document of {len(docs[i][0])} "
                                     "tokens")
            found[i] = rows[docs[i][1]:].astype(np.float16)  # (len - first, d)
        done += len(chunk)
        if progress:
            print(f"\r  dense store: {done}/{len(docs)} documents read ({time.perf_counter() - t0:.0f} s)",
                  end="", flush=True)
    width = found[0].shape[1]
    tokens = np.array([t for ids, first in docs for t in (*ids[first:], SEP)], dtype=np.uint32)
    everything = np.concatenate([part for rows in found for part in (rows, np.zeros((1, width), np.float16))])
    searchable = _searchable(tokens)
    mean, axes = fit_pca(everything[searchable].astype(np.float32), dim)
    keys = np.zeros((len(tokens), dim), dtype=np.float16)
    for start in range(0, len(tokens), 65536):  # reduce in blocks: the float32 copy of every state is not needed
        block = slice(start, start + 65536)
        keys[block] = reduce_states(everything[block], mean, axes)
    keys[~searchable] = 0
    _write(path, tokens, keys, mean, axes, {
        "format": FORMAT_VERSION, "source": SOURCE, "model": dict(model), "layer": int(layer), "dim": int(dim),
        "tokenizer": {"name": getattr(tokenizer, "name_or_path", ""),
                      "fingerprint": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None},
        "positions": int(searchable.sum()), "tokens": int(len(tokens)), "documents": len(docs), "corpus": corpus,
        "build_seconds": round(time.perf_counter() - t0, 1)})
    if progress:
        print(f"\r  dense store: {len(docs)} documents, {int(searchable.sum()):,} positions in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    return DenseStore.open(path, tokenizer=tokenizer, model_fingerprint=model.get("fingerprint"))


def chunks(lengths: Sequence[int], chunk_tokens: int = CHUNK_TOKENS) -> list[list[int]]:
    """Indices of documents, longest first, in chunks of at most `chunk_tokens` tokens (a longer document is a
    chunk of its own): each chunk is one call of `states`, and documents of similar length share one."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    size = 0
    for i in order:
        if out and size + lengths[i] <= chunk_tokens:
            out[-1].append(i)
            size += lengths[i]
        else:
            out.append([i])
            size = lengths[i]
    return out


def _searchable(tokens: np.ndarray) -> np.ndarray:
    """(N,) bool: positions that may be found -- a real token followed by two real ones (the first must be the
    newest context token, the second is the first draft)."""
    real = tokens != SEP
    ok = real.copy()
    ok[-2:] = False
    ok[:-2] &= real[1:-1] & real[2:]
    return ok


def _write(path: Path, tokens: np.ndarray, keys: np.ndarray, mean: np.ndarray, axes: np.ndarray, meta: dict) -> None:
    """Files into a temporary sibling, meta.json last with their checksums, then one rename."""
    tmp = path.with_name(path.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokens.astype("<u4").tofile(tmp / "tokens.u32")
    keys.astype("<f2").tofile(tmp / "keys.f16")
    np.savez(tmp / "pca.npz", mean=mean, axes=axes)
    meta["files"] = {name: full_hash(tmp / name) for name in FILES}
    write_atomic(tmp / "meta.json", json.dumps(meta, indent=1).encode("utf-8"))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


class DenseStore(StoreBase):
    """A built dense store, searched with faiss; see the module docstring.

    `state_layer` tells the decoder which hidden state to hand over (`see_state`) after every pass."""

    source = SOURCE
    fallback = True  # looked up only where the text sources draft nothing worth a wider pass (rest_core.draft)
    exact_up_to = EXACT_UP_TO  # stores of at most this many positions are searched exactly

    def __init__(self, path: Path, meta: dict, tokens: np.ndarray, keys: np.ndarray, mean: np.ndarray,
                 axes: np.ndarray, name: str = ""):
        import faiss  # a runtime dependency of this source only

        self._faiss = faiss
        self.path, self.meta, self.name = path, meta, name or path.name
        self.tokens = tokens.astype(np.int64)  # (N,) SEP kept as 0xFFFFFFFF
        self.mean, self.axes = mean, axes
        self.state_layer = int(meta["layer"])
        self.model_fingerprint = meta["model"].get("fingerprint")
        self.positions = np.flatnonzero(_searchable(tokens))  # (n,) the stream position of each indexed key
        self.index = search_index(faiss, np.ascontiguousarray(keys[self.positions], dtype=np.float32),
                                  self.exact_up_to)
        self.neighbours_k, self.keep = NEIGHBOURS, KEEP
        # False (measured better: docs/bench/dense-coverage.md): draft after the `keep` nearest places whatever
        # their next token; True: only after places whose next token is the newest context token too
        self.match_next = False
        self._state: Optional[np.ndarray] = None  # the newest state handed over, and the token it predicted
        self._token = -1

    @classmethod
    def open(cls, path: str | Path, tokenizer: Any = None, model_fingerprint: Optional[str] = None,
             name: str = "") -> DenseStore:
        """Open a built store, refusing a damaged one, one of another tokenizer or (when given) another model."""
        path = Path(path)
        meta = _read_meta(path)
        for fname, digest in meta["files"].items():
            fpath = path / fname
            if not fpath.is_file() or full_hash(fpath) != digest:
                raise DatastoreError(f"{fpath} is missing or does not match its checksum (damaged); rebuild the "
                                     f"store: `python -m rest_core datastore dense {path} --force`")
        built_with = meta["tokenizer"].get("fingerprint")
        if tokenizer is not None and built_with is not None and tokenizer_fingerprint(tokenizer) != built_with:
            raise DatastoreError(f"{path} was built with another tokenizer ({meta['tokenizer'].get('name')!r}); "
                                 f"rebuild it for this model: `python -m rest_core datastore dense {path} --force`")
        if model_fingerprint is not None:
            _refuse_other_model(meta, model_fingerprint, path)
        tokens = np.fromfile(path / "tokens.u32", dtype="<u4")
        keys = np.fromfile(path / "keys.f16", dtype="<f2")
        dim = int(meta["dim"])
        if keys.size != tokens.size * dim:
            raise DatastoreError(f"{path}: keys.f16 holds {keys.size} values, not {tokens.size} x {dim} (damaged); "
                                 "rebuild the store")
        with np.load(path / "pca.npz") as pca:
            mean, axes = pca["mean"], pca["axes"]
        return cls(path, meta, tokens, keys.reshape(tokens.size, dim), mean, axes, name)

    @property
    def label(self) -> str:
        return f"dense:{self.name}"

    def __len__(self) -> int:
        return int(self.meta["positions"])

    def describe(self) -> str:
        m = self.meta
        return (f"dense store {self.path}: {m['positions']:,} positions of {m['documents']} documents, model "
                f"{m['model'].get('name')} (fingerprint {str(m['model'].get('fingerprint'))[:12]}), hidden state "
                f"{m['layer']}, PCA {m['dim']}, built in {m.get('build_seconds')} s")

    def check_model(self, fingerprint: str) -> None:
        """Refuse (DatastoreError) to draft for a model other than the one whose states the store holds."""
        _refuse_other_model(self.meta, fingerprint, self.path)

    # -- the decoder's side -------------------------------------------------------------
    def begin(self, prompt: Sequence[int], n_max: int, n_min: int) -> None:
        self._state, self._token = None, -1  # the prefill's state arrives through see_state

    def see_state(self, state: np.ndarray, token: int) -> None:
        """The model's hidden state (d,) at `state_layer` that predicted `token`, the newest committed token."""
        self._state, self._token = state, int(token)

    def lookup(self, context: Sequence[int] | np.ndarray, n_max: int = 16, n_min: int = 2, max_matches: int = 512,
               continuation_len: int = 24) -> Lookup:
        check_lookup_args(n_max, n_min, max_matches, continuation_len)
        if self._state is None or len(context) == 0 or int(context[-1]) != self._token:
            return empty_lookup(self.source, continuation_len)
        positions, sims = self.neighbours(self._state, self._token)
        rows = gather_continuations(self.tokens, positions + 1, continuation_len, self.tokens.size)
        if rows.shape[0] == 0:
            return empty_lookup(self.source, continuation_len)
        return Lookup(self.source, int(positions.size), int(positions.size),
                      np.repeat(rows, _repeats(sims, min(ROWS_PER_STEP, max_matches)), axis=0),
                      list(zip(positions.tolist(), [round(float(s), 4) for s in sims])), by_suffix=False)

    def _search(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """faiss's exact search on one OpenMP thread -- one query a step: its threads cost more than they save (2
        threads, 90,000 keys of 64 dimensions, a busy 2-core machine: 17.5 ms a search against 2.2 ms on one) --
        then the calling thread's OpenMP thread count as it was: faiss and torch share one OpenMP runtime, and
        left at one thread it would run the model's passes on one core too."""
        was = self._faiss.omp_get_max_threads()
        self._faiss.omp_set_num_threads(1)
        try:
            return self.index.search(query, k)
        finally:
            self._faiss.omp_set_num_threads(was)

    def neighbours(self, state: np.ndarray, token: int) -> tuple[np.ndarray, np.ndarray]:
        """The `keep` nearest positions (with `match_next`: the first `keep` of the `neighbours_k` nearest whose next
        token is `token`), nearest first, and their similarities: (k,) int64 stream positions, (k,) float32.  A
        place p drafts the tokens from p + 2 on: p + 1 stands for the newest context token."""
        query = reduce_states(np.asarray(state, dtype=np.float32)[None], self.mean, self.axes)
        wanted = self.neighbours_k if self.match_next else self.keep  # without the filter `keep` are enough
        sims, found = self._search(query, wanted)  # (1, K) each, nearest first; -1 past the end
        sims, found = sims[0], found[0]
        ok = found >= 0
        sims, found = sims[ok], self.positions[found[ok]]
        if self.match_next:
            fits = self.tokens[found + 1] == token
            found, sims = found[fits], sims[fits]
        return found[:self.keep].astype(np.int64), sims[:self.keep]

    def around(self, position: int, before: int = 12, after: int = 12) -> tuple[list[int], list[int]]:
        """The stream's tokens up to and including `position` (at most `before`) and after it (at most `after`),
        within its document: what a neighbour's place reads like."""
        start = position
        while start > 0 and position - start < before - 1 and self.tokens[start - 1] != SEP:
            start -= 1
        head = self.tokens[start:position + 1].tolist()
        tail = []
        for t in self.tokens[position + 1:position + 1 + after].tolist():
            if t == SEP:
                break
            tail.append(t)
        return head, tail


def search_index(faiss: Any, keys: np.ndarray, exact_up_to: int = EXACT_UP_TO) -> Any:
    """A faiss inner-product index over (n, dim) float32 keys: exact (flat) up to `exact_up_to` keys, else an
    inverted file of about sqrt(n) k-means lists, of which each search scans the nearest 1/NPROBE_SHARE (at least
    MIN_PROBES).  On the default store (83,004 keys of 64 dimensions, decode-time states) that found 99.7% of the
    exact search's 32 nearest in a ninth of its time (docs/bench/dense-weighted-zen4.md); lists are trained on
    a sample of TRAIN_PER_LIST keys per list, with faiss's fixed seed, when the store opens (0.1-0.2 s)."""
    n, dim = keys.shape
    if n <= exact_up_to:
        index = faiss.IndexFlatIP(dim)
    else:
        lists = int(np.sqrt(n))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
        index.cp.max_points_per_centroid = TRAIN_PER_LIST
        index.train(keys)
        index.nprobe = min(lists, max(MIN_PROBES, lists // NPROBE_SHARE))
    index.add(keys)
    return index


def _repeats(sims: np.ndarray, rows: int) -> np.ndarray:
    """Rows per neighbour: `rows` shared in proportion to exp((sim - best) / TEMPERATURE), at least one each."""
    weight = np.exp((sims - sims.max()) / TEMPERATURE)
    return np.maximum(1, np.round(rows * weight / weight.sum())).astype(np.int64)


def _refuse_other_model(meta: dict, fingerprint: str, path: Path) -> None:
    """Refuse a store built from another model's hidden states."""
    built = meta["model"]
    if built.get("fingerprint") != fingerprint:
        raise DatastoreError(f"{path} holds the hidden states of model {built.get('name')!r} (fingerprint "
                             f"{str(built.get('fingerprint'))[:12]}), not of the model decoding now (fingerprint "
                             f"{fingerprint[:12]}): its neighbours would mean nothing. Rebuild it with this model: "
                             f"`python -m rest_core datastore dense {path} --force`")


def _read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatastoreError(f"{path} is not a dense store (no meta.json); build one with "
                             f"`python -m rest_core datastore dense {path}`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatastoreError(f"{path}/meta.json cannot be read ({exc}): the store is damaged; rebuild it with "
                             f"`python -m rest_core datastore dense {path} --force`") from None
    need = ("format", "model", "layer", "dim", "tokenizer", "files", "positions", "documents")
    if not isinstance(meta, dict) or any(k not in meta for k in need) or meta["format"] != FORMAT_VERSION \
            or not isinstance(meta["files"], dict) or set(meta["files"]) != set(FILES):
        raise DatastoreError(f"{path}/meta.json is not a dense store's of format {FORMAT_VERSION}: rebuild it with "
                             f"`python -m rest_core datastore dense {path} --force`")
    return meta
