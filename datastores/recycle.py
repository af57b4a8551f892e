"""The model's own predictions as a draft source ("model"): recycled tokens.

Every verify pass computes the model's next-token distribution at every tree node.  This
store keeps, for each token id, the top-k tokens the model predicted after it the last
time that token was a tree node (an adjacency table of vocab x k ids, under 2 MB for a
50k vocabulary at k = 8), and drafts from it where nothing else can: from the newest
token, a tree of likely continuations, wide near the root and narrow further down.

It needs no corpus and adapts to the conversation at hand: what the model said a moment
ago about a token is what it is likely to say again.  Verification is unchanged, so
greedy output stays identical and sampling exact; the cost model learns how often this
source's drafts are accepted, like any other source's.

Paths are returned as continuation rows, each repeated in proportion to a prior chance
of its ranks being right (rank 0 likelier than rank 1, ...), so the draft tree's prefix
counts order the nodes by that chance.
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from datastores.common import (
    DatastoreError,
    Lookup,
    StoreBase,
    check_lookup_args,
    empty_lookup,
    query_tail,
    write_atomic,
)

BRANCHING = (4, 3, 2, 2, 1, 1, 1, 1, 1, 1)  # children per node at each depth of the drafted tree
RANK_PRIOR = (0.55, 0.18, 0.08, 0.05, 0.03, 0.02, 0.015, 0.01)  # prior chance the rank-r successor is next
ROW_SCALE = 100  # rows per unit of chance (integer counts keep ties exact); a path below 1/200 is not drafted
# (a finer scale only multiplies the rows the draft tree merges: 1000 gave ~850 rows every step)


class RecycleStore(StoreBase):
    """Top-k successors per token id, refreshed from every verify pass's logits.

    ``successors_k`` tells the decoder how many of each node's top predictions to hand to
    `observe`.  ``path`` (optional) persists the table; the owner calls `save`.
    """

    source = "model"

    def __init__(self, vocab_size: int, k: int = 8, path: str | Path | None = None,
                 branching: Sequence[int] = BRANCHING):
        if vocab_size < 1 or not 1 <= k <= 64:
            raise DatastoreError(f"vocab_size={vocab_size}, k={k}: need a positive vocabulary and 1 <= k <= 64")
        self.vocab_size, self.successors_k = int(vocab_size), int(k)
        self.branching = tuple(int(b) for b in branching)
        self.path = Path(path) if path is not None else None
        self.table = np.full((self.vocab_size, self.successors_k), -1, dtype=np.int32)  # (V, k), -1 = unknown
        if self.path is not None and self.path.exists():
            self.load()

    @property
    def label(self) -> str:
        return "model"

    @property
    def known(self) -> int:
        """Token ids whose successors have been seen."""
        return int((self.table[:, 0] >= 0).sum())

    def observe(self, tokens: np.ndarray, successors: np.ndarray) -> None:
        """tokens: (q,) tree node ids; successors: (q, >=k) the model's top predictions after each, best first."""
        tokens = np.asarray(tokens, dtype=np.int64)
        ok = (tokens >= 0) & (tokens < self.vocab_size)
        self.table[tokens[ok]] = np.asarray(successors)[ok, :self.successors_k]

    def lookup(self, context: Any, n_max: int = 16, n_min: int = 2, max_matches: int = 5000,
               continuation_len: int = 10) -> Lookup:
        """Paths of the tree grown from the newest token (matched_len 1: one token looked up)."""
        check_lookup_args(n_max, n_min, max_matches, continuation_len)
        last = query_tail(context, 1)
        if last.size == 0 or not 0 <= int(last[0]) < self.vocab_size or self.table[int(last[0]), 0] < 0:
            return empty_lookup(self.source, continuation_len)
        paths, masses = self._grow(int(last[0]), continuation_len)
        counts = np.round(np.array(masses) * ROW_SCALE).astype(np.int64)  # (paths,)
        keep = counts > 0
        if not keep.any():
            return empty_lookup(self.source, continuation_len)
        rows = np.full((len(paths), continuation_len), -1, dtype=np.int64)
        for i, p in enumerate(paths):
            rows[i, :len(p)] = p
        rows = np.repeat(rows[keep], counts[keep], axis=0)[:max_matches]
        return Lookup(self.source, 1, int(rows.shape[0]), rows)

    def _grow(self, root: int, depth: int) -> tuple[list[tuple[int, ...]], list[float]]:
        """Every drafted path with the share of the prior chance that ends there.

        A node's chance is its parent's times RANK_PRIOR of its rank; what its children do not
        take ends at the node.  A path's rows then add up, over every prefix, to the prefix's
        chance: the draft tree scores each node by the chance of reaching it."""
        paths: list[tuple[int, ...]] = []
        ends: list[float] = []
        frontier: list[tuple[tuple[int, ...], int, float]] = [((), root, 1.0)]
        for d in range(depth):
            width = self.branching[d] if d < len(self.branching) else 1
            grown = []
            for path, tok, chance in frontier:
                succ = [int(t) for t in self.table[tok, :width] if t >= 0]
                children = [(path + (t,), t, chance * RANK_PRIOR[min(r, len(RANK_PRIOR) - 1)])
                            for r, t in enumerate(succ)]
                if path:
                    paths.append(path)
                    ends.append(chance - sum(c for _, _, c in children))
                grown.extend(c for c in children if c[2] * ROW_SCALE >= 0.5)  # too unlikely to draft
            frontier = grown
        for path, _, chance in frontier:
            paths.append(path)
            ends.append(chance)
        return paths, ends

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path | None = None) -> None:
        """Write the table atomically (temp file + rename) to path or self.path."""
        path = Path(path) if path is not None else self.path
        if path is None:
            raise DatastoreError("RecycleStore has no path to save to; pass path= here or to the constructor")
        buf = io.BytesIO()
        np.savez(buf, format=np.array("rest-lab-recycle"), version=np.array(1), table=self.table)
        try:
            write_atomic(path, buf.getvalue())
        except OSError as exc:
            raise DatastoreError(f"cannot save the model's successor table to {path}: {exc}") from None

    def load(self, path: str | Path | None = None) -> None:
        """Replace the table with the one saved at path (or self.path); a table of another shape is refused."""
        path = Path(path) if path is not None else self.path
        try:
            with np.load(path, allow_pickle=False) as z:
                if str(z["format"]) != "rest-lab-recycle":
                    raise ValueError("not a rest-lab successor table")
                table = z["table"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DatastoreError(f"successor table {path} is unreadable ({exc}); delete it to start afresh") from None
        if table.shape != self.table.shape or table.dtype != self.table.dtype:
            raise DatastoreError(f"successor table {path} has shape {table.shape}, this model needs "
                                 f"{self.table.shape}; delete it to start afresh")
        self.table = table.copy()
