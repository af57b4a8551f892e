"""Draft tree and tree mask: checked against a brute-force trie and the ancestor relation."""
from __future__ import annotations

from collections import Counter, defaultdict
from unittest.mock import patch

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rest_core.decode import aggregate_branches
from rest_core.tree import ancestor_matrix, build_draft_tree, prune_tree, row_order, tree_mask, tree_positions

from oracle import OracleLookup

SOURCES = ("static", "request", "history")


@st.composite
def lookups_strategy(draw):
    out = []
    for source in draw(st.lists(st.sampled_from(SOURCES), min_size=1, max_size=3, unique=True)):
        k = draw(st.integers(1, 30))
        width = draw(st.integers(1, 6))
        rows = []
        for _ in range(k):
            length = draw(st.integers(1, width))
            toks = draw(st.lists(st.integers(0, 4), min_size=length, max_size=length))
            # large ids too: vocabularies over 65,535
            toks = [t if t < 4 else 70_000 + t for t in toks]
            rows.append(toks + [-1] * (width - length))
        out.append(OracleLookup(source, draw(st.integers(1, 8)), k, np.array(rows, dtype=np.int64)))
    return out


def brute_force_prefix_scores(lookups, weights=None):
    """Every prefix of every continuation with its merged weight, from a dict-of-prefixes trie."""
    weights = weights or {}
    score = defaultdict(float)
    counts = defaultdict(lambda: defaultdict(int))
    units = {}
    for lk in lookups:
        units[lk.source] = weights.get(lk.source, 1.0) * lk.matched_len / lk.continuations.shape[0]
        for row in lk.continuations.tolist():
            toks = [t for t in row if t >= 0]
            for d in range(1, len(toks) + 1):
                counts[tuple(toks[:d])][lk.source] += 1
    for prefix, by_src in counts.items():
        score[prefix] = sum(units[s] * c for s, c in by_src.items())
    return score


def tree_prefixes(tree):
    out = []
    for node in range(1, len(tree)):
        path, n = [], node
        while n > 0:
            path.append(int(tree.tokens[n]))
            n = int(tree.parents[n])
        out.append(tuple(reversed(path)))
    return out


@settings(max_examples=150, deadline=None)
@given(lookups=lookups_strategy(), budget=st.integers(0, 40))
def test_tree_is_top_budget_prefixes_and_a_tree(lookups, budget):
    tree = build_draft_tree(7, lookups, budget)
    scores = brute_force_prefix_scores(lookups)
    kept = tree_prefixes(tree)
    assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0
    assert len(kept) == min(budget, len(scores))
    assert len(set(kept)) == len(kept)
    # parents come first, depths are consistent, flattened by depth
    for i in range(1, len(tree)):
        assert 0 <= tree.parents[i] < i
        assert tree.depths[i] == tree.depths[tree.parents[i]] + 1
    assert list(tree.depths) == sorted(tree.depths)
    # the kept prefixes are exactly the best ones: nothing left out scores higher than anything kept
    if kept:
        worst_kept = min(scores[p] for p in kept)
        left_out = [p for p in scores if p not in set(kept)]
        assert all(scores[p] <= worst_kept + 1e-12 for p in left_out)
        for p, s in zip(kept, tree.scores[1:]):
            assert abs(scores[p] - s) < 1e-9
    # children index agrees with parents
    for node in range(1, len(tree)):
        assert tree.children[int(tree.parents[node])][int(tree.tokens[node])] == node


@settings(max_examples=100, deadline=None)
@given(lookups=lookups_strategy(), budget=st.integers(1, 30), prefix_len=st.integers(0, 12))
def test_mask_node_sees_prefix_itself_and_ancestors_only(lookups, budget, prefix_len):
    tree = build_draft_tree(3, lookups, budget)
    mask = tree_mask(tree, prefix_len, torch.float32, torch.device("cpu"))
    q = len(tree)
    assert mask.shape == (1, 1, q, prefix_len + q) and mask.dtype == torch.float32
    allowed = mask[0, 0] == 0
    blocked = mask[0, 0] == torch.finfo(torch.float32).min
    assert bool((allowed | blocked).all())
    assert bool(allowed[:, :prefix_len].all())
    for i in range(q):
        ancestors = {i}
        n = i
        while tree.parents[n] >= 0:
            n = int(tree.parents[n])
            ancestors.add(n)
        for j in range(q):
            assert bool(allowed[i, prefix_len + j]) == (j in ancestors)
    pos = tree_positions(tree, prefix_len, torch.device("cpu"))
    assert pos.tolist() == [[prefix_len + int(d) for d in tree.depths]]
    assert ancestor_matrix(tree).sum() == sum(int(d) + 1 for d in tree.depths)


def test_no_continuations_gives_the_root_alone():
    empty = OracleLookup("static", 0, 0, np.zeros((0, 10), dtype=np.int64))
    tree = build_draft_tree(5, [empty], 64)
    assert len(tree) == 1 and tree.draft_size == 0


