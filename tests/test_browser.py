"""The page in Chromium: a streamed answer, the live figures, step-through, race, explorer, errors.

The app runs the offline default model with a small store built from a few
standard-library files in a temporary folder. Screenshots are saved to
artifacts/screenshots/ for inspection. Every wait is on a condition of the page
(generous timeouts: a loaded CI machine decodes slowly), never a fixed sleep.
"""
from __future__ import annotations

import re
import sysconfig
from pathlib import Path

import pytest

from conftest import CHROMIUM, chromium_page, free_port

pytestmark = [pytest.mark.browser, pytest.mark.server, pytest.mark.usefixtures("module_cache")]

SHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
DECODE_MS = 600_000  # a whole answer on a slow, shared CPU
PROMPT = "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser("


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
    with chromium_page(url) as pg:
        yield pg


def snap(page, name: str) -> None:
    """A screenshot of the whole page at its full height (the sidebar stays in place)."""
    height = page.evaluate("() => document.documentElement.scrollHeight")
    page.set_viewport_size({"width": 1600, "height": max(1000, min(height, 4000))})
    page.screenshot(path=str(SHOTS / name))
    page.set_viewport_size({"width": 1600, "height": 1000})


def plot_rendered(page, elem_id: str) -> None:
    page.wait_for_selector(f"#{elem_id} .js-plotly-plot .main-svg", state="attached", timeout=DECODE_MS)


def test_step_through_opens_on_the_example_run_for_a_new_visitor(url):
    """A visitor with no runs opens Step through on the shipped example run at its telling step, figures drawn,
    never an empty tab."""
    with chromium_page(url) as fresh:
        fresh.get_by_role("tab", name="Step through").click()
        explanation = fresh.locator("#step-explanation")
        explanation.get_by_text(re.compile(r"Step \d+\.")).first.wait_for(timeout=60_000)
        assert "example" in fresh.locator("#run-pick input").input_value().lower()
        plot_rendered(fresh, "step-tree")
        plot_rendered(fresh, "step-mask")
        assert fresh.locator("#step-choices table tbody tr").count() >= 1


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


def test_hover_a_node_and_read_its_probabilities(page):
    """The draft tree's hover tells the model's probabilities; the node picker's bars show them too."""
    explanation = page.locator("#step-explanation")
    for _ in range(40):  # on to a step whose draft the model accepted in part
        if "agreed with the first" in explanation.inner_text():
            break
        number = int(re.search(r"Step (\d+)\.", explanation.inner_text()).group(1))
        page.click("#step-forward")
        explanation.get_by_text(f"Step {number + 1}.").wait_for()
    text = explanation.inner_text()
    assert "agreed with the first" in text and "the model gave" in text and "the draft offered" in text
    points = page.locator("#step-tree .scatterlayer .trace .points path")
    hovered = ""
    for i in range(points.count()):
        box = points.nth(i).bounding_box()
        if not box:
            continue
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        label = page.locator("#step-tree .hoverlayer .hovertext")
        try:
            label.first.wait_for(timeout=3000)
        except Exception:  # this point shows no hover label (an edge, the path line)
            continue
        hovered = label.first.text_content() or ""
        if "likeliest next tokens" in hovered:
            break
    assert "likeliest next tokens" in hovered, hovered
    assert re.search(r"\d\.\d\d", hovered), "probabilities are shown as numbers"
    plot_rendered(page, "node-probs")
    assert "the model's next token" in page.inner_text("#node-probs")
    assert "all other tokens" in page.inner_text("#node-probs")
    page.locator("#step-tree").scroll_into_view_if_needed()
    snap(page, "probabilities.png")


def test_tree_labels_neither_overlap_nor_leave_the_figure(page):
    boxes = page.evaluate("""() => {
        const svg = document.querySelector('#step-tree .main-svg').getBoundingClientRect();
        return {svg: [svg.left, svg.top, svg.right, svg.bottom],
                labels: [...document.querySelectorAll('#step-tree .textpoint text')].map(t => {
                    const r = t.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom, t.textContent];
                }).filter(b => b[2] > b[0])};
    }""")
    left, top, right, bottom = boxes["svg"]
    labels = boxes["labels"]
    assert labels, "the tree has labels"
    for x0, y0, x1, y1, text in labels:
        assert left - 1 <= x0 and x1 <= right + 1 and top - 1 <= y0 and y1 <= bottom + 1, f"{text!r} is cut"
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            overlap_x = min(a[2], b[2]) - max(a[0], b[0])
            overlap_y = min(a[3], b[3]) - max(a[1], b[1])
            assert overlap_x <= 1 or overlap_y <= 1, f"labels {a[4]!r} and {b[4]!r} overlap"
        assert "&quot;" not in a[4] and "&amp;" not in a[4] and "\ufffd" not in a[4]


def test_the_sampling_check_draws_a_node_many_times(page):
    page.click("#sample-check-btn")
    plot_rendered(page, "sample-check")
    page.locator("#sample-check").get_by_text("draws after node").wait_for(timeout=60_000)
    text = page.inner_text("#sample-check")
    assert "committed by REST's rule (exact)" in text and "3-sigma band" in text and "what is committed" in text
    page.locator("#sample-check").scroll_into_view_if_needed()
    snap(page, "sampling-check.png")


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
    verdict = page.inner_text("#race-verdict")
    assert "faster" in verdict or "slower" in verdict
    assert "Why this speed" in verdict and "tokens per pass" in verdict and "cost per pass" in verdict
    assert "to break even a pass must bring" in verdict
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


