"""A static store's first-token table: per token id t, the first suffix-array rank whose backward string begins
with t (ranks whose newest token is t are one block, since the newest token leads every key), so a lookup
binary-searches that block only (~15 probes instead of ~26 in a 50M-token store).

Derived, not part of the format: written at build time, or computed and saved the first time an older store opens,
in `first-token-<hash>.i64` beside the store (the hash ties it to ``tokens.u32``); a store whose table is missing,
stale or unwritable searches every rank, with the same results.
"""
from __future__ import annotations

import array
from pathlib import Path
from typing import Optional

import numpy as np

from datastores.common import SEP

FIRST_TOKEN_MAX_ID = 1 << 22  # a store holding larger token ids (no tokenizer has them) keeps no table


def first_table_path(store: Path, digest: str) -> Path:
    return store / f"first-token-{digest[:16]}.i64"


def read_first_table(path: Path, tokens: np.ndarray, sa: np.ndarray, n_tokens: int) -> Optional[array.array]:
    """The saved table if it is there and fits this store (sizes, order, a few blocks checked), else None."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) < 16 or len(raw) % 8:
        return None
    first = np.frombuffer(raw, dtype="<i8")
    if first[0] != 0 or first[-1] > n_tokens or bool((np.diff(first) < 0).any()):
        return None
    filled = np.flatnonzero(np.diff(first))  # spot checks: a block's edges hold its token
    for t in filled[:: max(1, filled.size // 16)].tolist():
        if not (tokens[sa[first[t]]] == t and tokens[sa[first[t + 1] - 1]] == t):
            return None
    return array.array("q", raw) if array.array("q").itemsize == 8 else None


def count_first_table(tokens: np.ndarray) -> Optional[np.ndarray]:
    """The table of a stream: every token id counted (chunk by chunk, the separators left out), the running sums
    kept (little-endian int64); None where the stream holds ids past FIRST_TOKEN_MAX_ID."""
    counts = np.zeros(0, dtype=np.int64)
    chunk = 1 << 24
    for a in range(0, tokens.size, chunk):
        part = tokens[a:a + chunk]
        part = part[part != SEP]
        if part.size:
            if int(part.max()) >= FIRST_TOKEN_MAX_ID:
                return None  # ids no vocabulary has: search every rank
            got = np.bincount(part)
            if got.size > counts.size:
                got[:counts.size] += counts
                counts = got
            else:
                counts[:got.size] += got
    first = np.zeros(counts.size + 1, dtype="<i8")
    np.cumsum(counts, out=first[1:])
    return first
