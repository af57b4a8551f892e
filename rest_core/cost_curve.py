"""The cost curve: what a verify pass over q tokens costs on this machine, measured once and refreshed by every step.

`measure_forward_curve` times a pass over every size of the GRID after a prefix; `calibrated_curve` keeps the
measurement per model, device, dtype, machine key and choice of linear kernels (a `rest_base.calibration` file and
this process's memory) and checks a cached one with a quick probe.  `LiveCurve` is the part of the cost model that
refreshes the curve with each step's real timing, as a level (the machine's speed now) times a shape (what a pass
over q tokens costs in one-token passes); only the shape decides the budget.
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
from rest_core.kv_cache import new_cache
from rest_core.machine import machine_key
from rest_core.rows import ROWS

if TYPE_CHECKING:
    from rest_core.model import LoadedModel

GRID = ROWS  # query sizes the cost curve is measured at: the row counts the linear kernels are chosen at
CURVE_VERSION = 1  # of the calibration file (1: kept as a rest_base.calibration file)
RECENT_PASSES = 9  # a size's real relative cost on the curve: the median of its last this many passes ...
MIN_PASSES = 5  # ... once it has at least this many
RECENT_LEVELS = 9  # the machine's speed now: implied by this many newest passes of any size
MIN_REFERENCE = 3  # a tree pass tells its size's relative cost against at least this many one-token passes ...
REFERENCE_STEPS = 32  # ... taken within this many steps of it (the machine's speed moves from minute to minute)
STALE_STEPS = 128  # a size no step ran in this many steps goes back to its calibrated relative cost


def calibrated_curve(lm: LoadedModel, cache: bool = True) -> np.ndarray:
    """The model's curve on this machine (ms per GRID size): measured once and cached on disk and in this
    process; a new process times a few one- and 8-token passes and measures the curve again when they disagree
    with the cached one (`_cached_curve`).  REST_LAB_RECALIBRATE=1 forces a new measurement."""
    calibration = calibration_file(lm)
    times = _CURVES.get(calibration.path) if cache else None
    if times is None:
        times = _cached_curve(lm, calibration) if cache and os.environ.get("REST_LAB_RECALIBRATE") != "1" else None
        if times is None:
            times = measure_forward_curve(lm)
            if cache:
                calibration.write({"times_ms": times.tolist()})
        if cache:
            _CURVES[calibration.path] = times
    return times


class LiveCurve:
    """The cost model's curve (`grid`, `times_ms`) as the steps refresh it; the fields it reads and keeps are the
    cost model's (rest_core.cost.CostModel)."""

    def forward_ms(self, q: int | np.ndarray) -> float | np.ndarray:
        """Time of a pass over q tokens (one q, or an array of them), interpolated on the curve."""
        t = np.interp(q, self.grid, self.times_ms)
        return float(t) if np.ndim(t) == 0 else t

    def relative_cost(self, q: int) -> float:
        """Cost of a q-token verify pass relative to a one-token pass."""
        return self.forward_ms(q) / self.times_ms[0]

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



def calibration_file(lm) -> CalibrationFile:
    """Where this model's curve on this machine is kept: per device, dtype and machine key, and per choice of linear
    kernels (the curve depends on the kernels in use), measured on this grid."""
    kernels = getattr(lm, "kernels", None)
    tag = kernels.key() if kernels is not None else ""
    return CalibrationFile("cost", f"{lm.name}-{lm.device.type}-{str(lm.dtype).split('.')[-1]}",
                           machine_key() + (f"-{tag}" if tag else ""), CURVE_VERSION, {"grid": list(GRID)})
