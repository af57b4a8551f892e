"""A brute-force store: the reference every fast store and the decoder are checked against."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from datastores import StoreBase


@dataclass
class OracleLookup:
    source: str
    matched_len: int
    total_matches: int
    continuations: np.ndarray


class BruteForceStore(StoreBase):
    """Linear scan over a token list: longest suffix n_max..n_min, every occurrence with a continuation."""

    def __init__(self, tokens, source: str = "static"):
        self.tokens = [int(t) for t in tokens]
        self.source = source

    def lookup(self, context, n_max=16, n_min=2, max_matches=5000, continuation_len=10):
        ctx = [int(t) for t in context]
        toks = self.tokens
        for n in range(min(n_max, len(ctx)), n_min - 1, -1):
            suffix = ctx[-n:]
            ends = [i + n - 1 for i in range(len(toks) - n) if toks[i:i + n] == suffix]
            if ends:
                rows = []
                for e in ends[:max_matches]:
                    cont = toks[e + 1:e + 1 + continuation_len]
                    rows.append(cont + [-1] * (continuation_len - len(cont)))
                return OracleLookup(self.source, n, len(ends), np.array(rows, dtype=np.int64))
        return OracleLookup(self.source, 0, 0, np.zeros((0, continuation_len), dtype=np.int64))
