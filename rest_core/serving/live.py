"""What a served step costs now: the calibrated step cost refreshed from the engine's real steps, and propose()'s
own time.

`rest-lab calibrate-vllm` measures T(B, D) once; a shared machine's speed moves from minute to minute, and a table
measured in a busy minute is off in its shape as well as in its level (cells 20-60% apart from their neighbours).
So, as the decoder refreshes its forward-time curve (rest_core.cost), the served step cost is a level times a shape,
both refreshed from every step the engine really runs (the time from the end of one propose() call to the start
of the next, over B requests that all decoded, with the D drafts given to them):

* the shape of a batch size B along the drafts is the calibrated one, T_cal(B, D) / T_cal(B, 0) - 1 (the extra
  cost of D drafts in plain steps), scaled by a factor fitted to the newest steps at that batch size: a straight
  line ms = a + b * x through their (extra cost, ms) points, by Theil-Sen (the median of the pairwise slopes, so
  a few steps slowed by other programs do not move it), refitted every REFIT_EVERY steps; the factor is b / a.
  It needs steps with different draft counts (at least MIN_EACH on each side of some count): where the newest
  steps all drafted about as many tokens, every PROBE_EVERY-th step drafts half of what was planned (`probe`).
  A batch size with no fit for STALE_STEPS steps goes back to the calibrated shape, so a burst of load that made
  drafts look dear does not stay for the life of the server.  (A table that made drafts look too dear keeps
  drafting off at that batch size, where nothing can be learned about drafts, until it is measured again; the
  other way round -- drafts dearer than measured, the way that would make serving slower than plain -- is what
  the live shape corrects);
* the level, the machine's speed now, is what the newest RECENT_LEVELS steps of any batch size imply through the
  shape (their median): every batch size and draft count follows it, run or not.

`RecentChains` keeps what the newest lookups found, on which the decision to look up at all is made.
`ProposeTime` keeps propose()'s own time per request, in steps that drafted (lookups, trees, the plan, learning
from the verdict) and in steps that did not, as medians of the newest steps of each: drafting pays only when its
tokens are worth the engine's extra time *and* the proposer's (serving.load.plan_drafts' overhead_ms).
"""
from __future__ import annotations

import statistics
from collections import deque
from pathlib import Path
from typing import Optional

import numpy as np

from rest_base.files import read_json, write_json
from rest_core.serving.load import StepCost, typical_chains

RECENT_LEVELS = 9  # the machine's speed now: implied by this many newest steps of any batch size
FIT_STEPS = 32  # a batch size's shape along the drafts: fitted to its newest this many steps ...
MIN_EACH = 3  # ... once at least this many lie on each side of some draft count
REFIT_EVERY = 4  # ... refitted every this many of its steps once fitted (a fit over 32 steps moves slowly; fitting
# every step cost 0.035 ms of a batch-1 propose() call's median 0.42 ms in the chat replay, vllm-zen5-dense.md)
STALE_STEPS = 256  # a batch size with no such fit for this many steps goes back to its calibrated shape
PROBE_EVERY = 8  # where the newest steps cannot tell a slope, every this many steps drafts half of the plan
FLOOR = 1e-3  # per draft, in plain steps: a calibrated shape that is flat along the drafts still orders them
MAX_SCALE = 1000.0  # the fitted factor on the calibrated shape stays within [0, MAX_SCALE]
PROPOSE_STEPS = 16  # propose()'s time per request: the median of this many newest steps (drafting / not) ...
PROPOSE_STALE = 64  # ... drafting's forgotten this many steps after the last drafting step (it is tried again)
REALIZED_STEPS = 32  # what drafting really brought: the newest this many steps with drafts and without, per batch
REALIZED_MIN = 8  # ... and at least this many of each before they may switch drafting off
STALL_CAP = 3.0  # ... each step's time counted at most this many times its kind's median
WAVE_END_KEPT = 4  # what drafting for a batch's last requests brought: the newest this many batch ends, per key
WAVE_END_RETRY = 512  # ... and where it lost, it is tried again after this many steps served for last requests
# without it (about four of the chat suite's batch-16 waves)
WAVE_END_STEPS = 4  # ... a batch end counting once this many of its steps drafted (fewer: joined to the next)
WAVE_END_VERSION = 2  # of the file that keeps them
RECENT_CHAINS = 64  # the newest looked-up requests' chains: whether drafting would pay, asked before any lookup ...
MIN_CHAINS = 8  # ... the hopeful prior standing in for the missing ones while fewer are known
TYPICAL_KEPT = 8  # typical mixes of the same chains kept at once (the batch's size, its last requests' number)


