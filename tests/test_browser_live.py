"""What the live view costs, in Chromium on this machine: the Chat tab against the Race tab on one prompt.

tools/live_cost.py starts the app on the default model and stores, opens it in Chromium and, as two new
visitors, runs the prompt in a race (plain and REST in turn, REST timed by its own steps) and in the Chat tab
(REST with the live view streaming text and figures to the browser).  Ratios of runs side by side in one
process.  The tests catch the live view costing the decode and an estimate built from the wrong times; how
near the targets a run comes is measured by the tool itself over several prompts.
"""
from __future__ import annotations

import argparse

import pytest

from conftest import CHROMIUM, tool

pytestmark = [pytest.mark.browser, pytest.mark.server, pytest.mark.model, pytest.mark.slow]

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


@pytest.fixture(scope="module")
def measured():
    if not CHROMIUM.exists():
        pytest.skip("Chromium is not installed at /usr/bin/chromium (scripts/setup.sh --dev installs it)")
    live_cost = tool("live_cost")
    args = argparse.Namespace(prompts=[PROMPT], rounds=1, max_new_tokens=96, width=1280, figure_interval=None,
                              text_interval=None)
    return live_cost.measure(args)["rows"][0]


def test_the_chat_tab_decodes_about_as_fast_as_a_race(measured):
    """The live view does not hold the decode back.  Unpaced, the Chat tab ran at half the race's tokens/s, 1.9x
    its time per step and 3.5x its forward pass; paced, single runs on an idle 2-core machine read 0.77-1.15 of
    the race's tokens/s and 0.75-1.26 of its forward pass (a few tenths between two runs of three seconds).  The
    bounds sit between the two, so they catch the live view costing the decode again and not one noisy run;
    the targets (10% and 15%) are the benchmark's: tools/live_cost.py over three prompts, docs/bench/live-view.md."""
    assert measured["chat"]["tokens"] == measured["race"]["tokens"] > 0
    assert measured["step_ratio"] <= 1.5, measured  # time per step, chat over race
    assert measured["tokens_per_s_ratio"] >= 0.65, measured
    assert measured["forward_ratio"] is not None and measured["forward_ratio"] <= 1.5, measured


def test_the_chat_tabs_estimate_is_its_own_wall_time_against_the_fastest_plain_pace(measured):
    """The estimate divides plain decoding's measured time per token (the note names it) by the chat's own wall
    time per token, as a race divides its two wall times; the plain pace is the fastest this server measured,
    so the race that ran first bounds it.  How close the estimate comes to the race's measured speedup (target
    0.1x) is the benchmark's to say (tools/live_cost.py, docs/bench/live-view.md): both sides are three-second
    runs on a shared machine, and the race's own speedup moves by 0.3x between runs."""
    assert measured["order"] == ("race", "chat")
    assert measured["estimate"] is not None, "the Chat tab shows an estimated speedup"
    pace, chat, race = measured["estimate_plain_ms"], measured["chat"], measured["race"]
    assert pace is not None, "the estimate's note names the plain pace it divided"
    # not the calibrated one-token pass nor a cost curve: the chat's tokens in its wall time at that pace
    assert measured["estimate"] == pytest.approx(pace * chat["tokens_per_s"] / 1e3, rel=0.02, abs=0.011), measured
    # the race's plain decode was timed before the chat: the fastest pace is no slower (its prefill aside)
    assert race["plain_ms_per_token"] is not None
    assert pace <= 1.05 * race["plain_ms_per_token"], measured