def current_step(page) -> int:
    return int(re.search(r"Step (\d+)\.", page.inner_text("#step-explanation")).group(1))


def example_steps() -> list[dict]:
    from rest_core.app.replay import EXAMPLE_RUN_ID, example_run

    return example_run().load_steps(EXAMPLE_RUN_ID)


def test_the_tour_walks_the_example_run(page):
    """Every stop: its caption in the card, the part of the page it names outlined; keys and buttons move on."""
    from rest_core.app.tour import STOPS

    page.click("#tour-start")
    card = page.locator("#tour-card .tour-card")
    for i, stop in enumerate(STOPS):
        card.get_by_text(f"{i + 1} / {len(STOPS)}").wait_for()
        assert stop.title in card.inner_text()
        page.wait_for_selector(f"#{stop.target}.tour-target")
        assert page.locator(".tour-target").count() == 1, "one part of the page is highlighted at a time"
        if i == 0:
            assert "Example run" in page.input_value("#run-pick input")
            page.locator("#step-explanation").get_by_text("Step ").first.wait_for()
        if stop.target == "step-tree":
            plot_rendered(page, "step-tree")
            page.wait_for_timeout(600)  # the smooth scroll settles before the picture
            page.screenshot(path=str(SHOTS / "tour.png"), clip={"x": 360, "y": 0, "width": 1240, "height": 1000})
        if i == 1:  # back and forth: the Back button, then the arrow key a clicker sends
            page.click("#tour-back")
            card.get_by_text(f"1 / {len(STOPS)}").wait_for()
            page.keyboard.press("ArrowRight")
            card.get_by_text(f"2 / {len(STOPS)}").wait_for()
        if i < len(STOPS) - 1:
            page.click("#tour-next") if i % 2 else page.keyboard.press("ArrowRight")
    assert page.inner_text("#tour-next") == "Finish"
    page.click("#tour-next")
    page.wait_for_selector("#tour-card .tour-card", state="detached")
    page.wait_for_function("() => !document.querySelector('.tour-target')")


def test_arrow_keys_walk_the_steps(page):
    explanation = page.locator("#step-explanation")
    page.locator("#step-explanation").click()  # the focus off any text box
    start = current_step(page)
    page.keyboard.press("ArrowRight")
    explanation.get_by_text(f"Step {start + 1}.").wait_for()
    page.keyboard.press("ArrowLeft")
    explanation.get_by_text(f"Step {start}.").wait_for()
    page.keyboard.press("End")
    explanation.get_by_text(f"Step {len(example_steps()) - 1}.").wait_for()
    page.keyboard.press("Home")
    explanation.get_by_text("Step 0.").wait_for()
    page.locator("#whatif-budget input[type=number]").focus()
    page.keyboard.press("ArrowRight")  # a number box keeps its keys: the step stays
    page.wait_for_timeout(500)
    assert current_step(page) == 0
    for _ in range(3):  # quick clicks all count: the slider moves in the page, not after a round trip
        page.click("#step-forward")
    explanation.get_by_text("Step 3.").wait_for()
    page.click("#step-back")
    page.click("#step-back")
    explanation.get_by_text("Step 1.").wait_for()
    last = len(example_steps()) - 1
    page.keyboard.press("End")
    explanation.get_by_text(f"Step {last}.").wait_for()
    page.click("#step-forward")  # held at the last step
    page.wait_for_timeout(500)
    assert current_step(page) == last
    assert page.locator("#step-slider input[type=number]").input_value() == str(last)


def test_what_if_runs_a_step_again_beside_what_happened(page):
    """On the example run (the run's model, the page's small store): a larger fixed budget, both sides drawn."""
    from rest_core.app.tour import tour_step

    k = tour_step(example_steps())
    page.locator("#step-slider input[type=number]").fill(str(k))
    page.locator("#step-slider input[type=number]").press("Enter")
    page.locator("#step-explanation").get_by_text(f"Step {k}.").wait_for()
    recorded = example_steps()[k]
    page.locator("#whatif-budget-mode").get_by_text("fixed", exact=True).click()
    budget = page.locator("#whatif-budget input[type=number]")
    budget.fill("32")
    budget.press("Tab")
    page.click("#whatif-btn")
    summary = page.locator("#whatif-summary")
    summary.get_by_text(f"What if, at step {k}").wait_for(timeout=DECODE_MS)
    plot_rendered(page, "whatif-recorded")
    plot_rendered(page, "whatif-tree")
    rows = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#whatif-summary tr')]
        .map(r => [...r.children].map(c => c.textContent.trim())).filter(c => c[0]).map(c => [c[0], c.slice(1)]))""")
    then, now = map(int, rows["drafted tokens"])
    assert then == recorded["draft_size"] and then < now <= 32, rows
    accepted_then, accepted_now = map(int, rows["accepted drafts"])
    assert accepted_then == recorded["accepted_len"] and accepted_now >= 0
    assert int(rows["tokens per pass"][0]) == len(recorded["new_tokens"])
    assert f"Step {k}: {then} draft tokens, {accepted_then} accepted" in page.inner_text("#whatif-recorded")
    assert f"Step {k}: {now} draft tokens, {accepted_now} accepted" in page.inner_text("#whatif-tree")
    assert "accepted path" in page.inner_text("#whatif-recorded-path")
    assert "accepted path" in page.inner_text("#whatif-path")
    assert "The what-if commits" in summary.inner_text()
    page.locator("#whatif").scroll_into_view_if_needed()
    snap(page, "whatif.png")
    page.locator("#whatif").screenshot(path=str(SHOTS / "whatif-panel.png"))
