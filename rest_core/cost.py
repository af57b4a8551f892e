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
"""
from __future__ import annotations

import bisect
import os
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from rest_base.calibration import CalibrationFile
from rest_base.files import cache_dir, read_json, safe_file_name, write_json
from rest_base.native_policy import NATIVE, NativePolicy
from rest_core import native
from rest_core.kernels import ROWS
from rest_core.kv_cache import new_cache
from rest_core.machine import machine_key
from rest_core.tree import DraftTree, keep_nodes

if TYPE_CHECKING:
    from datastores import Store
    from rest_core.model import LoadedModel

GRID = ROWS  # query sizes the cost curve is measured at: the row counts the linear kernels are chosen at
CANDIDATE_BUDGETS = np.array([0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 63])  # draft sizes weighed
BINS = np.array([0.0, 0.05, 0.15, 0.3, 0.5, 0.7, 0.9, 1.0001])  # ratio bins (a node's share of its parent's rows)
DEPTHS = 4  # depth cells: 1, 2, 3, 4 and deeper
SUPPORT = np.array([0.0, 2.0, 4.0, 16.0])  # support cells: 1, 2-3, 4-15, 16+ rows through the node
SHAPE = (2, DEPTHS, len(SUPPORT), len(BINS) - 1)  # drafted / accepted counts per source
CELLS = DEPTHS * len(SUPPORT) * (len(BINS) - 1)  # cells per kind of count, flattened (C order of SHAPE[1:])
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the prior in each cell: learning wins soon
PRIOR_SCALE = 0.4  # the prior: this fraction of the ratio
MAX_COUNT = 5000.0  # per cell: older observations fade so the calibration keeps adapting
FEW_NODES = 16  # trees of up to this many drafts learn in Python numbers (CostModel._observe_few)
_BINS_LIST, _SUPPORT_LIST = BINS.tolist(), SUPPORT.tolist()
CURVE_VERSION = 1  # of the calibration file (1: kept as a rest_base.calibration file)
STATS_VERSION = 3  # 3: the model source drafts from pairs of tokens too (its cells mean other things)
REQUEST_WEIGHT = 4.0  # expected acceptances behind each request's correction: a few steps move it
AGREE_LEVELS = 3  # nodes drafted by 1, 2, 3 or more sources (rows of that many sources run through the node)
AGREE_WEIGHT = 20.0  # expected acceptances behind each level's correction
AGREE_MAX = 2000.0  # a level's expected acceptances fade past this, so its correction keeps adapting
MAX_CHANCE = 0.99  # a corrected conditional chance stays below certainty
RECENT_PASSES = 9  # a size's real relative cost on the curve: the median of its last this many passes ...
MIN_PASSES = 5  # ... once it has at least this many
RECENT_LEVELS = 9  # the machine's speed now: implied by this many newest passes of any size
MIN_REFERENCE = 3  # a tree pass tells its size's relative cost against at least this many one-token passes ...
REFERENCE_STEPS = 32  # ... taken within this many steps of it (the machine's speed moves from minute to minute)
STALE_STEPS = 128  # a size no step ran in this many steps goes back to its calibrated relative cost


@dataclass
class CostModel:
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
        calibration = _calibration_file(lm)
        times = _CURVES.get(calibration.path) if cache else None
        if times is None:
            times = _cached_curve(lm, calibration) if cache and os.environ.get("REST_LAB_RECALIBRATE") != "1" else None
            if times is None:
                times = measure_forward_curve(lm)
                if cache:
                    calibration.write({"times_ms": times.tolist()})
            if cache:
                _CURVES[calibration.path] = times
        model = cls(times_ms=np.array(times, dtype=float),
                    labels={s.source: getattr(s, "label", s.source) for s in stores or ()}, kind=kind)
        if cache:
            model.stats_path = _stats_path(lm)
            model.load_stats()
        return model

    @classmethod
    def for_acceptance(cls, model_name: str, stores: Sequence[Store] = (), kind: str = "") -> CostModel:
        """Acceptance learning alone, for a caller that weighs the drafts' cost itself (a served model's batch:
        rest_core.serving): the counts this model's decodes saved for these stores, a flat curve that no one reads."""
        model = cls(times_ms=np.ones(len(GRID)), labels={s.source: getattr(s, "label", s.source) for s in stores},
                    kind=kind)
        model.stats_path = _stats_path_for(model_name)
        model.load_stats()
        return model

    # -- the cost curve ---------------------------------------------------------------
    def forward_ms(self, q: int | np.ndarray) -> float | np.ndarray:
        """Time of a pass over q tokens (one q, or an array of them), interpolated on the curve."""
        t = np.interp(q, self.grid, self.times_ms)
        return float(t) if np.ndim(t) == 0 else t

    def relative_cost(self, q: int) -> float:
        """Cost of a q-token verify pass relative to a one-token pass."""
        return self.forward_ms(q) / self.times_ms[0]

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

    def _from_cells(self, tree: DraftTree, cells=None) -> tuple[np.ndarray, np.ndarray]:
        """(n,) each draft node's chance of being accepted once its parent was, by its cell alone, and
        (n,) its source name."""
        ratio, cell, sources = cells if cells is not None else _cells(tree)
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
            found = _cells(tree)
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
                _fade(c)
        if forward_ms is not None:
            self._refresh_curve(q, forward_ms)

    def _observe_few(self, tree: DraftTree, accepted_nodes: list[int]) -> None:
        """`observe`'s counting for a tree of a few nodes, in Python numbers: the same cells, the same counts added
        once per cell, the same fading. Right after a forward pass each distinct numpy operation runs from cold
        caches, and the array path's ~30 of them were most of what the cost model's learning cost per step. The
        request's sums add node by node where numpy sums in blocks of 8 (at most the last bit apart). The cell of a
        node is `_cells`' arithmetic on one node (tests/test_cost.py holds the two paths to the same counts)."""
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
            _fade(c)
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

    def _refresh_curve(self, q: int, forward_ms: float) -> None:
        """Refresh the curve with a real step's timing, as a level times a shape.

        The budget choice reads only the curve's shape -- what a pass over q tokens costs in one-token
        passes -- while a shared machine's speed (the level) moves from minute to minute.  Timings of
        different sizes taken minutes apart cannot be compared as they are: kept as absolute times, a size
        timed in a slow minute looked dear next to one timed in a fast minute, and a size no step ran kept
        the calibration's time while the others took the machine's speed of the moment, so that when the
        machine slowed down big trees looked nearly free (a 33-token pass at 1.15x a one-token pass, against
        2.0x measured in the same minute).  So:

        * the level is the one-token time the newest RECENT_LEVELS passes of any size imply through the
          shape (their median): every size follows the machine's speed, run or not;
        * a tree pass tells its size's cost in one-token passes against the one-token passes of the last
          REFERENCE_STEPS steps (their median; at least MIN_REFERENCE of them, else it tells nothing: read
          against other tree sizes, whose own costs are estimates, the shape drifted away from one-token
          passes where they are rare, as on code prompts); a size's relative cost is the median of its last
          RECENT_PASSES such readings, once it has MIN_PASSES.  A pass over q tokens between two grid sizes
          informs both, scaled by the shape (most budgets give passes of 9, 11, 13, 17 tokens, off the grid);
        * fewer tokens never cost more: a size's reading caps every smaller size and floors every larger
          one, the newest readings winning where two disagree;
        * a size no step ran in the last STALE_STEPS steps goes back to its calibrated relative cost, so a
          burst of load that made large trees look dear (and kept the budget too small to run them again)
          does not stay on the curve for the life of the process."""
        self._steps += 1
        grid = self.grid
        changed = False
        if q == 1:
            self._ones.append((self._steps, forward_ms))
        elif grid[0] < q <= grid[-1]:
            reference = [ms for step, ms in self._ones if step > self._steps - REFERENCE_STEPS]
            if len(reference) >= MIN_REFERENCE:
                relative = forward_ms / statistics.median(reference)  # this pass in one-token passes of the moment
                shape_q = float(np.interp(q, grid, self._shape))
                j = bisect.bisect_right(grid, q) - 1  # grid[j] <= q
                for i in ([j] if grid[j] == q else [j, j + 1]):
                    passes = self._passes.setdefault(i, _Passes())
                    changed = passes.add(relative * float(self._shape[i]) / shape_q, self._steps) or changed
        if grid[0] <= q <= grid[-1]:
            self._recent.append((q, forward_ms))
        stale = [i for i, passes in self._passes.items() if passes.at <= self._steps - STALE_STEPS]
        for i in stale:
            changed = self._passes.pop(i).median is not None or changed
        if changed:
            self._rebuild_shape()
        self._rebuild_curve()

    def _rebuild_shape(self) -> None:
        """The calibrated shape with every size that has enough recent readings at their median, applied oldest
        first: a size's reading caps every smaller size and floors every larger one (the newest win)."""
        values = self._calibrated_shape.tolist()
        for _, i, r in sorted((p.at, i, p.median) for i, p in self._passes.items() if p.median is not None):
            values[i] = r
            values[:i] = [min(x, r) for x in values[:i]]
            values[i + 1:] = [max(x, r) for x in values[i + 1:]]
        self._shape = np.array(values)

    def _rebuild_curve(self) -> None:
        """times_ms: the shape at the machine's level now, the one-token time the newest passes imply through
        it (the calibration's until a real pass was timed)."""
        level = float(self._calibrated[0])
        if self._recent:  # a handful of passes: Python floats (numpy's per-call cost was most of this step's)
            shape = self._shape.tolist()
            level = statistics.median([ms / _interp(q, self.grid, shape) for q, ms in self._recent])
        self.times_ms = level * self._shape

    def save_stats(self) -> None:
        """Keep the acceptance counts for the next run, per store (they depend on model and store, not on
        hardware); the other stores' counts in the file stay.  Called by whoever owns the cost model, after a
        decode; the decoder writes no files."""
        if self.stats_path is None:
            return
        data = read_json(self.stats_path)
        stores = _stored_counts(data)
        stores.update({self._disk_key(self.labels.get(k, k)): v.tolist() for k, v in self.counts.items()})
        agreement = _stored_agreement(data)
        agreement[self.kind] = self.agreement.tolist()
        write_json(self.stats_path, {"version": STATS_VERSION, "shape": list(SHAPE), "bins": BINS.tolist(),
                                     "stores": stores, "agreement": agreement})

    def load_stats(self) -> None:
        """Counts saved by earlier runs with this model for these stores, and this kind's agreement sums;
        anything unreadable is ignored."""
        data = read_json(self.stats_path)
        saved = _stored_counts(data)
        agreement = _stored_agreement(data).get(self.kind)
        self.agreement = np.asarray(agreement, dtype=float) if agreement is not None else np.zeros((2, AGREE_LEVELS))
        counts = {}
        for key, value in saved.items():
            label = self._label_of(key)
            if label is None:  # another kind's
                continue
            name = next((n for n, lab in self.labels.items() if lab == label), None if self.labels else label)
            if name is not None:
                counts[name] = np.asarray(value, dtype=float)
        self.counts = counts

    def _disk_key(self, label: str) -> str:
        """The key of a store's counts on disk: its label, and the kind of text when told."""
        return f"{label} [{self.kind}]" if self.kind else label

    def _label_of(self, key: str) -> Optional[str]:
        """The store label of a key on disk when it holds this kind's counts, else None."""
        if self.kind:
            suffix = f" [{self.kind}]"
            return key[:-len(suffix)] if key.endswith(suffix) else None
        return None if key.endswith("]") and " [" in key else key


