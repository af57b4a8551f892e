"""The draft budget, chosen per step from a cost model measured on this machine.

A verify pass over q tokens is not free on a CPU or for a small model, so the
number of draft tokens follows the expected gain:

    budget b maximizes  (1 + E[accepted drafts | top-b nodes]) / t(b + 1)

t(q) is the measured time of one forward pass over q tokens (calibrated once
per model, device, dtype and machine -- rest_core.machine.machine_key: CPU,
instruction set, threads, torch version -- cached, and refreshed with every
step's real timing: a level, the machine's speed now, times a shape, what a pass over q tokens costs
in one-token passes; only the shape decides).  E[accepted] sums each kept node's chance of being accepted,
and a node is accepted only when its parent is: its chance is the product, along
its path, of each node's chance of being accepted *once its parent was*.

That conditional chance is learned online per draft source, in cells of
(depth 1/2/3/4+, support: how many continuation rows run through the node,
ratio: the share of its parent's rows that continue with it -- for the model's own
predictions, the prior chance of its rank).  Every verified node whose parent was
accepted counts in its cell, hit or miss.  Before a cell has data its estimate is
the ratio scaled down (PRIOR_SCALE: retrieved text predicts the model's next token
far less often than its rows agree), so the first steps of a new store draft
little, and learning wins within a few decodes.  Nodes are kept best chance first
(a child never above its parent), so a source that is accepted more wins the
budget over one that merely retrieved more.  When no tree pays for its cost, b = 0
is a plain step, so REST never runs slower than plain decoding by design.

The cells say how often drafts like these landed over many requests; how predictable the
answer in hand is differs from request to request.  So within a request (`begin_request`,
called by the decoder) each source's chances are scaled by how its drafts did so far:
(accepted + REQUEST_WEIGHT) / (expected + REQUEST_WEIGHT), summed over its nodes put to the test
in this request, the expected ones being the cells' chances.  A request whose drafts keep
missing drafts less after a few misses, one that is copying text drafts more.

The counts are kept between runs per model, per store (its label: the Python
store, the general-text store, the request store, ...) and per kind of text being
decoded (`kind`: "chat" or "text", told by the caller), so a store that joins a
new set of stores brings what was learned about it, and what a store's drafts
earned on code prompts does not set how much it drafts in a chat (the Python
store's drafts were accepted 26% of the time on HumanEval and 6% in chat).  The
cost curve is measured once per process for a model, device and machine.

The curve, its measurement and its refresh live in `rest_core.cost_curve` (`LiveCurve`); the cells of the
acceptance counts and the file they are kept in, in `rest_core.cost_stats` (`KeptStats`); this module learns and
decides.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from rest_base.native_policy import NATIVE, NativePolicy
from rest_core import native
from rest_core.cost_curve import GRID, RECENT_LEVELS, REFERENCE_STEPS, LiveCurve, calibrated_curve
from rest_core.cost_stats import (
    AGREE_LEVELS,
    BINS,
    CELLS,
    DEPTHS,
    SHAPE,
    SUPPORT,
    KeptStats,
    fade,
    node_cells,
    stats_path_for,
)
from rest_core.tree import DraftTree, keep_nodes

if TYPE_CHECKING:
    from datastores import Store
    from rest_core.model import LoadedModel

CANDIDATE_BUDGETS = np.array([0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 63])  # draft sizes weighed
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the prior in each cell: learning wins soon
PRIOR_SCALE = 0.4  # the prior: this fraction of the ratio
FEW_NODES = 16  # trees of up to this many drafts learn in Python numbers (CostModel._observe_few)
_BINS_LIST, _SUPPORT_LIST = BINS.tolist(), SUPPORT.tolist()
REQUEST_WEIGHT = 4.0  # expected acceptances behind each request's correction: a few steps move it
AGREE_WEIGHT = 20.0  # expected acceptances behind each level's correction
AGREE_MAX = 2000.0  # a level's expected acceptances fade past this, so its correction keeps adapting
MAX_CHANCE = 0.99  # a corrected conditional chance stays below certainty


@dataclass
class CostModel(LiveCurve, KeptStats):
    """Forward cost curve t(q) plus calibrated acceptance; decides the budget per step."""

    grid: tuple[int, ...] = GRID
    times_ms: np.ndarray = field(default_factory=lambda: np.zeros(len(GRID)))  # median forward time per grid size
    max_budget: int = 63
    # per draft source: drafted / accepted counts of nodes whose parent was accepted, per cell (SHAPE)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    stats_path: Path | None = None  # where the acceptance counts persist between runs
    labels: dict[str, str] = field(default_factory=dict)  # source name -> the store's label (the key on disk)
    kind: str = ""  # what is being decoded: "chat", "text" ("" = not told); acceptance is kept per kind
    _calibrated: np.ndarray = field(init=False, repr=False)  # the curve as calibrated
    _calibrated_shape: np.ndarray = field(init=False, repr=False)  # ... per grid size in one-token passes
    _shape: np.ndarray = field(init=False, repr=False)  # per grid size, its cost in one-token passes (as refreshed)
    _recent: deque = field(init=False, repr=False)  # (q, ms) of the newest real passes: the machine's speed now
    _ones: deque = field(init=False, repr=False)  # (step, ms) of the newest one-token passes: the reference
    _passes: dict = field(default_factory=dict, repr=False)  # grid index -> its _Passes, while steps run it
    _steps: int = field(default=0, init=False, repr=False)  # steps observed
    # per draft source, in the request being decoded: (accepted, expected by the cells) of its tested nodes
    _request: dict = field(default_factory=dict, repr=False)
    # per agreement level (AGREE_LEVELS), over every request of this kind: accepted / expected by the cells and
    # the request's correction, of the tested nodes that many sources drafted (rows 0 / 1)
    agreement: np.ndarray = field(default_factory=lambda: np.zeros((2, AGREE_LEVELS)))
    use_agreement: bool = True  # False: no agreement correction (side-by-side runs)
    native: NativePolicy = NATIVE  # whether to rank with rank_tree.cpp where it is built (else numpy)

    def __post_init__(self) -> None:
        self.times_ms = np.array(self.times_ms, dtype=float)
        self._calibrated = self.times_ms.copy()
        self._calibrated_shape = self._calibrated / self._calibrated[0] if self._calibrated.size else self._calibrated
        self._shape = self._calibrated_shape.copy()
        self._recent = deque(maxlen=RECENT_LEVELS)
        self._ones = deque(maxlen=REFERENCE_STEPS)

    # -- construction ---------------------------------------------------------------
    @classmethod
    def for_model(cls, lm: LoadedModel, stores: Optional[Sequence[Store]] = None, cache: bool = True,
                  kind: str = "") -> CostModel:
        """Calibrated for this model on this machine, with acceptance learned for these stores on this kind of
        text ("chat" for chat-template prompts, "text" for plain continuation; "" when the caller cannot tell).

        The full curve is measured once and cached on disk and in this process; a new
        process times a few one- and 8-token passes and measures the curve again when
        they disagree with the cached one (a one-token pass off by more than 25%, or the
        8-token pass's relative cost by more than 12%: the machine changed, or was busy
        back then).  REST_LAB_RECALIBRATE=1 forces a new measurement.
        """
        times = calibrated_curve(lm, cache)
        model = cls(times_ms=np.array(times, dtype=float),
                    labels={s.source: getattr(s, "label", s.source) for s in stores or ()}, kind=kind)
        if cache:
            model.stats_path = stats_path_for(lm.name)
            model.load_stats()
        return model

    @classmethod
    def for_acceptance(cls, model_name: str, stores: Sequence[Store] = (), kind: str = "") -> CostModel:
        """Acceptance learning alone, for a caller that weighs the drafts' cost itself (a served model's batch:
        rest_core.serving): the counts this model's decodes saved for these stores, a flat curve that no one reads."""
        model = cls(times_ms=np.ones(len(GRID)), labels={s.source: getattr(s, "label", s.source) for s in stores},
                    kind=kind)
        model.stats_path = stats_path_for(model_name)
        model.load_stats()
        return model

    # -- the decision ---------------------------------------------------------------
    def _counts(self, source: str) -> np.ndarray:
        """SHAPE drafted / accepted counts of one draft source (created empty on first use)."""
        got = self.counts.get(source)
        if got is None:
            got = self.counts[source] = np.zeros(SHAPE)
        return got

    def begin_request(self) -> None:
        """A new request starts: the correction learned on the last one is dropped."""
        self._request = {}

    def use_request(self, corrections: dict) -> None:
        """Rank and learn for one of several requests decoded together: `corrections` is that request's own
        record of how its sources did (start each request with an empty dict; `observe` fills it in place)."""
        self._request = corrections

    def request_factor(self, source: str) -> float:
        """How much better (> 1) or worse than its cells a source's drafts did in this request."""
        accepted, expected = self._request.get(source, (0.0, 0.0))
        return (accepted + REQUEST_WEIGHT) / (expected + REQUEST_WEIGHT)

    def _from_cells(self, tree: DraftTree, found=None) -> tuple[np.ndarray, np.ndarray]:
        """(n,) each draft node's chance of being accepted once its parent was, by its cell alone, and
        (n,) its source name."""
        ratio, cell, sources = found if found is not None else node_cells(tree)
        drafted = np.zeros(len(sources))
        accepted = np.zeros(len(sources))
        for name in set(tree.sources[1:]):
            rows = sources == name
            c = self._counts(name).reshape(2, -1)  # (drafted, accepted) per flat cell
            at = cell[rows]
            drafted[rows], accepted[rows] = c[0, at], c[1, at]
        return (accepted + PRIOR_WEIGHT * PRIOR_SCALE * ratio) / (drafted + PRIOR_WEIGHT), sources

    def agreement_factors(self) -> np.ndarray:
        """(AGREE_LEVELS,) how much better (> 1) or worse than expected the nodes drafted by 1, 2, 3+ sources did.

        Where several stores continue the context the same way the token is likelier than any one store's
        statistics say: in chat (8 prompts, rest_full's stores) nodes of two sources that the cells and the
        request's correction gave 0.10-0.20 were accepted 0.32 of the time, nodes of one source 0.14
        (`docs/bench/agreement-correction.md`)."""
        accepted, expected = self.agreement
        return (accepted + AGREE_WEIGHT) / (expected + AGREE_WEIGHT)

    def _levels(self, tree: DraftTree) -> np.ndarray:
        """(n,) each draft node's agreement level: 0 for one source (or not known), 1 for two, 2 for more."""
        if tree.agree is None:
            return np.zeros(tree.draft_size, dtype=np.int64)
        return np.clip(tree.agree[1:] - 1, 0, AGREE_LEVELS - 1)

    def _with_request(self, chance: np.ndarray, tree: DraftTree, sources: np.ndarray) -> np.ndarray:
        """The cells' chances (n,) scaled in place by each source's correction in this request."""
        if self._request:
            for name in set(tree.sources[1:]):
                chance[sources == name] *= self.request_factor(name)
        return chance

    def conditional(self, tree: DraftTree) -> np.ndarray:
        """(n,) each draft node's calibrated chance of being accepted once its parent was: its cell's,
        corrected by how its source did in this request and by how nodes drafted by as many sources did."""
        chance, sources = self._from_cells(tree)
        chance = self._with_request(chance, tree, sources)
        if self.use_agreement:
            chance *= self.agreement_factors()[self._levels(tree)]
        return np.minimum(chance, MAX_CHANCE)

    def ranked(self, tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
        """Draft nodes (1-based) best first, and each one's chance of being accepted: the product of the
        conditional chances along its path.  A child never beats its parent, so every prefix of the
        ranking is a tree (ties go to the shallower node).  One native call where it can be had
        (`rank_tree.cpp`: the same order, bit-equal chances), else numpy."""
        got = self._ranked_native(tree)
        if got is not None:
            return got[:2]
        n = tree.draft_size
        product = self.conditional(tree).tolist()  # (n,) Python floats: a loop over a few dozen nodes
        for i, parent in enumerate(tree.parents[1:].tolist()):  # parents come first
            if parent > 0:
                product[i] *= product[parent - 1]
        chance = np.array(product)
        order = np.lexsort((np.arange(n), tree.depths[1:], -chance))
        return order + 1, chance[order]

    def _ranked_native(self, tree: DraftTree,
                       with_budget: bool = False) -> Optional[tuple[np.ndarray, np.ndarray, int]]:
        """`ranked` (and with_budget, the best budget of `_best_budget`) in one native call; None where it cannot
        be had."""
        if self.native.library(native.rank_tree_library) is None:
            return None  # checked first: without the library the numpy path would follow this work, not replace it
        names: dict[str, int] = {}
        index = [-1]
        for name in tree.sources[1:]:
            i = names.get(name)
            if i is None:
                i = names[name] = len(names)
            index.append(i)
        return native.rank_tree(tree.parents[1:], tree.depths[1:], tree.shares, tree.support[1:],
                                np.array(index, dtype=np.int64), tree.agree, [self._counts(name) for name in names],
                                np.array([self.request_factor(name) for name in names], dtype=np.float64),
                                bool(self._request), self.agreement_factors(), self.use_agreement, BINS, SUPPORT,
                                DEPTHS, PRIOR_WEIGHT * PRIOR_SCALE, PRIOR_WEIGHT, MAX_CHANCE,
                                *((CANDIDATE_BUDGETS, self.forward_ms(CANDIDATE_BUDGETS + 1)) if with_budget else ()))

    def _best_budget(self, chance: np.ndarray) -> int:
        budgets = CANDIDATE_BUDGETS[CANDIDATE_BUDGETS <= chance.size]  # (m,) 0 first
        gain = np.concatenate([[0.0], np.cumsum(chance)])  # (n+1,) expected accepted drafts of the top b
        rate = (1.0 + gain[budgets]) / self.forward_ms(budgets + 1)  # (m,) tokens per ms
        return int(budgets[int(rate.argmax())])  # the first best: a tie goes to the smaller budget

    def choose(self, tree: DraftTree) -> int:
        """Best number of draft nodes for this tree (the top of `ranked`)."""
        if tree.draft_size == 0:
            return 0
        return self._best_budget(self.ranked(tree)[1])

    def decide(self, tree: DraftTree) -> tuple[DraftTree, Optional[dict]]:
        """The tree cut to the nodes worth their cost (the best `choose(tree)` of `ranked(tree)`), and why
        (None when there was nothing to choose from): the candidate draft nodes, the ones kept, the accepted
        drafts expected of them, the pass's cost relative to a one-token pass, each candidate source's
        correction in this request, ("chances") each kept node's chance of being accepted, in the cut
        tree's node order (node 1 first), and where the tree counts its nodes' sources, how many candidates
        several sources drafted ("agreed") and the correction per number of sources ("agreement_factors")."""
        if tree.draft_size == 0:
            return tree, None
        got = self._ranked_native(tree, with_budget=True)
        if got is not None:
            return self._cut_at(tree, *got)
        return self.cut(tree, *self.ranked(tree))

    def cut(self, tree: DraftTree, order: np.ndarray, chance: np.ndarray) -> tuple[DraftTree, dict]:
        """`decide` for a tree already ranked (`ranked(tree)`: its draft nodes best first and their chances)."""
        return self._cut_at(tree, order, chance, self._best_budget(chance))

    def _cut_at(self, tree: DraftTree, order: np.ndarray, chance: np.ndarray,
                budget: int) -> tuple[DraftTree, dict]:
        kept = order[:budget]
        by_node = chance[:budget][np.argsort(kept)]  # keep_nodes keeps the nodes in their order in the tree
        why = {"candidates": int(tree.draft_size), "kept": budget,
               "expected_accepted": round(float(chance[:budget].sum()), 4),
               "relative_cost": round(self.relative_cost(budget + 1), 4),
               "request_factors": {name: round(self.request_factor(name), 4) for name in sorted(set(tree.sources[1:]))},
               "chances": [round(float(c), 4) for c in by_node]}
        if self.use_agreement and tree.agree is not None:  # candidates several stores drafted, and how they fare
            why["agreed"] = int((tree.agree[1:] >= 2).sum())
            why["agreement_factors"] = [round(float(f), 4) for f in self.agreement_factors()]
        return keep_nodes(tree, kept), why

    def observe(self, tree: DraftTree, accepted_nodes: list[int], forward_ms: Optional[float]) -> None:
        """Learn from one verified step: which nodes were accepted, and what the pass cost (None: not timed)."""
        q = len(tree)
        if 1 < q <= FEW_NODES + 1:
            self._observe_few(tree, accepted_nodes)
        elif q > 1:
            found = node_cells(tree)
            _, cell, sources = found
            expected, _ = self._from_cells(tree, found)  # the cells' chances before this step joins them
            taken = np.zeros(q, dtype=bool)
            taken[[0, *accepted_nodes]] = True  # the root is always "accepted"
            seen = taken[tree.parents[1:]]  # (q-1,) the parent was accepted: this node was put to the test
            hit = taken[1:].astype(float)
            corrected = self._with_request(expected.copy(), tree, sources)  # before this step joins them
            self._learn_agreement(self._levels(tree)[seen], hit[seen], np.minimum(corrected, MAX_CHANCE)[seen])
            for name in set(tree.sources[1:]):
                rows = (sources == name) & seen
                if not rows.any():
                    continue
                accepted, predicted = self._request.get(name, (0.0, 0.0))
                self._request[name] = (accepted + float(hit[rows].sum()), predicted + float(expected[rows].sum()))
                c = self._counts(name)
                at = cell[rows]
                c[0] += np.bincount(at, minlength=CELLS).reshape(SHAPE[1:])
                c[1] += np.bincount(at, weights=hit[rows], minlength=CELLS).reshape(SHAPE[1:])
                fade(c)
        if forward_ms is not None:
            self._refresh_curve(q, forward_ms)

    def _observe_few(self, tree: DraftTree, accepted_nodes: list[int]) -> None:
        """`observe`'s counting for a tree of a few nodes, in Python numbers: the same cells, the same counts added
        once per cell, the same fading. Right after a forward pass each distinct numpy operation runs from cold
        caches, and the array path's ~30 of them were most of what the cost model's learning cost per step. The
        request's sums add node by node where numpy sums in blocks of 8 (at most the last bit apart). The cell of a
        node is `node_cells`' arithmetic on one node (tests/test_cost.py holds the two paths to the same counts)."""
        parents, depths = tree.parents.tolist(), tree.depths.tolist()
        shares, support, names = tree.shares.tolist(), tree.support.tolist(), tree.sources
        taken = set(accepted_nodes)
        taken.add(0)  # the root is always "accepted"
        bins, sup_edges = _BINS_LIST, _SUPPORT_LIST
        per: dict[str, list] = {}  # source -> [accepted, predicted, {cell: [drafted, hits]}]
        agree = tree.agree.tolist() if tree.agree is not None else None
        factors = {}  # source -> its request correction before this step
        levels = [[0.0, 0.0] for _ in range(AGREE_LEVELS)]  # per agreement level: hits, corrected expectations
        for node in range(1, len(parents)):
            parent = parents[node]
            if parent not in taken:
                continue  # the parent was rejected: this node was never put to the test
            name, share = names[node], shares[node]
            parent_share = shares[parent]
            ratio = share / max(parent_share, 1e-12) if names[parent] == name and parent_share > 0 else share
            ratio = min(max(ratio, 0.0), 1.0)
            depth = min(depths[node] - 1, DEPTHS - 1)
            sup = min(bisect.bisect_right(sup_edges, support[node]) - 1, len(sup_edges) - 1)
            rbin = min(bisect.bisect_right(bins, ratio) - 1, len(bins) - 2)
            cell = (depth * len(sup_edges) + sup) * (len(bins) - 1) + rbin
            counts = self._counts(name)
            drafted, accepted = counts.item(cell), counts.item(CELLS + cell)  # flat: (drafted, accepted) per cell
            expected = (accepted + PRIOR_WEIGHT * PRIOR_SCALE * ratio) / (drafted + PRIOR_WEIGHT)
            hit = 1.0 if node in taken else 0.0
            factor = factors.get(name)
            if factor is None:
                factor = factors[name] = self.request_factor(name)
            level = levels[min(max(agree[node] - 1, 0), AGREE_LEVELS - 1) if agree is not None else 0]
            level[0] += hit
            level[1] += min(expected * factor, MAX_CHANCE)
            entry = per.setdefault(name, [0.0, 0.0, {}])
            entry[0] += hit
            entry[1] += expected
            at = entry[2].setdefault(cell, [0, 0.0])
            at[0] += 1
            at[1] += hit
        for name, (hits, predicted, cells) in per.items():
            accepted, before = self._request.get(name, (0.0, 0.0))
            self._request[name] = (accepted + hits, before + predicted)
            c = self._counts(name)
            for cell, (n, h) in cells.items():
                c.flat[cell] += n
                c.flat[CELLS + cell] += h
            fade(c)
        if per:
            self._learn_agreement_sums(levels)

    def _learn_agreement(self, levels: np.ndarray, hits: np.ndarray, expected: np.ndarray) -> None:
        """Add tested nodes (their agreement levels, 1.0 where accepted, their corrected chances) to the levels."""
        self._learn_agreement_sums([[float(hits[levels == i].sum()), float(expected[levels == i].sum())]
                                    for i in range(AGREE_LEVELS)])

    def _learn_agreement_sums(self, sums: list) -> None:
        for i, (hits, expected) in enumerate(sums):
            self.agreement[0, i] += hits
            self.agreement[1, i] += expected
            if self.agreement[1, i] > AGREE_MAX:
                self.agreement[:, i] *= 0.5
