"""Load-aware drafting: how many draft tokens each running request gets, from the measured cost of a step.

A served model verifies every running request's drafts in one engine step, so a draft token is paid for by the
whole batch: the step over B requests and D drafts costs T(B, D) (`StepCost`, measured on this machine by
`rest_core.serving.calibrate` and cached per machine like the decoder's cost curve), and it emits B tokens plus
the drafts accepted.  `plan_drafts` picks the draft lengths that maximise the batch's tokens per millisecond:

    maximise  (B + sum_i E_i(k_i)) / (T(B, sum_i k_i) + propose()'s drafting time)

E_i(k) is the chance-weighted length of request i's best chain cut at k tokens (the sum of each node's chance of
being accepted, a product along the chain, so every further token is worth less than the one before).  Adding
tokens best-first over all requests gives, for each total D, the best split; the best D wins, and D = 0 -- no
draft at all, a plain step -- whenever no draft pays, which is what a busy CPU at batch 16 usually finds.
The table is measured once; serving.live refreshes it from the engine's real steps and measures propose()'s
own time, both of which the drafter hands to the plan.

`typical_pay` asks the same question before any lookup is made, with chains typical of what the recent requests'
lookups gave (an empty one where they found nothing) and drafting's measured time: when even those chains would not pay
for their tokens and for the proposer's own work, the stores are not searched at all, so a loaded server pays
nothing for having a drafter.  `AcceptanceProfile` values the chains of a source the cost model has not learned
yet, by how the recent drafts fared at each depth.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Optional

import numpy as np

from rest_base.calibration import CalibrationFile
from rest_base.files import safe_file_name

BATCHES = (1, 2, 4, 8, 16)  # batch sizes the step cost is measured at
# draft tokens per request measured at each batch size: every count to 6, since a step's cost need not rise with
# its drafts (vLLM's CPU engine on a Zen 4, batch 1: 48 ms a step with none, 55 with one, 41-43 with two to five,
# 49 with six), then sparser up to 16
DRAFTS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16)
CURVE_VERSION = 2  # 1: drafts (0, 1, 2, 4, 8), evened out to rise along both axes
MAX_CHANCE = 0.99  # a scaled chance stays below certainty
LEAST_CHANCE = 0.01  # last_request_worth's floor under a request's chance (one with no draft has none)


@dataclass(frozen=True)
class StepCost:
    """T(B, D): the measured time (ms) of one engine step over B running requests with D draft tokens in all.

    ms[i][j] is the step time at batch BATCHES[i] with DRAFTS[j] drafts per request.  Between measured batch sizes
    and draft counts it interpolates linearly in the drafts per request, then in the batch size; past the largest
    it extends the last segment's slope."""

    batches: tuple[int, ...]
    drafts: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]
    # per batch size, the longest row computed so far (read-only): propose() asks for rows at every step
    _rows: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        arr = np.asarray(self.ms, dtype=float)
        if arr.shape != (len(self.batches), len(self.drafts)) or not np.isfinite(arr).all() or (arr <= 0).any():
            raise ValueError(f"a step-cost table needs {len(self.batches)} x {len(self.drafts)} positive times, "
                             f"got shape {arr.shape}")
        if list(self.batches) != sorted(set(self.batches)) or list(self.drafts) != sorted(set(self.drafts)) \
                or self.drafts[0] != 0 or len(self.batches) < 2 or len(self.drafts) < 2:
            raise ValueError("a step-cost table needs increasing batch sizes and draft counts, the drafts from 0")

    def row(self, batch: int, drafts: int) -> np.ndarray:
        """Milliseconds of a step over `batch` requests with 0, 1, ..., `drafts` draft tokens in all (read-only;
        a row is a prefix of every longer row of its batch size, so the longest one asked for is kept)."""
        known = self._rows.get(batch)
        if known is None or len(known) <= drafts:
            known = self._rows[batch] = self._compute(batch, max(drafts, 2 * len(known) if known is not None else 0))
            known.flags.writeable = False
        return known[:drafts + 1]

    def _compute(self, batch: int, drafts: int) -> np.ndarray:
        per_request = np.arange(drafts + 1) / max(batch, 1)
        j = min(max(bisect.bisect_right(self.batches, batch) - 1, 0), len(self.batches) - 2)
        low, high = (_extend(per_request, self.drafts, self.ms[i]) for i in (j, j + 1))
        t = (batch - self.batches[j]) / (self.batches[j + 1] - self.batches[j])
        return np.maximum(low + (high - low) * t, 1e-3)

    def __call__(self, batch: int, drafts: int) -> float:
        """Milliseconds of a step over `batch` requests with `drafts` draft tokens in all."""
        return float(self.row(batch, drafts)[-1])

    def to_json(self) -> dict:
        return {"version": CURVE_VERSION, "batches": list(self.batches), "drafts": list(self.drafts),
                "ms": [list(r) for r in self.ms]}

    @classmethod
    def from_json(cls, data) -> Optional[StepCost]:
        """The table a curve file holds, or None for anything else."""
        try:
            if data.get("version") != CURVE_VERSION:
                return None
            return cls(tuple(int(b) for b in data["batches"]), tuple(int(d) for d in data["drafts"]),
                       tuple(tuple(float(x) for x in row) for row in data["ms"]))
        except (AttributeError, KeyError, TypeError, ValueError):
            return None


