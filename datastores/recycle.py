"""The model's own predictions as a draft source ("model"): recycled tokens.

Every verify pass computes the model's next-token distribution at every tree node.  This
store keeps the top-k tokens the model predicted there, twice over: per token id (an
adjacency table of vocab x k ids, under 2 MB for a 50k vocabulary at k = 8), and per pair
of tokens -- the node and the token before it -- in a fixed-size hashed table where a newer
pair takes an older one's slot.  It drafts from them where nothing else can: from the
newest token, a tree of likely continuations, wide near the root and narrow further down,
each node's successors taken after the same two tokens when that pair was seen, else after
the same token.

The pair is worth the extra table: replaying the model's greedy answers to 40 of the
general-text store's requests (each table learning from the answers before it), the rank-0
successor recorded after the same pair was the model's next token 53% of the time, the one
recorded after the token alone (in another context) 15%.  The two kinds of node therefore
carry their own prior chances (PAIR_PRIOR, TOKEN_PRIOR), so a confident chain is drafted deep
and a doubtful guess stays short, and the cost model, which learns acceptance per (depth,
support, ratio) cell, tells them apart from the start.

It needs no corpus and adapts to the conversation at hand: what the model said a moment
ago after these tokens is what it is likely to say again.  Verification is unchanged, so
greedy output stays identical and sampling exact; the cost model learns how often this
source's drafts are accepted, like any other source's.

Paths are returned as continuation rows, each repeated in proportion to its prior chance,
so the draft tree's prefix counts order the nodes by that chance.

Many visitors of one server each learn their own table from one starting table: `fork` gives a
store that reads the starting table's arrays and copies them only when it first learns (copy on
write), so a fork costs a few hundred bytes until its first decode, and `share` returns a fork
to the starting table, dropping its copy.
"""
from __future__ import annotations

import copy
import ctypes
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from datastores.common import (
    GOLDEN,
    DatastoreError,
    Lookup,
    StoreBase,
    check_lookup_args,
    empty_lookup,
    query_ids,
    write_atomic,
)
from datastores.native import address, recycle_grow_library

BRANCHING = (4, 3, 2, 2, 1, 1, 1, 1, 1, 1)  # children per node at each depth of the drafted tree
# prior chance that the rank-r successor recorded after the same two tokens is the model's next token, and
# of one recorded after the same token only (another context); both fitted to the model's own answers to the
# general-text store's requests (datastores/answer_prompts.py), not to the benchmark's prompts
PAIR_PRIOR = (0.53, 0.08, 0.04, 0.026, 0.02, 0.014, 0.012, 0.012)
TOKEN_PRIOR = (0.15, 0.08, 0.048, 0.034, 0.022, 0.02, 0.018, 0.016)
PAIR_SLOTS = 1 << 16  # pairs kept (2.5 MiB at k = 8); a newer pair hashed to a taken slot replaces the older
_SHIFT = 64 - (PAIR_SLOTS.bit_length() - 1)
FORMAT_VERSION = 2  # 1: the per-token table only
FEW_NODES = 16  # `observe` of at most this many nodes runs on Python integers (cold, 16 nodes: ~0.1 ms, arrays ~0.12)
ROW_SCALE = 100  # rows per unit of chance (integer counts keep ties exact); a path below 1/200 is not drafted
# (a finer scale only multiplies the rows the draft tree merges: 1000 gave ~850 rows every step)


