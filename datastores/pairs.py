"""Which pairs of adjacent tokens a store holds: a hashed bit set that answers "no match" without a search.

Every match of two or more tokens ends with the context's newest two tokens, so a store in which that pair
never occurs has nothing to draft from, whatever else the context holds.  Each store keeps one bit per hash of
the pairs it holds (a superset: two pairs may share a bit, and a pair may occur only where nothing follows it),
and a lookup whose newest pair has its bit clear answers empty at once -- the same answer the search would give
(the context's older tokens are not read then: whatever they are, nothing can match).

Why it pays: a lookup runs right after a forward pass that streamed every weight through the caches, so any
code path it takes starts cold.  A step in which no store holds the newest pair (most steps with nothing to
draft) spent ~150 us on five searches that all missed (a 2-vCPU AMD EPYC), where one bit per store takes a few.

The static stores compute their bits once (saved beside the store: 1.5-3 s for 50M tokens, in the background
for large stores); the request and history stores set the bits of what they append.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from datastores.common import GOLDEN, SEP

_GOLDEN_U = np.uint64(GOLDEN)
_MASK64 = (1 << 64) - 1
MIN_LOG2, MAX_LOG2 = 16, 26  # 8 KB .. 8 MB of bits
_CHUNK = 1 << 22  # tokens hashed per numpy pass


def log2_bits_for(pairs: int) -> int:
    """Bits (as a power of two) for a store of about `pairs` pairs: at least one bit per pair, so at most ~1 in 2
    bits is set even if every pair were distinct (real text repeats most pairs: a 50M-token Python store holds
    ~1.7M distinct pairs, 2.6% of 2^26 bits)."""
    return min(MAX_LOG2, max(MIN_LOG2, int(pairs - 1).bit_length()))


class PairBits:
    """One bit per hash of the token pairs a store holds (`excludes(context)`: the newest pair is surely absent)."""

    def __init__(self, log2_bits: int, data: bytes | bytearray | None = None):
        if not MIN_LOG2 <= log2_bits <= MAX_LOG2:
            raise ValueError(f"log2_bits must be in {MIN_LOG2}..{MAX_LOG2}, got {log2_bits}")
        size = 1 << (log2_bits - 3)
        if data is not None and len(data) != size:
            raise ValueError(f"{len(data)} bytes of bits for 2^{log2_bits} bits (needs {size})")
        self.log2_bits = log2_bits
        self._shift = 64 - log2_bits
        self.bits = bytearray(data) if data is not None else bytearray(size)

    def holds(self, a: int, b: int) -> bool:
        """Whether the pair (a, b) may occur (its bit is set, or the ids are none the bits can read)."""
        return not self.excludes((a, b))

    def excludes(self, context: Sequence[int] | np.ndarray) -> bool:
        """True when the context's newest two tokens are surely not a pair of the store (no match of two or more
        tokens is possible); False when they may be, and for a context it cannot read (fewer than two tokens,
        ids outside 0..2^32 - 2, non-integers: the lookup then answers, or explains what is wrong)."""
        if len(context) < 2:
            return False
        a, b = context[-2], context[-1]
        if type(a) is not int or type(b) is not int:
            try:
                a, b = operator.index(a), operator.index(b)
            except TypeError:
                return False
        if not (0 <= a < SEP and 0 <= b < SEP):
            return False
        h = ((((a << 32) | b) * GOLDEN) & _MASK64) >> self._shift
        return not self.bits[h >> 3] >> (h & 7) & 1

    def add(self, before: int, tokens: Sequence[int]) -> None:
        """Set the bits of the pairs (before, tokens[0]), (tokens[0], tokens[1]), ... (before < 0: none before).
        The hash is written out here and in `excludes`, not called: both run on every decoding step, right after a
        forward pass, where each extra call starts cold."""
        bits, shift = self.bits, self._shift
        for t in tokens:
            if before >= 0:
                h = ((((before << 32) | t) * GOLDEN) & _MASK64) >> shift
                bits[h >> 3] |= 1 << (h & 7)
            before = t

    def add_stream(self, stream: np.ndarray, start: int = 1, stop: int | None = None) -> None:
        """Set the bits of the pairs (stream[i - 1], stream[i]) for start <= i < stop (non-negative ids below 2^32),
        in chunks of numpy operations."""
        stop = stream.size if stop is None else stop
        start = max(1, start)
        view = np.frombuffer(self.bits, dtype=np.uint8)
        shift, three, seven, high = np.uint64(self._shift), np.uint64(3), np.uint64(7), np.uint64(32)
        for a in range(start, stop, _CHUNK):
            b = min(stop, a + _CHUNK)
            key = (stream[a - 1:b - 1].astype(np.uint64) << high) | stream[a:b].astype(np.uint64)
            h = (key * _GOLDEN_U) >> shift
            np.bitwise_or.at(view, h >> three, np.left_shift(np.uint8(1), (h & seven).astype(np.uint8)))

    @classmethod
    def of_stream(cls, stream: np.ndarray, log2_bits: int | None = None) -> PairBits:
        """The bits of every adjacent pair of a token stream."""
        bits = cls(log2_bits if log2_bits is not None else log2_bits_for(stream.size))
        bits.add_stream(stream)
        return bits

    def grown(self, stream: np.ndarray, start: int, stop: int) -> PairBits:
        """Twice the bits, set afresh from stream[start:stop] (a growing store keeps about one bit per pair)."""
        bigger = PairBits(min(MAX_LOG2, self.log2_bits + 1))
        bigger.add_stream(stream, start + 1, stop)
        return bigger


def pair_bits_path(folder: Path, digest: str, log2_bits: int) -> Path:
    return folder / f"pairs-{digest[:16]}-{log2_bits}.bits"


def read_pair_bits(path: Path, log2_bits: int, stream: np.ndarray) -> PairBits | None:
    """The saved bits if they fit the stream (size, and the pairs at 64 spread positions set), else None."""
    try:
        raw = path.read_bytes()
        bits = PairBits(log2_bits, raw)
    except (OSError, ValueError):
        return None
    n = stream.size
    spots = np.linspace(1, n - 1, num=min(64, n - 1), dtype=np.int64).tolist() if n > 1 else []
    return bits if all(bits.holds(int(stream[i - 1]), int(stream[i])) for i in spots) else None

