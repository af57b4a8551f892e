"""The live view's pacing: each kind of redraw measured by the forward passes it overlapped, and spaced by it."""
import pytest

from rest_core.app import pacing
from rest_core.app.pacing import Pacing, redraw_cost_s
from rest_core.app.streaming import Disturbance


def curve(q: int) -> float:
    return 30.0 + 2.0 * q


def row(step: int, size: int, extra_ms: float = 0.0) -> dict:
    return {"step": step, "draft_size": size, "t_forward_ms": curve(size + 1) + extra_ms}


def test_steps_beside_a_text_update_measure_its_cost_and_space_the_next_ones():
    """Two text updates, each followed by a step 40 ms slower than its tree size takes: 40 ms an update; with
    TEXT_SHARE of the time allowed, the next updates wait 40 ms / TEXT_SHARE.  Steps ending after the render's
    window are the undisturbed reference; the steps beside an update teach the cost curve nothing."""
    drawing = Disturbance()
    pace = Pacing(drawing, curve)
    assert pace.text_interval == pacing.TEXT_INTERVAL_S  # nothing measured yet: the page's pace
    rows, t = [], 100.0
    for update in range(2):
        pace.text_sending(t)
        assert not drawing.quiet_since(t + pacing.TEXT_SETTLE_S / 2)  # a step starting now is disturbed
        pace.step(len(rows), t + 0.04)  # ends inside the render's window
        rows.append(row(len(rows), 4, extra_ms=40.0))
        for _ in range(3):
            t += 0.2
            pace.step(len(rows), t)  # ends after the window: quiet
            rows.append(row(len(rows), 2 + update))
    assert pace.text_steps == {0, 4} and pace.noisy == {0, 4}
    pace.weigh(rows, t)
    assert drawing.text_cost_s == pytest.approx(0.04)
    assert pace.text_interval == pytest.approx(0.04 / pacing.TEXT_SHARE)
    assert not pace.text_steps and pace.text_sent == 0


def test_a_text_update_not_yet_rendered_is_not_weighed():
    drawing = Disturbance()
    pace = Pacing(drawing, curve)
    pace.text_sending(10.0)
    pace.step(0, 10.05)
    pace.weigh([row(0, 3, extra_ms=50.0), row(1, 3)], 10.06)  # still inside the window
    assert drawing.text_cost_s is None and pace.text_steps == {0}


def test_a_free_text_update_keeps_the_pages_pace_and_estimates_follow_the_measurements():
    drawing = Disturbance()
    drawing.text_cost_s = 0.1
    pace = Pacing(drawing, curve)
    pace.text_sending(0.0)
    pace.step(0, 0.01)
    rows = [row(0, 2), row(1, 2), row(2, 5)]  # the step beside the update took no longer than the others
    pace.weigh(rows, 1.0)
    assert drawing.text_cost_s == pytest.approx(0.1 * (1 - pacing.TEXT_COST_WEIGHT))  # it moves towards 0
    for _ in range(30):
        pace.text_sending(2.0)
        pace.weigh(rows, 3.0)  # updates beside which no step ran cost nothing
    assert pace.text_interval == pacing.TEXT_INTERVAL_S


def test_figures_and_text_are_weighed_apart():
    """A step beside the figures counts for the figures' cost, not the text's; neither is the other's reference."""
    drawing = Disturbance()
    pace = Pacing(drawing, curve)
    pace.figures_building()
    pace.step(0, 5.0)
    pace.figures_sent(4.9, 5.1)
    pace.text_sending(5.2)  # inside the figures' settle window: its steps are the figures'
    pace.step(1, 5.3)
    t = 5.1 + pacing.DRAW_SETTLE_S
    pace.text_sending(t)
    pace.step(2, t + 0.05)
    rows = [row(0, 3, 300.0), row(1, 3, 100.0), row(2, 3, 20.0), row(3, 3), row(4, 6)]
    pace.weigh(rows, t + 1.0)
    assert drawing.cost_s == pytest.approx(0.4)
    assert drawing.text_cost_s == pytest.approx(0.02 / 2)  # two updates sent, one step beside the second
    assert redraw_cost_s(rows, {2}, curve, {0, 1}) == pytest.approx(0.02)