def test_longer_dynamic_match_outweighs_static_majority():
    # static: 10 rows of A at a 2-token match; request: one row of B at an 8-token match
    static = OracleLookup("static", 2, 10, np.array([[11, 12]] * 10))
    request = OracleLookup("request", 8, 1, np.array([[21, 22]]))
    tree = build_draft_tree(1, [static, request], budget=2)
    assert tree_prefixes(tree) == [(21,), (21, 22)]  # weight 8 (matched length) against 2
    tree = build_draft_tree(1, [static, request], budget=3)
    assert tree.scores[tree.children[0][21]] == 4 * tree.scores[tree.children[0][11]]
    assert tree.sources[tree.children[0][21]] == "request"


def test_ties_are_broken_deterministically():
    rows = np.array([[5, 1], [4, 1], [6, 1]])
    a = build_draft_tree(0, [OracleLookup("static", 3, 3, rows)], budget=2)
    b = build_draft_tree(0, [OracleLookup("static", 3, 3, rows[::-1].copy())], budget=2)
    assert tree_prefixes(a) == tree_prefixes(b) == [(4,), (5,)]


@settings(max_examples=100, deadline=None)
@given(lookups=lookups_strategy(), big=st.integers(1, 40), small=st.integers(0, 40))
def test_pruning_a_tree_equals_building_it_with_the_smaller_budget(lookups, big, small):
    small = min(small, big)
    pruned = prune_tree(build_draft_tree(9, lookups, big), small)
    direct = build_draft_tree(9, lookups, small)
    assert pruned.tokens.tolist() == direct.tokens.tolist()
    assert pruned.parents.tolist() == direct.parents.tolist()
    assert pruned.children == direct.children


def numpy_tree():
    """build_draft_tree on its numpy path (a machine without a compiler), inside a with block."""
    return patch("rest_core.native.draft_tree", lambda *args: None)


def _same_tree(a, b) -> bool:
    return (a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
            and a.depths.tolist() == b.depths.tolist() and a.scores.tolist() == b.scores.tolist()
            and a.sources == b.sources and a.shares.tolist() == b.shares.tolist()
            and a.support.tolist() == b.support.tolist() and a.agree.tolist() == b.agree.tolist())


@settings(max_examples=150, deadline=None)
@given(lookups=lookups_strategy(), budget=st.integers(1, 40))
def test_scoring_only_the_prefixes_near_the_budget_gives_the_tree_all_prefixes_give(lookups, budget):
    """Only prefixes within rounding of the budget-th best rough score are scored exactly; with a budget
    above the number of prefixes every one is. The kept nodes, scores, sources and shares are the same."""
    with numpy_tree():
        assert _same_tree(build_draft_tree(9, lookups, budget),
                          prune_tree(build_draft_tree(9, lookups, 10**6), budget))


def test_thousands_of_prefixes_with_many_ties_give_the_same_tree():
    """As a step in chat: one store's 512 continuations of 24 tokens after a frequent pair, two more stores
    with fewer rows and other weights, a small alphabet so that many prefixes are shared and many tie."""
    rng = np.random.default_rng(11)
    lookups = [OracleLookup("static", 2, 512, rng.integers(0, 5, size=(512, 24))),
               OracleLookup("answers", 3, 200, rng.integers(0, 3, size=(200, 24))),
               OracleLookup("model", 1, 37, np.repeat(rng.integers(0, 4, size=(5, 24)), [20, 8, 5, 3, 1], axis=0))]
    with numpy_tree():
        for budget in (1, 8, 63):
            assert _same_tree(build_draft_tree(9, lookups, budget),
                              prune_tree(build_draft_tree(9, lookups, 10**6), budget))


@settings(max_examples=150, deadline=None)
@given(lookups=lookups_strategy(), budget=st.integers(0, 40))
def test_the_native_tree_is_the_numpy_tree_bit_for_bit(lookups, budget):
    from rest_core import native
    if native.draft_tree_library() is None:
        return  # nothing to compare on a machine without a compiler
    fast = build_draft_tree(9, lookups, budget)
    with numpy_tree():
        assert _same_tree(fast, build_draft_tree(9, lookups, budget))


def test_the_native_tree_matches_on_a_chat_sized_step_with_many_ties():
    from rest_core import native
    assert native.draft_tree_library() is not None, native.unavailable()
    rng = np.random.default_rng(12)
    lookups = [OracleLookup("static", 2, 512, rng.integers(0, 5, size=(512, 24))),
               OracleLookup("request", 5, 64, np.where(rng.random((64, 24)) < 0.1, -1, rng.integers(0, 4, (64, 24)))),
               OracleLookup("answers", 3, 200, rng.integers(0, 3, size=(200, 24))),
               OracleLookup("model", 1, 37, np.repeat(rng.integers(0, 4, size=(5, 24)), [20, 8, 5, 3, 1], axis=0))]
    for lk in lookups[1:2]:  # rows cut short: a -1 stays to the row's end
        lk.continuations[:] = np.where(np.logical_or.accumulate(lk.continuations < 0, axis=1), -1, lk.continuations)
    fast = [build_draft_tree(9, lookups, budget) for budget in (1, 8, 63, 400)]
    blank = [OracleLookup("static", 2, 3, np.full((3, 4), -1))]  # rows without a token: the root alone
    blank_fast = build_draft_tree(9, blank, 5)
    with numpy_tree():
        for budget, tree in zip((1, 8, 63, 400), fast):
            assert _same_tree(tree, build_draft_tree(9, lookups, budget)), budget
        assert _same_tree(blank_fast, build_draft_tree(9, blank, 5)) and len(blank_fast) == 1
    assert len(fast[-1]) == 401 and set(fast[-1].sources[1:]) == {"static", "request", "answers", "model"}


