"""Retrieve and draft tree of one step, with the fallback stores looked up only where the others are weak.

A fallback store (`Store.fallback`: the dense store) drafts after places where the model's state was near,
whatever text preceded them: its drafts are accepted far less often than a matched suffix's (6% of its nodes
in chat against 8-40% for the text sources, docs/bench/dense-decoded-zen4.md), and merged into every step's
tree they took the candidates' places and made the passes wider for less.  So each step first drafts from the
other stores as if there were no fallback; only where that tree, cut by the cost model, holds no draft (or,
with a fixed budget, where those stores have no continuation at all) does it look the fallback stores up and
draft again from every store's continuations.  Steps the text sources cover are drafted exactly as without the
fallback stores, at no cost; the others get the fallback's drafts, which the cost model keeps only where they
are worth their pass.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from datastores import Lookup, Store
from datastores.common import empty_lookup
from rest_core.phases import PhaseTimer
from rest_core.retrieve import RetrieveSettings, query_suffix, retrieve
from rest_core.tree import DraftTree, build_draft_tree, root_only

if TYPE_CHECKING:
    from rest_core.cost import CostModel


def _tree(root: int, lookups: Sequence[Lookup], budget: int, weights: dict[str, float],
          chooser: Optional[CostModel]) -> tuple[DraftTree, Optional[dict]]:
    """The draft tree of these continuations, cut by the cost model when there is one (and why)."""
    tree = build_draft_tree(root, lookups, budget, weights) if lookups else root_only(root)
    if chooser is None:
        return tree, None
    return chooser.decide(tree)


def draft(timer: PhaseTimer, context: Sequence[int], stores: Sequence[Store], settings: RetrieveSettings,
          budget: int, weights: dict[str, float],
          chooser: Optional[CostModel]) -> tuple[list[int], list[Lookup], DraftTree, Optional[dict]]:
    """The step's query, one Lookup per store (in the stores' order; an empty one for a fallback store not
    looked up), the draft tree and the cost model's reasons (None without one), timed as the retrieve and tree
    phases."""
    spare = [i for i, s in enumerate(stores) if getattr(s, "fallback", False)]
    main = [s for i, s in enumerate(stores) if i not in spare]
    with timer("retrieve"):
        query = query_suffix(context, settings)
        found = retrieve(query, main, settings) if budget > 0 else []
    with timer("tree"):
        tree, why = _tree(context[-1], found, budget, weights, chooser)
    if not spare or budget <= 0:
        return query, found, tree, why
    extra = [empty_lookup(stores[i].source, settings.continuation_len) for i in spare]
    if tree.draft_size == 0:  # the other stores have nothing worth a wider pass: ask the fallback stores
        with timer("retrieve"):
            extra = retrieve(query, [stores[i] for i in spare], settings)
        if any(lk.continuations.shape[0] for lk in extra):
            every = _in_order(found, extra, spare)
            with timer("tree"):
                tree, why = _tree(context[-1], every, budget, weights, chooser)
            return query, every, tree, why
    return query, _in_order(found, extra, spare), tree, why


def _in_order(found: list[Lookup], extra: list[Lookup], spare: list[int]) -> list[Lookup]:
    """The main stores' lookups and the fallback stores' together, in the stores' order."""
    out, main, more = [], iter(found), iter(extra)
    for i in range(len(found) + len(extra)):
        out.append(next(more) if i in spare else next(main))
    return out
