"""The model's own predictions as a draft source: the successor table, the drafted tree, persistence."""
from __future__ import annotations

import numpy as np
import pytest

from datastores import DatastoreError, RecycleStore, open_recycle
from datastores.recycle import PAIR_PRIOR, PAIR_SLOTS, ROW_SCALE, TOKEN_PRIOR
from rest_core.tree import build_draft_tree


def trained() -> RecycleStore:
    store = RecycleStore(vocab_size=50, k=4)
    store.observe(np.array([5, 7, 8]), np.array([[7, 9, 11, 13], [8, 20, 21, 22], [30, 31, 32, 33]]))
    return store


def test_observe_keeps_the_latest_top_successors_per_token():
    store = trained()
    assert store.known == 3 and store.table[5].tolist() == [7, 9, 11, 13]
    store.observe(np.array([5]), np.array([[1, 2, 3, 4, 99]]))  # more predictions than k: the best k kept
    assert store.table[5].tolist() == [1, 2, 3, 4]
    store.observe(np.array([-1, 500]), np.array([[1, 2, 3, 4], [1, 2, 3, 4]]))  # ids outside the vocabulary
    assert store.known == 3


def test_lookup_drafts_a_tree_scored_by_the_chance_of_reaching_each_node():
    lk = trained().lookup([1, 2, 5], continuation_len=4)
    assert lk.source == "model" and lk.matched_len == 1  # no pair seen: the token's own successors
    by_path = shares_by_path(build_draft_tree(5, [lk], budget=64))
    # shares are the prior chance of reaching each node, relative to all drafted paths:
    # rank 0 after 5 is 7, rank 0 after 7 is 8, rank 0 after 8 is 30
    tol = 3 / ROW_SCALE
    assert by_path[(9,)] / by_path[(7,)] == pytest.approx(TOKEN_PRIOR[1] / TOKEN_PRIOR[0], abs=tol)
    assert by_path[(7, 8)] / by_path[(7,)] == pytest.approx(TOKEN_PRIOR[0], abs=tol)
    assert by_path[(7, 20)] / by_path[(7,)] == pytest.approx(TOKEN_PRIOR[1], abs=tol)
    assert by_path[(7, 8)] < by_path[(7,)]
    assert TOKEN_PRIOR[0] ** 3 * ROW_SCALE < 0.5 and (7, 8, 30) not in by_path  # three lone-token guesses: too unlikely
    assert {(7,), (9,), (11,), (13,)} <= set(by_path)  # four children at the first depth (BRANCHING[0])
    assert (9, 1) not in by_path  # nothing is known after 9
    assert trained().lookup([1, 2, 6]).matched_len == 0  # nothing known after 6: no draft


def test_a_finer_row_scale_drafts_deeper_guesses_and_a_wider_branching_more_children():
    """row_scale sets the least chance drafted (1 / (2 * row_scale)) and branching the children per depth: the
    three lone-token guesses too unlikely at the default are drafted at 1000 rows per unit of chance."""
    base = trained()
    wide = RecycleStore(vocab_size=50, k=4, branching=(1, 4, 4), row_scale=1000)
    wide.table[:] = base.table
    for native in (True, False):
        base.native = wide.native = native
        fine = shares_by_path(build_draft_tree(5, [wide.lookup([1, 2, 5], continuation_len=4)], budget=64))
        coarse = shares_by_path(build_draft_tree(5, [base.lookup([1, 2, 5], continuation_len=4)], budget=64))
        assert (7, 8, 30) in fine and (7, 8, 30) not in coarse
        assert (9,) in coarse and (9,) not in fine  # one child at the first depth
        assert {(7, 8), (7, 20), (7, 21), (7, 22)} <= set(fine)  # four at the second
    for bad in ({"row_scale": 0}, {"row_scale": 10**6}, {"branching": (2, -1)}):
        with pytest.raises(DatastoreError, match="row_scale"):
            RecycleStore(vocab_size=50, k=4, **bad)


def shares_by_path(tree) -> dict[tuple[int, ...], float]:
    """Each node's share, keyed by the tokens from the root to it."""
    by_path = {}
    for node in range(1, len(tree)):
        path, n = [], node
        while n > 0:
            path.append(int(tree.tokens[n]))
            n = int(tree.parents[n])
        by_path[tuple(reversed(path))] = tree.shares[node]
    return by_path


