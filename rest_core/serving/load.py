"""Load-aware drafting: how many draft tokens each running request gets, from the measured cost of a step.

A served model verifies every running request's drafts in one engine step, so a draft token is paid for by the
whole batch: the step over B requests and D drafts costs T(B, D) (`StepCost`, measured on this machine by
`rest_core.serving.calibrate` and cached per machine like the decoder's cost curve), and it emits B tokens plus
the drafts accepted.  `plan_drafts` picks the draft lengths that maximise the batch's tokens per millisecond:

    maximise  (B + sum_i E_i(k_i)) / (T(B, sum_i k_i) + drafting time)

E_i(k) is the chance-weighted length of request i's best chain cut at k tokens (the sum of each node's chance of
being accepted, a product along the chain, so every further token is worth less than the one before).  Adding
tokens best-first over all requests gives, for each total D, the best split; the best D wins, and D = 0 -- no
draft at all, a plain step -- whenever no draft pays, which is what a busy CPU at batch 16 usually finds.

`worth_drafting` asks the same question before any lookup is made, with the chances the recent drafts earned
(`AcceptanceProfile`): when even those chains would not pay for their tokens and the lookups' own time, the
stores are not searched at all, so a loaded server pays nothing for having a drafter.
"""
from __future__ import annotations

import bisect
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from rest_base.files import cache_dir, safe_file_name, write_atomic

BATCHES = (1, 2, 4, 8, 16)  # batch sizes the step cost is measured at
DRAFTS = (0, 1, 2, 4, 8)  # draft tokens per request measured at each batch size
CURVE_VERSION = 1


@dataclass(frozen=True)
class StepCost:
    """T(B, D): the measured time (ms) of one engine step over B running requests with D draft tokens in all.

    ms[i][j] is the step time at batch BATCHES[i] with DRAFTS[j] drafts per request.  Between measured batch sizes
    and draft counts it interpolates linearly in the drafts per request, then in the batch size; past the largest
    it extends the last segment's slope."""

    batches: tuple[int, ...]
    drafts: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        arr = np.asarray(self.ms, dtype=float)
        if arr.shape != (len(self.batches), len(self.drafts)) or not np.isfinite(arr).all() or (arr <= 0).any():
            raise ValueError(f"a step-cost table needs {len(self.batches)} x {len(self.drafts)} positive times, "
                             f"got shape {arr.shape}")
        if list(self.batches) != sorted(set(self.batches)) or list(self.drafts) != sorted(set(self.drafts)) \
                or self.drafts[0] != 0 or len(self.batches) < 2 or len(self.drafts) < 2:
            raise ValueError("a step-cost table needs increasing batch sizes and draft counts, the drafts from 0")

    def at_batch_row(self, row: int, per_request: float) -> float:
        """T at measured batch size batches[row] with this many drafts per request."""
        return _extend(per_request, self.drafts, self.ms[row])

    def __call__(self, batch: int, drafts: int) -> float:
        """Milliseconds of a step over `batch` requests with `drafts` draft tokens in all."""
        per_request = drafts / max(batch, 1)
        times = [self.at_batch_row(i, per_request) for i in range(len(self.batches))]
        return max(_extend(batch, self.batches, times), 1e-3)

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


def _extend(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Linear interpolation of ys over xs at x, the end segments extended beyond them."""
    j = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
    return float(ys[j] + slope * (x - xs[j]))


def curve_path(key: str) -> Path:
    """Where the step-cost table of one model, engine and machine (`key`) is kept."""
    return cache_dir() / "cost" / f"vllm-{safe_file_name(key)}.json"


def load_curve(key: str) -> Optional[StepCost]:
    path = curve_path(key)
    try:
        return StepCost.from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def save_curve(key: str, cost: StepCost, about: dict) -> Path:
    path = curve_path(key)
    write_atomic(path, json.dumps({**cost.to_json(), **about,
                                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1).encode())
    return path


def plan_drafts(chances: Sequence[Sequence[float]], cost: StepCost, batch: Optional[int] = None,
                overhead_ms: float = 0.0) -> list[int]:
    """Draft tokens per request (a prefix of each request's chain) that maximise the step's tokens per ms.

    chances[i][j]: the chance that request i's first j + 1 drafts are all accepted (non-increasing in j);
    batch: requests in the step (default: len(chances); requests with nothing to draft count too);
    overhead_ms: time a step that drafts anything spends on it and a plain step does not (the lookups, when the
    question is whether to make them at all)."""
    batch = len(chances) if batch is None else batch
    gains = [(-float(c), i, j) for i, row in enumerate(chances) for j, c in enumerate(row) if c > 0]
    gains.sort()  # best first; ties: the earlier request, then the shallower draft (each chain stays a prefix)
    best_rate, best_total, gained = batch / cost(batch, 0), 0, 0.0
    for total, (neg, _, _) in enumerate(gains, 1):
        gained -= neg
        rate = (batch + gained) / (cost(batch, total) + overhead_ms)
        if rate > best_rate:
            best_rate, best_total = rate, total
    counts = [0] * len(chances)
    for _, i, _ in gains[:best_total]:
        counts[i] += 1
    return counts


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


def worth_drafting(profile: AcceptanceProfile, cost: StepCost, batch: int, max_drafts: int,
                   lookup_ms: float) -> bool:
    """Whether chains as good as the recent ones, for every request, would pay for their tokens and the lookups."""
    if max_drafts <= 0 or batch <= 0:
        return False
    typical = profile.chain(max_drafts)
    counts = plan_drafts([typical] * batch, cost, batch, overhead_ms=lookup_ms * batch)
    return sum(counts) > 0
