"""Types and helpers every store shares: the separator, the lookup result, the
error, query validation and the vectorized continuation gather.

All three stores (static, request, history) answer the same question with the same
semantics, so the pieces that define that semantics live here once:

* the query is the newest ``min(n_max, len(context))`` context tokens;
* a match of length n is a position ``i`` whose n tokens ending at ``i`` equal the
  query's last n tokens, and that has a continuation (``i + 1`` exists, is not SEP);
* the longest n from ``min(n_max, len(context))`` down to ``n_min`` with any match wins;
* a continuation is the up to ``L`` tokens after ``i``, cut at SEP or the end of the
  stream and padded with -1.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from rest_base.native_policy import NativePolicy

SEP: int = 0xFFFFFFFF  # document separator in every token stream; never a real token
# Fibonacci hashing (2^64 / golden ratio): the top b bits of key * GOLDEN spread any keys evenly over 2^b slots
GOLDEN: int = 0x9E3779B97F4A7C15

__all__ = [
    "GOLDEN",
    "SEP",
    "DatastoreError",
    "Lookup",
    "Store",
    "StoreBase",
    "check_lookup_args",
    "gather_continuations",
    "query_ids",
    "query_tail",
]


class DatastoreError(Exception):
    """Any problem with a store or its inputs; the message names the problem and the fix."""


@dataclass
class Lookup:
    """What one store returned for one context.

    ``continuations`` rows are the tokens that followed each chosen match, ``-1`` after
    a cut (separator, end of stream, end of the dynamic tokens). With no match,
    ``matched_len == 0`` and ``continuations`` has shape ``(0, L)``.
    """

    source: str  # the store's draft source name ("static", "request", "history", ...)
    matched_len: int  # length of the longest context suffix found (0 = none)
    total_matches: int  # occurrences of that suffix (with a continuation) in the store
    continuations: np.ndarray = field(repr=False)  # (k, L) int64, k <= max_matches
    # a dense store's answer: the (stream position, similarity) of each neighbour drafted from, nearest first
    neighbours: list = field(default_factory=list, repr=False)
    # True: `matched_len` is a suffix length, which the draft tree weighs this source's rows by; False (a dense
    # store: `matched_len` counts its neighbours): the tree gives its rows a suffix source's weight instead
    by_suffix: bool = True

    def __repr__(self) -> str:  # keeps logs short: shape instead of the whole array
        return (f"Lookup(source={self.source!r}, matched_len={self.matched_len}, "
                f"total_matches={self.total_matches}, continuations=shape{tuple(self.continuations.shape)})")


@runtime_checkable
class Store(Protocol):
    """The one seam between the decoder and anything it drafts from.

    ``source`` names the draft source (the draft tree, the cost model, the traces and
    the figures know a store's drafts by it); ``lookup`` answers with the longest
    context suffix it holds and the continuations that followed.  The decoder tells
    every store where a request stands: ``begin`` with the prompt, ``extend`` with
    each step's committed tokens, ``end`` with the whole answer.  A store that learns
    from the model itself sets ``successors_k`` > 0 and gets, after every forward pass,
    each tree node's token with the model's top ``successors_k`` next tokens and the token before
    it (`observe`).
    A store that drafts from the model's hidden state sets ``state_layer`` (transformers' numbering of
    `output_hidden_states`) and gets, after the prefill and after every step, the state at that layer that
    predicted the newest committed token, with that token (`see_state`): kept from the pass the decoder ran
    anyway.  A store that does not change while decoding inherits the no-op versions from `StoreBase`.
    """

    source: str
    successors_k: int

    def lookup(self, context: Sequence[int] | np.ndarray, n_max: int, n_min: int, max_matches: int,
               continuation_len: int) -> Lookup: ...

    def begin(self, prompt: Sequence[int], n_max: int, n_min: int) -> None: ...

    def extend(self, tokens: Sequence[int]) -> None: ...

    def end(self, answer: Sequence[int], remember: bool) -> None: ...

    def observe(self, tokens: np.ndarray, successors: np.ndarray, previous: np.ndarray | None = None) -> None: ...

    @property
    def label(self) -> str: ...


class StoreBase:
    """No-op request lifecycle for stores that do not change while decoding."""

    source = ""
    successors_k = 0  # > 0: wants the model's top predictions after every tree node (`observe`)
    state_layer: int | None = None  # not None: wants the model's hidden state at this layer (`see_state`)
    # True: looked up only in steps where the other stores draft nothing worth a wider pass (rest_core.draft)
    fallback = False

    def begin(self, prompt: Sequence[int], n_max: int, n_min: int) -> None:
        """A request starts with this prompt, looked up with suffixes of n_min..n_max tokens."""

    def extend(self, tokens: Sequence[int]) -> None:
        """The decoder committed these tokens."""

    def end(self, answer: Sequence[int], remember: bool) -> None:
        """The request finished with this answer; `remember` asks stores that learn to keep it."""

    def observe(self, tokens: np.ndarray, successors: np.ndarray, previous: np.ndarray | None = None) -> None:
        """tokens (q,): a forward pass's tree nodes; successors (q, successors_k): the model's top
        next tokens after each, best first; previous (q,): the token before each node (-1: unknown)."""

    def see_state(self, state: np.ndarray, token: int) -> None:
        """state (d,): the model's hidden state at `state_layer` that predicted `token`, the newest committed token."""

    def use_native(self, policy: NativePolicy) -> None:
        """Take the native lookup (where the store has one) as `policy` says from now on; the answers are the
        same either way."""

    @property
    def label(self) -> str:
        """How runs and reports name this store."""
        return self.source