def test_successors_are_kept_per_pair_and_the_pair_wins_over_the_token():
    store = RecycleStore(vocab_size=50, k=4)
    # token 5 seen after 2 (model predicted 7 ...) and later after 3 (model predicted 40 ...)
    store.observe(np.array([5, 7]), np.array([[7, 9, 11, 13], [8, 20, 21, 22]]), previous=np.array([2, 5]))
    store.observe(np.array([5]), np.array([[40, 41, 42, 43]]), previous=np.array([3]))
    assert store.known == 2 and store.known_pairs == 3
    row, paired = store.successors(2, 5)
    assert paired and row.tolist() == [7, 9, 11, 13]  # after the same two tokens: what was said then
    row, paired = store.successors(3, 5)
    assert paired and row.tolist() == [40, 41, 42, 43]
    row, paired = store.successors(4, 5)  # an unseen pair: the token's latest successors
    assert not paired and row.tolist() == [40, 41, 42, 43]
    assert not store.successors(-1, 5)[1]
    store.observe(np.array([6]), np.array([[1, 2, 3, 4]]), previous=np.array([-1]))  # no token before: token only
    assert store.known == 3 and store.known_pairs == 3

    lk = store.lookup([1, 2, 5], continuation_len=4)
    assert lk.matched_len == 2  # the newest two tokens were seen as a pair
    by_path = shares_by_path(build_draft_tree(5, [lk], budget=64))
    tol = 3 / ROW_SCALE
    assert (7,) in by_path and (40,) not in by_path
    assert by_path[(9,)] / by_path[(7,)] == pytest.approx(PAIR_PRIOR[1] / PAIR_PRIOR[0], abs=tol)
    assert by_path[(7, 8)] / by_path[(7,)] == pytest.approx(PAIR_PRIOR[0], abs=tol)  # (5, 7) seen as a pair too
    assert store.lookup([1, 4, 5], continuation_len=4).matched_len == 1
    assert (40,) in shares_by_path(build_draft_tree(5, [store.lookup([1, 4, 5], continuation_len=4)], budget=64))


def test_a_chain_seen_in_context_is_drafted_deeper_than_one_seen_token_by_token():
    """The same successors, recorded once with the tokens before them and once without: the chain known pair
    by pair runs deep, the one known token by token stays short (its chance falls faster)."""
    chain = np.arange(10, 30)
    successors = np.stack([chain + 1, chain + 100, chain + 200, chain + 300], axis=1) % 500
    in_context, token_only = RecycleStore(500, k=4), RecycleStore(500, k=4)
    in_context.observe(chain, successors, previous=np.concatenate([[9], chain[:-1]]))
    token_only.observe(chain, successors)
    deep = build_draft_tree(10, [in_context.lookup([9, 10], continuation_len=16)], budget=64)
    shallow = build_draft_tree(10, [token_only.lookup([9, 10], continuation_len=16)], budget=64)
    assert deep.depths.max() >= 6 > shallow.depths.max()
    assert deep.tokens[deep.depths == 1].tolist()[0] == 11 == shallow.tokens[shallow.depths == 1].tolist()[0]


