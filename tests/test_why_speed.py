"""The break-even arithmetic beside the speed: tokens per pass, the cost of a tree pass, the speedup."""
from __future__ import annotations

import re

from rest_core.app.panels import why_speed_html
from rest_core.traces.palette import SOURCE_MARKERS, source_marker, source_pattern


def _step(k: int, draft: int, tokens: int, forward: float, other: float) -> dict:
    return {"step": k, "draft_size": draft, "new_tokens": list(range(tokens)), "t_forward_ms": forward,
            "t_retrieve_ms": other, "t_tree_ms": 0.0, "t_verify_ms": 0.0, "t_commit_ms": 0.0}


def numbers(html: str) -> list[float]:
    return [float(x) for x in re.findall(r"<b>([\d.]+)×?</b>", html)]


def test_a_run_slower_than_plain_is_explained():
    # 4 passes, 5 tokens (1.25 per pass); each step 60 ms against 40 ms per plain token: 1.5x the cost
    steps = [_step(k, 7, t, 55.0, 5.0) for k, t in enumerate((2, 1, 1, 1))]
    html = why_speed_html(steps, 40.0, curve=lambda q: {1: 40.0, 8: 56.0}.get(q, 0.0))
    per_pass, tree_cost, cost, speedup = numbers(html)
    assert per_pass == 1.25 and tree_cost == 1.4 and cost == 1.5
    assert speedup == round(1.25 / 1.5, 2) and "slower" in html
    assert "to break even a pass must bring 1.50 tokens" in html
    assert "8.0 tokens" in html  # the mean tree, root included


def test_a_faster_run_and_nothing_to_explain():
    steps = [_step(k, 3, 3, 45.0, 5.0) for k in range(3)]
    html = why_speed_html(steps, 40.0, rest_ms_per_pass=50.0)
    assert numbers(html) == [3.0, 1.25, 2.4] and "faster" in html and "cost curve" not in html
    assert why_speed_html([], 40.0) == "" and why_speed_html(steps, None) == ""


def test_sources_have_a_shape_and_a_pattern_beside_their_colour():
    shapes = [source_marker(s) for s in ("static", "request", "history", "model")]
    assert len(set(shapes)) == 4 and set(shapes) <= set(SOURCE_MARKERS.values())
    patterns = [source_pattern(s) for s in ("request", "history", "model")]
    assert len(set(patterns)) == 3 and source_marker("my-store") == source_marker("my-store")
