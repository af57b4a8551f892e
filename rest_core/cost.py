"""The draft budget, chosen per step from a cost model measured on this machine.

A verify pass over q tokens is not free on a CPU or for a small model, so the
number of draft tokens follows the expected gain:

    budget b maximizes  (1 + E[accepted drafts | top-b nodes]) / t(b + 1)

t(q) is the measured time of one forward pass over q tokens (calibrated once
per model, device and thread count, cached, and refreshed with every step's
real timing).  E[accepted] sums each kept node's chance of being accepted.  A
node's retrieval score, as a share of the root's, is the fraction of retrieved
continuations that start with its path: an estimate of that chance.  The
estimate is calibrated online: per score bin, the share of drafted nodes that
were really accepted.  When no tree pays for its cost, b = 0 is a plain step,
so REST never runs slower than plain decoding by design.
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rest_core.trace import SOURCES
from rest_core.tree import DraftTree

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # query sizes the cost curve is measured at
CANDIDATE_BUDGETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 63)
BINS = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 0.95, 1.0001])  # score share bins
PRIOR_WEIGHT = 8.0  # pseudo-observations behind the prior (the share itself) in each bin: learning wins soon
MAX_COUNT = 5000.0  # per bin: older observations fade so the calibration keeps adapting


@dataclass
class CostModel:
    """Forward cost curve t(q) plus calibrated acceptance; decides the budget per step."""

    grid: tuple[int, ...] = GRID
    times_ms: np.ndarray = field(default_factory=lambda: np.zeros(len(GRID)))  # median forward time per grid size
    max_budget: int = 63
    # drafted / accepted node counts per (source of the node, score-share bin): a request-store draft
    # with a given share is accepted far more often than a static-store one with the same share
    drafted: np.ndarray = field(default_factory=lambda: np.zeros((len(SOURCES), len(BINS) - 1)))
    accepted: np.ndarray = field(default_factory=lambda: np.zeros((len(SOURCES), len(BINS) - 1)))
    stats_path: Path | None = None  # where the acceptance counts persist between runs
    _recent: dict = field(default_factory=dict, repr=False)

    # -- construction ---------------------------------------------------------------
    @classmethod
    def for_model(cls, lm, cache: bool = True) -> "CostModel":
        """Calibrated for this model on this machine.

        The full curve is measured once and cached; every later start times a few
        one-token passes and measures the curve again when they disagree with the
        cached one by more than 25% (the machine changed, or was busy back then).
        REST_LAB_RECALIBRATE=1 forces a new measurement.
        """
        path = _calibration_path(lm)
        if cache and os.environ.get("REST_LAB_RECALIBRATE") != "1" and path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
                if tuple(data["grid"]) == GRID:
                    cached = cls(times_ms=np.array(data["times_ms"], dtype=float))
                    now = measure_forward_curve(lm, grid=(1,), repeats=3)[0]
                    if abs(now - cached.times_ms[0]) <= 0.25 * cached.times_ms[0]:
                        return cached._with_stats(lm, cache)
            except (ValueError, KeyError, OSError):
                pass
        model = cls(times_ms=measure_forward_curve(lm))
        if cache and path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps({"grid": GRID, "times_ms": model.times_ms.tolist(),
                                            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}))
            except OSError:
                pass
        return model._with_stats(lm, cache)

    def _with_stats(self, lm, cache: bool) -> "CostModel":
        if cache:
            self.stats_path = _stats_path(lm)
            self.load_stats()
        return self

    # -- the cost curve ---------------------------------------------------------------
    def forward_ms(self, q: int) -> float:
        return float(np.interp(q, self.grid, self.times_ms))

    def relative_cost(self, q: int) -> float:
        """Cost of a q-token verify pass relative to a one-token pass."""
        return self.forward_ms(q) / self.times_ms[0]

    # -- the decision ---------------------------------------------------------------
    def acceptance(self, shares: np.ndarray, sources: np.ndarray) -> np.ndarray:
        """Calibrated chance that a node with this score share, drafted by this source, is accepted."""
        b = _bins(shares)
        return (self.accepted[sources, b] + PRIOR_WEIGHT * shares) / (self.drafted[sources, b] + PRIOR_WEIGHT)

    def choose(self, tree: DraftTree) -> int:
        """Best number of draft nodes (top by score) for this tree."""
        n = tree.draft_size
        if n == 0:
            return 0
        shares = tree.scores[1:] / tree.scores[0]
        order = np.lexsort((np.arange(n), tree.depths[1:], -shares))  # the order prune_tree keeps nodes in
        chance = self.acceptance(shares[order], _source_ids(tree)[order])
        gain = np.concatenate([[0.0], np.cumsum(chance)])  # (n+1,) expected accepted drafts of the top b
        best, best_rate = 0, 1.0 / self.forward_ms(1)
        for b in CANDIDATE_BUDGETS:
            if b == 0 or b > n:
                continue
            rate = (1.0 + gain[b]) / self.forward_ms(b + 1)
            if rate > best_rate:
                best, best_rate = b, rate
        return best

    def observe(self, tree: DraftTree, accepted_nodes: list[int], forward_ms: float) -> None:
        """Learn from one verified step: which nodes were accepted, and what the pass cost."""
        q = len(tree)
        if q > 1:
            shares = tree.scores[1:] / tree.scores[0]
            cells = (_source_ids(tree), _bins(shares))
            np.add.at(self.drafted, cells, 1.0)
            hit = np.zeros(q - 1)
            hit[[n - 1 for n in accepted_nodes[1:]]] = 1.0
            np.add.at(self.accepted, cells, hit)
            full = self.drafted > MAX_COUNT
            if full.any():
                scale = np.where(full, MAX_COUNT / np.maximum(self.drafted, 1.0), 1.0)
                self.drafted *= scale
                self.accepted *= scale
        i = int(np.argmin(np.abs(np.array(self.grid) - q)))
        if self.grid[i] == q:  # refresh the curve with real step timings (median of the last few)
            recent = self._recent.setdefault(q, deque(maxlen=9))
            recent.append(forward_ms)
            if len(recent) >= 5:
                self.times_ms[i] = float(np.median(recent))


    def save_stats(self) -> None:
        """Keep the acceptance counts for the next run (they depend on model and stores, not on hardware)."""
        if self.stats_path is None:
            return
        try:
            self.stats_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.stats_path.with_name(self.stats_path.name + f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"bins": BINS.tolist(), "sources": list(SOURCES),
                                       "drafted": self.drafted.tolist(), "accepted": self.accepted.tolist()}))
            os.replace(tmp, self.stats_path)
        except OSError:
            pass

    def load_stats(self) -> None:
        if self.stats_path is None or not self.stats_path.is_file():
            return
        try:
            data = json.loads(self.stats_path.read_text())
            if data["bins"] == BINS.tolist() and data["sources"] == list(SOURCES):
                self.drafted = np.array(data["drafted"], dtype=float)
                self.accepted = np.array(data["accepted"], dtype=float)
        except (ValueError, KeyError, OSError):
            pass


def _bins(shares: np.ndarray) -> np.ndarray:
    return np.clip(np.digitize(shares, BINS) - 1, 0, len(BINS) - 2)


def _source_ids(tree: DraftTree) -> np.ndarray:
    """(n,) source index of each draft node (root excluded)."""
    return np.array([SOURCES.index(s) for s in tree.sources[1:]], dtype=np.int64)


def measure_forward_curve(lm, prefix_len: int = 256, repeats: int = 5, grid: tuple[int, ...] = GRID) -> np.ndarray:
    """Median time (ms) of one forward pass over q tokens after a prefix, for every q in grid."""
    from transformers import DynamicCache

    model = lm.model
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    times = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        prefix = torch.randint(0, vocab, (1, prefix_len), generator=gen).to(lm.device)
        lm.forward(input_ids=prefix, cache=cache, logits_to_keep=1)
        for q in grid:
            samples = []
            for rep in range(repeats + 1):
                ids = torch.randint(0, vocab, (1, q), generator=gen).to(lm.device)
                pos = torch.arange(prefix_len, prefix_len + q, device=lm.device)[None]
                mask = torch.zeros((1, 1, q, prefix_len + q), dtype=lm.dtype, device=lm.device) if q > 1 else None
                if lm.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                lm.forward(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache)
                if lm.device.type == "cuda":
                    torch.cuda.synchronize()
                if rep:  # the first pass at a new size warms up
                    samples.append((time.perf_counter() - t0) * 1e3)
                cache.crop(-q)
            times.append(float(np.median(samples)))
    return monotone_fit(np.array(times))  # more tokens never cost less


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


def _stats_path(lm) -> Path:
    from rest_core.model import cache_root

    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in lm.name)
    return cache_root() / "cost" / f"{safe}-acceptance.json"


def _calibration_path(lm) -> Path | None:
    from rest_core.model import cache_root

    key = f"{lm.name}-{lm.device.type}-{str(lm.dtype).split('.')[-1]}-t{torch.get_num_threads()}-c{os.cpu_count()}"
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in key)
    return cache_root() / "cost" / f"{safe}.json"
