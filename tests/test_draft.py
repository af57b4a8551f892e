"""The fallback stores (rest_core.draft): looked up only where the other stores draft nothing worth a pass, and
then merged with them; a step the other stores cover drafts exactly as without the fallback stores."""
from __future__ import annotations

import numpy as np
import pytest

from datastores import Lookup, StoreBase
from rest_core.cost import GRID, CostModel
from rest_core.draft import draft
from rest_core.phases import PhaseTimer
from rest_core.retrieve import RetrieveSettings
from rest_core.tree import build_draft_tree

from oracle import BruteForceStore

SETTINGS = RetrieveSettings(continuation_len=4)


class Fallback(StoreBase):
    """A store drafting [7, 8] whatever the context (like the dense store: no suffix), counting its look-ups."""

    source = "dense"
    fallback = True

    def __init__(self):
        self.asked = 0

    def lookup(self, context, n_max=16, n_min=2, max_matches=512, continuation_len=4):
        self.asked += 1
        return Lookup(self.source, 32, 32, np.array([[7, 8, -1, -1]] * 4), by_suffix=False)


def _draft(context, stores, budget=8, chooser=None):
    timer = PhaseTimer()
    query, lookups, tree, why = draft(timer, context, stores, SETTINGS, budget, {}, chooser)
    return lookups, tree, timer.ms


def test_a_step_the_text_stores_cover_never_asks_the_fallback_and_drafts_as_without_it():
    text = BruteForceStore([1, 2, 3, 4, 5, 1, 2, 3, 9])
    spare = Fallback()
    lookups, tree, ms = _draft([1, 2], [text, spare])
    _, alone, _ = _draft([1, 2], [text])
    assert spare.asked == 0
    assert [lk.source for lk in lookups] == ["static", "dense"] and lookups[1].matched_len == 0
    assert tree.tokens.tolist() == alone.tokens.tolist() and tree.parents.tolist() == alone.parents.tolist()
    assert set(ms) == {"retrieve", "tree"}


def test_a_step_the_text_stores_miss_drafts_from_the_fallback():
    text = BruteForceStore([1, 2, 3, 4])
    spare = Fallback()
    lookups, tree, _ = _draft([5, 6], [spare, text])  # in the stores' order, the fallback first
    assert spare.asked == 1
    assert [lk.source for lk in lookups] == ["dense", "static"]
    assert tree.tokens.tolist() == [6, 7, 8] and tree.sources[1:] == ["dense", "dense"]
    assert tree.tokens.tolist() == build_draft_tree(6, lookups, 8).tokens.tolist()


def test_no_budget_asks_no_store():
    spare = Fallback()
    lookups, tree, _ = _draft([5, 6], [BruteForceStore([5, 6, 7]), spare], budget=0)
    assert spare.asked == 0 and lookups == [] and tree.draft_size == 0


@pytest.mark.parametrize("slope_ms, asked", [(0.0, 0), (50.0, 1)])
def test_with_a_cost_model_the_fallback_is_asked_where_the_text_drafts_are_not_worth_a_pass(slope_ms, asked):
    """Free verification keeps the text store's draft (no fallback look-up); verification that costs a whole
    pass per draft token keeps none of it, so the fallback store is asked."""
    chooser = CostModel(times_ms=np.array([50.0 + slope_ms * (q - 1) for q in GRID]))
    text = BruteForceStore([1, 2, 3, 4, 1, 2, 5, 6])
    spare = Fallback()
    _, tree, _ = _draft([1, 2], [text, spare], budget=16, chooser=chooser)
    assert spare.asked == asked
    assert (tree.draft_size > 0) == (slope_ms == 0.0)
