"""Datastores: every store's lookup against a brute-force search, builds from text,
refusals of bad stores, and history persistence."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from datastores import (
    SEP,
    DatastoreError,
    HistoryStore,
    RequestStore,
    TokenDatastore,
    build_datastore,
    build_from_token_documents,
    iter_jsonl,
    iter_text_files,
    reversed_suffix_array,
    tokenizer_fingerprint,
)
from datastores.native import request_scan_library
from datastores.static import LEFT_CONTEXT_TOKENS
from datastores.store_format import SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS
from rest_base.native_policy import NATIVE, PYTHON, NativePolicy
from rest_core.datastore_cli import main

FAST = settings(max_examples=int(os.environ.get("DATASTORES_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- brute force reference
def brute_match(stream: list[int], ctx: list[int], n_max: int, n_min: int) -> tuple[int, list[int]]:
    """(n, end positions) of the longest context suffix with a continuation, by scanning."""
    N = len(stream)
    for n in range(min(n_max, len(ctx)), n_min - 1, -1):
        suf = list(ctx[len(ctx) - n:])
        occ = [i for i in range(n - 1, N)
               if stream[i - n + 1:i + 1] == suf and i + 1 < N and stream[i + 1] != SEP]
        if occ:
            return n, occ
    return 0, []


def brute_row(stream: list[int], i: int, L: int) -> tuple[int, ...]:
    row = []
    for t in stream[i + 1:i + 1 + L]:
        if t == SEP:
            break
        row.append(t)
    return tuple(row + [-1] * (L - len(row)))


def backward(stream: list[int], i: int) -> tuple[int, ...]:
    """The backward string at i; tuple order = the documented suffix-array order."""
    return tuple(stream[i::-1])


def join_docs(docs: list[list[int]]) -> list[int]:
    out: list[int] = []
    for d in docs:
        if d:
            if out:
                out.append(SEP)
            out.extend(d)
    return out


def rows(arr: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in r) for r in arr]


# tokens from a small alphabet so matches happen, mixed with ids beyond 16 bits
ALPHABET = [0, 1, 2, 3, 65535, 65536, 2**31 + 5, 2**32 - 2]
token = st.sampled_from(ALPHABET)
docs_strategy = st.lists(st.lists(token, min_size=0, max_size=30), min_size=1, max_size=5)
ctx_strategy = st.lists(token, min_size=0, max_size=20)


def static_store(tmp: str, docs: list[list[int]]) -> TokenDatastore:
    return build_from_token_documents(Path(tmp) / "s", docs, tokenizer_info={"name": "test"}, overwrite=True)


# ---------------------------------------------------------------- static store
@FAST
@given(docs=st.lists(st.lists(st.integers(0, 3), max_size=25), min_size=1, max_size=4).filter(
    lambda d: any(d)))
def test_suffix_array_order_matches_the_documented_convention(docs):
    stream = join_docs(docs)
    sa = reversed_suffix_array(np.array(stream, dtype=np.uint32))
    assert sorted(range(len(stream)), key=lambda i: backward(stream, i)) == sa.tolist()


@FAST
@given(docs=docs_strategy.filter(lambda d: any(d)), ctx=ctx_strategy,
       n_max=st.integers(1, 8), n_min=st.integers(1, 3), max_matches=st.integers(1, 6),
       L=st.integers(1, 5))
def test_static_lookup_equals_brute_force(docs, ctx, n_max, n_min, max_matches, L):
    n_min = min(n_min, n_max)
    stream = join_docs(docs)
    with tempfile.TemporaryDirectory() as tmp:
        store = static_store(tmp, docs)
        got = store.lookup(ctx, n_max=n_max, n_min=n_min, max_matches=max_matches, continuation_len=L)
        again = store.lookup(np.array(ctx, dtype=np.int64), n_max=n_max, n_min=n_min,
                             max_matches=max_matches, continuation_len=L)
        store.close()
    n, occ = brute_match(stream, ctx, n_max, n_min)
    assert got.source == "static"
    assert (got.matched_len, got.total_matches) == (n, len(occ))
    assert got.continuations.dtype == np.int64 and got.continuations.shape[1] == L
    assert rows(got.continuations) == rows(again.continuations)  # deterministic
    if len(occ) <= max_matches:
        assert sorted(rows(got.continuations)) == sorted(brute_row(stream, i, L) for i in occ)
    else:  # the documented choice: longest shared left context, then nearest, half per side
        occ.sort(key=lambda i: backward(stream, i))
        ext = tuple(reversed(ctx[-max(n_max, LEFT_CONTEXT_TOKENS):]))
        lcp = {i: next((t for t, (a, b) in enumerate(zip(backward(stream, i), ext)) if a != b),
                       min(len(ext), i + 1)) for i in occ}
        level = max(n for n in range(len(ext) + 1) if sum(v >= n for v in lcp.values()) >= max_matches)
        inner = [i for i in occ if lcp[i] > level]
        left = [i for i in occ if lcp[i] == level and backward(stream, i) < ext]
        right = [i for i in occ if lcp[i] == level and backward(stream, i) >= ext]
        need = max_matches - len(inner)
        tl, tr = (need + 1) // 2, need // 2
        if len(left) < tl:
            tl, tr = len(left), need - len(left)
        elif len(right) < tr:
            tl, tr = need - len(right), len(right)
        chosen = left[len(left) - tl:] + inner + right[:tr]
        assert rows(got.continuations) == [brute_row(stream, i, L) for i in chosen]


@FAST
@given(docs=st.lists(st.lists(st.sampled_from([0, 1, 2, 3, 9, 70000]), max_size=30), min_size=1, max_size=5)
       .filter(lambda d: any(d)),
       ctx=st.lists(st.sampled_from([0, 1, 2, 3, 4, 9, 70000, 70001, 2**20]), max_size=20),
       n_max=st.integers(1, 8), n_min=st.integers(1, 3), max_matches=st.integers(1, 6))
def test_the_derived_tables_change_no_lookup(docs, ctx, n_max, n_min, max_matches):
    """A lookup searches only the ranks that end with the query's newest token, and answers at once where the
    store never holds its newest two tokens side by side: the same answer as searching every rank without the pair
    bits and as a scan of the stream, for tokens the store holds, lacks, or holds beyond the table."""
    n_min = min(n_min, n_max)
    with tempfile.TemporaryDirectory() as tmp:
        store = static_store(tmp, docs)
        assert store.first_token_table() and store.pair_bits()
        got = store.lookup(ctx, n_max=n_max, n_min=n_min, max_matches=max_matches, continuation_len=3)
        (table, store._first), (pairs, store._pairs) = (store._first, None), (store._pairs, None)
        every = store.lookup(ctx, n_max=n_max, n_min=n_min, max_matches=max_matches, continuation_len=3)
        store._first, store._pairs = table, pairs
        store.close()
    n, occ = brute_match(join_docs(docs), ctx, n_max, n_min)
    assert (got.matched_len, got.total_matches) == (every.matched_len, every.total_matches) == (n, len(occ))
    assert rows(got.continuations) == rows(every.continuations)


def test_the_first_token_table_is_saved_checked_and_rebuilt(tmp_path):
    docs = [[5, 1, 2, 40 + k] for k in range(30)] + [[9, 1, 2, 77]]
    store = build_from_token_documents(tmp_path / "s", docs)
    saved = list((tmp_path / "s").glob("first-token-*.i64"))
    assert len(saved) == 1 and store.first_token_table(wait=False)  # written with the store
    want = store.lookup([9, 1, 2], n_max=2, max_matches=1, continuation_len=1)
    table = np.fromfile(saved[0], dtype="<i8")
    assert table[-1] == sum(len(d) for d in docs) and table[1] == 0 and table[2] - table[1] == 31  # 31 ones
    reopened = TokenDatastore.open(tmp_path / "s")
    assert reopened._read_first_table() is not None  # the saved table fits: read, not counted again
    bad = table.copy()
    bad[[5, 9]] = bad[[9, 5]]  # out of order: not used, counted afresh and saved again
    bad.tofile(saved[0])
    assert reopened._read_first_table() is None
    fixed = TokenDatastore.open(tmp_path / "s")
    assert fixed.first_token_table() and np.array_equal(np.fromfile(saved[0], dtype="<i8"), table)
    saved[0].write_bytes(b"\0" * 12)  # truncated
    again = TokenDatastore.open(tmp_path / "s")
    got = again.lookup([9, 1, 2], n_max=2, max_matches=1, continuation_len=1)
    assert rows(got.continuations) == rows(want.continuations) == [(77,)]
    TokenDatastore.open(tmp_path / "s").verify()  # the derived file is no part of the store's checksums


def test_a_lookup_whose_newest_pair_the_store_never_holds_answers_without_searching(tmp_path, monkeypatch):
    """The pair bits are saved beside a static store, read back when they fit it and computed again when they do
    not; a context whose newest two tokens never occur side by side takes neither search, one that may does."""
    docs = [[5, 1, 2, 40 + k] for k in range(30)] + [[9, 1, 2, 77]]
    store = build_from_token_documents(tmp_path / "s", docs)
    saved = list((tmp_path / "s").glob("pairs-*.bits"))
    assert len(saved) == 1 and store.pair_bits(wait=False)  # written with the store

    def searched(*args, **kwargs):
        raise AssertionError("searched")

    monkeypatch.setattr(store, "_native_lookup", searched)
    monkeypatch.setattr(store, "_lower_bound", searched)
    for ctx in ([1, 3], [40, 41], [9, 1, 2, 5, 9], [7, 7, 7]):  # the newest pair is not in the store
        got = store.lookup(ctx, n_max=4, continuation_len=2)
        assert (got.matched_len, got.total_matches, got.continuations.shape) == (0, 0, (0, 2))
    with pytest.raises(AssertionError, match="searched"):
        store.lookup([9, 1, 2], n_max=4, continuation_len=2)  # "1 2" occurs: searched
    with pytest.raises(AssertionError, match="searched"):
        store.lookup([7, 2], n_max=4, n_min=1, continuation_len=2)  # a one-token match needs no pair
    monkeypatch.undo()
    assert rows(store.lookup([9, 1, 2], n_max=2, max_matches=1, continuation_len=1).continuations) == [(77,)]
    assert TokenDatastore.open(tmp_path / "s")._pairs is not None  # read back
    bits = bytearray(saved[0].read_bytes())
    bits[:] = bytes(len(bits))  # every bit clear: does not fit the stream, computed afresh and saved again
    saved[0].write_bytes(bytes(bits))
    fixed = TokenDatastore.open(tmp_path / "s")
    assert fixed.pair_bits() and fixed.lookup([9, 1, 2], n_max=2, continuation_len=1).matched_len == 2
    assert saved[0].read_bytes() != bytes(bits)
    saved[0].write_bytes(b"\0" * 12)  # truncated: the same
    assert TokenDatastore.open(tmp_path / "s").lookup([5, 1, 2], n_max=3, continuation_len=1).matched_len == 3


def test_the_dynamic_stores_pair_bits_hold_every_pair_something_followed():
    """The request and history stores set a pair's bit once a token follows it, appended a few tokens at a time
    (Python integers) or many (numpy) and as the bits double: every pair with a continuation is held; the
    request's own newest pair, which nothing follows yet, is not, so a step whose newest pair is new answers
    without searching."""
    from datastores.pairs import MIN_LOG2
    rng = np.random.default_rng(3)
    stream = rng.integers(0, 5000, size=70_000).tolist()  # more pairs than the first bits hold
    request = RequestStore(stream[:5], n_max=8, n_min=2)
    at = 5
    while at < len(stream):
        step = int(rng.integers(1, 12)) if at < 2000 else 5000  # both paths, then growth
        request.extend(stream[at:at + step])
        at += step
    bits = request._index.pairs
    assert bits.log2_bits > MIN_LOG2
    assert all(bits.holds(a, b) for a, b in zip(stream[:-2], stream[1:-1]))
    fresh = RequestStore([1, 2, 3], n_max=8, n_min=2)
    assert fresh._index.pairs.holds(1, 2) and not fresh._index.pairs.holds(2, 3)
    assert fresh._index.pairs.excludes([1, 2, 3]) and fresh.lookup([1, 2, 3]).matched_len == 0
    fresh.extend([4, 2, 3])
    assert not fresh._index.pairs.excludes([2, 3])
    assert fresh.lookup([2, 3], continuation_len=1).continuations.tolist() == [[4]]
    history = HistoryStore(n_max=8, n_min=2)
    history.add([1, 2, 3])
    history.add([8, 9])
    pairs = history._index.pairs
    assert pairs.holds(1, 2) and pairs.holds(2, 3) and not pairs.holds(8, 9)  # 3 is followed by the separator
    assert history.lookup([1, 2], continuation_len=1).continuations.tolist() == [[3]]


def test_pair_bits_read_any_integer_context_and_refuse_nothing():
    """A context of numpy integers reads as Python integers; one the bits cannot read (fewer than two tokens, ids
    out of range, not integers) is never excluded, so the lookup answers or explains what is wrong."""
    from datastores.pairs import PairBits, log2_bits_for
    bits = PairBits.of_stream(np.array([3, 4, 5], dtype=np.uint32))
    assert bits.log2_bits == log2_bits_for(3) == 16 and bits.holds(3, 4) and bits.holds(4, 5)
    assert bits.excludes([5, 3]) and bits.excludes(np.array([9, 5, 3])) and not bits.excludes(np.array([3, 4]))
    for odd in ([], [4], [-1, 3], [3, SEP], [3.0, 4.0], ["a", "b"]):
        assert not bits.excludes(odd)
    with pytest.raises(ValueError):
        PairBits(16, b"\0" * 3)
    assert log2_bits_for(50_000_000) == 26 and log2_bits_for(100_000) == 17


def test_a_store_with_ids_beyond_any_vocabulary_searches_every_rank(tmp_path):
    store = build_from_token_documents(tmp_path / "s", [[1, 2, 2**31 + 5, 3], [1, 2, 4]])
    assert not store.first_token_table() and not list((tmp_path / "s").glob("first-token-*"))
    assert store.lookup([2**31 + 5, 3], n_max=2, continuation_len=1).matched_len == 0  # ends the document
    assert rows(store.lookup([1, 2], n_max=2, continuation_len=1).continuations) in ([(2**31 + 5,), (4,)],
                                                                                     [(4,), (2**31 + 5,)])


def test_static_many_matches_prefer_shared_left_context(tmp_path):
    # "9 1 2" occurs once among many "x 1 2": with max_matches=1 the chosen one must be
    # the occurrence whose earlier token also agrees with the context.
    docs = [[5, 1, 2, 40 + k] for k in range(30)] + [[9, 1, 2, 77]] + [[6, 1, 2, 50 + k] for k in range(30)]
    store = build_from_token_documents(tmp_path / "s", docs)
    got = store.lookup([9, 1, 2], n_max=2, n_min=2, max_matches=1, continuation_len=1)
    assert (got.matched_len, got.total_matches) == (2, 61)
    assert rows(got.continuations) == [(77,)]


def test_static_many_matches_split_evenly_around_the_context(tmp_path):
    # all six occurrences of "1 2" agree on 2 tokens; the context's earlier token (5)
    # sorts between 3 and 7, so 3 picks are split 2 below (3 ...) and 1 above (7 ...)
    docs = [[3, 1, 2, 40 + k] for k in range(3)] + [[7, 1, 2, 50 + k] for k in range(3)]
    store = build_from_token_documents(tmp_path / "s", docs)
    got = store.lookup([5, 1, 2], n_max=2, max_matches=3, continuation_len=1)
    assert got.total_matches == 6
    assert sorted(r[0] // 10 for r in rows(got.continuations)) == [4, 4, 5]


def test_static_no_match_and_short_context(tmp_path):
    store = build_from_token_documents(tmp_path / "s", [[1, 2, 3]])
    for ctx in ([], [1], [7, 8], [3]):
        got = store.lookup(ctx, continuation_len=4)
        assert got.matched_len == 0 and got.total_matches == 0 and got.continuations.shape == (0, 4)
    # the only "2 3" ends the stream: it has no continuation, so it is not a match
    assert store.lookup([2, 3]).matched_len == 0
    with pytest.raises(DatastoreError, match="outside"):
        store.lookup([1, SEP])
    with pytest.raises(DatastoreError, match="n_min"):
        store.lookup([1, 2], n_min=0)


def test_a_step_of_bad_ids_is_refused_and_changes_nothing():
    request = RequestStore([1, 2, 3, 1, 2])
    for bad in ([4, -1], [SEP], [np.int64(-3)]):
        with pytest.raises(DatastoreError):
            request.extend(bad)
        assert request.tokens.tolist() == [1, 2, 3, 1, 2]
    request.extend([np.int64(3), 4])  # numpy integers take the array path
    assert request.tokens.tolist() == [1, 2, 3, 1, 2, 3, 4]
    assert request.lookup([2, 3]).continuations[:, 0].tolist() == [4, 1]


# ---------------------------------------------------------------- dynamic stores
@FAST
@given(chunks=st.lists(st.lists(token, max_size=12), min_size=1, max_size=5), ctx=ctx_strategy,
       n_max=st.integers(2, 9), max_matches=st.integers(1, 6), L=st.integers(1, 5),
       use_own_tokens=st.booleans(), native=st.booleans())
def test_request_store_equals_brute_force(chunks, ctx, n_max, max_matches, L, use_own_tokens, native):
    """Both ways of answering (one native scan of the stream; the hashed n-gram index) match a brute-force scan."""
    store = RequestStore(chunks[0], n_max=8, n_min=2, native=NativePolicy(native))
    if native and request_scan_library() is not None:
        assert store._index.scan is not None and not store._index.postings[2].tail_len  # nothing hashed
    for c in chunks[1:]:
        store.extend(c)
    stream = [t for c in chunks for t in c]
    if use_own_tokens:
        ctx = stream  # the decoder's usual query: the store's own newest tokens
    got = store.lookup(ctx, n_max=n_max, n_min=2, max_matches=max_matches, continuation_len=L)
    n, occ = brute_match(stream, ctx, n_max, 2)
    assert (got.matched_len, got.total_matches) == (n, len(occ))
    expect = [brute_row(stream, i, L) for i in sorted(occ, reverse=True)[:max_matches]]
    assert rows(got.continuations) == expect  # most recent first
    assert store.n_tokens == len(stream)


@FAST
@given(answers=st.lists(st.lists(token, max_size=15), min_size=1, max_size=8), ctx=ctx_strategy,
       n_max=st.integers(2, 9), n_min=st.integers(2, 4), max_tokens=st.integers(1, 60),
       max_matches=st.integers(1, 6), L=st.integers(1, 5), native=st.booleans())
def test_history_store_equals_brute_force(answers, ctx, n_max, n_min, max_tokens, max_matches, L, native):
    n_min = min(n_min, n_max)
    store = HistoryStore(n_max=8, n_min=2, max_tokens=max_tokens, native=NativePolicy(native))
    kept: list[list[int]] = []
    for a in answers:
        store.add(a)
        if a:
            kept.append(a[-max_tokens:])
            while sum(map(len, kept)) > max_tokens:
                kept.pop(0)
    assert len(store) == len(kept) and store.n_tokens == sum(map(len, kept))
    stream = join_docs(kept)
    got = store.lookup(ctx, n_max=n_max, n_min=n_min, max_matches=max_matches, continuation_len=L)
    n, occ = brute_match(stream, ctx, n_max, n_min)
    assert (got.matched_len, got.total_matches) == (n, len(occ))
    assert rows(got.continuations) == [brute_row(stream, i, L) for i in sorted(occ, reverse=True)[:max_matches]]


def test_short_appends_hashed_in_python_index_the_same_n_grams_as_numpy(monkeypatch):
    """A decoding step appends a token or a few (hashed with Python integers below SMALL_APPEND); longer appends
    are hashed with numpy: the two must put the same n-gram hashes at the same positions, inside documents only."""
    from datastores import dynamic
    rng = np.random.default_rng(5)
    stream = rng.integers(0, 30, size=300)
    cuts = [3]
    while cuts[-1] < stream.size:
        cuts.append(cuts[-1] + int(rng.integers(1, 10)))  # 1-9 tokens: both sides of SMALL_APPEND

    def build():
        request = RequestStore(stream[:3], n_max=16, n_min=2, native=PYTHON)  # the hashed index
        for a, b in zip(cuts, cuts[1:]):
            request.extend(stream[a:b].tolist())  # a list of ints, as the decoder hands over
        history = HistoryStore(n_max=16, n_min=2)
        for a, b in zip(cuts[:12], cuts[1:12]):
            history.add(stream[a:b])  # short answers: a separator, then the answer's n-grams only
        return request, history

    fast = build()
    monkeypatch.setattr(dynamic, "SMALL_APPEND", 0)  # numpy for every append
    reference = build()
    for a, b in zip(fast, reference):
        for n, postings in a._index.postings.items():
            other = b._index.postings[n]
            postings.merge()
            other.merge()
            assert np.array_equal(postings.keys, other.keys), n
            assert np.array_equal(postings.pos, other.pos), n
    assert fast[0]._index.postings[16].keys.size == stream.size - 15  # every 16-gram of the request
    ctx = stream[-6:].tolist()
    assert rows(fast[0].lookup(ctx, continuation_len=3).continuations) == \
        rows(reference[0].lookup(ctx, continuation_len=3).continuations)


@pytest.mark.parametrize("native", [False, True])
def test_dynamic_stores_scale_past_the_merge_threshold(native):
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 50, size=40_000)
    store = RequestStore(stream[:100], native=NativePolicy(native))
    for k in range(100, stream.size, 997):
        store.extend(stream[k:k + 997])
    for ctx in (stream[-5:].tolist(), stream[-5:].tolist() + [7, 7]):
        n, occ = brute_match(stream.tolist(), ctx, 16, 2)
        got = store.lookup(ctx, max_matches=3, continuation_len=3)
        assert (got.matched_len, got.total_matches) == (n, len(occ))
        assert rows(got.continuations) == [brute_row(stream.tolist(), i, 3) for i in sorted(occ)[::-1][:3]]
    # a history scanned while small, looked up through its hashes once past SCAN_MAX: the same answers as a scan
    history, docs = HistoryStore(native=NativePolicy(native)), []
    for k in range(0, 30_000, 1500):
        history.add(stream[k:k + 1500])
        docs.append(stream[k:k + 1500].tolist())
        ctx = stream[k + 1490:k + 1497].tolist()
        n, occ = brute_match(join_docs(docs), ctx, 16, 2)
        got = history.lookup(ctx, max_matches=4, continuation_len=3)
        assert (got.matched_len, got.total_matches) == (n, len(occ)), k
        assert rows(got.continuations) == [brute_row(join_docs(docs), i, 3) for i in sorted(occ)[::-1][:4]]


def test_history_persistence_round_trip(tmp_path):
    for name in ("hist.npz", "hist.json"):
        path = tmp_path / name
        h = HistoryStore(path, max_tokens=10)
        for a in ([1, 2, 3, 4], [2**32 - 2, 1, 2, 9], [5, 6, 7]):
            h.add(a)
        assert len(h) == 2  # the first answer was dropped past 10 tokens
        h.save()
        again = HistoryStore(path, max_tokens=10)
        assert [a.tolist() for a in again.answers()] == [[2**32 - 2, 1, 2, 9], [5, 6, 7]]
        got = again.lookup([8, 1, 2], n_min=2)
        assert (got.matched_len, rows(got.continuations)) == (2, [(9,) + (-1,) * 9])
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(DatastoreError, match="corrupt"):
        HistoryStore(tmp_path / "bad.npz")


# ---------------------------------------------------------------- building from text
def word_tokenizer(words: str = "def return import class self x y if else for in"):
    vocab = {"[UNK]": 0}
    for w in words.split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def test_build_from_folder_and_jsonl(tmp_path):
    tok = word_tokenizer()
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text("def x return y\n")
    (src / "pkg" / "b.py").write_text("class self if x return y else x\n")
    (src / "notes.txt").write_text("for x in y\n")
    (src / "blob.py").write_bytes(b"\x00\x01binary")
    (src / "latin.py").write_bytes("caf\xe9".encode("latin-1"))
    store = build_datastore(tmp_path / "st", tok, iter_text_files([src], suffixes=[".py"]), progress=False)
    assert store.n_docs == 2 and store.meta["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)
    counts = store.meta["sources"][0]["counts"]
    assert counts["skipped_binary"] == 1 and counts["skipped_undecodable"] == 1
    got = store.lookup(tok("x return", add_special_tokens=False)["input_ids"], continuation_len=2)
    assert got.matched_len == 2 and got.total_matches == 2
    assert sorted(rows(got.continuations)) == [(7, -1), (7, 9)]  # "y" then end / "y else"
    assert "2 documents" in store.describe()
    store.verify()

    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"text": "import x if y"}) + "\n{broken\n" + json.dumps({"body": "x"}) + "\n"
                  + json.dumps({"text": "import x for"}) + "\n")
    js = build_datastore(tmp_path / "js", tok, iter_jsonl(jl), progress=False, max_tokens=6)
    assert js.n_tokens == 6 and js.meta["build"]["truncated"]  # 4 + SEP + 1
    assert js.meta["sources"][0]["counts"]["skipped_bad_lines"] == 1
    assert js.lookup([3, 6]).continuations.tolist() == [[8, 7] + [-1] * 8]  # second copy was cut


def test_build_refuses_empty_corpus_and_existing_store(tmp_path):
    tok = word_tokenizer()
    with pytest.raises(DatastoreError, match="empty"):
        build_datastore(tmp_path / "e", tok, [("a", "   ")], progress=False)
    assert not (tmp_path / "e").exists()
    build_datastore(tmp_path / "s", tok, [("a", "x y")], progress=False)
    with pytest.raises(DatastoreError, match="already exists"):
        build_datastore(tmp_path / "s", tok, [("a", "x y")], progress=False)
    build_datastore(tmp_path / "s", tok, [("a", "x y x")], progress=False, overwrite=True)
    assert TokenDatastore.open(tmp_path / "s").n_tokens == 3
    with pytest.raises(DatastoreError, match="does not exist"):
        iter_text_files([tmp_path / "nope"])


def test_interrupted_build_leaves_nothing_that_opens(tmp_path):
    tok = word_tokenizer()

    def docs():
        for k in range(3000):
            if k == 2000:
                raise KeyboardInterrupt
            yield str(k), "x y if"

    with pytest.raises(KeyboardInterrupt):
        build_datastore(tmp_path / "s", tok, docs(), progress=False)
    assert os.listdir(tmp_path) == []
    with pytest.raises(DatastoreError, match="does not exist"):
        TokenDatastore.open(tmp_path / "s")


def test_resumed_build_reuses_tokenized_batches(tmp_path, monkeypatch):
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path / "cache"))
    tok = word_tokenizer()
    texts = [(str(k), "x y if " * 100) for k in range(1200)]  # 3 batches of 512 documents

    def interrupted():
        yield from texts[:1100]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_datastore(tmp_path / "s", tok, interrupted(), progress=False, resume=True)
    store = build_datastore(tmp_path / "s", tok, texts, progress=False, resume=True)
    assert store.meta["build"]["cached_batches"] == 2 and store.n_docs == 1200
    fresh = build_datastore(tmp_path / "f", tok, texts, progress=False)
    assert np.array_equal(store._tokens, fresh._tokens)


# ---------------------------------------------------------------- refusals on open
@pytest.fixture
def built(tmp_path):
    tok = word_tokenizer()
    build_datastore(tmp_path / "s", tok, [(str(k), "x y if x return " * (k + 1)) for k in range(50)],
                    progress=False)
    return tmp_path / "s", tok


def test_open_refuses_other_tokenizer(built):
    path, tok = built
    TokenDatastore.open(path, tokenizer=tok)
    with pytest.raises(DatastoreError, match="built with tokenizer.*python -m rest_core datastore build"):
        TokenDatastore.open(path, tokenizer=word_tokenizer("def return other words"))


@pytest.mark.parametrize("damage", ["truncate_tokens", "truncate_sa", "flip_sa", "corrupt_meta",
                                    "no_meta", "meta_field", "missing_ends"])
def test_open_refuses_damaged_store(built, damage):
    path, _ = built
    if damage == "truncate_tokens":
        with open(path / "tokens.u32", "r+b") as f:
            f.truncate(f.seek(0, 2) - 4)
    elif damage == "truncate_sa":
        with open(path / "sa.u32", "r+b") as f:
            f.truncate(8)
    elif damage == "flip_sa":
        data = bytearray((path / "sa.u32").read_bytes())
        data[4] ^= 0xFF
        (path / "sa.u32").write_bytes(bytes(data))
    elif damage == "corrupt_meta":
        (path / "meta.json").write_text("{ not json")
    elif damage == "no_meta":
        (path / "meta.json").unlink()
    elif damage == "meta_field":
        meta = json.loads((path / "meta.json").read_text())
        del meta["n_tokens"]
        (path / "meta.json").write_text(json.dumps(meta))
    elif damage == "missing_ends":
        (path / "ends.u32").unlink()
    with pytest.raises(DatastoreError, match="rebuild"):
        TokenDatastore.open(path)


def test_verify_catches_what_sampling_misses(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "s"
    store = build_from_token_documents(path, [rng.integers(0, 1000, size=600_000)])
    store.close()
    size = (path / "tokens.u32").stat().st_size
    starts = np.linspace(0, size - SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS).astype(np.int64)
    gap = int(starts[0] + SAMPLE_BLOCK_BYTES + 8)  # between the first two sampled blocks
    assert gap < starts[1]
    with open(path / "tokens.u32", "r+b") as f:
        f.seek(gap)
        byte = f.read(1)
        f.seek(gap)
        f.write(bytes([byte[0] ^ 1]))
    reopened = TokenDatastore.open(path)  # the cheap check on open does not read this byte
    with pytest.raises(DatastoreError, match="full checksum"):
        reopened.verify()


def test_open_missing_directory(tmp_path):
    with pytest.raises(DatastoreError, match="does not exist.*python -m rest_core datastore build"):
        TokenDatastore.open(tmp_path / "nowhere")


def test_cli_build_info_and_errors(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("x y if x return y")
    tok = word_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    assert main(["build", str(tmp_path / "s"), "--files", str(src), "--tokenizer", str(tmp_path / "tok"),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "bytes/token" in out
    assert main(["info", str(tmp_path / "s"), "--verify"]) == 0
    assert "checksums match" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["build", str(tmp_path / "t"), "--files", str(tmp_path / "nope"), "--tokenizer",
                 str(tmp_path / "tok")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_store_is_labelled_by_its_folder_or_the_name_it_was_opened_with(tmp_path):
    build_from_token_documents(tmp_path / "s", [[1, 2, 3], [4, 5]])
    assert TokenDatastore.open(tmp_path / "s").label == f"static:{tmp_path / 's'}"
    assert TokenDatastore.open(tmp_path / "s", name="uploaded").label == "static:uploaded"


def test_opened_stores_are_warmed_where_they_fit_in_memory(tmp_path, monkeypatch):
    """The openers touch a store's pages in the background (no page faults in later lookups) unless the
    store would take more than WARM_SHARE of the available memory."""
    import datastores.builtin as builtin
    from datastores.static import TokenDatastore

    tok = word_tokenizer()
    build_datastore(tmp_path / "s", tok, [("a", "x y x y if x return y")], progress=False)
    warmed = []
    monkeypatch.setattr(TokenDatastore, "warm", lambda self, background=False: warmed.append(background))
    store = builtin.open_static_store(str(tmp_path / "s"), tok)
    assert warmed == [True] and store.mapped_bytes() > 0
    monkeypatch.setattr(builtin, "available_memory", lambda: int(store.mapped_bytes() / builtin.WARM_SHARE) - 1)
    builtin.open_static_store(str(tmp_path / "s"), tok)
    assert warmed == [True]  # too big for the memory at hand: left to fault in
    monkeypatch.setattr(builtin, "available_memory", lambda: None)  # unknown memory: warmed
    builtin.open_static_store(str(tmp_path / "s"), tok)
    assert warmed == [True, True]


def test_warming_a_store_changes_no_lookup(tmp_path):
    tok = word_tokenizer()
    store = build_datastore(tmp_path / "s", tok, [("a", "x y x y if x return y else x")], progress=False)
    before = store.lookup(tok("x y", add_special_tokens=False)["input_ids"], continuation_len=3)
    store.warm(background=True).join(timeout=10)
    after = store.lookup(tok("x y", add_special_tokens=False)["input_ids"], continuation_len=3)
    assert (before.matched_len, before.total_matches) == (after.matched_len, after.total_matches)
    assert np.array_equal(before.continuations, after.continuations)


@FAST
@given(docs=st.lists(st.lists(st.sampled_from([0, 1, 2, 3, 9, 70000, 2**31 + 5, 2**32 - 2]), max_size=40),
                     min_size=1, max_size=6).filter(lambda d: any(d)),
       ctx=st.lists(st.sampled_from([0, 1, 2, 3, 4, 9, 70000, 2**31 + 5]), max_size=24),
       n_max=st.integers(1, 10), n_min=st.integers(1, 3), max_matches=st.integers(1, 8), L=st.integers(1, 6),
       without_table=st.booleans())
def test_the_native_lookup_answers_as_the_python_path(docs, ctx, n_max, n_min, max_matches, L, without_table):
    """`static_lookup.cpp` answers every lookup with the Python path's matched length, count and rows in the same
    order: on random stores (ids up to 2**32 - 2, documents ending anywhere), contexts, limits (the choice by left
    context included) and with or without the first-token table."""
    from datastores.native import static_lookup_library
    if static_lookup_library() is None:
        pytest.skip("no C++ compiler here: the Python path is the only one")
    n_min = min(n_min, n_max)
    with tempfile.TemporaryDirectory() as tmp:
        store = static_store(tmp, docs)
        store._pairs = None  # every lookup searches (the pair bits' own test: test_the_derived_tables_change_no_lookup)
        if without_table:
            store._first = None
        native = store.lookup(ctx, n_max=n_max, n_min=n_min, max_matches=max_matches, continuation_len=L)
        assert store._native or min(n_max, len(ctx)) < n_min, "the native lookup was taken"
        store.use_native(PYTHON)
        python = store.lookup(ctx, n_max=n_max, n_min=n_min, max_matches=max_matches, continuation_len=L)
        store.close()
    assert (native.source, native.matched_len, native.total_matches) == \
        (python.source, python.matched_len, python.total_matches)
    assert native.continuations.dtype == np.int64 and native.continuations.shape[1] == L
    assert rows(native.continuations) == rows(python.continuations)


def test_the_native_lookup_answers_as_the_python_path_on_the_built_in_store():
    """On the Python store the app drafts from (where it is built), 300 contexts cut from its own stream and 100
    random ones give the same answers both ways, many of them past max_matches (16)."""
    from datastores.native import static_lookup_library
    from rest_base.files import cache_dir
    if static_lookup_library() is None:
        pytest.skip("no C++ compiler here: the Python path is the only one")
    found = [p for p in sorted((cache_dir() / "stores").glob("python-*")) if (p / "meta.json").exists()]
    if not found:
        pytest.skip("the built-in store is not built on this machine")
    store = TokenDatastore.open(found[0])
    rng = np.random.default_rng(3)
    stream = np.frombuffer((found[0] / "tokens.u32").read_bytes()[:4 << 20], dtype="<u4")
    contexts = []
    for _ in range(300):
        at = int(rng.integers(20, stream.size))
        contexts.append([int(t) for t in stream[at - int(rng.integers(1, 20)):at] if t != SEP])
    contexts += [rng.integers(0, 49152, size=int(rng.integers(1, 20))).tolist() for _ in range(100)]
    past = 0
    for ctx in contexts:
        native = store.lookup(ctx, n_max=16, n_min=2, max_matches=16, continuation_len=12)
        store.use_native(PYTHON)
        python = store.lookup(ctx, n_max=16, n_min=2, max_matches=16, continuation_len=12)
        store.use_native(NATIVE)
        assert (native.matched_len, native.total_matches) == (python.matched_len, python.total_matches), ctx
        assert np.array_equal(native.continuations, python.continuations), ctx
        past += native.total_matches > 16
    store.close()
    assert past > 15  # 29 of them on the store built from the Python docs
