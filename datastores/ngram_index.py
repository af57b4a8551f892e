"""The growing token stream and its n-gram index, under the request and history stores (datastores.dynamic).

For a few n-gram lengths ("levels": n_min, 2*n_min, 4*n_min, ... <= n_max) a
64-bit hash of every n-gram maps to its end positions. A lookup takes the longest
level whose query n-gram occurs, then measures every candidate's exact match length
with one vectorized comparison (which also discards hash collisions). Every match of
length >= a level is among that level's candidates, so the answer is exact, and a few
levels cost far less memory than one dict entry per n (16 bytes per token per level).

Each level keeps a sorted run (binary-searched) plus a small unsorted tail of the
newest entries (scanned); the tail is merged into the run when it outgrows
max(1024, run/8) capped at 16384 entries, so appending is O(new tokens * levels)
amortized and a lookup stays O(log N + tail).

Where `request_scan.cpp` is built (datastores.native) a stream of up to SCAN_MAX tokens is
looked up by one native scan instead, with the same answers.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from datastores.common import (
    SEP,
    DatastoreError,
    Lookup,
    check_lookup_args,
    empty_lookup,
    gather_continuations,
    query_ids,
)
from datastores.pairs import MAX_LOG2, MIN_LOG2, PairBits

_MASK = (1 << 64) - 1
_M1 = 0x9E3779B97F4A7C15
_M2 = 0xBF58476D1CE4E5B9
_P = 0x100000001B3
_M1_U, _M2_U, _P_U = np.uint64(_M1), np.uint64(_M2), np.uint64(_P)

SCAN_MAX = 1 << 14  # a stream of up to this many tokens is looked up by one native scan (~10 us) where it is built
SMALL_APPEND = 8  # appends of up to this many tokens (a decoding step's) are hashed with Python integers


def _mix_np(tokens: np.ndarray) -> np.ndarray:
    """Per-token 64-bit scramble (int64 ids -> uint64), so n-gram hashes spread well."""
    x = (tokens.astype(np.uint64) + np.uint64(1)) * _M1_U
    x ^= x >> np.uint64(31)
    return x * _M2_U


def _mix_py(t: int) -> int:
    x = ((t + 1) * _M1) & _MASK
    x ^= x >> 31
    return (x * _M2) & _MASK


def _query_hashes(rev_query: list[int], levels: list[int]) -> dict[int, int]:
    """Hash of the newest n tokens for every level n (same function as `_Postings`)."""
    out, h = {}, 0
    want = set(levels)
    for k, t in enumerate(rev_query, 1):
        h = (h * _P + _mix_py(t)) & _MASK
        if k in want:
            out[k] = h
    return out


class _Postings:
    """n-gram hash -> end positions for one n: sorted run + unsorted newest tail."""

    def __init__(self, n: int):
        self.n = n
        self.keys = np.empty(0, dtype=np.uint64)  # (R,) sorted
        self.pos = np.empty(0, dtype=np.int64)  # (R,) sorted by (key, pos)
        self.tail_keys = np.empty(256, dtype=np.uint64)  # (capacity,) first tail_len used
        self.tail_pos = np.empty(256, dtype=np.int64)
        self.tail_len = 0

    def add(self, keys: np.ndarray, pos: np.ndarray) -> None:
        """Append entries whose positions exceed every stored one."""
        k = keys.size
        if self.tail_len + k > self.tail_keys.size:
            cap = max(2 * self.tail_keys.size, self.tail_len + k)
            self.tail_keys = np.resize(self.tail_keys, cap)
            self.tail_pos = np.resize(self.tail_pos, cap)
        self.tail_keys[self.tail_len:self.tail_len + k] = keys
        self.tail_pos[self.tail_len:self.tail_len + k] = pos
        self.tail_len += k
        if self.tail_len > min(16384, max(1024, self.keys.size // 8)):
            self.merge()

    def add_one(self, key: int, pos: int) -> None:
        """`add` of one entry from Python integers (a decoding step's few new n-grams)."""
        n = self.tail_len
        if n == self.tail_keys.size:
            self.tail_keys = np.resize(self.tail_keys, 2 * n)
            self.tail_pos = np.resize(self.tail_pos, 2 * n)
        self.tail_keys[n] = key
        self.tail_pos[n] = pos
        self.tail_len = n + 1
        if n + 1 > min(16384, max(1024, self.keys.size // 8)):
            self.merge()

    def merge(self) -> None:
        if not self.tail_len:
            return
        tk, tp = self.tail_keys[:self.tail_len], self.tail_pos[:self.tail_len]
        order = np.lexsort((tp, tk))
        tk, tp = tk[order], tp[order]
        at = np.searchsorted(self.keys, tk, side="right")  # new positions are the largest
        self.keys = np.insert(self.keys, at, tk)
        self.pos = np.insert(self.pos, at, tp)
        self.tail_len = 0

    def find(self, key: int) -> np.ndarray:
        """End positions of n-grams hashing to key, ascending. (k,) int64"""
        ku = np.uint64(key)
        lo, hi = np.searchsorted(self.keys, ku, "left"), np.searchsorted(self.keys, ku, "right")
        main = self.pos[lo:hi]
        if self.tail_len:
            tail = self.tail_pos[:self.tail_len][self.tail_keys[:self.tail_len] == ku]
            if tail.size:
                return np.concatenate([main, tail]) if main.size else tail
        return main

    def shift(self, cut: int) -> None:
        """Forget positions below cut and renumber the rest (the stream lost its head)."""
        self.merge()
        keep = self.pos >= cut
        self.keys, self.pos = self.keys[keep], self.pos[keep] - cut


class NgramIndex:
    """A growing token stream (SEP between documents) with hashed n-gram postings.

    With ``scan`` (a loaded `request_scan.cpp`) a stream of up to SCAN_MAX tokens is looked up by one native scan,
    with the same answers; without ``hashed`` it keeps no postings at all and always scans (the request store: its
    few thousand tokens cost less to scan than to hash every step)."""

    def __init__(self, n_max: int, n_min: int, scan=None, hashed: bool = True):
        if n_min < 1 or n_max < n_min:
            raise DatastoreError(f"n_min={n_min}, n_max={n_max}: need 1 <= n_min <= n_max")
        if not hashed and scan is None:
            raise DatastoreError("an index without postings needs the native scan to look anything up")
        self.n_min, self.n_max = n_min, n_max
        self.scan, self.hashed = scan, hashed
        levels, n = [], n_min
        while n <= n_max:
            levels.append(n)
            n *= 2
        self.levels = levels
        self.postings = {n: _Postings(n) for n in levels}
        self.toks = np.empty(1024, dtype=np.int64)  # (capacity,) first `size` used
        self.size = 0
        # the adjacent pairs followed by a token (datastores.pairs; about one bit per pair): the newest pair, the
        # context's own end in the request store, is no match until something follows it
        self.pairs = PairBits(MIN_LOG2)
        self._tail = (-1, -1)  # the two newest tokens, as Python ints (-1: none)
        self.doc_start = 0  # first position of the document being appended to
        self.live_start = 0  # positions below this belong to dropped documents

    def append(self, tokens: np.ndarray | list[int], new_doc: bool) -> None:
        """Add tokens (int64 or Python ints, checked) to the stream, as a new document or to the last one."""
        if new_doc and self.size:
            tokens = np.concatenate([np.array([SEP], dtype=np.int64), tokens])
        k = len(tokens)
        if not k:
            return
        if self.size + k > self.toks.size:
            self.toks = np.resize(self.toks, max(2 * self.toks.size, self.size + k))
        start = self.size
        self.toks[start:start + k] = tokens
        self.size += k
        if new_doc:
            self.doc_start = start + (1 if start else 0)
        self._add_pairs(tokens, start)
        if self.hashed:
            self._index(start)

    def _add_pairs(self, tokens: np.ndarray | list[int], start: int) -> None:
        """Set the bits of the pairs that the tokens appended at `start` gave a continuation (with Python integers
        for a decoding step's few tokens); twice the bits, set afresh from the live stream, once it holds more pairs
        than bits."""
        if isinstance(tokens, list) and len(tokens) <= SMALL_APPEND:
            before, last = self._tail
            self.pairs.add(before, [last, *tokens[:-1]] if last >= 0 else tokens[:-1])
            self._tail = (tokens[-2], tokens[-1]) if len(tokens) > 1 else (last, tokens[-1])
        else:
            self.pairs.add_stream(self.toks, start - 1, self.size - 1)
            self._tail = (int(self.toks[self.size - 2]) if self.size > 1 else -1, int(self.toks[self.size - 1]))
        if self.size - self.live_start > 1 << self.pairs.log2_bits and self.pairs.log2_bits < MAX_LOG2:
            self.pairs = self.pairs.grown(self.toks, self.live_start, self.size - 1)

    def _index(self, first_new: int) -> None:
        """Hash the n-grams ending at positions first_new.. that lie inside the document."""
        top = self.levels[-1]
        if self.size - first_new <= SMALL_APPEND:
            self._index_few(first_new, top)
            return
        w0 = max(self.doc_start, first_new - top + 1)
        mixed = _mix_np(self.toks[w0:self.size])  # (W,) window ending at the stream end
        h = mixed.copy()  # h[t] = hash of the (k+1)-gram ending at window position t (t >= k)
        with np.errstate(over="ignore"):
            for k in range(1, top + 1):
                if k in self.postings:
                    lo = max(k - 1, first_new - w0)  # full k-gram inside window, new end position
                    if lo < h.size:
                        self.postings[k].add(h[lo:], np.arange(w0 + lo, self.size, dtype=np.int64))
                if k == top or k >= h.size:
                    break
                h[k:] = h[k:] * _P_U + mixed[:h.size - k]  # (k+1)-gram hashes

    def _index_few(self, first_new: int, top: int) -> None:
        """`_index` for the few tokens a decoding step appends, with Python integers (the same hashes, added in
        the same order): right after a forward pass every distinct numpy operation runs from cold caches, and
        building arrays of one or two entries per level was most of a step's bookkeeping for this store."""
        lo = max(self.doc_start, first_new - top + 1)
        mixed = [_mix_py(t) for t in self.toks[lo:self.size].tolist()]  # the window ending at the stream end
        postings = self.postings
        for t in range(first_new, self.size):
            h = 0
            for j in range(min(top, t - self.doc_start + 1)):  # the n-grams ending at t, inside the document
                h = (h * _P + mixed[t - j - lo]) & _MASK
                if j + 1 in postings:
                    postings[j + 1].add_one(h, t)

    def match(self, context: Sequence[int] | np.ndarray, n_max: int, n_min: int,
              max_matches: int) -> tuple[int, int, np.ndarray]:
        """(matched_len, total, chosen end positions most recent first) for a context."""
        if n_min < self.n_min:
            raise DatastoreError(f"this store indexes suffixes of at least {self.n_min} tokens, "
                                 f"lookup asked for n_min={n_min}; construct it with n_min={n_min}")
        if n_min >= 2 and self.pairs.excludes(context):  # the newest pair was never appended: no match
            return 0, 0, np.empty(0, dtype=np.int64)
        newest = query_ids(context, n_max)[::-1]  # (m,) newest first
        m = len(newest)
        if m < n_min or self.size == 0:
            return 0, 0, np.empty(0, dtype=np.int64)
        if self.scan is not None and (not self.hashed or self.size <= SCAN_MAX):
            return self._scanned(newest, n_min, max_matches)
        last = self.size - 1  # an n-gram ending here has no continuation (the request store's own newest tokens)
        first = self.postings[self.n_min].find(_query_hashes(newest[:self.n_min], [self.n_min])[self.n_min])
        if not first.size or first[0] >= last or first[-1] < self.live_start:
            return 0, 0, np.empty(0, dtype=np.int64)  # every match ends with the newest n_min tokens: none here
        hashes = _query_hashes(newest, self.levels)
        rq = np.array(newest, dtype=np.int64)
        cands = [n for n in self.levels if n <= m]
        for li in range(len(cands) - 1, -1, -1):
            level = cands[li]
            need = max(level, n_min)
            # the longer level found nothing live, so no live match reaches it: compare
            # only up to its length (a frequent bigram has many candidates)
            cap = cands[li + 1] - 1 if li + 1 < len(cands) else m
            pos = self.postings[level].find(hashes[level])  # (c,) ascending
            if pos.size and pos[-1] == last:
                pos = pos[:-1]
            if pos.size and self.live_start:
                pos = pos[pos >= self.live_start]
            if pos.size:
                # exact match length of each candidate (up to cap), newest token first
                idx = pos[:, None] - np.arange(cap, dtype=np.int64)  # (c, cap)
                win = self.toks[np.maximum(idx, 0)]  # (c, cap)
                eq = (win == rq[:cap]) & (idx >= 0)
                length = np.where(eq.all(axis=1), cap, np.argmin(eq, axis=1))  # (c,)
                nxt = pos + 1
                live = nxt < self.size
                live[live] = self.toks[nxt[live]] != SEP
                ok = live & (length >= need)
                if ok.any():
                    best = int(length[ok].max())
                    chosen = pos[ok & (length >= best)][::-1]  # most recent first
                    return best, int(chosen.size), chosen[:max_matches]
            if level <= n_min:
                break  # shorter levels cannot reach n_min
        return 0, 0, np.empty(0, dtype=np.int64)

    def _scanned(self, newest: list[int], n_min: int, max_matches: int) -> tuple[int, int, np.ndarray]:
        """`match` by one native scan of the stream (the same matched length, count and positions)."""
        chosen = np.empty(max(1, min(max_matches, self.size)), dtype=np.int64)
        info = (ctypes.c_int64 * 2)()
        k = self.scan.rest_lab_request_scan(self.toks.ctypes.data, self.size, self.live_start,
                                            (ctypes.c_int64 * len(newest))(*newest), len(newest), n_min,
                                            chosen.size, chosen.ctypes.data, chosen.size, info, len(info))
        if k < 0:
            raise DatastoreError("the request store's scan refused its input (a bug: please report it)")
        return (info[0], info[1], chosen[:k]) if info[0] else (0, 0, np.empty(0, dtype=np.int64))

    def gather(self, ends: np.ndarray, length: int) -> np.ndarray:
        return gather_continuations(self.toks, ends, length, self.size)

    def drop_before(self, cut: int) -> None:
        """Forget documents before position cut (a document start); compacts lazily."""
        self.live_start = cut
        if cut > self.size // 4:
            keep = self.toks[cut:self.size].copy()
            self.toks = np.resize(keep, max(1024, 2 * keep.size))
            self.size = keep.size
            self.doc_start -= cut
            self.live_start = 0
            for p in self.postings.values():
                p.shift(cut)


def index_lookup(index: NgramIndex, source: str, context, n_max: int, n_min: int, max_matches: int,
                  continuation_len: int) -> Lookup:
    """The one lookup rule of both dynamic stores: longest suffix, then its continuations."""
    check_lookup_args(n_max, n_min, max_matches, continuation_len)
    n, total, ends = index.match(context, n_max, n_min, max_matches)
    if not n:
        return empty_lookup(source, continuation_len)
    return Lookup(source, n, total, index.gather(ends, continuation_len))