def test_colliding_pairs_replace_each_other_and_never_answer_for_one_another():
    store = RecycleStore(vocab_size=70_000, k=2)
    keys = np.arange(1, 70_000, dtype=np.int64) * 70_000 + 5  # (previous, 5) for many previous tokens
    store.observe(np.full(keys.size, 5), np.stack([keys % 97, keys % 89], axis=1), previous=keys // 70_000)
    assert store.known_pairs <= PAIR_SLOTS < keys.size
    hits = [store.successors(int(p), 5) for p in range(1, 70_000, 997)]
    assert 0 < sum(paired for _, paired in hits) < len(hits)  # some pairs were pushed out by later ones
    for p, (row, paired) in zip(range(1, 70_000, 997), hits):
        if paired:  # a pair found is always the pair asked for
            assert row.tolist() == [(p * 70_000 + 5) % 97, (p * 70_000 + 5) % 89]


def test_a_few_nodes_observed_one_by_one_write_what_the_array_path_writes(monkeypatch):
    rng = np.random.default_rng(3)
    by_loop, by_arrays = RecycleStore(vocab_size=60, k=3), RecycleStore(vocab_size=60, k=3)
    for step in range(300):
        q = int(rng.integers(1, 17))  # the sizes the loop takes (up to FEW_NODES)
        tokens = rng.integers(-2, 63, q)  # repeats and ids outside the vocabulary included
        successors = rng.integers(0, 60, (q, 5))
        previous = None if step % 7 == 0 else rng.integers(-2, 63, q)
        by_loop.observe(tokens, successors, previous)
        monkeypatch.setattr("datastores.recycle.FEW_NODES", 0)
        by_arrays.observe(tokens, successors, previous)
        monkeypatch.undo()
    assert by_loop.known > 40 and by_loop.known_pairs > 100
    for a, b in ((by_loop.table, by_arrays.table), (by_loop.pair_keys, by_arrays.pair_keys),
                 (by_loop.pair_table, by_arrays.pair_table)):
        assert np.array_equal(a, b)


def test_the_table_persists_and_a_bad_file_is_refused(tmp_path):
    path = tmp_path / "t.npz"
    store = trained()
    store.observe(np.array([9]), np.array([[1, 2, 3, 4]]), previous=np.array([5]))
    store.path = path
    store.save()
    again = RecycleStore(50, k=4, path=path)
    assert again.table.tolist() == store.table.tolist()
    row, paired = again.successors(5, 9)
    assert paired and row.tolist() == [1, 2, 3, 4]
    with np.load(path) as z:  # a file of the first format: the per-token table only
        np.savez(tmp_path / "v1.npz", format=z["format"], version=np.array(1), table=z["table"])
    first = RecycleStore(50, k=4, path=tmp_path / "v1.npz")
    assert first.table.tolist() == store.table.tolist() and first.known_pairs == 0
    with pytest.raises(DatastoreError, match="shape"):
        RecycleStore(60, k=4, path=path)
    path.write_bytes(b"not a table")
    with pytest.raises(DatastoreError, match="unreadable"):
        RecycleStore(50, k=4, path=path)


def test_open_recycle_specs(tmp_path, monkeypatch):
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path))

    class Tok:
        def get_vocab(self):
            return {f"t{i}": i for i in range(50)}

    assert open_recycle("none", Tok(), 50, "m") is None
    assert open_recycle("session", Tok(), 50, "m").path is None
    default = open_recycle("default", Tok(), 50, "m")
    default.path.parent.mkdir(parents=True, exist_ok=True)
    default.path.write_bytes(b"corrupt")
    again = open_recycle("default", Tok(), 50, "m")  # the built-in table is a cache: started afresh
    assert again.known == 0 and not again.path.exists()
    (tmp_path / "other.npz").write_bytes(b"corrupt")
    with pytest.raises(DatastoreError):
        open_recycle(str(tmp_path / "other.npz"), Tok(), 50, "m")


def test_a_full_table_drafts_from_few_rows_however_deep():
    """Every token knows 8 successors: the paths at 24 tokens deep still come as about ROW_SCALE rows (one per
    1/ROW_SCALE of chance), so merging them into the step's tree stays cheap, and the likeliest path leads."""
    vocab = 64
    store = RecycleStore(vocab_size=vocab, k=8)
    ids = np.arange(vocab)
    store.observe(ids, (ids[:, None] * 7 + np.arange(1, 9)[None, :]) % vocab)  # (V, 8) distinct successors
    lk = store.lookup([3], continuation_len=24)
    assert lk.continuations.shape[1] == 24
    assert lk.continuations.shape[0] <= ROW_SCALE + 16  # rounding may add a row per path
    tree = build_draft_tree(3, [lk], budget=8)
    first = int(store.table[3, 0])
    assert tree.tokens[1] == first and int(store.table[first, 0]) in tree.children[1]  # rank 0, then rank 0 again


def test_a_pairs_slot_is_the_same_whether_hashed_alone_or_with_others():
    from datastores.recycle import _slots
    store = RecycleStore(vocab_size=70_000, k=2)
    rng = np.random.default_rng(0)
    prev, tok = rng.integers(0, 70_000, 500), rng.integers(0, 70_000, 500)
    store.observe(tok, np.stack([tok, prev], axis=1), previous=prev)
    slots = _slots(prev * 70_000 + tok)
    assert slots.min() >= 0 and slots.max() < PAIR_SLOTS
    last = {}
    for i, s in enumerate(slots):
        last[int(s)] = i  # the pair observed last in each slot holds it
    for i in last.values():
        row, paired = store.successors(int(prev[i]), int(tok[i]))
        assert paired and row.tolist() == [tok[i], prev[i]]