def _extend(x: np.ndarray, xs: Sequence[float], ys: Sequence[float]) -> np.ndarray:
    """Linear interpolation of ys over xs at every x, the end segments extended beyond them."""
    xs_, ys_ = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    j = np.clip(np.searchsorted(xs_, x, side="right") - 1, 0, len(xs_) - 2)
    slope = (ys_[j + 1] - ys_[j]) / (xs_[j + 1] - xs_[j])
    return ys_[j] + slope * (x - xs_[j])


def curve_file(key: str) -> CalibrationFile:
    """The step-cost table of one model, engine and machine (`key`), in the cache beside the decoder's curves."""
    return CalibrationFile("cost", "vllm", safe_file_name(key), CURVE_VERSION)


def curve_path(key: str) -> Path:
    return curve_file(key).path


def load_curve(key: str) -> Optional[StepCost]:
    data = curve_file(key).read()
    return StepCost.from_json(data) if data is not None else None


def save_curve(key: str, cost: StepCost, about: dict) -> Path:
    calibration = curve_file(key)
    calibration.write({**cost.to_json(), **about})
    return calibration.path


def plan_drafts(chances: Sequence[Sequence[float]], cost, batch: Optional[int] = None,
                overhead_ms: float = 0.0, base_ms: float = 0.0, worth: Optional[Sequence[float]] = None,
                base: Optional[float] = None) -> list[int]:
    """Draft tokens per request (a prefix of each request's chain) that maximise the step's tokens per ms
    (or what `worth` says a request's tokens are worth: see last_request_worth).

    chances[i][j]: the chance that request i's first j + 1 drafts are all accepted (non-increasing in j);
    cost: the step cost (a StepCost or live.LiveStepCost: anything with `row(batch, drafts)`);
    batch: requests in the step (default: len(chances); requests with nothing to draft count too);
    overhead_ms: time a step that drafts anything spends on it and a plain step does not (propose()'s drafting:
    the lookups, when the question is whether to make them at all); base_ms: time every step spends beside the
    engine's (propose() following the requests); worth: per request, what one of its accepted tokens is worth
    against a token of the step's own (default: 1 each); base: what the step's own tokens are worth (default:
    `batch`, one a request)."""
    batch = len(chances) if batch is None else batch
    base = float(batch) if base is None else base
    counts = [0] * len(chances)
    table = _table(chances)
    if worth is not None:
        table = table * np.asarray(worth, dtype=float)[:, None]
    flat = table.ravel()
    # best first; ties: the earlier request, then the shallower draft (each chain stays a prefix)
    order = np.argsort(-flat, kind="stable")
    order = order[flat[order] > 0]
    if not order.size:
        return counts
    times = cost.row(batch, order.size) + base_ms  # a step with 0, 1, ... of the best drafts
    rates = (base + np.cumsum(flat[order])) / (times[1:] + overhead_ms)
    best = int(np.argmax(rates))  # the first of equal rates: fewer drafts
    if rates[best] <= base / times[0]:
        return counts
    return np.bincount(order[:best + 1] // table.shape[1], minlength=len(chances)).tolist()


def last_request_worth(first_chances: Sequence[float], cost, batch: int) -> tuple[list[float], float]:
    """What an accepted first draft of each of the batch's last requests is worth when nothing waits to join
    (the batch is done when they are): `first_chances[i]`, the chance that last request i keeps its first draft
    this step: the gate of drafting for those requests (`last_requests_gain`).

    The last requests are those with the most tokens still to go; the batch ends a step sooner only when every
    one of them has gained a token.  Each gains at a step with its chance q_i, so a step saved takes about
    sum_j 1/q_j drafting steps of theirs, and saves the batch's final step, over those requests alone:
    S = T(n, 0).  Valuing request i's token at S (1/q_i) / sum_j (1/q_j) makes each of their first drafts worth
    S / sum_j (1/q_j) at its chance: they draft together or not at all, and never where one of them has next to
    no chance (the least served decides).  Worth is in tokens of the step's own, T(batch, 0) / batch ms each,
    and the step's own tokens are `batch` of them (plan_drafts' `worth` and `base`).  With every request last
    and their chances equal, each token is worth one: the plan is throughput's."""
    n = len(first_chances)
    if n == 0 or batch <= 0:
        return [], float(max(batch, 0))
    inverse = 1.0 / np.maximum(np.asarray(first_chances, dtype=float), LEAST_CHANCE)
    saved_ms, token_ms = cost(n, 0), cost(batch, 0) / batch
    return (saved_ms / token_ms * inverse / inverse.sum()).tolist(), float(batch)


def last_requests_gain(first_chances: Sequence[float], cost, batch: int, base_ms: float = 0.0) -> bool:
    """Whether the batch's last requests (`first_chances`: each one's chance of keeping its first draft) would
    gain enough, all of them together, for any of their first drafts to pay as last_request_worth values them
    (the gate of drafting for a batch that nothing waits to join)."""
    if not first_chances:
        return False
    worth, base = last_request_worth(first_chances, cost, batch)
    return sum(plan_drafts([[q] for q in first_chances], cost, batch, base_ms=base_ms, worth=worth,
                           base=base)) > 0


def last_requests_pay(typical_last: Sequence[Sequence[float]], typical_near: Sequence[Sequence[float]], cost,
                      batch: int, overhead_ms: float, base_ms: float = 0.0) -> bool:
    """typical_pay for a batch that nothing waits to join: whether chains like the recent ones would get past
    last_requests_gain for that many last requests (`typical_last`), and would then pay for their tokens and for
    drafting's time (`overhead_ms`) over the requests near the last (`typical_near`: those within
    num_speculative_tokens of them, any of which may end the batch), a token of theirs counting in full."""
    if batch <= 0 or not typical_last or not typical_near:
        return False
    if not last_requests_gain([chain[0] if chain else 0.0 for chain in typical_last], cost, batch, base_ms):
        return False
    return sum(plan_drafts(typical_near, cost, batch, overhead_ms=overhead_ms, base_ms=base_ms,
                           base=float(len(typical_near)))) > 0


def _table(chains: Sequence[Sequence[float]]) -> np.ndarray:
    """The chains as rows of one table, zeros past each chain's end (at least one column)."""
    lengths = np.fromiter((len(c) for c in chains), dtype=np.int64, count=len(chains))
    table = np.zeros((len(chains), max(int(lengths.max(initial=0)), 1)))
    table[np.arange(table.shape[1]) < lengths[:, None]] = np.fromiter(chain.from_iterable(chains), dtype=float,
                                                                      count=int(lengths.sum()))
    return table


@dataclass
class AcceptanceProfile:
    """How the served drafts fared lately: per depth, the share of drafts accepted once the one before was
    (a running mean over about `window` tested drafts), from a hopeful start so drafting is tried at all."""

    depth: int
    window: float = 200.0
    prior: float = 0.6
    rates: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.rates:
            self.rates = [self.prior] * self.depth

    def observe(self, drafted: int, accepted: int) -> None:
        """One verified chain: `drafted` tokens put to the test, the first `accepted` of them kept."""
        w = 1.0 / self.window
        for j in range(min(drafted, self.depth)):
            hit = 1.0 if j < accepted else 0.0
            self.rates[j] += w * (hit - self.rates[j])
            if not hit:
                break  # the deeper drafts were never tested

    def chain(self, length: int) -> list[float]:
        """The chances of a typical chain's first 1..length drafts all being accepted."""
        out, p = [], 1.0
        for j in range(min(length, self.depth)):
            p *= self.rates[j]
            out.append(p)
        return out


@dataclass
class ChanceCalibration:
    """How the plan's chances came true: per depth j, the drafts verified there, how often their chain's first
    j + 1 tokens were all accepted against the chance the plan gave it, as (accepted + weight) / (expected +
    weight) over about `window` expected acceptances.  The plan's chances are scaled by it: the cost model's
    chances, and the recent drafts' rates that stand in for a source it has not learned (whichever is higher),
    came true 16-20% less often than said in the served suites, enough to draft at a loss where a draft barely
    pays (batch 16)."""

    depth: int
    weight: float = 10.0
    window: float = 400.0
    hits: list[float] = field(default_factory=list)
    expected: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hits = self.hits or [0.0] * self.depth
        self.expected = self.expected or [0.0] * self.depth

    def observe(self, chances: Sequence[float], accepted: int) -> None:
        """One verified chain: the plan's (unscaled) chances of its drafts, the first `accepted` of them kept."""
        for j, c in enumerate(chances[:self.depth]):
            self.expected[j] += c
            self.hits[j] += 1.0 if j < accepted else 0.0
            if self.expected[j] > self.window:
                self.expected[j] *= 0.5
                self.hits[j] *= 0.5

    def apply(self, chances: Sequence[float]) -> list[float]:
        """The chances scaled by how such chances came true (still non-increasing, below certainty)."""
        out, last = [], MAX_CHANCE
        for j, c in enumerate(chances[:self.depth]):
            last = min(last, c * (self.hits[j] + self.weight) / (self.expected[j] + self.weight))
            out.append(last)
        return out


def typical_pay(typical: Sequence[Sequence[float]], cost, batch: int, overhead_ms: float, base_ms: float = 0.0
                ) -> bool:
    """Whether chains like the recent requests' would pay, for a batch of this size, for their tokens and for
    drafting's own time (see plan_drafts), asked of the batch's typical chains (typical_chains of the recent ones:
    chances as the plan saw them, an empty chain where the lookups found nothing), which the caller keeps
    (serving.live.RecentChains.typical)."""
    if batch <= 0 or not typical:
        return False
    return sum(plan_drafts(typical, cost, batch, overhead_ms=overhead_ms, base_ms=base_ms)) > 0


def typical_chains(recent: Sequence[Sequence[float]], batch: int) -> list[list[float]]:
    """`batch` chains that stand for the recent ones: ranked by their expected length and cut into `batch`
    groups, each group's mean chance at every depth (so one request stands for the average of them all, and a
    batch keeps the recent mix of good chains and chains with nothing); repeated when there are fewer."""
    ranked = sorted(recent, key=sum, reverse=True)
    if len(ranked) <= batch:
        return [list(ranked[i % len(ranked)]) for i in range(batch)]
    size, extra = divmod(len(ranked), batch)  # as np.array_split cuts: the first `extra` groups one longer
    sizes = np.full(batch, size)
    sizes[:extra] += 1
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return (np.add.reduceat(_table(ranked), starts, axis=0) / sizes[:, None]).tolist()