class RecycleStore(StoreBase):
    """Top-k successors per token id and per pair of tokens, refreshed from every verify pass's logits.

    ``successors_k`` tells the decoder how many of each node's top predictions to hand to
    `observe`.  ``path`` (optional) persists the tables; the owner calls `save`.  ``branching`` (children
    per node at each depth) and ``row_scale`` (rows per unit of chance) set how wide and how deep a draft
    grows: a path below 1 / (2 * row_scale) of chance is not drafted.
    """

    source = "model"

    def __init__(self, vocab_size: int, k: int = 8, path: str | Path | None = None,
                 branching: Sequence[int] = BRANCHING, row_scale: int = ROW_SCALE):
        if vocab_size < 1 or not 1 <= k <= 64:
            raise DatastoreError(f"vocab_size={vocab_size}, k={k}: need a positive vocabulary and 1 <= k <= 64")
        if not 1 <= row_scale <= 100_000 or any(b < 0 for b in branching):
            raise DatastoreError(f"row_scale={row_scale}, branching={tuple(branching)}: need 1 <= row_scale <= "
                                 "100000 and no negative width")
        self.row_scale = int(row_scale)
        self.vocab_size, self.successors_k = int(vocab_size), int(k)
        self.branching = tuple(int(b) for b in branching)
        self._branching_c = (ctypes.c_int64 * max(1, len(self.branching)))(*self.branching)
        self.native = True  # draft with recycle_grow.cpp where it can be had (False: the Python path)
        self.path = Path(path) if path is not None else None
        self.table = np.full((self.vocab_size, self.successors_k), -1, dtype=np.int32)  # (V, k), -1 = unknown
        # per pair (previous token, token): key previous * V + token in its hashed slot (-1 = empty), successors
        self.pair_keys = np.full(PAIR_SLOTS, -1, dtype=np.int64)  # (S,)
        self.pair_table = np.full((PAIR_SLOTS, self.successors_k), -1, dtype=np.int32)  # (S, k)
        self.shared = False  # the tables are another store's too (read-only): copied before the first write
        if self.path is not None and self.path.exists():
            self.load()

    # ------------------------------------------------------------------ copy on write
    def fork(self) -> RecycleStore:
        """A store that drafts from these tables as they are now and copies them when it first learns (it never
        saves: no path).  The tables become read-only here, so this store copies them before it learns too."""
        for array in (self.table, self.pair_keys, self.pair_table):
            array.setflags(write=False)
        self.shared = True
        twin = copy.copy(self)
        twin.path = None
        return twin

    def share(self, base: RecycleStore) -> None:
        """Go back to reading `base`'s tables (a fork of it), dropping what this store learned on its own."""
        if not base.shared:
            base.fork()  # freezes base's tables
        self.table, self.pair_keys, self.pair_table = base.table, base.pair_keys, base.pair_table
        self.shared = True

    def _own(self) -> None:
        """Copy shared tables before the first write (copy on write)."""
        self.table, self.pair_keys, self.pair_table = self.table.copy(), self.pair_keys.copy(), self.pair_table.copy()
        self.shared = False

    @property
    def label(self) -> str:
        return "model"

    @property
    def known(self) -> int:
        """Token ids whose successors have been seen."""
        return int((self.table[:, 0] >= 0).sum())

    @property
    def known_pairs(self) -> int:
        """Pairs of tokens whose successors are kept."""
        return int((self.pair_keys >= 0).sum())

    def observe(self, tokens: np.ndarray, successors: np.ndarray, previous: np.ndarray | None = None) -> None:
        """tokens: (q,) tree node ids; successors: (q, >=k) the model's top predictions after each, best first;
        previous: (q,) the token before each node (its parent's; -1 where unknown), for the pair table."""
        if self.shared:
            self._own()
        succ = np.asarray(successors)[:, :self.successors_k]
        if len(tokens) <= FEW_NODES:
            self._observe_few(tokens, succ, previous)
            return
        tokens = np.asarray(tokens, dtype=np.int64)
        ok = (tokens >= 0) & (tokens < self.vocab_size)
        self.table[tokens[ok]] = succ[ok]
        if previous is None:
            return
        prev = np.asarray(previous, dtype=np.int64)
        both = ok & (prev >= 0) & (prev < self.vocab_size)
        keys = prev[both] * self.vocab_size + tokens[both]
        slots = _slots(keys)
        self.pair_keys[slots] = keys  # a repeated slot takes the last of both, consistently
        self.pair_table[slots] = succ[both]

    def _observe_few(self, tokens, succ: np.ndarray, previous) -> None:
        """`observe` for a few nodes with Python integers (the same writes, in node order): right after a forward
        pass every distinct numpy operation runs from cold caches, and a one-token step's dozen of them cost
        ~4x this loop's."""
        vocab = self.vocab_size
        toks = [int(t) for t in tokens]
        prevs = [-1] * len(toks) if previous is None else [int(p) for p in previous]
        for i, (t, p) in enumerate(zip(toks, prevs)):
            if not 0 <= t < vocab:
                continue
            row = succ[i]
            self.table[t] = row
            if 0 <= p < vocab:
                key = p * vocab + t
                slot = _slot(key)
                self.pair_keys[slot] = key
                self.pair_table[slot] = row

    def successors(self, previous: int, token: int) -> tuple[np.ndarray, bool]:
        """(k,) the successors kept after this pair when it was seen (True), else after the token (False)."""
        if 0 <= previous < self.vocab_size:
            key = previous * self.vocab_size + token
            slot = _slot(key)
            if self.pair_keys.item(slot) == key:
                return self.pair_table[slot], True
        return self.table[token], False

    def _successor_list(self, previous: int, token: int) -> tuple[list[int], bool]:
        """`successors` as a list of Python ints (what drafting a tree reads, node by node)."""
        row, paired = self.successors(previous, token)
        return row.tolist(), paired

    def lookup(self, context: Any, n_max: int = 16, n_min: int = 2, max_matches: int = 5000,
               continuation_len: int = 10) -> Lookup:
        """Paths of the tree grown from the newest token (matched_len 2: the newest two tokens were seen as a
        pair; 1: only the newest token was)."""
        check_lookup_args(n_max, n_min, max_matches, continuation_len)
        tail = query_ids(context, 2)
        if not tail or not 0 <= tail[-1] < self.vocab_size or self.table[tail[-1], 0] < 0:
            return empty_lookup(self.source, continuation_len)  # a pair is only ever kept with its token
        previous, last = (tail[0] if len(tail) == 2 else -1), tail[-1]
        if self.native:
            found = self._grow_native(previous, last, continuation_len, max_matches)
            if found is not None:
                return found
        paths, masses, paired = self._grow(previous, last, continuation_len)
        # rows per path (round half to even, as numpy rounds); Python integers and two array calls in all, since
        # right after a forward pass each distinct numpy operation runs from cold caches
        kept = [(path, n) for path, n in zip(paths, (round(m * self.row_scale) for m in masses)) if n > 0]
        if not kept:
            return empty_lookup(self.source, continuation_len)
        rows = np.array([path + (-1,) * (continuation_len - len(path)) for path, _ in kept], dtype=np.int64)
        rows = np.repeat(rows, [n for _, n in kept], axis=0)[:max_matches]
        return Lookup(self.source, 2 if paired else 1, int(rows.shape[0]), rows)

    def _grow_native(self, previous: int, root: int, depth: int, max_matches: int) -> Lookup | None:
        """`lookup`'s rows from `recycle_grow.cpp` in one call (the same rows in the same order), or None where that
        library cannot be had (the Python path then answers)."""
        lib = recycle_grow_library()
        if lib is None:
            return None
        tables = (self.table, self.pair_keys, self.pair_table)
        if not all(t.flags.c_contiguous for t in tables) or self.table.dtype != np.int32 \
                or self.pair_table.dtype != np.int32 or self.pair_keys.dtype != np.int64:
            return None
        table, keys, pairs = (address(t) for t in tables)
        rows = np.empty((min(max_matches, 4 * self.row_scale), depth), dtype=np.int64)
        info = (ctypes.c_int64 * 1)()
        n = lib.rest_lab_recycle_grow(table, self.vocab_size, self.successors_k, keys, pairs, GOLDEN, _SHIFT,
                                      self._branching_c, len(self.branching), _PAIR_PRIOR_C, len(PAIR_PRIOR),
                                      _TOKEN_PRIOR_C, len(TOKEN_PRIOR), previous, root, depth, float(self.row_scale),
                                      rows.shape[0], rows.ctypes.data, info)
        if n < 0 or (n == rows.shape[0] < max_matches):  # refused, or the buffer may have cut rows: Python
            return None
        if n == 0:
            return empty_lookup(self.source, depth)
        return Lookup(self.source, 2 if info[0] else 1, n, rows[:n].copy())

    def _grow(self, previous: int, root: int, depth: int) -> tuple[list[tuple[int, ...]], list[float], bool]:
        """Every drafted path with the share of the prior chance that ends there, and whether the root's
        successors were those kept after (previous, root).

        A node's chance is its parent's times the prior of its rank (PAIR_PRIOR when its successors were
        recorded after the same two tokens, TOKEN_PRIOR after the same token only); what its children do
        not take ends at the node.  A path's rows then add up, over every prefix, to the prefix's chance:
        the draft tree scores each node by the chance of reaching it."""
        paths: list[tuple[int, ...]] = []
        ends: list[float] = []
        frontier: list[tuple[tuple[int, ...], int, int, float]] = [((), previous, root, 1.0)]
        root_paired = False
        for d in range(depth):
            width = self.branching[d] if d < len(self.branching) else 1
            grown = []
            for path, before, tok, chance in frontier:
                row, paired = self._successor_list(before, tok)
                if d == 0:  # the root alone
                    root_paired = paired
                prior = PAIR_PRIOR if paired else TOKEN_PRIOR
                succ = [t for t in row[:width] if t >= 0]
                children = [(path + (t,), tok, t, chance * prior[min(r, len(prior) - 1)])
                            for r, t in enumerate(succ)]
                if path:
                    paths.append(path)
                    ends.append(chance - sum(c[3] for c in children))
                grown.extend(c for c in children if c[3] * self.row_scale >= 0.5)  # too unlikely to draft
            frontier = grown
        for path, _, _, chance in frontier:
            paths.append(path)
            ends.append(chance)
        return paths, ends, root_paired

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path | None = None) -> None:
        """Write the tables atomically (temp file + rename) to path or self.path."""
        path = Path(path) if path is not None else self.path
        if path is None:
            raise DatastoreError("RecycleStore has no path to save to; pass path= here or to the constructor")
        buf = io.BytesIO()
        np.savez(buf, format=np.array("rest-lab-recycle"), version=np.array(FORMAT_VERSION), table=self.table,
                 pair_keys=self.pair_keys, pair_table=self.pair_table)
        try:
            write_atomic(path, buf.getvalue())
        except OSError as exc:
            raise DatastoreError(f"cannot save the model's successor table to {path}: {exc}") from None

    def load(self, path: str | Path | None = None) -> None:
        """Replace the tables with those saved at path (or self.path); tables of another shape are refused.
        A file of the first format (the per-token table only) loads with an empty pair table."""
        path = Path(path) if path is not None else self.path
        pair_keys, pair_table = np.full_like(self.pair_keys, -1), np.full_like(self.pair_table, -1)
        try:
            with np.load(path, allow_pickle=False) as z:
                if str(z["format"]) != "rest-lab-recycle":
                    raise ValueError("not a rest-lab successor table")
                table = z["table"]
                if int(z["version"]) >= 2:
                    pair_keys, pair_table = z["pair_keys"], z["pair_table"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DatastoreError(f"successor table {path} is unreadable ({exc}); delete it to start afresh") from None
        if table.shape != self.table.shape or table.dtype != self.table.dtype:
            raise DatastoreError(f"successor table {path} has shape {table.shape}, this model needs "
                                 f"{self.table.shape}; delete it to start afresh")
        if pair_keys.shape != self.pair_keys.shape or pair_table.shape != self.pair_table.shape \
                or pair_keys.dtype != self.pair_keys.dtype or pair_table.dtype != self.pair_table.dtype:
            raise DatastoreError(f"successor table {path} has a pair table of shape {pair_table.shape}, this model "
                                 f"needs {self.pair_table.shape}; delete it to start afresh")
        self.table = table.copy()
        self.pair_keys, self.pair_table = pair_keys.copy(), pair_table.copy()
        self.shared = False


_PAIR_PRIOR_C = (ctypes.c_double * len(PAIR_PRIOR))(*PAIR_PRIOR)
_TOKEN_PRIOR_C = (ctypes.c_double * len(TOKEN_PRIOR))(*TOKEN_PRIOR)


def _slot(key: int) -> int:
    """The pair table's slot of one key (previous * V + token, >= 0): `_slots` without arrays, for lookups."""
    return ((key * GOLDEN) & 0xFFFFFFFFFFFFFFFF) >> _SHIFT


def _slots(keys: np.ndarray) -> np.ndarray:
    """(n,) the pair table's slot of each key (previous * V + token, >= 0)."""
    return ((keys.astype(np.uint64) * np.uint64(GOLDEN)) >> np.uint64(_SHIFT)).astype(np.int64)
