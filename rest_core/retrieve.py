"""Retrieve: look the newest context tokens up in every active store.

Each store answers with the longest context suffix it holds (n_max down to
n_min) and up to `max_matches` continuations of `continuation_len` tokens.
Stores are independent; their answers are merged later, in the draft tree.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# continuations taken per store and step: enough for a store's shares of its next tokens to be steady
# (with more matches a store keeps those whose preceding text agrees longest with the context), few enough
# that merging them into a tree stays cheap -- 5000 rows of 24 tokens took 15-30 ms to merge, half a pass
MAX_MATCHES = 512


@dataclass(frozen=True)
class RetrieveSettings:
    n_max: int = 16  # longest suffix tried
    n_min: int = 2  # shortest suffix accepted as a match
    max_matches: int = MAX_MATCHES  # continuations taken per store
    continuation_len: int = 24  # tokens per continuation (deepest draft; the cost model cuts doubtful depth)

    def validate(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"Suffix lengths need 1 <= n_min <= n_max; got n_min={self.n_min}, n_max={self.n_max}.")
        if self.n_max > 64:
            raise ValueError(f"n_max={self.n_max} is too long: matches beyond 16 tokens are rare; use 64 at most.")
        if self.max_matches < 1:
            raise ValueError(f"max_matches must be at least 1, got {self.max_matches}.")
        if not 1 <= self.continuation_len <= 64:
            raise ValueError(f"continuation_len must be in 1..64, got {self.continuation_len}.")


def query_suffix(context: Sequence[int], settings: RetrieveSettings) -> list[int]:
    """The newest n_max context tokens, as Python integers: all that any lookup can use (the stores check a list of
    ints without numpy)."""
    return [int(t) for t in context[-settings.n_max:]]


def retrieve(query: Sequence[int], stores: Sequence, settings: RetrieveSettings) -> list:
    """One Lookup per store (datastores.Lookup), in the order the stores were given."""
    return [store.lookup(query, n_max=settings.n_max, n_min=settings.n_min,
                         max_matches=settings.max_matches, continuation_len=settings.continuation_len)
            for store in stores]