def test_rows_sort_as_lexsort_sorts_them():
    rng = np.random.default_rng(3)
    for width in (1, 3, 24):
        rows = rng.integers(-1, 4, size=(500, width))
        rows[::7] = rows[1]  # ties keep their order
        np.testing.assert_array_equal(row_order(rows), np.lexsort(rows.T[::-1]))
    big = np.array([[70_000, 5], [-1, 9], [65_536, 2], [255, 256]])
    np.testing.assert_array_equal(row_order(big), np.lexsort(big.T[::-1]))


@settings(max_examples=100, deadline=None)
@given(lookups=lookups_strategy())
def test_branches_are_every_distinct_continuation_with_its_count(lookups):
    lookups = [*lookups, OracleLookup("history", 0, 0, np.zeros((0, 4), dtype=np.int64))]  # a miss adds nothing
    expected = []
    for lk in lookups:
        counted = Counter(tuple(t for t in row if t >= 0) for row in lk.continuations.tolist())
        expected += sorted(((lk.source, toks, n) for toks, n in counted.items()), key=lambda b: (-b[2], b[1]))
    assert [(b.source, b.tokens, b.count) for b in aggregate_branches(lookups)] == expected


def test_every_node_counts_the_sources_whose_rows_run_through_it():
    static = OracleLookup("static", 3, 3, np.array([[11, 12, 13], [11, 12, 14], [21, 22, 23]]))
    request = OracleLookup("request", 2, 1, np.array([[11, 12, 14]]))
    model = OracleLookup("model", 1, 2, np.array([[11, 15, -1], [21, -1, -1]]))
    for native_tree in (True, False):
        if native_tree:
            tree = build_draft_tree(9, [static, request, model], budget=63)
        else:
            with numpy_tree():
                tree = build_draft_tree(9, [static, request, model], budget=63)
        path = {}
        for n in range(1, len(tree)):
            path[n] = path.get(int(tree.parents[n]), ()) + (int(tree.tokens[n]),)
        agree = {path[n]: int(tree.agree[n]) for n in range(1, len(tree))}
        assert agree == {(11,): 3, (11, 12): 2, (11, 12, 13): 1, (11, 12, 14): 2, (11, 15): 1, (21,): 2,
                         (21, 22): 1, (21, 22, 23): 1}
        assert tree.agree[0] == 0
        cut = prune_tree(tree, 3)  # the cut tree keeps each kept node's count
        cut_path = {}
        for n in range(1, len(cut)):
            cut_path[n] = cut_path.get(int(cut.parents[n]), ()) + (int(cut.tokens[n]),)
        assert len(cut) == 4 and all(int(cut.agree[n]) == agree[cut_path[n]] for n in cut_path)


def _dense_lookup(rows, neighbours):
    """A dense store's answer: `matched_len` counts its neighbours, not a suffix (by_suffix False)."""
    from datastores import Lookup

    return Lookup("dense", neighbours, neighbours, np.array(rows, dtype=np.int64), by_suffix=False)


def test_a_dense_source_weighs_as_much_as_the_text_sources_not_its_neighbour_count():
    """32 neighbours do not make the dense rows outweigh a 2-token text match 16 to 1: they weigh as one more
    text source (the matched ones' mean weight), so the text source's drafts keep their places in the tree."""
    from rest_core.tree import lookup_weights

    text = OracleLookup("static", 2, 1, np.array([[11, 12, 13]]))
    request = OracleLookup("request", 4, 1, np.array([[31, 32, 33]]))
    dense = _dense_lookup([[21 + i, 40, 41] for i in range(4) for _ in range(16)], 32)
    assert lookup_weights([text, request, dense], {}) == [2.0, 4.0, 3.0]
    assert lookup_weights([dense], {"dense": 0.5}) == [0.5]  # alone: weight 1, times its base weight
    tree = build_draft_tree(1, [text, dense], budget=3)
    assert tree_prefixes(tree) == [(11,), (11, 12), (11, 12, 13)]  # 2.0 each, against 0.5 per dense branch
    tree = build_draft_tree(1, [text, dense], budget=4)
    assert tree.scores[tree.children[0][11]] == 4 * tree.scores[tree.children[0][21]]
    assert tree.sources[tree.children[0][21]] == "dense"


def test_a_dense_source_that_found_nothing_weighs_nothing():
    from rest_core.tree import lookup_weights

    text = OracleLookup("static", 2, 1, np.array([[11, 12]]))
    assert lookup_weights([text, _dense_lookup(np.zeros((0, 2)), 0)], {}) == [2.0, 0.0]
