"""The model's own predictions as a draft source: the successor table, the drafted tree, persistence."""
from __future__ import annotations

import numpy as np
import pytest

from datastores import DatastoreError, RecycleStore, open_recycle
from datastores.recycle import RANK_PRIOR, ROW_SCALE
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
    assert lk.source == "model" and lk.matched_len == 1
    tree = build_draft_tree(5, [lk], budget=64)
    by_path = {}
    for node in range(1, len(tree)):
        path, n = [], node
        while n > 0:
            path.append(int(tree.tokens[n]))
            n = int(tree.parents[n])
        by_path[tuple(reversed(path))] = tree.shares[node]
    # shares are the prior chance of reaching each node, relative to all drafted paths:
    # rank 0 after 5 is 7, rank 0 after 7 is 8, rank 0 after 8 is 30
    tol = 3 / ROW_SCALE
    assert by_path[(9,)] / by_path[(7,)] == pytest.approx(RANK_PRIOR[1] / RANK_PRIOR[0], abs=tol)
    assert by_path[(7, 8)] / by_path[(7,)] == pytest.approx(RANK_PRIOR[0], abs=tol)
    assert by_path[(7, 20)] / by_path[(7,)] == pytest.approx(RANK_PRIOR[1], abs=tol)
    assert by_path[(7, 8, 30)] < by_path[(7, 8)] < by_path[(7,)]
    assert {(7,), (9,), (11,), (13,)} <= set(by_path)  # four children at the first depth (BRANCHING[0])
    assert (9, 1) not in by_path  # nothing is known after 9
    assert trained().lookup([1, 2, 6]).matched_len == 0  # nothing known after 6: no draft


def test_the_table_persists_and_a_bad_file_is_refused(tmp_path):
    path = tmp_path / "t.npz"
    store = trained()
    store.path = path
    store.save()
    assert RecycleStore(50, k=4, path=path).table.tolist() == store.table.tolist()
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