def empty_lookup(source: str, continuation_len: int) -> Lookup:
    """The no-match answer: matched_len 0 and a (0, L) continuation array."""
    return Lookup(source, 0, 0, np.empty((0, continuation_len), dtype=np.int64))


def check_lookup_args(n_max: int, n_min: int, max_matches: int, continuation_len: int) -> None:
    """Reject parameter combinations that have no meaning, with the fix in the message."""
    if n_min < 1:
        raise DatastoreError(f"n_min={n_min}: the shortest suffix must be at least 1 token; pass n_min >= 1")
    if n_max < n_min:
        raise DatastoreError(f"n_max={n_max} is below n_min={n_min}; pass n_max >= n_min")
    if max_matches < 1:
        raise DatastoreError(f"max_matches={max_matches}: pass a positive number of matches to return")
    if continuation_len < 1:
        raise DatastoreError(f"continuation_len={continuation_len}: pass a continuation length of at least 1")


def query_tail(context: Sequence[int] | np.ndarray, count: int) -> np.ndarray:
    """The newest ``count`` tokens of ``context`` as int64, checked to be real token ids.

    Only the tail is converted, so a long context costs nothing extra. Raises
    DatastoreError for ids outside ``[0, SEP)`` (SEP is reserved as the separator).
    """
    if count <= 0:
        return np.empty(0, dtype=np.int64)
    try:
        tail = context[-count:]
        arr = np.asarray(tail, dtype=np.int64)  # (<=count,)
    except (TypeError, ValueError, OverflowError) as exc:
        raise DatastoreError(f"context must be a sequence of integer token ids ({exc}); "
                             "pass a list of ints or a 1-D integer numpy array") from None
    if arr.ndim != 1:
        raise DatastoreError(f"context must be 1-D, got shape {arr.shape}; pass one token sequence")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= SEP):
        raise DatastoreError("context holds a token id outside [0, 2**32 - 1); "
                             "token ids must be non-negative and below the separator 0xFFFFFFFF")
    return arr


def query_ids(context: Sequence[int] | np.ndarray, count: int) -> list[int]:
    """`query_tail` as a list of Python integers.  A list or tuple of Python ints (what the decoder hands over) is
    checked without numpy: every lookup runs right after a forward pass, when each distinct numpy operation
    starts from cold caches, and a miss needs none."""
    if count <= 0:
        return []
    if isinstance(context, (list, tuple)):
        tail = context[-count:]
        if all(type(t) is int and 0 <= t < SEP for t in tail):
            return list(tail)
    return query_tail(context, count).tolist()


def gather_continuations(stream: np.ndarray, ends: np.ndarray, length: int, stream_len: int,
                         window: np.ndarray | None = None) -> np.ndarray:
    """The ``length`` tokens after each end position, cut at SEP / end of stream.

    stream: (>= stream_len,) token ids (uint32 mapped file or int64 buffer)
    ends:   (k,) int64 end positions of matches
    window: optional cached ``sliding_window_view(stream[:stream_len], length)``
    returns (k', length) int64, -1 after a cut; rows without any token are dropped.

    Rows are copied whole from a sliding-window view (one contiguous read per match,
    the cost that dominates with thousands of matches); only the few rows that meet a
    separator or the end of the stream take the slow masked path.
    """
    if ends.size == 0:
        return np.empty((0, length), dtype=np.int64)
    starts = ends + 1  # (k,)
    if stream_len >= length:
        win = window if window is not None else sliding_window(stream[:stream_len], length)  # (N-L+1, L)
        near_end = starts > stream_len - length  # (k,) rows that would run past the stream
        if near_end.any():
            vals = np.empty((ends.size, length), dtype=np.int64)
            vals[~near_end] = win[starts[~near_end]]
            vals[near_end] = _masked_rows(stream, starts[near_end], length, stream_len)
        else:
            vals = win[starts].astype(np.int64)  # (k, L)
    else:
        vals = _masked_rows(stream, starts, length, stream_len)
    sep = vals == SEP  # (k, L)
    hit = np.flatnonzero(sep.any(axis=1))  # rows that cross a separator: usually few
    if hit.size:
        cut = np.logical_or.accumulate(sep[hit], axis=1)  # (h, L) once cut, stays cut
        sub = vals[hit]
        sub[cut] = -1
        vals[hit] = sub
    if (vals[:, 0] == -1).any():
        vals = vals[vals[:, 0] != -1]
    return vals


def sliding_window(stream: np.ndarray, length: int) -> np.ndarray:
    """(N-L+1, L) view whose row i is stream[i:i+L] (no copy; never written to).

    Built with the ndarray constructor: numpy's sliding_window_view validates its
    arguments in Python, which costs more than a small gather."""
    stream = np.ascontiguousarray(stream)
    step = stream.strides[0]
    return np.ndarray(shape=(stream.size - length + 1, length), dtype=stream.dtype, buffer=stream,
                      strides=(step, step))


def _masked_rows(stream: np.ndarray, starts: np.ndarray, length: int, stream_len: int) -> np.ndarray:
    """Rows of ``length`` tokens from starts, past-the-end cells as SEP (so they cut). (k, L) int64"""
    idx = starts[:, None] + np.arange(length, dtype=np.int64)  # (k, L)
    inside = idx < stream_len
    vals = stream[np.minimum(idx, stream_len - 1)].astype(np.int64)
    vals[~inside] = SEP
    return vals