@dataclass
class _Passes:
    """One grid size's last real passes (the cost in one-token passes each implies for it), the step of the
    newest, and their median once there are MIN_PASSES of them."""
    readings: deque = field(default_factory=lambda: deque(maxlen=RECENT_PASSES))
    at: int = 0
    median: Optional[float] = None

    def add(self, relative: float, step: int) -> bool:
        """Keep one more pass; True when the median (the size's relative cost on the curve) was set."""
        self.readings.append(relative)
        self.at = step
        if len(self.readings) < MIN_PASSES:
            return False
        self.median = statistics.median(self.readings)
        return True


def _interp(x: float, xs: Sequence[int], ys: Sequence[float]) -> float:
    """np.interp(x, xs, ys) for one x inside [xs[0], xs[-1]] (increasing xs), by the same formula."""
    j = bisect.bisect_right(xs, x) - 1
    if j >= len(xs) - 1:
        return float(ys[-1])
    slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
    return slope * (x - xs[j]) + ys[j]


def _fade(counts: np.ndarray) -> None:
    """A source's counts after a step: cells past MAX_COUNT drafted are scaled back to it, so older
    observations fade and the calibration keeps adapting."""
    full = counts[0] > MAX_COUNT
    if full.any():
        counts *= np.where(full, MAX_COUNT / np.maximum(counts[0], 1.0), 1.0)


