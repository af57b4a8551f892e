"""The on-disk static store: open, check, look up.

A store is a directory of a token stream, the suffix array of its reverse, the ranks of document ends and
meta.json (their layout, and the checksums that tie them together, are `datastores.store_format`'s), with derived
tables beside them: a first-token table and the pair bits (`datastores.pairs`).

Why reversed: every query suffix of length n (n_max down to n_min) is a *prefix* of
the one reversed query ``q[-1], q[-2], ...``, so one binary search finds the longest
matching length and the ranges for shorter lengths nest around the same point.

Why bytes: reversing the little-endian bytes of ``tokens[i-m+1 : i+1]`` yields the m
tokens read backwards, each in big-endian order, so Python's ``bytes`` comparison
(memcmp, shorter-prefix-first) is exactly the suffix-array order. A binary-search
probe is then two slices of an ``mmap`` and one C comparison (well under a microsecond).
"""
from __future__ import annotations

import array
import ctypes
import mmap
import struct
import threading
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
    gather_continuations,
    query_ids,
    sliding_window,
)
from datastores.fingerprint import check_tokenizer
from datastores.first_token import count_first_table, first_table_path, read_first_table
from datastores.native import static_lookup_library
from datastores.pairs import PairBits, log2_bits_for, pair_bits_path, read_pair_bits
from datastores.store_format import (
    META_NAME,
    TOKENS_NAME,
    describe_store,
    full_hash,
    index_dtype,
    read_meta,
    rebuild_hint,
    sample_hash,
    save_beside,
)
from rest_base.native_build import address
from rest_base.native_policy import NATIVE, NativePolicy

LEFT_CONTEXT_TOKENS = 64  # context tokens used to rank matches when there are too many
TABLES_AT_ONCE = 1 << 20  # stores up to this size compute a missing first-token table and pair bits at open
# (milliseconds); larger ones in a background thread (2-4 s per 50M tokens), searching until they are ready
NATIVE_MAX_CELLS = 1 << 22  # a native lookup writes max_matches rows into one buffer; larger asks take the Python path