def theil_sen(x: np.ndarray, y: np.ndarray) -> Optional[tuple[float, float]]:
    """(intercept, slope) of the line through (x, y): the median of the slopes between every two points of
    different x, then the median of y - slope * x; None when all x are equal."""
    dx = x[None, :] - x[:, None]
    upper = np.triu(np.abs(dx) > 1e-12, 1)
    if not upper.any():
        return None
    slope = float(np.median(((y[None, :] - y[:, None])[upper]) / dx[upper]))
    return float(np.median(y - slope * x)), slope


class LiveStepCost:
    """T(B, D) as the machine runs now: the calibrated table's shape, refreshed per batch size, at the level the
    newest steps imply (see the module's docstring).  Called and planned with like a StepCost."""

    def __init__(self, calibrated: StepCost):
        self.calibrated = calibrated
        self.level = 1.0  # the machine's speed now, in calibrated steps
        self._levels: deque = deque(maxlen=RECENT_LEVELS)
        self._steps: dict[int, deque] = {}  # batch size -> (step, extra cost, ms) of its newest steps
        self._scale: dict[int, tuple[float, int]] = {}  # batch size -> (factor on its shape, step it was fitted at)
        self._unfitted: dict[int, int] = {}  # batch size -> its steps observed since its last fit
        self._step = 0
        self.fits = 0  # how many times a batch size's fit was made or dropped: the shape changed

    def extra(self, batch: int, drafts: np.ndarray) -> np.ndarray:
        """The calibrated extra cost of these draft counts at this batch size, in plain steps (with the floor)."""
        row = self.calibrated.row(batch, int(np.max(drafts)))
        return row[drafts] / row[0] - 1.0 + FLOOR * drafts

    def _extra_at(self, batch: int, drafts: int) -> float:
        """`extra` of one draft count, in plain Python (called at every step)."""
        row = self.calibrated.row(batch, drafts)
        return float(row[drafts] / row[0]) - 1.0 + FLOOR * drafts

    def observe(self, batch: int, drafts: int, ms: float) -> None:
        """One real engine step: `batch` requests, all decoding, `drafts` draft tokens among them, `ms` long."""
        if batch < 1 or drafts < 0 or not ms > 0:
            return
        self._step += 1
        steps = self._steps.setdefault(batch, deque(maxlen=FIT_STEPS))
        steps.append((self._step, self._extra_at(batch, drafts), ms))
        while steps and steps[0][0] <= self._step - STALE_STEPS:
            steps.popleft()
        self._unfitted[batch] = self._unfitted.get(batch, 0) + 1
        if batch not in self._scale or self._unfitted[batch] >= REFIT_EVERY:
            self._fit(batch, steps)
        for b in [b for b, (_, at) in self._scale.items() if at <= self._step - STALE_STEPS]:
            del self._scale[b]
            self.fits += 1
        self._levels.append(ms / self._shape_at(batch, drafts))
        self.level = statistics.median(self._levels)

    @staticmethod
    def _spread(steps: deque) -> bool:
        """Whether these steps hold MIN_EACH or more on each side of some draft count (a slope can be told)."""
        x = sorted(s[1] for s in steps)
        return len(x) >= 2 * MIN_EACH and x[MIN_EACH - 1] < x[-MIN_EACH]

    def _fit(self, batch: int, steps: deque) -> None:
        if not self._spread(steps):
            return
        self._unfitted[batch] = 0
        x = np.array([s[1] for s in steps])
        fit = theil_sen(x, np.array([s[2] for s in steps]))
        if fit is not None and fit[0] > 0:
            self._scale[batch] = (min(max(fit[1] / fit[0], 0.0), MAX_SCALE), self._step)
            self.fits += 1

    def _shape(self, batch: int, drafts: np.ndarray) -> np.ndarray:
        """T at level 1: the calibrated plain step times (1 + the fitted factor times the extra cost), or the
        calibrated table as it is where no fit holds."""
        scale = self._scale.get(batch)
        if scale is None:
            return self.calibrated.row(batch, int(np.max(drafts)))[drafts]
        return self.calibrated(batch, 0) * (1.0 + scale[0] * self.extra(batch, drafts))

    def _shape_at(self, batch: int, drafts: int) -> float:
        """`_shape` of one draft count, in plain Python (called at every step)."""
        scale = self._scale.get(batch)
        if scale is None:
            return float(self.calibrated.row(batch, drafts)[drafts])
        return float(self.calibrated.row(batch, 0)[0]) * (1.0 + scale[0] * self._extra_at(batch, drafts))

    def row(self, batch: int, drafts: int) -> np.ndarray:
        """Milliseconds of a step over `batch` requests with 0, 1, ..., `drafts` draft tokens in all."""
        return self.level * self._shape(batch, np.arange(drafts + 1))

    def __call__(self, batch: int, drafts: int) -> float:
        return self.level * self._shape_at(batch, drafts)

    def probe(self, batch: int) -> bool:
        """Whether this step should draft half of its plan: the newest steps at this batch size all drafted
        about as many tokens, so that a slope cannot be told, and it is every PROBE_EVERY-th step."""
        steps = self._steps.get(batch)
        return steps is not None and len(steps) >= 2 * MIN_EACH and self._step % PROBE_EVERY == 0 \
            and not self._spread(steps)

    def fitted(self, batch: int) -> Optional[float]:
        """The factor on the calibrated shape at this batch size, where the newest steps fitted one."""
        scale = self._scale.get(batch)
        return None if scale is None else scale[0]