def _cells(tree: DraftTree) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per draft node: its ratio (share of its parent's rows, or its own share under a parent of another
    source), its cell (depth, support, ratio bin) as one index into a source's counts flattened per kind
    (`CELLS` of them), and its source name (an array, for masks)."""
    parents = tree.parents[1:]
    shares = tree.shares[1:]
    parent_share = tree.shares[parents]
    named = np.array(tree.sources)
    same = named[parents] == named[1:]
    ratio = np.where(same & (parent_share > 0), shares / np.maximum(parent_share, 1e-12), shares)
    ratio = np.minimum(np.maximum(ratio, 0.0), 1.0)
    depth = np.minimum(tree.depths[1:] - 1, DEPTHS - 1)  # draft nodes are at depth 1 and deeper
    # np.digitize(x, increasing bins) - 1 is searchsorted(bins, x, "right") - 1; support and ratio are >= 0
    sup = np.minimum(SUPPORT.searchsorted(tree.support[1:], "right") - 1, len(SUPPORT) - 1)
    rbin = np.minimum(BINS.searchsorted(ratio, "right") - 1, len(BINS) - 2)
    return ratio, (depth * len(SUPPORT) + sup) * (len(BINS) - 1) + rbin, named[1:]


def _stored_agreement(data) -> dict[str, list]:
    """Per kind of text, the agreement levels' (accepted, expected) sums a stats file holds (empty for a file of
    another version or without them; a kind whose sums are unreadable is left out)."""
    if not isinstance(data, dict) or data.get("version") != STATS_VERSION:
        return {}
    found = data.get("agreement")
    out = {}
    for kind, value in (found.items() if isinstance(found, dict) else ()):
        try:
            arr = np.asarray(value, dtype=float)
        except (TypeError, ValueError):
            continue
        if arr.shape == (2, AGREE_LEVELS) and np.isfinite(arr).all() and (arr >= 0).all():
            out[str(kind)] = value
    return out


def _stored_counts(data) -> dict[str, list]:
    """The per-store counts of a stats file this version wrote (empty for anything else)."""
    if not isinstance(data, dict) or data.get("version") != STATS_VERSION or data.get("shape") != list(SHAPE) \
            or data.get("bins") != BINS.tolist() or not isinstance(data.get("stores"), dict):
        return {}
    out = {}
    for label, value in data["stores"].items():
        try:
            arr = np.asarray(value, dtype=float)
        except (TypeError, ValueError):
            return {}
        if arr.shape != SHAPE or not np.isfinite(arr).all() or (arr < 0).any():
            return {}
        out[str(label)] = value
    return out


def measure_forward_curve(lm: LoadedModel, prefix_len: int = 256, repeats: int = 5,
                          grid: tuple[int, ...] = GRID) -> np.ndarray:
    """Time (ms) of one forward pass over q tokens after a prefix, for every q in grid.

    Every round passes once over every q (after a warm-up round), so a burst of load from other
    programs hits all sizes alike; each q keeps its fastest round, since other programs only ever
    add time (a burst during the one-token passes would otherwise make every tree look cheap)."""
    model = lm.model
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    samples: dict[int, list[float]] = {q: [] for q in grid}
    with torch.inference_mode():
        cache = new_cache(model)
        prefix = torch.randint(0, vocab, (1, prefix_len), generator=gen).to(lm.device)
        lm.forward(input_ids=prefix, cache=cache, logits_to_keep=1)
        for rep in range(repeats + 1):
            for q in grid:
                ids = torch.randint(0, vocab, (1, q), generator=gen).to(lm.device)
                pos = torch.arange(prefix_len, prefix_len + q, device=lm.device)[None]
                mask = torch.zeros((1, 1, q, prefix_len + q), dtype=lm.dtype, device=lm.device) if q > 1 else None
                if lm.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                lm.forward(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache)
                if lm.device.type == "cuda":
                    torch.cuda.synchronize()
                if rep:  # the first round warms every size up
                    samples[q].append((time.perf_counter() - t0) * 1e3)
                cache.crop(-q)
    return monotone_fit(np.array([min(samples[q]) for q in grid]))  # more tokens never cost less


def monotone_fit(values: np.ndarray) -> np.ndarray:
    """Closest non-decreasing sequence (pool adjacent violators): one noisy spike is averaged with its
    neighbours instead of lifting every later point, as a running maximum would."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values.astype(float):
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(c), t / c) for t, c in blocks])


