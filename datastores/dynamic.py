"""Stores that grow while the server runs: the current request, and past answers.

Both answer lookups with the static store's semantics (longest suffix n_max..n_min
that has an occurrence with a continuation wins; continuations cut at document ends)
but order matches most recent first and, past ``max_matches``, keep the most recent.
Both keep their tokens in an `NgramIndex` (datastores.ngram_index: hashed n-grams, or one native scan of a short
stream): the request store then keeps no hashed index at all where the scan is built (a decoding step appends its
tokens and hashes nothing), and the history uses its index only once it holds more than SCAN_MAX tokens.
"""
from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from datastores.common import SEP, DatastoreError, Lookup, StoreBase, query_tail
from datastores.native import request_scan_library
from datastores.ngram_index import SMALL_APPEND, NgramIndex, index_lookup
from rest_base.files import write_atomic
from rest_base.native_policy import NATIVE, NativePolicy

__all__ = ["HistoryStore", "RequestStore"]


class RequestStore(StoreBase):
    """The current request (prompt + answer so far), extended as tokens are accepted.

    The occurrence that *is* the end of the stored tokens has nothing after it and is
    never a match, so looking up the store's own tokens finds earlier repeats only.
    ``begin`` starts it afresh for each request, indexed for that request's suffix lengths.
    Looked up by one native scan where that can be built and ``native`` allows it (else the hashed index).
    """

    source = "request"

    def __init__(self, tokens: Sequence[int] = (), n_max: int = 16, n_min: int = 2,
                 native: NativePolicy = NATIVE):
        self._scan = native.library(request_scan_library)  # None: the hashed index
        self.begin(tokens, n_max, n_min)

    def use_native(self, policy: NativePolicy) -> None:
        """Scan (or hash) as `policy` says: the tokens so far are indexed again the chosen way."""
        self._scan = policy.library(request_scan_library)
        self.begin(self.tokens.tolist(), self.n_max, self.n_min)

    def begin(self, prompt: Sequence[int], n_max: int, n_min: int) -> None:
        self._index = NgramIndex(n_max, n_min, self._scan, hashed=self._scan is None)
        self.n_max, self.n_min = n_max, n_min
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append accepted tokens; indexes only the new n-grams."""
        if isinstance(tokens, list) and len(tokens) <= SMALL_APPEND and all(
                type(t) is int and 0 <= t < SEP for t in tokens):  # a decoding step's: no arrays needed
            self._index.append(tokens, new_doc=False)
            return
        arr = query_tail(tokens, len(tokens))
        self._index.append(arr, new_doc=False)

    @property
    def n_tokens(self) -> int:
        return self._index.size

    def __len__(self) -> int:
        return self._index.size

    @property
    def tokens(self) -> np.ndarray:
        return self._index.toks[:self._index.size].copy()

    def lookup(self, context: Sequence[int] | np.ndarray, n_max: int = 16, n_min: int = 2, max_matches: int = 5000,
               continuation_len: int = 10) -> Lookup:
        return index_lookup(self._index, self.source, context, n_max, n_min, max_matches, continuation_len)


class HistoryStore(StoreBase):
    """Past answers, one document each, optionally persisted to ``path``.

    When the total passes ``max_tokens`` the oldest answers are dropped (an answer longer
    than max_tokens keeps its last max_tokens tokens). ``path`` ending in ``.json`` is
    saved as JSON, anything else as ``.npz``; it is loaded on construction if it exists.
    Up to SCAN_MAX tokens it is looked up by one native scan where that can be built
    (as ``native`` allows; else always through its hashed index).
    """

    source = "history"

    def __init__(self, path=None, n_max: int = 16, n_min: int = 2, max_tokens: int = 1_000_000,
                 native: NativePolicy = NATIVE):
        if max_tokens < 1:
            raise DatastoreError(f"max_tokens={max_tokens}: pass a positive history size")
        self._scan = native.library(request_scan_library)  # scans a small history; hashed when it grows
        self.path = Path(path) if path is not None else None
        self.n_max, self.n_min, self.max_tokens = n_max, n_min, max_tokens
        self._reset()
        if self.path is not None and self.path.exists():
            self.load()

    @property
    def label(self) -> str:
        return f"history:{self.path}" if self.path is not None else "history"

    def use_native(self, policy: NativePolicy) -> None:
        self._scan = self._index.scan = policy.library(request_scan_library)  # the postings are kept either way

    def begin(self, prompt: Sequence[int], n_max: int, n_min: int) -> None:
        """Re-index the kept answers when a request looks up shorter or longer suffixes than indexed."""
        if (n_max, n_min) != (self.n_max, self.n_min):
            answers = self.answers()
            self.n_max, self.n_min = n_max, n_min
            self._reset()
            for a in answers:
                self.add(a)

    def end(self, answer: Sequence[int], remember: bool) -> None:
        """Keep the finished answer in memory (saving it is the owner's call: `save`)."""
        if remember and len(answer):
            self.add(answer)

    def _reset(self) -> None:
        self._index = NgramIndex(self.n_max, self.n_min, self._scan)
        self._docs: list[tuple[int, int]] = []  # (start position, length) of live answers
        self._first = 0  # index into _docs of the oldest live answer
        self.n_tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        """Record one finished answer; continuations never run into the next answer."""
        arr = query_tail(tokens, len(tokens))[-self.max_tokens:]
        if not arr.size:
            return
        ix = self._index
        self._index.append(arr, new_doc=True)
        self._docs.append((ix.size - arr.size, int(arr.size)))
        self.n_tokens += int(arr.size)
        dropped = False
        while self.n_tokens > self.max_tokens:
            self.n_tokens -= self._docs[self._first][1]
            self._first += 1
            dropped = True
        if dropped:
            cut = self._docs[self._first][0]
            before = ix.size
            ix.drop_before(cut)
            shift = before - ix.size  # non-zero when the stream was compacted
            self._docs = [(s - shift, n) for s, n in self._docs[self._first:]]
            self._first = 0

    def __len__(self) -> int:
        return len(self._docs) - self._first

    def answers(self) -> list[np.ndarray]:
        """The live answers, oldest first. list of (len,) int64"""
        t = self._index.toks
        return [t[s:s + n].copy() for s, n in self._docs[self._first:]]

    def lookup(self, context: Sequence[int] | np.ndarray, n_max: int = 16, n_min: int = 2, max_matches: int = 5000,
               continuation_len: int = 10) -> Lookup:
        return index_lookup(self._index, self.source, context, n_max, n_min, max_matches, continuation_len)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path | None = None) -> None:
        """Write the live answers atomically (temp file + rename) to path or self.path."""
        path = Path(path) if path is not None else self.path
        if path is None:
            raise DatastoreError("HistoryStore has no path to save to; pass path= here or to the constructor")
        answers = self.answers()
        lengths = np.array([a.size for a in answers], dtype=np.int64)
        flat = np.concatenate(answers) if answers else np.empty(0, dtype=np.int64)
        if path.suffix == ".json":
            data = json.dumps({"format": "rest-lab-history", "version": 1,
                               "answers": [a.tolist() for a in answers]}).encode("utf-8")
        else:
            buf = io.BytesIO()
            np.savez(buf, format=np.array("rest-lab-history"), version=np.array(1),
                     tokens=flat.astype(np.uint32), lengths=lengths)
            data = buf.getvalue()
        try:
            write_atomic(path, data)
        except OSError as exc:
            raise DatastoreError(f"cannot save history to {path}: {exc}") from None

    def load(self, path: str | Path | None = None) -> None:
        """Replace the contents with the answers saved at path (or self.path)."""
        path = Path(path) if path is not None else self.path
        if path is None or not path.exists():
            raise DatastoreError(f"no history file at {path}; save() one first or pass an existing path")
        try:
            if path.suffix == ".json":
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("format") != "rest-lab-history":
                    raise ValueError("not a rest-lab history file")
                answers = [np.asarray(a, dtype=np.int64) for a in data["answers"]]
            else:
                with np.load(path, allow_pickle=False) as z:
                    if str(z["format"]) != "rest-lab-history":
                        raise ValueError("not a rest-lab history file")
                    flat, lengths = z["tokens"].astype(np.int64), z["lengths"].astype(np.int64)
                if lengths.sum() != flat.size or (lengths < 0).any():
                    raise ValueError("answer lengths do not add up to the token count")
                answers = np.split(flat, np.cumsum(lengths)[:-1]) if lengths.size else []
        except (OSError, ValueError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise DatastoreError(f"history file {path} is corrupt ({exc}); move it aside or delete it "
                                 "to start a fresh history") from None
        self._reset()
        for a in answers:
            self.add(a)
