"""A public server's page in Chromium: only the operator's models, a prompt over the limit refused
with its reason, and an answer that goes on to the end after the trace store filled up.

The server runs the tiny random model with a trace store capped at 100 KB, so a long answer fills
it part-way; every wait is on a condition of the page, never a fixed sleep.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from rest_core import app as sup
from rest_core.app.policy import Policy
from rest_core.model import DEFAULT_MODEL

from conftest import CHROMIUM, chromium_page, free_port, make_tiny_lm, no_chooser, private_cache

pytestmark = [pytest.mark.browser, pytest.mark.server]

SHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
POLICY = Policy(public=True, reason="test", models=(DEFAULT_MODEL, "tiny-random"), max_prompt_chars=300,
                max_new_tokens=512, max_trace_bytes=100 * 1024)
SETTINGS = sup.Settings(mode="completion", static=sup.NO_STATIC, max_new_tokens=400, budget_mode="fixed", budget=8)
WAIT_MS = 300_000


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.skip("Chromium is not installed at /usr/bin/chromium (scripts/setup.sh --dev installs it)")
    import app

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REST_LAB_CACHE", private_cache(tmp_path_factory.mktemp("cache")))
        mp.setenv("GRADIO_TEMP_DIR", str(tmp_path_factory.mktemp("gradio")))
        tiny = make_tiny_lm(max_positions=512)
        demo = app.build_demo(lm_factory=lambda name: tiny, store_factory=lambda tok: None,
                              cost_factory=no_chooser, preload=False, defaults=SETTINGS, policy=POLICY,
                              trace_db=str(tmp_path_factory.mktemp("traces") / "traces.sqlite"))
        _, url, _ = app.launch(demo, prevent_thread_lock=True, server_port=free_port(), quiet=True)
        SHOTS.mkdir(parents=True, exist_ok=True)
        with chromium_page(url, timeout_ms=60_000) as pg:
            yield pg
        demo.close()


def test_only_the_operators_models_are_offered(page):
    page.click("#model input")
    options = page.locator("[role=option]")
    options.first.wait_for()
    offered = sorted(t.replace("✓", "").strip() for t in options.all_inner_texts())
    assert offered == sorted(POLICY.models), offered
    page.keyboard.press("Escape")
    assert "models this server offers" in page.inner_text("#model").lower() or \
        "The models this server offers" in page.content()


def test_a_prompt_over_the_limit_is_refused_with_its_reason(page):
    page.fill("#prompt textarea", "t5 " * 150)  # 450 characters
    page.click("#prompt button.submit-button")
    notice = page.locator("#notice")
    notice.get_by_text("accepts at most 300").wait_for(timeout=WAIT_MS)
    assert "450 characters" in notice.inner_text()


def test_the_answer_goes_on_when_the_trace_store_is_full(page):
    page.fill("#prompt textarea", "t5 t6 t7 t8 t9")
    page.click("#prompt button.submit-button")
    page.wait_for_selector('#metrics [data-state="done"]', timeout=WAIT_MS)
    notice = page.locator("#notice")
    notice.get_by_text("Recording stopped after").wait_for(timeout=WAIT_MS)
    recorded = int(notice.inner_text().split("after")[1].split()[0])
    metrics = page.inner_text("#metrics")
    assert f"Figures of the {recorded} recorded steps" in metrics and "the whole answer: 400 tokens" in metrics
    answer = page.locator("#chatbot .message-row").last
    assert answer.locator(".rest-answer").count() == 2, "recorded steps tinted by origin, the rest as plain text"
    assert len(re.findall(r"t\d+", answer.inner_text())) == 400, "the whole answer is shown"
    page.screenshot(path=str(SHOTS / "public-recording-stopped.png"), full_page=True)


def test_visitor_text_shows_as_it_is_never_as_a_link(page):
    """The tiny tokenizer refuses a context that is not t<id> words, quoting it back: the explorer's summary and the
    toast show the quote as it is, with no link or emphasis made of it."""
    page.get_by_role("tab", name="Datastore explorer").click()
    page.fill("#explore-text textarea", "t5 x[**win**](http://evil.example/x)www.evil.example")
    page.click("#explore-btn")
    summary = page.locator("#explore-summary")
    summary.get_by_text("invalid literal").wait_for(timeout=WAIT_MS)
    quoted = "[**win**](http://evil.example/x)www.evil.example"
    assert quoted in summary.inner_text()
    assert summary.locator("a").count() == 0 and summary.locator("strong, em").count() == 0
    toast = page.locator("[data-testid=toast-body]").last
    toast.wait_for()
    assert quoted in toast.inner_text() and toast.locator("a").count() == 0