class ProposeTime:
    """propose()'s own time per running request, in steps that drafted and in steps that did not: the medians of
    the newest PROPOSE_STEPS of each.  Drafting's measurements older than PROPOSE_STALE steps are forgotten (until
    drafting runs again it is assumed to cost nothing more), so one slow call -- the first look into a store the
    page cache had dropped, a native library built on first use -- cannot keep drafting off for good (until
    MIN_EACH drafting steps were timed, drafting is taken to cost nothing more, so that it is tried).  Drafting is
    weighed per group of batch sizes (batch_group): a lookup step's time per request holds what the step spends
    once, whatever its size, so a batch of one's (the engine's warm-up request's, say) says little of a batch of
    16's (1.4 ms a request at 1, 0.25 at 16 on a 2-core Zen 5), and taken for it kept drafting off for the first
    PROPOSE_STALE steps of a full batch."""

    def __init__(self):
        self._drafting: deque = deque(maxlen=PROPOSE_STEPS)  # (step, batch group, ms per request)
        self._plain: deque = deque(maxlen=PROPOSE_STEPS)  # (step, ms per request)
        self._step = 0

    def add(self, drafting: bool, requests: int, ms: float) -> None:
        self._step += 1
        if requests > 0:
            if drafting:
                self._drafting.append((self._step, batch_group(requests), ms / requests))
            else:
                self._plain.append((self._step, ms / requests))
        while self._drafting and self._drafting[0][0] <= self._step - PROPOSE_STALE:
            self._drafting.popleft()

    def plain_ms(self, requests: int) -> float:
        """What a step that drafts nothing spends in propose() (following the requests)."""
        return requests * statistics.median([ms for _, ms in self._plain]) if self._plain else 0.0

    def drafting_ms(self, requests: int) -> float:
        """What drafting adds to propose() in a step over this many requests, from drafting steps of about as many
        (the same batch_group)."""
        group = batch_group(requests)
        near = [ms for _, g, ms in self._drafting if g == group]
        if len(near) < MIN_EACH:  # too few to outvote a first slow call: drafting is tried
            return 0.0
        return max(0.0, requests * statistics.median(near) - self.plain_ms(requests))


class RecentChains:
    """The chains the newest lookups gave, one per looked-up request (the plan's chances; an empty chain where
    nothing was found): whether drafting would pay is asked on chains like these before any lookup is made.
    Chains older than PROPOSE_STALE steps are forgotten, and while fewer than MIN_CHAINS are known the missing
    ones are taken as the hopeful prior: a few lookups that found nothing (the first request's, say) cannot keep
    drafting off for good, since with drafting off nothing new would be learned."""

    def __init__(self):
        self._chains: deque = deque(maxlen=RECENT_CHAINS)  # (step, chances)
        self._step = 0
        self._typical: dict = {}  # (batch size, prior) -> serving.load.typical_chains' answer for these chains

    def tick(self) -> None:
        """One more engine step."""
        self._step += 1
        while self._chains and self._chains[0][0] <= self._step - PROPOSE_STALE:
            self._chains.popleft()
            self._typical.clear()

    def add(self, chances: list[float]) -> None:
        self._chains.append((self._step, chances))
        self._typical.clear()

    def chains(self, prior: list[float]) -> list[list[float]]:
        known = [c for _, c in self._chains]
        return known + [prior] * max(0, MIN_CHAINS - len(known))

    def typical(self, batch: int, prior: list[float]) -> list[list[float]]:
        """serving.load.typical_chains of these chains for a batch of this size, kept per size and prior until the
        chains change (a step that looks nothing up asks again with the same ones; a batch that nothing waits to
        join asks for two sizes: its requests near the last and its last ones)."""
        key = (batch, tuple(prior))
        got = self._typical.get(key)
        if got is None:
            if len(self._typical) >= TYPICAL_KEPT:
                self._typical.clear()
            got = self._typical[key] = typical_chains(self.chains(prior), batch)
        return got


