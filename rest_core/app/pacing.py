"""How often a live answer redraws: the streamed text and the figures, each spaced by what it costs the decode.

With the browser on the decode's machine, every redraw takes cores the decode needs: the server builds and
sends it, the browser renders it.  Each kind of redraw is measured where it shows, in the forward passes that
ran while it was sent and drawn (their time beyond an undisturbed pass of the same tree size); the next
redraws of that kind wait that cost over the share of the decode's time they may take.  A browser elsewhere
costs nothing, and the page redraws at its fastest pace.  Steps timed during a redraw also teach the model's
cost curve nothing (the slot's `Disturbance`).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Optional

from rest_core.app.settings import (
    DRAW_SETTLE_S,
    FIGURE_INTERVAL_S,
    FIGURE_SHARE,
    TEXT_INTERVAL_S,
    TEXT_SETTLE_S,
    TEXT_SHARE,
)
from rest_core.app.streaming import Disturbance

TEXT_COST_WEIGHT = 0.3  # each measurement's weight in the running estimate of a text update's cost


def redraw_cost_s(rows: list[dict], disturbed: set, curve: Optional[Callable[[int], float]],
                  noisy: frozenset | set = frozenset()) -> float:
    """Seconds the `disturbed` steps' forward passes took beyond an undisturbed pass over a tree of their size
    (the steps of `rows` neither disturbed nor `noisy`, scaled to the cost curve when there is one)."""
    def size_cost(row: dict) -> float:
        return curve(int(row["draft_size"]) + 1) if curve is not None else 1.0

    timed = [r for r in rows if r.get("t_forward_ms")]
    quiet = [r["t_forward_ms"] / size_cost(r) for r in timed if r["step"] not in disturbed and r["step"] not in noisy]
    if not quiet:
        return 0.0
    scale = statistics.median(quiet)  # a step's own noise goes both ways: summed as it is, at least 0 in all
    return max(0.0, sum(r["t_forward_ms"] - scale * size_cost(r) for r in timed if r["step"] in disturbed)) / 1e3


class Pacing:
    """One live answer's redraws: which steps each overlapped, what they cost, when the next may come.  The
    measured costs are kept on the model's slot (`drawing`), so the next answers start from them."""

    def __init__(self, drawing: Disturbance, curve: Optional[Callable[[int], float]]):
        self.drawing, self.curve = drawing, curve
        self.fig_until = 0.0  # figures being built and sent (inf), then drawn by the browser until then
        self.text_until = 0.0  # the latest text update rendered by the browser until then
        self.fig_steps: set[int] = set()  # steps that ran while figures were built, sent or drawn (not yet weighed)
        self.text_steps: set[int] = set()  # steps that ran while a text update was rendered (not yet weighed)
        self.noisy: set[int] = set()  # every step either overlapped: no reference for an undisturbed pass
        self.text_sent = 0  # text updates since the latest weighing
        self.build_s = 0.0  # building and sending the latest figures here

    def step(self, step_no: int, now: float) -> None:
        """A step ended at `now`: which redraw, if any, it ran beside."""
        if now < self.fig_until:
            self.fig_steps.add(step_no)
        elif now < self.text_until:
            self.text_steps.add(step_no)
        else:
            return
        self.noisy.add(step_no)

    def text_sending(self, now: float) -> None:
        self.text_until = now + TEXT_SETTLE_S
        self.text_sent += 1
        self.drawing.mark(self.text_until)

    def figures_building(self) -> None:
        self.fig_until = float("inf")  # until they are sent and the browser has drawn them
        self.drawing.mark(self.fig_until)

    def figures_sent(self, began: float, now: float) -> None:
        self.build_s = now - began
        self.fig_until = now + DRAW_SETTLE_S
        self.drawing.settle(self.fig_until)

    def weigh(self, rows: list[dict], now: float) -> None:
        """Once a redraw is over, what it cost the decode (the extra forward time of the stored steps that ran
        meanwhile), kept on the model's slot for the next redraws and answers."""
        if not rows:
            return
        last = rows[-1]["step"]
        if self.fig_steps and now >= self.fig_until:
            over = {s for s in self.fig_steps if s <= last}
            self.fig_steps -= over
            self.drawing.cost_s = redraw_cost_s(rows, over, self.curve, self.noisy)
        if self.text_sent and now >= self.text_until:
            over = {s for s in self.text_steps if s <= last}
            self.text_steps -= over
            per_update = redraw_cost_s(rows, over, self.curve, self.noisy) / self.text_sent
            self.text_sent = 0
            known = self.drawing.text_cost_s
            self.drawing.text_cost_s = per_update if known is None else known + TEXT_COST_WEIGHT * (per_update - known)

    @property
    def fig_interval(self) -> float:
        """Seconds between two figure redraws: what one costs (built here, and the decode's time the latest one
        took) over the share of the time they may take, at least FIGURE_INTERVAL_S."""
        return max(FIGURE_INTERVAL_S, (self.build_s + self.drawing.cost_s) / FIGURE_SHARE)

    @property
    def text_interval(self) -> float:
        """Seconds between two text updates: what one costs the decode over TEXT_SHARE, at least TEXT_INTERVAL_S."""
        return max(TEXT_INTERVAL_S, (self.drawing.text_cost_s or 0.0) / TEXT_SHARE)