_CURVES: dict[Path, np.ndarray] = {}  # calibration file -> curve measured or checked in this process


PROBE = (1, 8)  # sizes a new process times to check a cached curve
PROBE_LEVEL = 0.25  # a one-token pass this much slower or faster: the machine is not what it was
PROBE_SHAPE = 0.12  # an 8-token pass's cost relative to a one-token pass off by this share: the choice would differ


def _cached_curve(lm, calibration: CalibrationFile) -> Optional[np.ndarray]:
    """The curve stored on disk, if a quick probe agrees with it: a one-token pass within 25% of its time,
    and an 8-token pass's cost relative to it within 12% of the curve's.  The budget choice reads only the
    curve's shape (how much more a tree costs than one token), so a curve measured while the machine was
    busy -- a one-token pass at the usual time, larger sizes slowed, or the other way round -- must not
    survive a probe that sees another shape."""
    data = calibration.read()
    if data is None:
        return None
    try:
        times = np.array(data["times_ms"], dtype=float)
    except (KeyError, TypeError, ValueError):
        return None
    if times.shape != (len(GRID),) or not np.isfinite(times).all() or (times <= 0).any():
        return None
    now = measure_forward_curve(lm, grid=PROBE, repeats=3)
    cached = np.interp(PROBE, GRID, times)
    level_holds = abs(now[0] - cached[0]) <= PROBE_LEVEL * cached[0]
    shape_now, shape_then = now[1:] / now[0], cached[1:] / cached[0]
    shape_holds = bool(np.all(np.abs(shape_now - shape_then) <= PROBE_SHAPE * shape_then))
    return times if level_holds and shape_holds else None


def _stats_path(lm) -> Path:
    return _stats_path_for(lm.name)


def _stats_path_for(model_name: str) -> Path:
    return cache_dir() / "cost" / f"{safe_file_name(model_name)}-acceptance-v{STATS_VERSION}.json"


def _calibration_file(lm) -> CalibrationFile:
    """Where this model's curve on this machine is kept: per device, dtype and machine key, and per choice of linear
    kernels (the curve depends on the kernels in use), measured on this grid."""
    kernels = getattr(lm, "kernels", None)
    tag = kernels.key() if kernels is not None else ""
    return CalibrationFile("cost", f"{lm.name}-{lm.device.type}-{str(lm.dtype).split('.')[-1]}",
                           machine_key() + (f"-{tag}" if tag else ""), CURVE_VERSION, {"grid": list(GRID)})