def batch_group(batch: int) -> int:
    """The batch sizes whose steps RealizedRates weighs together: 1, 2-3, 4-7, 8-15, 16-31, ... (the largest power
    of two not above it).  A batch that drains passes through each size for a few steps only, too few to tell
    anything by themselves."""
    return 1 << (max(int(batch), 1).bit_length() - 1)


class RealizedRates:
    """What drafting really brought at each batch size: the tokens per millisecond of the steps that verified
    drafts and of the steps that did not (the engine's time plus the propose() call that prepared the step),
    over the newest REALIZED_STEPS of each.  The plan drafts by chances and a step cost; where, at some batch size,
    the drafting steps gave fewer tokens per ms than the plain steps all the same, drafting is a loss there however
    it was planned, and `losing` says so: the drafter then looks nothing up at that batch size.  Drafting steps
    older than PROPOSE_STALE steps are forgotten, so drafting is tried again (REALIZED_MIN new ones are needed
    before it can be switched off again), and a batch size that sees too few steps of either kind is left to
    the plan.

    Steps of nearby batch sizes are weighed together (`batch_group`): each step's tokens per request against its
    time in plain steps of its own batch size (`plain_ms`, the step cost's: where no cost is given, 1), so that
    a step over 9 requests and one over 15 count alike, and a batch that drains from 16 requests to 1 -- each
    size for a few steps -- is judged all the same.

    A kind's rate is its steps' tokens over their time, summed (throughput), not the median of each step's own
    rate: at batch 1 most drafting steps may keep none of their drafts and a few keep eight, and the median step
    then reads as a loss while the steps together gave twice the tokens per ms.  Each step's time is capped at
    STALL_CAP times its kind's median, so one step stalled by another program does not decide."""

    def __init__(self):
        # (batch group, drafted) -> (step, tokens per request, time in plain steps of its batch size)
        self._steps: dict[tuple[int, bool], deque] = {}
        self._step = 0

    def observe(self, batch: int, drafts: int, tokens: int, ms: float, plain_ms: float = 1.0) -> None:
        """One step over `batch` requests that verified `drafts` drafts in all, gave `tokens` and took `ms`; a
        plain step over `batch` requests takes about `plain_ms` (the unit its time is counted in)."""
        if batch < 1 or tokens < 1 or not ms > 0 or not plain_ms > 0:
            return
        self._step += 1
        key = (batch_group(batch), drafts > 0)
        self._steps.setdefault(key, deque(maxlen=REALIZED_STEPS)).append((self._step, tokens / batch, ms / plain_ms))

    def rate(self, batch: int, drafted: bool) -> Optional[float]:
        """Tokens per request and per plain step's time of the newest steps of one kind in this batch size's group
        (with no plain step times given: tokens per request and ms; None before any)."""
        steps = self._steps.get((batch_group(batch), drafted))
        if not steps:
            return None
        cap = STALL_CAP * statistics.median(time for _, _, time in steps)
        return sum(tokens for _, tokens, _ in steps) / sum(min(time, cap) for _, _, time in steps)

    def losing(self, batch: int) -> bool:
        """Whether the newest steps in this batch size's group that verified drafts gave fewer tokens per request
        and per plain step's time than those that did not."""
        group = batch_group(batch)
        drafting, plain = self._steps.get((group, True)), self._steps.get((group, False))
        while drafting and drafting[0][0] <= self._step - PROPOSE_STALE:
            drafting.popleft()
        if not drafting or not plain or len(drafting) < REALIZED_MIN or len(plain) < REALIZED_MIN:
            return False
        return self.rate(batch, True) < self.rate(batch, False)