class TokenDatastore(StoreBase):
    """A memory-mapped static store; opening costs a few small reads whatever its size."""

    source = "static"

    @property
    def label(self) -> str:
        return f"{self.source}:{self.name or self.path}"

    def __init__(self, path: Path, meta: dict, name: str | None = None, source: str | None = None):
        self.path = Path(path)
        self.name = name  # shown instead of the path where given
        if source:
            self.source = source  # a second static store drafts under its own name (e.g. "answers")
        self.meta = meta
        self.n_tokens = int(meta["n_tokens"])
        self.n_docs = int(meta["n_docs"])
        sa_dtype, suffix = index_dtype(self.n_tokens)
        self._sa_name, self._ends_name = f"sa.{suffix}", f"ends.{suffix}"
        self._maps = []
        self._tok_mm = self._map(TOKENS_NAME)
        self._sa_mm = self._map(self._sa_name)
        self._ends_mm = self._map(self._ends_name)
        self._tokens = np.frombuffer(self._tok_mm, dtype="<u4")  # (N,) token stream
        self._sa = np.frombuffer(self._sa_mm, dtype=sa_dtype)  # (N,) forward end positions
        self._ends = np.frombuffer(self._ends_mm, dtype=sa_dtype)  # (n_ends,) sorted ranks
        self._ends_type = self._ends.dtype.type
        self._windows: dict[int, np.ndarray] = {}  # continuation_len -> sliding view of the stream
        self._sa_item = np.dtype(sa_dtype).itemsize
        self._sa_unpack = struct.Struct("<I" if self._sa_item == 4 else "<Q").unpack_from
        self.native = NATIVE  # whether the lookup is one call of static_lookup.cpp where it can be had
        self._native = None  # (library, stream / suffix array / ends addresses), looked up at the first lookup
        # per token id t, ranks [first[t], first[t + 1]) are those whose newest token is t (None: not ready)
        self._first: array.array | None = self._read_first_table()
        # the pairs of adjacent tokens the stream holds (None: not ready): a context whose newest pair is not
        # there cannot match, and its lookup answers at once (datastores.pairs)
        self._pairs_log2 = log2_bits_for(self.n_tokens)
        self._pairs: PairBits | None = read_pair_bits(self._pair_bits_path(), self._pairs_log2, self._tokens)
        self._tables_thread: threading.Thread | None = None
        if self._first is None or self._pairs is None:
            if self.n_tokens <= TABLES_AT_ONCE:
                self._make_tables()
            else:
                self._tables_thread = threading.Thread(target=self._make_tables, name="store-tables", daemon=True)
                self._tables_thread.start()

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str | Path, tokenizer: Any = None, name: str | None = None,
             source: str | None = None) -> TokenDatastore:
        """Open a built store. With ``tokenizer``, refuse a store built by another one.
        ``name`` labels it in runs and statistics instead of its path (``static:NAME``);
        ``source`` names its drafts (default "static"), so two static stores can draft side by side.

        Checks on open: meta.json complete, every file present with the recorded size
        (consistent with n_tokens) and the sampled-block hash. ``verify()`` hashes all.
        """
        path = Path(path)
        meta = read_meta(path)
        n = meta["n_tokens"]
        _, suffix = index_dtype(n)
        item = 4 if suffix == "u32" else 8
        expected = {TOKENS_NAME: 4 * n, f"sa.{suffix}": item * n, f"ends.{suffix}": None}
        for fname, want in expected.items():
            rec = meta["files"].get(fname)
            if not isinstance(rec, dict) or not isinstance(rec.get("size"), int) \
                    or not isinstance(rec.get("sample_sha256"), str):
                raise DatastoreError(f"{path / META_NAME} is corrupt (no record for {fname}); {rebuild_hint(path)}")
            fpath = path / fname
            if not fpath.exists():
                raise DatastoreError(f"{fpath} is missing; the store is incomplete; {rebuild_hint(path)}")
            size = fpath.stat().st_size
            want = rec["size"] if want is None else want
            if size != rec["size"] or size != want or size == 0 or size % item:
                raise DatastoreError(f"{fpath} has {size} bytes, expected {want} (truncated or replaced); "
                                     f"{rebuild_hint(path)}")
            if sample_hash(fpath, size) != rec["sample_sha256"]:
                raise DatastoreError(f"{fpath} does not match its checksum (corrupt); {rebuild_hint(path)}")
        if tokenizer is not None:
            check_tokenizer(meta, tokenizer, path)
        return cls(path, meta, name, source)

    # ------------------------------------------------------------------ derived tables
    def _make_tables(self) -> None:
        """Compute (and save beside the store) whichever derived table could not be read."""
        if self._first is None:
            self._make_first_table()
        if self._pairs is None:
            self._make_pair_bits()

    def _digest(self) -> str:
        return str(self.meta.get("files", {}).get(TOKENS_NAME, {}).get("sample_sha256", "unhashed"))

    def _first_table_path(self) -> Path:
        return first_table_path(self.path, self._digest())

    def _pair_bits_path(self) -> Path:
        return pair_bits_path(self.path, self._digest(), self._pairs_log2)

    def _make_pair_bits(self) -> None:
        tokens = self._tokens
        if tokens is None:
            return
        bits = PairBits.of_stream(tokens, self._pairs_log2)
        save_beside(self._pair_bits_path(), bytes(bits.bits))
        self._pairs = bits

    def pair_bits(self, wait: bool = True) -> bool:
        """Whether a lookup whose newest two tokens the store never holds side by side answers without searching
        (else it searches, with the same result); `wait` joins bits still being computed."""
        if wait and self._tables_thread is not None:
            self._tables_thread.join()
        return self._pairs is not None

    def _read_first_table(self) -> array.array | None:
        return read_first_table(self._first_table_path(), self._tokens, self._sa, self.n_tokens)

    def _make_first_table(self) -> None:
        """Count the stream's token ids into the table, then save it beside the store (best effort: a read-only
        store computes it again next time)."""
        if self._tokens is None:
            return
        first = count_first_table(self._tokens)
        if first is None:
            return
        table = array.array("q", first.tobytes())
        save_beside(self._first_table_path(), first.tobytes())
        self._first = table

    def first_token_table(self, wait: bool = True) -> bool:
        """Whether lookups search only the block of ranks that ends with the query's newest token (else every
        rank, with the same results); `wait` joins a table still being computed."""
        if wait and self._tables_thread is not None:
            self._tables_thread.join()
        return self._first is not None

    def _map(self, name: str) -> mmap.mmap:
        with open(self.path / name, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._maps.append(mm)
        return mm

    def verify(self) -> None:
        """Hash every file in full and compare with meta.json; raises DatastoreError."""
        for name, rec in self.meta["files"].items():
            fpath = self.path / name
            if not fpath.exists() or full_hash(fpath) != rec.get("sha256"):
                raise DatastoreError(f"{fpath} fails its full checksum (corrupt); {rebuild_hint(self.path)}")

    def describe(self) -> str:
        """Multi-line human summary (what `python -m rest_core datastore info` prints)."""
        return describe_store(self.path, self.meta)

    def mapped_bytes(self) -> int:
        """Bytes of the files this store maps (what `warm` touches)."""
        return sum(len(mm) for mm in self._maps)

    def warm(self, background: bool = False) -> threading.Thread | None:
        """Touch every page of the mapped files so later lookups pay no page faults.

        A fresh mapping faults on first access to each 4 KiB page (microseconds each where the
        file is in the page cache, a disk read where it is not); the built-in openers
        (`datastores.builtin.warmed`) call this once after opening, with background=True to keep
        opening instant (returns the thread).
        """
        def touch() -> None:
            for arr in (self._tokens, self._sa, self._ends):
                if arr is None:
                    return
                step = max(1, 4096 // arr.itemsize)
                for a in range(0, arr.size, step << 12):  # 16 MiB-ish slices: lookups interleave
                    int(arr[a:a + (step << 12):step].max())

        if not background:
            touch()
            return None
        t = threading.Thread(target=touch, name="datastore-warm", daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self._windows = {}
        self._tokens = self._sa = self._ends = None
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # an array view still alive elsewhere; the OS frees it later
                pass
        self._maps = []

    def __repr__(self) -> str:
        return f"TokenDatastore({str(self.path)!r}, n_tokens={self.n_tokens})"

    # ------------------------------------------------------------------ search
    def _key(self, rank: int, m: int) -> bytes:
        """Backward string at SA rank ``rank``, at most m tokens, big-endian bytes."""
        i = self._sa_unpack(self._sa_mm, rank * self._sa_item)[0]
        s = i - m + 1
        return self._tok_mm[(s if s > 0 else 0) * 4:(i + 1) * 4][::-1]

    def _lower_bound(self, q: bytes, m: int, lo: int, hi: int) -> int:
        """First rank in [lo, hi) whose m-token backward string is >= q."""
        unpack, sa_mm, tok_mm, item = self._sa_unpack, self._sa_mm, self._tok_mm, self._sa_item
        while lo < hi:
            mid = (lo + hi) >> 1
            i = unpack(sa_mm, mid * item)[0]
            s = i - m + 1
            if tok_mm[(s if s > 0 else 0) * 4:(i + 1) * 4][::-1] < q:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _gallop(self, q: bytes, n: int, lo: int, hi: int) -> tuple[int, int]:
        """Grow [lo, hi) (inside the block of ranks whose n-token key equals q) to the
        whole block. Galloping costs O(log block) probes instead of O(log N)."""
        key, N = self._key, self.n_tokens
        step = 1  # left edge: find a rank below the block, then binary search
        while lo - step >= 0 and key(lo - step, n) == q:
            step <<= 1
        lo = self._lower_bound(q, n, max(0, lo - step), lo)
        step = 1  # right edge
        while hi + step - 1 < N and key(hi + step - 1, n) == q:
            step <<= 1
        a, b = hi, min(N, hi + step - 1)
        while a < b:  # first rank in [a, b) whose key != q (keys there are >= q)
            mid = (a + b) >> 1
            if key(mid, n) == q:
                a = mid + 1
            else:
                b = mid
        return lo, a

    def _dead(self, lo: int, hi: int) -> int:
        """How many ranks in [lo, hi) have no continuation."""
        e, t = self._ends, self._ends_type  # typed keys: an untyped int makes numpy copy e
        return int(e.searchsorted(t(hi))) - int(e.searchsorted(t(lo)))

    def _live_ranks(self, a: int, b: int) -> np.ndarray:
        """End positions at ranks [a, b) that have a continuation, in rank order. (k,) int64"""
        pos = self._sa[a:b].astype(np.int64)
        e, t = self._ends, self._ends_type
        d0, d1 = int(e.searchsorted(t(a))), int(e.searchsorted(t(b)))
        if d1 > d0:
            keep = np.ones(b - a, dtype=bool)
            keep[e[d0:d1].astype(np.int64) - a] = False
            pos = pos[keep]
        return pos

    def _lcp(self, rank: int, q: bytes, m: int) -> int:
        """Tokens the backward string at rank shares with q (at most m)."""
        k = self._key(rank, m)
        lo, hi = 0, min(len(k), len(q)) >> 2
        while lo < hi:  # binary search on prefix equality: a few C comparisons
            mid = (lo + hi + 1) >> 1
            if k[:4 * mid] == q[:4 * mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _select_by_left_context(self, ext_b: bytes, e: int, lo: int, hi: int, k: int) -> np.ndarray:
        """k live end positions in [lo, hi) sharing the longest reversed context ext_b.

        The ranks sharing ext[:agree] form a block around ext's insertion point, nested for
        agree = e, e-1, ...; take every occurrence of the largest block with fewer than k,
        then fill from the next block out, half on each side nearest the inner block
        (the odd one on the lower-rank side; fewer on a side that runs out).
        """
        pe = self._lower_bound(ext_b, e, lo, hi)
        top = max([self._lcp(r, ext_b, e) for r in (pe - 1, pe) if lo <= r < hi] or [0])
        inner = (pe, pe)  # block(top + 1): empty
        blo, bhi, agree = pe, pe, top
        while True:  # terminates: block(matched_len) = [lo, hi) has more than k live
            blo, bhi = self._gallop(ext_b[:4 * agree], agree, blo, bhi)
            if (bhi - blo) - self._dead(blo, bhi) >= k:
                break
            inner = (blo, bhi)
            # the block next grows at the longest agreement just outside it; the levels
            # in between have this same block, so jump straight there
            agree = max(self._lcp(blo - 1, ext_b, e) if blo > lo else -1,
                        self._lcp(bhi, ext_b, e) if bhi < hi else -1)
        got = self._live_ranks(*inner)
        need = k - got.size
        avail_l = (inner[0] - blo) - self._dead(blo, inner[0])
        avail_r = (bhi - inner[1]) - self._dead(inner[1], bhi)
        take_l, take_r = (need + 1) // 2, need // 2
        if avail_l < take_l:
            take_l, take_r = avail_l, need - avail_l
        elif avail_r < take_r:
            take_l, take_r = need - avail_r, avail_r
        a = inner[0] - take_l  # widen until the window holds take_l live ranks
        while (inner[0] - a) - self._dead(a, inner[0]) < take_l:
            a -= take_l - ((inner[0] - a) - self._dead(a, inner[0]))
        b = inner[1] + take_r
        while (b - inner[1]) - self._dead(inner[1], b) < take_r:
            b += take_r - ((b - inner[1]) - self._dead(inner[1], b))
        return np.concatenate([self._live_ranks(a, inner[0]), got, self._live_ranks(inner[1], b)])

    def use_native(self, policy: NativePolicy) -> None:
        self.native, self._native = policy, None  # the library asked again at the next lookup

    def _native_lookup(self, ext: list[int], n_max: int, n_min: int, max_matches: int,
                       continuation_len: int) -> Lookup | None:
        """`lookup` in one call of `static_lookup.cpp` (the same rows in the same order), or None where that
        library cannot be had, the store is closed or the ask is too large for its buffer (the Python path then
        answers)."""
        native = self._native
        if native is None:
            lib = self.native.library(static_lookup_library)
            if lib is None or self._tokens is None:
                self._native = False
                return None
            native = self._native = (lib, self._tokens.ctypes.data, self._sa.ctypes.data, self._ends.ctypes.data)
        elif native is False or self._tokens is None:
            return None
        if max_matches * continuation_len > NATIVE_MAX_CELLS:
            return None
        lib, tokens, sa, ends = native
        first = self._first  # None until a table is read or computed
        first_at, first_len = (None, 0) if first is None else (address(first), len(first))
        rows = np.empty((max_matches, continuation_len), dtype=np.int64)
        info = (ctypes.c_int64 * 2)()
        k = lib.rest_lab_static_lookup(tokens, self.n_tokens, sa, ends, self._ends.size, self._sa_item, first_at,
                                       first_len, (ctypes.c_int64 * len(ext))(*ext), len(ext), n_max, n_min,
                                       max_matches, continuation_len, rows.ctypes.data, rows.size, info, len(info))
        if k < 0:
            return None
        if info[0] == 0:
            return empty_lookup(self.source, continuation_len)
        return Lookup(self.source, info[0], info[1], rows[:k] if 2 * k >= max_matches else rows[:k].copy())

    def lookup(self, context: Sequence[int] | np.ndarray, n_max: int = 16, n_min: int = 2,
               max_matches: int = 5000, continuation_len: int = 10) -> Lookup:
        """Longest context suffix (n_max..n_min tokens) found in the store and what followed.

        With more than ``max_matches`` occurrences, the chosen ones are those whose
        preceding tokens agree longest with the context's (up to LEFT_CONTEXT_TOKENS
        tokens back): matches in the same surroundings predict better. Among equally long
        agreements, those nearest in SA order win (see `_select_by_left_context`). Rows
        come in SA order; the choice is deterministic for a given store and context.
        """
        check_lookup_args(n_max, n_min, max_matches, continuation_len)
        pairs = self._pairs
        if n_min >= 2 and pairs is not None and pairs.excludes(context):  # the newest pair never occurs here
            return empty_lookup(self.source, continuation_len)
        ext = query_ids(context, max(n_max, LEFT_CONTEXT_TOKENS))  # (<=ext,)
        m = min(n_max, len(ext))
        if m < n_min:
            return empty_lookup(self.source, continuation_len)
        found = self._native_lookup(ext, n_max, n_min, max_matches, continuation_len)
        if found is not None:
            return found
        ext_b = struct.pack(f">{len(ext)}I", *reversed(ext))  # reversed context, big-endian tokens
        q = ext_b[:4 * m]
        N = self.n_tokens
        first = self._first
        if first is None:  # no table (yet): every rank
            a, b = 0, N
        elif ext[-1] + 1 < len(first):  # the ranks whose newest token is the query's: every match is there
            a, b = first[ext[-1]], first[ext[-1] + 1]
        else:  # a token id the store never holds
            return empty_lookup(self.source, continuation_len)
        p = self._lower_bound(q, m, a, b)
        # the ranks next to the insertion point share the longest prefix with q
        best = max([self._lcp(r, q, m) for r in (p - 1, p) if a <= r < b] or [0])
        lo = hi = p
        n = best
        while n >= n_min:
            lo, hi = self._gallop(q[:4 * n], n, lo, hi)
            live = (hi - lo) - self._dead(lo, hi)
            if live > 0:
                break
            n -= 1  # only dead ends matched this long: try shorter
        else:
            return empty_lookup(self.source, continuation_len)

        if live <= max_matches:
            ends = self._live_ranks(lo, hi)
        else:
            ends = self._select_by_left_context(ext_b, len(ext), lo, hi, max_matches)
        win = self._windows.get(continuation_len)
        if win is None and N >= continuation_len:
            win = self._windows[continuation_len] = sliding_window(self._tokens, continuation_len)
        conts = gather_continuations(self._tokens, ends, continuation_len, N, win)
        return Lookup(self.source, n, int(live), conts)