def test_the_native_draft_is_the_python_paths_row_for_row():
    """`recycle_grow.cpp` drafts the same rows in the same order as the Python path: random tables (unknown
    successors included), pairs seen and not, random depths, branchings, row scales and row limits."""
    from datastores.native import recycle_grow_library
    if recycle_grow_library() is None:
        pytest.skip("no C++ compiler here: the Python path is the only one")
    rng = np.random.default_rng(5)
    native_answers = 0
    python_drafts = []  # trees the Python path grew while the native one was asked
    for trial in range(300):
        vocab, k = int(rng.integers(8, 40)), int(rng.integers(1, 9))
        branching = tuple(int(b) for b in rng.integers(1, 5, size=int(rng.integers(1, 8))))
        row_scale = int(rng.choice([1, 7, 100, 1000]))
        store = RecycleStore(vocab_size=vocab, k=k, branching=branching, row_scale=row_scale)
        n = int(rng.integers(1, 3 * vocab))
        tokens = rng.integers(0, vocab, size=n)
        succ = rng.integers(0, vocab, size=(n, k))
        succ[rng.random((n, k)) < 0.1] = -1  # unknown successors here and there
        store.observe(tokens, succ, previous=np.where(rng.random(n) < 0.7, rng.integers(0, vocab, size=n), -1))

        def python_grow(*args, grow=store._grow, store=store):
            if store.native:
                python_drafts.append(args)
            return grow(*args)

        store._grow = python_grow
        for _ in range(5):
            ctx = rng.integers(0, vocab, size=int(rng.integers(1, 4))).tolist()
            depth, limit = int(rng.integers(1, 25)), int(rng.integers(1, 300))
            store.native = True
            native = store.lookup(ctx, continuation_len=depth, max_matches=limit)
            assert not python_drafts, "the native path answered"
            store.native = False
            python = store.lookup(ctx, continuation_len=depth, max_matches=limit)
            assert (native.matched_len, native.total_matches) == (python.matched_len, python.total_matches), trial
            assert native.continuations.shape == python.continuations.shape, trial
            assert np.array_equal(native.continuations, python.continuations), trial
            native_answers += native.total_matches > 0
    assert native_answers > 500


def test_the_native_draft_rounds_rows_half_to_even_as_python_does(monkeypatch):
    """A path whose share of ROW_SCALE rows falls exactly on a half (priors that are binary fractions) gets the
    Python path's round-half-to-even count natively too (12.5 -> 12 rows, 37.5 -> 38)."""
    import ctypes

    from datastores import recycle
    from datastores.native import recycle_grow_library
    if recycle_grow_library() is None:
        pytest.skip("no C++ compiler here: the Python path is the only one")
    priors = (0.125, 0.375, 0.25, 0.25)
    for name in ("PAIR_PRIOR", "TOKEN_PRIOR"):
        monkeypatch.setattr(recycle, name, priors)
        monkeypatch.setattr(recycle, f"_{name}_C", (ctypes.c_double * len(priors))(*priors))
    store = RecycleStore(vocab_size=8, k=2, branching=(2,))
    store.observe(np.array([1]), np.array([[2, 3]]))
    counts = {}
    for native in (True, False):
        store.native = native
        lk = store.lookup([1], continuation_len=1)
        counts[native] = {int(t): int((lk.continuations[:, 0] == t).sum()) for t in (2, 3)}
    assert counts[True] == counts[False] == {2: 12, 3: 38}


def test_a_fork_reads_the_shared_table_until_it_learns_then_copies_it():
    base = trained()
    fork, other = base.fork(), base.fork()
    assert all(np.shares_memory(a, b) for a, b in ((fork.table, base.table), (fork.pair_table, base.pair_table),
                                                   (fork.pair_keys, base.pair_keys))), "a fork copies nothing"
    assert fork.lookup([1, 2, 5], continuation_len=4).continuations.tolist() == \
        base.lookup([1, 2, 5], continuation_len=4).continuations.tolist(), "and drafts what the shared table holds"
    with pytest.raises(ValueError):
        base.table[5] = 0  # the shared table is read-only: nobody changes it for the others
    fork.observe(np.array([5]), np.array([[40, 41, 42, 43]]), previous=np.array([7]))
    assert fork.table[5].tolist() == [40, 41, 42, 43] and not fork.shared
    assert base.table[5].tolist() == [7, 9, 11, 13] and other.table[5].tolist() == [7, 9, 11, 13], \
        "what one fork learns stays its own"
    assert not np.shares_memory(fork.table, base.table) and np.shares_memory(other.table, base.table)
    base.observe(np.array([8]), np.array([[1, 2, 3, 4]]))  # the shared table's owner learns on a copy too
    assert base.table[8].tolist() == [1, 2, 3, 4] and other.table[8].tolist() == [30, 31, 32, 33]
    fork.share(other)  # back to reading a shared table: its own copy dropped
    assert np.shares_memory(fork.table, other.table) and fork.shared and fork.table[5].tolist() == [7, 9, 11, 13]
