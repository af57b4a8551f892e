"""Draft tree: from retrieved continuations to the tensors of one verify pass.

`build_draft_tree` merges every source's continuations into one prefix tree and
keeps the `budget` prefixes with the highest weight (REST's Trie, vectorized):
rows are sorted lexicographically once, so every prefix is a run of rows and
its weight a difference of a cumulative sum (rest_core.native's draft_tree.cpp does the same in one call
where it can be built, with bit-equal scores).  Each source's rows share that
source's mixture weight equally (see `source_weight`), so a prefix's score is
a mixture estimate of the chance that the text continues with it.  A child
never scores above its parent and ties go to the shallower node, so the kept
set is always a tree.

`tree_mask` and `tree_positions` flatten the tree for the model: node 0 is the
root (the last committed token), every node attends to the whole prefix, to
itself and to its ancestors, at position prefix_len + depth.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from rest_core import native

if TYPE_CHECKING:
    from datastores import Lookup


@dataclass
class DraftTree:
    tokens: np.ndarray  # (n,) int64; node 0 = root
    parents: np.ndarray  # (n,) int64; -1 for the root; parents[i] < i
    depths: np.ndarray  # (n,) int64; root = 0
    scores: np.ndarray  # (n,) float64; root = total weight
    sources: list[str] = field(default_factory=list)  # dominant source per node ("" for root)
    # (n,) float64: the share of its dominant source's continuations that run through each node
    # (root: 1.0) -- that source's own estimate of the chance the text continues this way
    shares: np.ndarray = field(default_factory=lambda: np.ones(1))
    # (n,) float64: how many of its dominant source's continuation rows run through each node (root: 0)
    support: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # (n,) int64: how many sources have continuation rows through each node (root: 0); None where not known
    # (a tree built by hand): the cost model then counts every node as one source's
    agree: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @cached_property
    def children(self) -> list[dict[int, int]]:
        """Per node: token -> child node (built when first asked: the verifier's walk needs it, a tree the
        budget choice cuts down never does)."""
        return _children(self.tokens, self.parents)

    @property
    def draft_size(self) -> int:
        return len(self) - 1


def root_only(root_token: int) -> DraftTree:
    """The tree of the root alone (a step with nothing to draft).  Its arrays are rows of two small arrays, made
    in two operations rather than eight: right after a forward pass each numpy operation runs from cold caches."""
    ints = np.array([[root_token], [-1], [0], [0]], dtype=np.int64)  # tokens, parents, depths, agree
    floats = np.array([[0.0], [1.0], [0.0]])  # scores, shares, support
    return DraftTree(tokens=ints[0], parents=ints[1], depths=ints[2], scores=floats[0], sources=[""],
                     shares=floats[1], support=floats[2], agree=ints[3])


def source_weight(source: str, matched_len: int, base: dict[str, float]) -> float:
    """Mixture weight of one source's continuations.

    Proportional to the length of the suffix that matched (a longer shared
    context predicts better) times a per-source base weight.  Sources with no
    match get nothing.
    """
    return base.get(source, 1.0) * matched_len if matched_len > 0 else 0.0


def lookup_weights(lookups, base_weights: dict[str, float]) -> list[float]:
    """Each lookup's mixture weight.  A suffix source's is `source_weight`; a source whose `matched_len` is not a
    suffix length (`by_suffix` False: a dense store, which counts its neighbours there) weighs as much as the
    suffix sources that matched weigh on average (1.0 when none did), times its base weight: as heavy as one
    more text source, whatever number of neighbours it reports, so its rows cannot crowd the text sources'
    candidates out of the tree."""
    by_suffix = [getattr(lk, "by_suffix", True) for lk in lookups]
    weights = [source_weight(lk.source, lk.matched_len, base_weights) if suffix else 0.0
               for lk, suffix in zip(lookups, by_suffix)]
    matched = [w for w, suffix in zip(weights, by_suffix) if suffix and w > 0]
    typical = sum(matched) / len(matched) if matched else 1.0
    return [w if suffix else source_weight(lk.source, min(lk.matched_len, 1), base_weights) * typical
            for lk, w, suffix in zip(lookups, weights, by_suffix)]


def _stack_rows(lookups, base_weights: dict[str, float]):
    """All sources' continuation rows in one (k, L) array, each row's source index, and the
    weight of one row per source.  None when nothing can be drafted."""
    names = list(dict.fromkeys(lk.source for lk in lookups))  # draft sources in store order (ties go first)
    blocks, src_ids = [], []
    unit = np.zeros(len(names))  # weight of one continuation row, per source
    for lk, w in zip(lookups, lookup_weights(lookups, base_weights)):
        rows = lk.continuations
        if rows.shape[0] == 0 or w <= 0:
            continue
        s_id = names.index(lk.source)
        unit[s_id] = w / rows.shape[0]
        blocks.append(rows)
        src_ids.append(np.full(rows.shape[0], s_id, dtype=np.int64))
    if not blocks:
        return None
    width = max(b.shape[1] for b in blocks)
    rows = np.full((sum(b.shape[0] for b in blocks), width), -1, dtype=np.int64)  # shorter rows padded with -1
    at = 0
    for b in blocks:
        rows[at:at + b.shape[0], :b.shape[1]] = b
        at += b.shape[0]
    return rows, np.concatenate(src_ids), unit, names


def row_order(rows: np.ndarray) -> np.ndarray:
    """The stable lexicographic order of the rows (ids >= -1), as np.lexsort(rows.T[::-1]) gives it: each
    row as one big-endian byte string, so one comparison sort does it (several times faster than a
    lexsort over 24 columns)."""
    keys = np.ascontiguousarray((rows + 1).astype(">u8"))  # (k, L): byte order = numeric order
    return np.argsort(keys.view(np.dtype((np.void, 8 * keys.shape[1]))).ravel(), kind="stable")


def _prefix_candidates(rows: np.ndarray, src: np.ndarray, unit: np.ndarray, total: float,
                       budget: int | None = None) -> dict:
    """Every distinct prefix of the rows that can be among the `budget` best as a candidate node (all of
    them when budget is None): depth, last token, score, first sorted row, parent candidate, dominant
    source, its share and support, how many sources have rows through it, as flat arrays ordered by depth,
    then sorted-row order (`total`: the rows' whole weight).  All depths at once: a prefix is a run of
    sorted rows that agree up to its depth.

    A step's rows can hold thousands of prefixes (512 continuations of 24 tokens from one store) of which
    the tree keeps a few dozen, so each prefix is first scored roughly (a float running sum of row
    weights) and only those within rounding of the budget-th best rough score are scored exactly: a
    superset of the best `budget`, so the tree built from them is the one all prefixes give."""
    order = row_order(rows)  # (k,) sort by column 0, then 1, ...
    rows, src = rows[order], src[order]
    k, width = rows.shape
    differs = np.ones_like(rows, dtype=bool)  # (k, L)
    differs[1:] = rows[1:] != rows[:-1]
    new_group = np.logical_or.accumulate(differs, axis=1)  # row i opens a new prefix at depth d
    real = np.logical_and.accumulate(rows >= 0, axis=1)  # (k, L) the prefix holds real tokens only
    # per-source row counts as exact integers, so equal counts give bit-equal scores (clean ties)
    cum_src = np.zeros((unit.size, k + 1), dtype=np.int64)  # (S, k+1)
    for s_id in range(unit.size):
        cum_src[s_id, 1:] = np.cumsum(src == s_id)
    source_total = cum_src[:, -1] * unit  # (S,) each source's whole weight

    depth, start = np.nonzero(new_group.T)  # every prefix: (depth - 1, first row), by depth then row
    same_depth = np.append(depth[1:] == depth[:-1], False)
    end = np.where(same_depth, np.append(start[1:], k), k)  # one past its last row
    keep = real[start, depth]
    depth, start, end = depth[keep], start[keep], end[keep]
    key = depth * k + start  # ascending: a prefix's place among all of them
    if budget is not None and depth.size > budget > 0:
        weight = np.concatenate([[0.0], np.cumsum(unit[src])])  # (k+1,) weight of the sorted rows so far
        rough = weight[end] - weight[start]  # each prefix's score, off by float rounding at most
        bar = np.partition(rough, rough.size - budget)[rough.size - budget]  # the budget-th best rough score
        near = np.flatnonzero(rough >= bar - 1e-9 * total)  # rounding is ~1e-13 of the total weight
        depth, start, end = depth[near], start[near], end[near]
    else:
        near = None
    n = depth.size
    rows_src = cum_src[:, end] - cum_src[:, start]  # (S, n) rows per source
    by_src = rows_src * unit[:, None]  # (S, n) weight per source
    dominant = by_src.argmax(axis=0) if n else np.zeros(0, dtype=np.int64)
    idx = np.arange(n)
    parent = np.searchsorted(key, (depth - 1) * k + start, side="right") - 1  # the prefix one shorter
    if near is not None:  # its place among the prefixes scored (-2 if it was not: then this one is never kept)
        place = np.full(key.size, -2)
        place[near] = idx
        parent = place[np.maximum(parent, 0)]
    parent = np.where(depth > 0, parent, -1)
    return {"depth": depth + 1, "token": rows[start, depth], "score": by_src.sum(axis=0), "start": start,
            "parent": parent, "source": dominant,
            "share": by_src[dominant, idx] / np.maximum(source_total[dominant], 1e-300),
            "support": rows_src[dominant, idx].astype(float), "agree": (rows_src > 0).sum(axis=0)}


def build_draft_tree(root_token: int, lookups: Sequence[Lookup], budget: int,
                     base_weights: dict[str, float] | None = None) -> DraftTree:
    """Top-`budget` prefixes over all sources' continuations, flattened by depth."""
    stacked = _stack_rows(lookups, base_weights or {}) if budget > 0 else None
    if stacked is None:
        return root_only(root_token)
    rows, src, unit, names = stacked
    total = float(np.bincount(src, minlength=unit.size) @ unit)  # the whole weight: the root's score
    found = native.draft_tree(rows, src, unit, budget, int(root_token), total)
    if found is not None:  # the same nodes and scores, in one call (each numpy operation runs cold after a pass)
        ints, floats = found
        if ints.shape[1] == 1:  # no real prefix among the rows
            return root_only(root_token)
        return DraftTree(ints[0], ints[1], ints[2], floats[0], [""] + [names[i] for i in ints[3, 1:].tolist()],
                         floats[1], floats[2], ints[4])
    c = _prefix_candidates(rows, src, unit, total, budget)
    if c["depth"].size == 0:
        return root_only(root_token)

    # highest score first; ties: shallower first (keeps the set prefix-closed), then sorted-row order
    keep = np.lexsort((c["start"], c["depth"], -c["score"]))[:budget]
    keep = keep[np.lexsort((c["start"][keep], c["depth"][keep]))]  # flatten by depth, siblings in token order
    new_index = np.full(c["depth"].size, -1)
    new_index[keep] = np.arange(1, keep.size + 1)
    parent = c["parent"][keep]  # -1: the root
    parents = np.where(parent == -1, 0, np.where(parent >= 0, new_index[np.maximum(parent, 0)], -1))
    assert (parents >= 0).all() and (parents < np.arange(1, keep.size + 1)).all(), "kept prefixes must form a tree"

    tree_tokens = np.concatenate([[root_token], c["token"][keep]]).astype(np.int64)
    tree_parents = np.concatenate([[-1], parents]).astype(np.int64)
    tree_depths = np.concatenate([[0], c["depth"][keep]]).astype(np.int64)
    tree_scores = np.concatenate([[total], c["score"][keep]])
    sources = [""] + [names[i] for i in c["source"][keep]]
    shares = np.concatenate([[1.0], c["share"][keep]])
    support = np.concatenate([[0.0], c["support"][keep]])
    agree = np.concatenate([[0], c["agree"][keep]]).astype(np.int64)
    return DraftTree(tree_tokens, tree_parents, tree_depths, tree_scores, sources, shares, support, agree)


def _children(tokens: np.ndarray, parents: np.ndarray) -> list[dict[int, int]]:
    """Per node: token -> child node."""
    children: list[dict[int, int]] = [dict() for _ in range(len(tokens))]
    for node in range(1, len(tokens)):
        children[int(parents[node])][int(tokens[node])] = node
    return children


def ancestors(parents: np.ndarray | Sequence[int]) -> np.ndarray:
    """(n, n) bool from a parent list (parents[i] < i, root -1): [i, j] is True when node j
    is node i itself or one of its ancestors, i.e. where node i may attend inside the tree."""
    n = len(parents)
    allowed = np.eye(n, dtype=bool)
    for i in range(1, n):  # parents come first, so each row extends its parent's row
        allowed[i] |= allowed[parents[i]]
    return allowed


def ancestor_matrix(tree: DraftTree) -> np.ndarray:
    """(n, n) bool: [i, j] is True when node j is node i itself or one of its ancestors."""
    return ancestors(tree.parents)


def mask_from_allowed(allowed: np.ndarray, prefix_len: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """The 4D additive tree mask (1, 1, q, prefix_len + q) from the (q, q) allowed block:
    0 over the whole prefix and where allowed, dtype-min elsewhere.  The one place the
    mask is built, for the model and for replaying a stored step alike."""
    q = allowed.shape[0]
    mask = torch.zeros((1, 1, q, prefix_len + q), dtype=dtype, device=device)
    blocked = torch.from_numpy(~np.asarray(allowed, dtype=bool)).to(device)
    mask[0, 0, :, prefix_len:].masked_fill_(blocked, torch.finfo(dtype).min)
    return mask


def tree_mask(tree: DraftTree, prefix_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, 1, q, prefix_len + q) additive mask: 0 where a node may attend, dtype-min elsewhere."""
    return mask_from_allowed(ancestor_matrix(tree), prefix_len, dtype, device)


def tree_positions(tree: DraftTree, prefix_len: int, device: torch.device) -> torch.Tensor:
    """(1, q) position ids: prefix_len + depth."""
    return torch.from_numpy(tree.depths + prefix_len).to(device).unsqueeze(0)


def prune_tree(tree: DraftTree, budget: int) -> DraftTree:
    """The same tree cut to its `budget` best draft nodes (the set build_draft_tree keeps for that budget)."""
    if budget >= tree.draft_size:
        return tree
    if budget <= 0:
        return root_only(int(tree.tokens[0]))
    nodes = np.arange(1, len(tree))
    return keep_nodes(tree, nodes[np.lexsort((nodes, tree.depths[1:], -tree.scores[1:]))[:budget]])


def keep_nodes(tree: DraftTree, nodes: np.ndarray) -> DraftTree:
    """The tree cut to these draft nodes (every kept node's parent must be kept too), still flattened by depth."""
    keep = np.concatenate([[0], np.sort(np.asarray(nodes, dtype=np.int64))])
    new_index = np.full(len(tree), -1)
    new_index[keep] = np.arange(keep.size)
    parents = np.concatenate([[-1], new_index[tree.parents[keep[1:]]]]).astype(np.int64)
    if (parents[1:] < 0).any():
        raise ValueError("keep_nodes: a kept node's parent was cut; keep a prefix-closed set of nodes")
    return DraftTree(tree.tokens[keep], parents, tree.depths[keep], tree.scores[keep],
                     [tree.sources[i] for i in keep], tree.shares[keep], tree.support[keep],
                     None if tree.agree is None else tree.agree[keep])