class WaveEnds:
    """What drafting for the requests a batch ends with (nothing waits to join it: serving.load.last_requests_gain)
    really brought, per kind of end (`key`: its last requests' kind and its batch's size, RestDrafter._end_key): the
    time it saved against the time it spent, over whole batch ends.  The throughput plan counts every kept draft in
    full, but at a batch's end a draft saves a whole step only when every last request keeps one, else only its
    request's share of a step; and an end's drafts are paid for in its first steps and pay, if at all, steps later.  In
    the chat suite's batch-16 waves (their last requests all run to max_tokens) 37 steps drafted about 9 tokens each for
    13 requests, kept half and ended the wave 7 steps sooner, losing ~0.15 s; in HumanEval's, 50 steps ended it 22 steps
    sooner and gained ~0.1 s (docs/bench/vllm-zen5-last-requests.md).

    Each drafting step is settled at the next one (RestDrafter._settle_wave_step) into the batch end under way
    (`observe`), which `begin` closes when requests join the batch (one with fewer than WAVE_END_STEPS such steps,
    as a batch's first steps while its prompts are read, goes on into the next).  Where the newest WAVE_END_KEPT
    ends of a kind that drafted saved less time than they spent, its next ends are served without that drafting
    (`losing`, asked once a step) until WAVE_END_RETRY steps were, when it is tried again at the next end and
    judged on that end alone.  The file at `path` keeps all this between runs of the engine (None: this run
    only); serving.config keeps it beside the step-cost table."""

    def __init__(self, path: Optional[Path] = None):
        self.path = path
        self._ends: dict[str, list[list[float]]] = {}  # key -> the newest ends that drafted: [saved ms, spent ms]
        self._skipped: dict[str, int] = {}  # key -> steps served without drafting since the newest of those
        self._now: dict[str, list[float]] = {}  # the end under way: key -> [saved ms, spent ms, steps]
        self._off: dict[str, int] = {}  # keys the end under way is served without drafting for: its steps so far
        self._written: Optional[dict] = None  # what `save` last wrote
        data = read_json(path)
        if not isinstance(data, dict) or data.get("version") != WAVE_END_VERSION:
            data = {}
        try:
            for key, got in data.get("keys", {}).items():
                self._ends[key] = [[float(saved), float(spent)] for saved, spent in got["ends"]][-WAVE_END_KEPT:]
                self._skipped[key] = int(got["skipped"])
        except (AttributeError, KeyError, TypeError, ValueError):  # a damaged file: measured again
            self._ends, self._skipped = {}, {}

    def observe(self, key: str, saved_ms: float, spent_ms: float) -> None:
        """One drafting step of an end of this kind (`key`), settled."""
        now = self._now.setdefault(key, [0.0, 0.0, 0])
        now[0] += saved_ms
        now[1] += spent_ms
        now[2] += 1

    def losing(self, key: str) -> bool:
        """Whether the batch end under way, of this kind (`key`), is served without drafting for its last requests."""
        if key in self._off:
            self._off[key] += 1
            return True
        ends = self._ends.get(key)
        if not ends or self._skipped.get(key, 0) >= WAVE_END_RETRY:
            return False
        if sum(saved for saved, _ in ends) >= sum(spent for _, spent in ends):
            return False
        self._off[key] = 1
        return True

    def begin(self) -> None:
        """Requests joined the batch: the end under way (if any) is closed, and kept."""
        changed = bool(self._off) or any(steps >= WAVE_END_STEPS for _, _, steps in self._now.values())
        self._ends, self._skipped = self._closed()
        self._now = {key: now for key, now in self._now.items() if now[2] < WAVE_END_STEPS}  # carried on
        self._off = {}
        if changed:
            self.save()

    def _closed(self) -> tuple[dict, dict]:
        """The ends and skipped counts as they stand with the end under way closed."""
        ends, skipped = dict(self._ends), dict(self._skipped)
        for key, (saved, spent, steps) in self._now.items():
            if steps >= WAVE_END_STEPS:
                retried = skipped.get(key, 0) >= WAVE_END_RETRY
                ends[key] = [*([] if retried else ends.get(key, [])), [saved, spent]][-WAVE_END_KEPT:]
                skipped[key] = 0
        for key, steps in self._off.items():
            skipped[key] = skipped.get(key, 0) + steps
        return ends, skipped

    def save(self) -> None:
        """Keep the ends at `path`, the one under way as if it closed now (a batch's last request leaves the engine
        unseen: the drafter hears of it at the next batch, if one comes)."""
        if self.path is None:
            return
        ends, skipped = self._closed()
        kept = {key: {"ends": got, "skipped": skipped.get(key, 0)} for key, got in ends.items()}
        if kept != self._written:
            write_json(self.path, {"version": WAVE_END_VERSION, "keys": kept})
            self._written = kept

    def totals(self, key: str) -> tuple[int, float, float]:
        """A key's batch ends kept, the time they saved and the time they spent (ms)."""
        ends = self._ends.get(key, [])
        return len(ends), sum(saved for saved, _ in ends), sum(spent for _, spent in ends)
