"""The page in Chromium: a streamed answer, the live figures, step-through, race, explorer, errors.

The app runs the offline default model with a small store built from a few
standard-library files in a temporary folder. Screenshots are saved to
artifacts/screenshots/ for inspection. Every wait is on a condition of the page
(generous timeouts: a loaded CI machine decodes slowly), never a fixed sleep.
"""
from __future__ import annotations

import socket
import sysconfig
from pathlib import Path

import pytest

from conftest import private_cache

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
DECODE_MS = 600_000  # a whole answer on a slow, shared CPU
PROMPT = "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser("


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def module_cache(tmp_path_factory):
    """The page's cache (trace store, session folders, cost statistics) in a temporary folder, never the
    real one; the converted default model is shared with the real cache when it is there already."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REST_LAB_CACHE", private_cache(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    if not CHROMIUM.exists():
        pytest.skip("Chromium is not installed at /usr/bin/chromium (scripts/setup.sh --dev installs it)")
    import app
    from datastores import build_datastore, iter_text_files
    from rest_core import app as sup
    from rest_core.model import load_model

    lm = load_model()
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [lib / name for name in ("argparse.py", "optparse.py", "getopt.py", "textwrap.py")]
    store = build_datastore(tmp_path_factory.mktemp("store") / "small", lm.tokenizer,
                            iter_text_files([f for f in files if f.exists()]), progress=False)
    defaults = sup.Settings(mode="completion", max_new_tokens=48, budget_mode="fixed", budget=16)
    demo = app.build_demo(lm_factory=lambda name: lm, store_factory=lambda tok: store, preload=True,
                          trace_db=str(tmp_path_factory.mktemp("traces") / "traces.sqlite"), defaults=defaults)
    demo.queue()
    _, local_url, _ = app.launch(demo, prevent_thread_lock=True, server_port=free_port(), quiet=True)
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield local_url
    demo.close()


@pytest.fixture(scope="module")
def page(url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        pg = browser.new_page(viewport={"width": 1600, "height": 1000})
        pg.set_default_timeout(120_000)
        pg.goto(url)
        pg.wait_for_selector("#prompt textarea")
        yield pg
        browser.close()


def snap(page, name: str) -> None:
    """A screenshot of the whole page at its full height (the sidebar stays in place)."""
    height = page.evaluate("() => document.documentElement.scrollHeight")
    page.set_viewport_size({"width": 1600, "height": max(1000, min(height, 4000))})
    page.screenshot(path=str(SHOTS / name))
    page.set_viewport_size({"width": 1600, "height": 1000})


def plot_rendered(page, elem_id: str) -> None:
    page.wait_for_selector(f"#{elem_id} .js-plotly-plot .main-svg", state="attached", timeout=DECODE_MS)


def test_answer_streams_with_live_figures(page):
    # count the tinted tokens at every change of the chat, to see the answer arrive in pieces
    page.evaluate("""() => {
        window.seenCounts = new Set();
        new MutationObserver(() => window.seenCounts.add(
            document.querySelectorAll('#chatbot .rest-answer span').length)
        ).observe(document.querySelector('#chatbot'), {childList: true, subtree: true, characterData: true});
    }""")
    page.fill("#prompt textarea", PROMPT)
    page.click("#prompt button.submit-button")
    page.wait_for_selector("#chatbot .rest-answer span", timeout=DECODE_MS)
    page.wait_for_selector('#metrics [data-state="done"]', timeout=DECODE_MS)
    partial = page.evaluate("() => [...window.seenCounts].filter(n => n > 0).length")
    assert partial >= 2, "the answer streams: several partial answers were shown"
    for elem_id in ("tree-plot", "mask-plot", "speed-plot"):
        plot_rendered(page, elem_id)
    assert page.locator("#chatbot .rest-answer span").count() >= 2
    assert "Draft tree" in page.inner_text("#tree-plot") or page.locator("#tree-plot .main-svg").count() > 0
    assert "tree attention mask" in page.inner_text("#mask-plot")
    assert "forward passes" in page.inner_text("#speed-plot")
    snap(page, "chat.png")


def test_step_through_a_stored_run(page):
    page.get_by_role("tab", name="Step through").click()
    explanation = page.locator("#step-explanation")
    explanation.get_by_text("Step 0.").wait_for(timeout=DECODE_MS)  # the latest run opens at its first step
    plot_rendered(page, "step-tree")
    plot_rendered(page, "step-mask")
    page.click("#step-forward")
    explanation.get_by_text("Step 1.").wait_for()
    page.click("#step-forward")
    explanation.get_by_text("Step 2.").wait_for()
    page.click("#step-back")
    explanation.get_by_text("Step 1.").wait_for()
    assert "forward pass" in explanation.inner_text()
    assert "matched" in page.inner_text("#step-suffix")
    snap(page, "step-through.png")


def test_play_walks_through_the_steps(page):
    explanation = page.locator("#step-explanation")
    page.click("#step-play")
    explanation.get_by_text("Step 3.").wait_for(timeout=60_000)
    page.click("#step-play")  # pause
    page.get_by_role("button", name="▶ Play").wait_for()


def test_run_history_replays_a_run(page):
    page.get_by_role("tab", name="Run history").click()
    first_cell = page.locator("#runs-table [data-testid=cell-0-0]")
    first_cell.wait_for()
    first_cell.click()
    plot_rendered(page, "history-speed")
    page.locator("#history-text .rest-origin").wait_for()
    snap(page, "run-history.png")


def test_race_checks_greedy_outputs(page):
    page.get_by_role("tab", name="Race").click()
    page.fill("#race-prompt textarea", PROMPT)
    page.click("#race-btn")
    page.locator("#race-verdict").get_by_text("Greedy outputs are identical").wait_for(timeout=2 * DECODE_MS)
    assert "faster" in page.inner_text("#race-verdict") or "slower" in page.inner_text("#race-verdict")
    plot_rendered(page, "race-speed")
    snap(page, "race.png")


def test_datastore_explorer(page):
    page.get_by_role("tab", name="Datastore explorer").click()
    page.fill("#explore-text textarea", "parser.add_argument(")
    page.click("#explore-btn")
    page.locator("#explore-summary").get_by_text("longest suffix").first.wait_for(timeout=DECODE_MS)
    plot_rendered(page, "explore-tree")
    snap(page, "explorer.png")


def test_uploaded_files_become_my_datastore(page, tmp_path):
    source = tmp_path / "widgets.py"
    source.write_text("def frobnicate_widgets(widget_list, factor):\n    return [w * factor for w in widget_list]\n")
    page.get_by_text("Your files → your datastore").click()
    page.locator("#uploads input[type=file]").set_input_files(str(source))
    page.locator("#uploads").get_by_text("widgets.py").first.wait_for()
    page.click("#build-btn")
    page.locator("#upload-status").get_by_text("Your datastore").wait_for(timeout=DECODE_MS)
    assert page.get_by_label("my uploaded files").is_checked()


def test_empty_prompt_shows_a_message(page):
    page.get_by_role("tab", name="Chat").click()
    page.fill("#prompt textarea", "")
    page.click("#prompt button.submit-button")
    page.locator("#notice").get_by_text("prompt is empty").wait_for(timeout=60_000)
    page.screenshot(path=str(SHOTS / "empty-prompt.png"), full_page=False)


def test_model_source_has_a_switch_and_a_legend_key(page):
    switch = page.get_by_label("Model's own predictions (recycled tokens)")
    assert switch.is_checked(), "on by default"
    assert "model's own prediction (recycled)" in page.inner_text(".origin-legend")
    assert "bonus token" in page.inner_text(".origin-legend")
    switch.uncheck()
    assert not switch.is_checked()
    switch.check()
