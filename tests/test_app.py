"""The page: its handlers driven directly, then the launched app called through its API.

Most tests use the tiny random model from conftest (completion mode, no built-in
store) so they run in seconds; tests marked `model` use the offline default model
with a small store built in a temporary folder (never the big default store).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import plotly.graph_objects as go
import pytest

from datastores import DatastoreError, RecycleStore
from rest_base.files import cache_dir
from rest_core import app as sup
from rest_core.app import engine as engine_module
from rest_core.traces import figures
from rest_core.traces.recorder import TraceRecorder

from conftest import free_port, last_values, make_tiny_lm, no_chooser, private_cache

pytestmark = pytest.mark.usefixtures("module_cache")

PROMPT_IDS = [5, 6, 7, 8, 9]
PROMPT = " ".join(f"t{t}" for t in PROMPT_IDS)
TINY = sup.Settings(model="tiny", mode="completion", static=sup.BUILT_IN, max_new_tokens=24, budget_mode="fixed",
                    budget=8)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_lm(max_positions=256)


@pytest.fixture(scope="module")
def tiny_store(tiny, tmp_path_factory):
    """A static store holding the model's own greedy continuation of PROMPT among noise (so drafts hit)."""
    import numpy as np

    from datastores import build_from_token_documents
    from rest_core.decode import DecodeConfig, plain_generate

    plain = plain_generate(tiny, PROMPT_IDS, DecodeConfig(max_new_tokens=40, stop_at_eos=False))
    noise = np.random.default_rng(0).integers(1, 60_000, size=300).tolist()
    docs = [noise[:150] + PROMPT_IDS + plain.tokens + noise[150:], PROMPT_IDS[-2:] + noise[:10]]
    return build_from_token_documents(tmp_path_factory.mktemp("store") / "tiny-store", docs)


def tiny_engine(tiny, store, traces) -> sup.Engine:
    engine = sup.Engine(lm_factory=lambda name: tiny, store_factory=lambda tok: store,
                        cost_factory=no_chooser, recorder=TraceRecorder(traces))
    assert engine.start_static(engine.model(TINY.model)).finished.wait(30)
    return engine


@pytest.fixture
def engine(tiny, tiny_store, tmp_path):
    return tiny_engine(tiny, tiny_store, tmp_path / "traces.sqlite")


@pytest.fixture
def session(tmp_path, monkeypatch):
    monkeypatch.setenv("REST_LAB_CACHE", private_cache(tmp_path / "cache"))  # visitors' folders
    return sup.Session(id="visitor-a")


def run_turn(engine, session, settings, text):
    return list(sup.chat_turn(engine, session, settings, text))


# ---------------------------------------------------------------- handlers, directly

def test_chat_turn_streams_the_answer_and_figures_from_stored_steps(engine, session, tiny):
    views = run_turn(engine, session, TINY, PROMPT)
    final = views[-1]
    assert final.done and final.run_id is not None and not final.notice
    streamed = [v for v in views if v.tree is not None]
    assert streamed, "the figures are drawn while decoding"
    assert all(isinstance(f, go.Figure) for v in streamed for f in (v.tree, v.mask, v.speed))
    steps = engine.recorder.load_steps(final.run_id)
    run = engine.recorder.get_run(final.run_id)
    assert run["status"] == "done" and run["new_tokens"] == sum(len(s["new_tokens"]) for s in steps)
    # the tinted answer is exactly the recorded tokens, and REST drafted some of them
    answer = final.chat[-1]["content"]
    assert answer.startswith('<div class="rest-answer">')
    assert answer.count("<span") == run["new_tokens"]
    assert sum(s["accepted_len"] for s in steps) > 0
    assert 'data-state="done"' in final.metrics and "tokens / pass" in final.metrics
    # the final figures show a stored step
    shown = final.tree.layout.title.text
    assert shown.startswith(f"Step {sup.best_step(steps)}:")
    assert session.run_ids == [final.run_id]


def test_greedy_race_reports_identical_outputs_and_records_the_comparison(engine, session):
    views = list(sup.race(engine, session, TINY, PROMPT))
    final = views[-1]
    assert final.done and final.run_id is not None, final.notice
    assert "Greedy outputs are identical" in final.metrics
    assert "×" in final.metrics and "in turn" in final.metrics
    run = engine.recorder.get_run(final.run_id)
    assert run["identical"] == 1 and run["speedup"] > 0 and run["plain_wall_s"] > 0
    # why this speed: tokens per pass ÷ cost per pass gives back the measured speedup (same tokens both sides)
    why = re.search(r"= ([\d.]+) ÷ ([\d.]+) = <b>([\d.]+)×", final.metrics)
    assert why and "Why this speed" in final.metrics
    assert float(why.group(3)) == pytest.approx(run["speedup"], abs=0.011)
    assert engine.recorder.load_steps(final.run_id), "the race's REST run can be stepped through"
    assert any(v.plain for v in views[:-1]) and any(v.rest for v in views[:-1]), "both sides stream"


@pytest.mark.parametrize("text, expected", [
    ("", "prompt is empty"),
    ("   \n ", "prompt is empty"),
    (" ".join(["t5"] * 300), "context holds 256"),
])
def test_bad_prompts_give_a_clear_message(engine, session, text, expected):
    views = run_turn(engine, session, TINY, text)
    assert views[-1].done and expected in views[-1].notice and views[-1].warning
    assert "Traceback" not in views[-1].notice


def test_chat_mode_without_a_chat_template_says_so(engine, session):
    views = run_turn(engine, session, replace(TINY, mode="chat"), PROMPT)
    assert "no chat template" in views[-1].notice


def test_unknown_model_offline_is_a_clear_message(tmp_path, session, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    engine = sup.Engine(store_factory=lambda tok: None, recorder=TraceRecorder(tmp_path / "t.sqlite"))
    views = run_turn(engine, session, replace(TINY, model="no-such-org/no-such-model-xyz"), "hello")
    assert "Could not load model 'no-such-org/no-such-model-xyz'" in views[-1].notice
    assert "no-such-org/no-such-model-xyz" in engine.status()


def test_stopping_a_decode_ends_it_and_marks_the_run(engine, session, monkeypatch):
    import time

    from rest_core.app import pacing

    monkeypatch.setattr(pacing, "FIGURE_INTERVAL_S", 0.0)  # live figures at once: the decode is stopped mid-way
    turn = sup.chat_turn(engine, session, replace(TINY, max_new_tokens=200), PROMPT)
    for view in turn:
        if view.tree is not None:
            break
    turn.close()  # what the page does when the visitor presses Stop or leaves
    run_id = session.run_ids[-1]
    deadline = time.time() + 60
    while engine.recorder.get_run(run_id)["status"] == "running" and time.time() < deadline:
        time.sleep(0.05)
    run = engine.recorder.get_run(run_id)
    assert run["status"] == "stopped" and run["new_tokens"] < 200
    slot = engine.model(TINY.model)
    assert slot.lock.acquire(timeout=30), "the model is free again"
    slot.lock.release()


def test_status_tells_while_the_built_in_store_is_built(tiny, tmp_path, session):
    release = threading.Event()

    def slow_store(tokenizer):
        release.wait(30)
        return None

    engine = sup.Engine(lm_factory=lambda name: tiny, store_factory=slow_store, cost_factory=no_chooser,
                        recorder=TraceRecorder(tmp_path / "t.sqlite"))
    assert "loads on first use" in engine.status()
    views = run_turn(engine, session, replace(TINY, max_new_tokens=4), PROMPT)
    assert "still being built" in views[1].notice and views[-1].done and not views[-1].notice
    assert "building the built-in datastore" in engine.status() and not engine.ready()
    release.set()
    assert engine.model(TINY.model).static.finished.wait(30)
    assert "no built-in datastore" in engine.status() and engine.ready()


def test_bad_settings_are_refused_clearly(engine, session):
    views = run_turn(engine, session, replace(TINY, n_min=9, n_max=4), PROMPT)
    assert "n_min" in views[-1].notice


def test_uploaded_store_needs_a_build_first(engine, session):
    views = run_turn(engine, session, replace(TINY, static=sup.UPLOADED), PROMPT)
    assert "No uploaded datastore yet" in views[-1].notice


def test_step_view_explains_a_recorded_step(engine, session):
    run_id = run_turn(engine, session, TINY, PROMPT)[-1].run_id
    run, steps = sup.open_run(engine.recorder, session, run_id)
    k = sup.best_step(steps)
    view = sup.step_view(engine.recorder, run, k)
    text = view["explanation"]
    assert text.startswith(f"**Step {k}.**") and "static store matched the last" in text
    assert "one forward pass" in text and "bonus token" in text
    assert view["branches"] and view["choices"] and "accepted path" in view["path"]
    assert isinstance(view["tree"], go.Figure) and isinstance(view["mask"], go.Figure)
    assert "static" in view["suffix"]
    accepted_rows = [r for r in view["choices"] if r[-1] == "✓"]
    assert len(accepted_rows) == steps[k]["accepted_len"] + 1  # the root and every accepted draft


def test_answer_html_stays_on_one_line():
    """The chat renders Markdown: a raw line break (then four spaces) would turn the HTML into a code block."""
    steps = [{"step": 0, "new_tokens": [1, 2, 3], "new_texts": ["def f():\n", "    return", " 1<2"], "accepted_len": 2,
              "accepted_sources": ["static", "request"]}]
    out = figures.origin_spans(steps, hide=frozenset({"<|im_end|>"}))
    assert "\n" not in out and out.count("&#10;") == 1 and "1&lt;2" in out and out.count("<span") == 3
    assert "\n" not in sup.user_bubble("a\n\n    b")["content"]


def test_explanation_of_a_step_with_no_draft():
    step = {"step": 3, "draft_size": 0, "matched_len": {"request": 0}, "branches": [], "new_tokens": [7],
            "bonus_text": "x", "accepted_sources": [], "query_text": "ab",
            "nodes": [{"node": 0, "parent": -1, "depth": 0, "token_text": "b", "accepted": 1, "model_choice_text": "x",
                       "chosen": None}]}
    text = sup.explain_step(step, {"settings": {}})
    assert "request store found no match" in text and "ordinary one" in text and "committed 1 token " in text


def test_runs_stay_their_owners(engine, session):
    mine = run_turn(engine, session, TINY, PROMPT)[-1].run_id
    other = sup.Session(id="visitor-b")
    theirs = run_turn(engine, other, TINY, PROMPT)[-1].run_id
    assert [r["id"] for r in sup.visible_runs(engine.recorder, session)] == [mine]
    assert [r["id"] for r in sup.visible_runs(engine.recorder, other)] == [theirs]
    with pytest.raises(KeyError):
        sup.open_run(engine.recorder, session, theirs)
    # a run recorded outside the page (the command line) is shown to everyone
    cli = engine.recorder.start_run(model="m", tokenizer_name="t", stores=[], settings={}, prompt="p",
                                    prompt_tokens=3)
    assert cli in {r["id"] for r in sup.visible_runs(engine.recorder, session)}


def test_history_store_drafts_from_the_visitors_own_answers(engine, session):
    settings = replace(TINY, static=sup.NO_STATIC, history_store=True, request_store=False)
    first = run_turn(engine, session, settings, "t11 t12 t13")[-1]
    again = run_turn(engine, session, settings, "t11 t12 t13")[-1]
    steps = engine.recorder.load_steps(again.run_id)
    assert engine.recorder.get_run(first.run_id)["output"] == engine.recorder.get_run(again.run_id)["output"]
    assert any("history" in (s["accepted_sources"] or []) for s in steps)


# ---------------------------------------------------------------- the model's own predictions (source "model")

MODEL_ONLY = replace(TINY, static=sup.NO_STATIC, request_store=False, history_store=False, model_drafts=True)


def node_sources(recorder, run_id) -> set:
    return {n["source"] for k in range(recorder.step_count(run_id)) for n in recorder.load_step(run_id, k)["nodes"]}


def recycle_files():
    folder = cache_dir() / "recycle"
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_model_source_drafts_and_greedy_output_stays_plain(engine, session, tiny):
    from rest_core.decode import DecodeConfig, plain_generate

    first = run_turn(engine, session, MODEL_ONLY, PROMPT)[-1]  # the table learns what follows each step's root...
    final = run_turn(engine, session, MODEL_ONLY, PROMPT)[-1]  # ... and drafts it when those tokens come again
    assert final.done and not final.notice, final.notice
    rec = engine.recorder
    assert rec.get_run(first.run_id)["output"] == rec.get_run(final.run_id)["output"]
    run, steps = sup.open_run(rec, session, final.run_id)
    assert "model" in run["stores"] and run["settings"]["model_drafts"] is True
    assert "model" in node_sources(rec, final.run_id), "some step drafted from the model's own predictions"
    plain = plain_generate(tiny, PROMPT_IDS, DecodeConfig(max_new_tokens=TINY.max_new_tokens))
    assert [t for s in steps for t in s["new_tokens"]] == plain.tokens, "greedy output identical to plain"
    accepted = [s for s in steps if "model" in (s["accepted_sources"] or [])]
    assert accepted, "the second turn repeats the first: its recycled drafts are accepted"
    assert f'class="tok model" style="background:{figures.ORIGIN_STYLES["model"][0]}' in final.chat[-1]["content"]
    text = sup.step_view(rec, run, accepted[0]["step"])["explanation"]
    assert "the model's own earlier prediction after the same tokens (recycled)" in text
    assert accepted[0]["matched_len"]["model"] == 2, "the repeated turn's tokens were seen as pairs before"
    assert "model's own earlier predictions after the last two tokens (recycled) offered" in text
    assert recycle_files() == [], "a visitor's table is never written"


def test_model_source_off_drafts_nothing_from_the_model(engine, session):
    final = run_turn(engine, session, replace(MODEL_ONLY, model_drafts=False), PROMPT)[-1]
    run = engine.recorder.get_run(final.run_id)
    assert final.done and "model" not in run["stores"] and run["settings"]["model_drafts"] is False
    assert node_sources(engine.recorder, final.run_id) == {""}, "no store: every step is a plain one"
    assert session.recycled == {}
    with pytest.raises(DatastoreError, match="No store is switched on"):
        sup.explore(engine, session, replace(MODEL_ONLY, model_drafts=False), "t5 t6 t7", 8)


def test_visitor_tables_start_from_the_persisted_one_and_are_never_saved(engine, session, tiny, monkeypatch):
    persisted = cache_dir() / "recycle" / "tiny-random.npz"
    learned = RecycleStore(tiny.vocab_size, path=persisted)
    learned.table[3] = list(range(10, 18))  # what command-line runs learned after token 3
    learned.save()
    before = persisted.read_bytes()
    monkeypatch.setattr("rest_core.app.slots.default_recycle_path", lambda name, tok: persisted)
    slot = engine.model("tiny")
    mine = session.recycle_store(slot)
    assert mine.path is None and list(mine.table[3]) == list(range(10, 18))
    run_turn(engine, session, MODEL_ONLY, PROMPT)
    run_turn(engine, session, MODEL_ONLY, "t11 t12 t13")
    assert session.recycle_store(slot) is mine and mine.known > learned.known, "it learned from this visitor"
    assert persisted.read_bytes() == before and recycle_files() == [persisted], "nothing written to disk"
    other = sup.Session(id="visitor-b").recycle_store(slot)
    assert (other.table == learned.table).all(), "another visitor starts from the persisted table, not from mine"
    persisted.write_bytes(b"not a table")  # an unreadable table: a server that reads it starts empty
    fresh = sup.Engine(lm_factory=lambda name: tiny, store_factory=lambda tok: None, cost_factory=no_chooser,
                       recorder=engine.recorder)
    assert sup.Session(id="visitor-c").recycle_store(fresh.model("tiny")).known == 0


def test_explorer_shows_the_model_source(engine, session):
    run_turn(engine, session, MODEL_ONLY, PROMPT)
    out = sup.explore(engine, session, MODEL_ONLY, PROMPT, 8)
    assert "**model** (its own earlier predictions):" in out["summary"] and "recycled path" in out["summary"]
    assert any(row[0] == "model" for row in out["continuations"])
    names = {d.name for d in out["tree"].data}
    assert "from the model's own earlier predictions (recycled)" in names
    fresh = sup.explore(engine, sup.Session(id="visitor-b"), MODEL_ONLY, PROMPT, 8)
    assert "nothing recycled yet" in fresh["summary"]


def test_the_live_page_reads_only_new_steps(engine, session, monkeypatch):
    read = []  # the step numbers each read returned
    load_steps = engine.recorder.load_steps

    def counting(run_id, since_step=0):
        rows = load_steps(run_id, since_step)
        read.extend(r["step"] for r in rows)
        return rows

    monkeypatch.setattr(engine.recorder, "load_steps", counting)
    final = run_turn(engine, session, TINY, PROMPT)[-1]
    assert final.done
    assert read == [s["step"] for s in load_steps(final.run_id)], "every step read once, in order"


def test_stream_delivers_what_was_emitted_before_an_error():
    inline = SimpleNamespace(workers=SimpleNamespace(submit=lambda fn: fn()))  # all is emitted before any read

    def work(emit):
        for k in range(3):
            emit(k)
        raise ValueError("broken")

    seen = []
    with pytest.raises(ValueError, match="broken"):
        for batch in sup.stream_in_thread(inline, work):
            seen += batch
    assert seen == [0, 1, 2]


def test_race_closes_its_streams(engine, session, monkeypatch):
    from rest_core.app import live

    class Spy:
        def __init__(self, stream):
            self.stream, self.closed = stream, False

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.stream)

        def close(self):
            self.closed = True
            self.stream.close()

    opened = []
    real = live.stream_in_thread
    monkeypatch.setattr(live, "stream_in_thread", lambda *a, **k: opened.append(Spy(real(*a, **k))) or opened[-1])
    assert list(sup.race(engine, session, TINY, PROMPT))[-1].done
    assert len(opened) == 1 and opened[0].closed, "the race's stream is closed when done"
    opened.clear()
    stopped = sup.race(engine, session, replace(TINY, max_new_tokens=200), PROMPT)
    for _ in stopped:
        if opened:
            break
    stopped.close()  # the visitor pressed Stop during the race
    assert len(opened) == 1 and opened[0].closed
    slot = engine.model(TINY.model)
    assert slot.lock.acquire(timeout=30), "the model is free again"
    slot.lock.release()


def test_the_race_runs_both_decodes_in_turn_and_times_each_by_its_own_steps():
    """in_turn: the side behind in the answer steps next (REST first on a tie), so the two go through the
    answer side by side; each side's time is what its own steps took, not the wall time both shared."""
    from rest_core.app.decoding import in_turn
    from rest_core.decode import DecodeResult

    order = []

    def side(name, chunks, step_s):
        for chunk in chunks:
            time.sleep(step_s)
            order.append(name)
            yield chunk
        return DecodeResult([1], [], "", steps=len(chunks), wall_s=99.0, prefill_s=0.0, stop_reason="length")

    class Step:  # what REST's stream yields: a trace with the step's new tokens
        def __init__(self, tokens):
            self.new_tokens = tokens

    emitted = []
    t0 = time.perf_counter()
    plain, rest, traces = in_turn(side("plain", [7] * 6, 0.01), side("rest", [Step([7, 7, 7]), Step([7, 7, 7])], 0.03),
                                  emitted.append)
    shared = time.perf_counter() - t0
    assert order == ["rest", "plain", "plain", "plain", "rest", "plain", "plain", "plain"]
    assert [s for s, _ in emitted] == order and sum(len(t) for s, t in emitted if s == "rest") == 6
    assert len(traces) == 2 and plain.steps == 6 and rest.steps == 2
    assert plain.wall_s >= 0.06 and rest.wall_s >= 0.06  # each side's steps ...
    assert plain.wall_s + rest.wall_s <= shared  # ... and only its own: together they fill the time both shared


@pytest.mark.slow
def test_importing_the_app_touches_no_cache(tmp_path):
    cache = tmp_path / "cache"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "REST_LAB_CACHE": str(cache), "HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", "import app; assert app.demo.engine"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not cache.exists() and not (tmp_path / "home" / ".cache" / "rest-lab").exists()


# ---------------------------------------------------------------- uploads

def test_uploads_are_checked(session, tmp_path):
    with pytest.raises(sup.UploadError, match="No files"):
        sup.save_uploads(session, [])
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(sup.UploadError, match="usable text"):
        sup.save_uploads(session, [str(binary)])
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: 21 MB on paper, nothing on disk
        f.truncate(21 * 2**20)
    with pytest.raises(sup.UploadError, match="at most 20 MB"):
        sup.save_uploads(session, [str(big)])
    assert not session.folder.exists()


def test_uploads_land_in_the_visitors_folder_only(session, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "..evil name.py").write_text("print('hi')\n")
    (src / "b.txt").write_text("hello world\n")
    docs = sup.save_uploads(session, [str(src / "..evil name.py"), str(src / "b.txt")])
    saved = sorted(p.name for p in session.files_dir.iterdir())
    assert saved == sorted(name for name, _ in docs) and len(saved) == 2
    assert all(p.resolve().parent == session.files_dir.resolve() for p in session.files_dir.iterdir())
    assert {text for _, text in docs} == {"print('hi')\n", "hello world\n"}
    with pytest.raises(sup.UploadError, match="not an uploaded file"):
        sup.save_uploads(session, [str(src / "b.txt")], upload_root=tmp_path / "uploads")
    sup.discard_session(session)
    assert not session.folder.exists()


@pytest.mark.model
def test_upload_store_is_built_and_drafts(tmp_path, session):
    from rest_core.model import load_model

    engine = sup.Engine(lm_factory=lambda name: load_model(), store_factory=lambda tok: None,
                        cost_factory=no_chooser, recorder=TraceRecorder(tmp_path / "t.sqlite"))
    code = "def frobnicate_widgets(widget_list, factor):\n    return [w * factor for w in widget_list]\n"
    (tmp_path / "mine.py").write_text(code * 3)
    docs = sup.save_uploads(session, [str(tmp_path / "mine.py")])
    tokenizer = engine.model(None).lm.tokenizer
    store = sup.build_upload_store(session, docs, tokenizer, engine.canonical(None), progress=False)
    assert store.n_tokens > 20 and "Your datastore" in sup.upload_summary(session, store)
    out = sup.explore(engine, session, sup.Settings(static=sup.UPLOADED, request_store=False),
                      "def frobnicate_widgets(widget", 16)
    assert "**static**: longest suffix" in out["summary"] and out["continuations"]
    assert any("list" in row[1] for row in out["continuations"])
    assert isinstance(out["tree"], go.Figure) and len(out["tree"].data) >= 2


# ---------------------------------------------------------------- the launched app, through its API

@pytest.fixture(scope="module")
def served(tiny, tiny_store, tmp_path_factory):
    from gradio_client import Client

    import app

    traces = tmp_path_factory.mktemp("served") / "traces.sqlite"
    demo = app.build_demo(lm_factory=lambda name: tiny, store_factory=lambda tok: tiny_store,
                          cost_factory=no_chooser, trace_db=str(traces), preload=False, defaults=TINY)
    demo.queue()
    _, url, _ = app.launch(demo, prevent_thread_lock=True, server_port=free_port(), quiet=True)
    yield demo, url, Client
    demo.close()


def settings_args(settings: sup.Settings) -> list:
    return [getattr(settings, f) for f in sup.Settings.__dataclass_fields__]


def is_plot(value) -> bool:
    return isinstance(value, dict) and value.get("type") == "plotly" and "draft" in str(value.get("plot", ""))


@pytest.mark.slow
def test_module_builds_the_page():
    import gradio as gr

    import app

    assert isinstance(app.demo, gr.Blocks) and callable(app.build_demo)


def test_api_chat_streams_figures(served, monkeypatch):
    from rest_core.app import pacing

    monkeypatch.setattr(pacing, "FIGURE_INTERVAL_S", 0.0)  # the tiny decode is over before the page's interval
    demo, url, Client = served
    client = Client(url, verbose=False)
    job = client.submit(PROMPT, *settings_args(TINY), api_name="/chat")
    outputs = [list(o) for o in job]
    assert len(outputs) >= 3, "the answer streams"
    chat, tree, mask, speed, metrics, notice = last_values(outputs)[:6]
    assert chat[-1]["role"] == "assistant" and "rest-answer" in str(chat[-1]["content"])
    assert is_plot(tree) and isinstance(mask, dict) and mask.get("type") == "plotly"
    assert isinstance(speed, dict) and speed.get("type") == "plotly"
    assert 'data-state="done"' in metrics
    streamed_plots = [o for o in outputs[:-1] if isinstance(o[1], dict) and o[1].get("type") == "plotly"]
    assert streamed_plots, "figures update while decoding, not only at the end"


def test_api_race_reports_identical_greedy_outputs(served):
    _, url, Client = served
    client = Client(url, verbose=False)
    plain, rest, verdict, speed, notice = last_values([list(o) for o in client.submit(
        PROMPT, *settings_args(TINY), api_name="/race")])[:5]
    assert "Greedy outputs are identical" in verdict
    assert plain and "rest-answer" in rest
    assert isinstance(speed, dict) and speed.get("type") == "plotly"


@pytest.mark.parametrize("text, settings, expected", [
    ("", TINY, "prompt is empty"),
    (" ".join(["t5"] * 300), TINY, "context holds 256"),
])
def test_api_bad_input_shows_a_message(served, text, settings, expected):
    _, url, Client = served
    client = Client(url, verbose=False)
    values = last_values([list(o) for o in client.submit(text, *settings_args(settings), api_name="/chat")])
    notice = values[5]
    assert expected in str(notice) and "Traceback" not in str(notice)


def test_api_bad_upload_shows_a_message(served, tmp_path):
    from gradio_client import handle_file

    _, url, Client = served
    client = Client(url, verbose=False)
    blob = tmp_path / "blob.txt"  # a text name, binary content
    blob.write_bytes(b"\x00" * 1000)
    status, _, notice = client.predict([handle_file(str(blob))], "tiny", api_name="/build_datastore")
    assert "usable text" in status and "usable text" in str(notice)
    exe = tmp_path / "tool.exe"  # a type the upload refuses before the page sees it
    exe.write_bytes(b"MZ" + b"\x00" * 100)
    with pytest.raises(Exception, match="Invalid file type"):
        client.predict([handle_file(str(exe))], "tiny", api_name="/build_datastore")


def test_two_users_share_the_model_one_decode_at_a_time(served):
    demo, url, Client = served
    a, b = Client(url, verbose=False), Client(url, verbose=False)
    jobs = [c.submit(PROMPT, *settings_args(TINY), api_name="/chat") for c in (a, b)]
    finals = [last_values([list(o) for o in job]) for job in jobs]
    assert all('data-state="done"' in f[4] for f in finals)
    rec = demo.engine.recorder
    runs_a, runs_b = (c.predict(api_name="/runs") for c in (a, b))
    ids_a = {row[0] for row in runs_a["data"]}
    ids_b = {row[0] for row in runs_b["data"]}
    assert len(ids_a) == len(ids_b) == 1 and not ids_a & ids_b, "each user sees their own run only"
    first, second = sorted((rec.get_run(i) for i in ids_a | ids_b), key=lambda r: r["started_at"])
    assert second["started_at"] >= first["finished_at"], "the second decode waited for the first"
    assert first["output"] == second["output"]


def test_api_step_and_explore(served):
    _, url, Client = served
    client = Client(url, verbose=False)
    final = last_values([list(o) for o in client.submit(PROMPT, *settings_args(TINY), api_name="/chat")])
    run_id = client.predict(api_name="/runs")["data"][0][0]
    explanation, suffix, branches, choices, path, tree, mask, bars, node = client.predict(run_id, 0, api_name="/step")
    assert explanation.startswith("**Step 0.**") and is_plot(tree) and "the model's next token" in bars["plot"]
    assert "the model gave" in explanation and node["value"] == [r[0] for r in choices["data"] if r[-1] == "✓"][-1]
    assert "After node 0 " in client.predict(run_id, 0, 0, api_name="/node")["plot"]
    summary, *_ = client.predict("t1 t5 t6 t7", 8, *settings_args(TINY), api_name="/explore")
    assert "**static**: longest suffix 3 tokens" in summary and "draft tree: **8** tokens" in summary
    assert final[0][-1]["role"] == "assistant"


# ---------------------------------------------------------------- the general-text store (source "answers")

def answers_engine(tiny, tiny_store, traces, factory) -> sup.Engine:
    engine = sup.Engine(lm_factory=lambda name: tiny, store_factory=lambda tok: None,
                        cost_factory=no_chooser, recorder=TraceRecorder(traces), answers_factory=factory)
    assert engine.start_static(engine.model(TINY.model)).finished.wait(30)
    return engine


def test_the_general_text_store_drafts_when_the_prompt_format_asks(tiny, tiny_store, tmp_path, session):
    from datastores import TokenDatastore

    answers = TokenDatastore.open(tiny_store.path, name="answers-tiny", source="answers")
    engine = answers_engine(tiny, tiny_store, tmp_path / "t.sqlite", lambda slot, pause, st: answers)
    assert engine.start_answers(engine.model(TINY.model)).finished.wait(30)
    assert "general-text store ready" in engine.status()
    only = replace(TINY, static=sup.NO_STATIC, request_store=False, model_drafts=False, history_store=False)
    # completion (code continued as is) leaves it out by default; "always" drafts from it in any format
    plain_run = run_turn(engine, session, only, PROMPT)[-1]
    assert not any(label.startswith("answers") for label in engine.recorder.get_run(plain_run.run_id)["stores"])
    assert replace(only, mode="chat").use_answers
    assert not replace(only, answers=sup.ANSWERS_NEVER, mode="chat").use_answers
    final = run_turn(engine, session, replace(only, answers=sup.ANSWERS_ALWAYS), PROMPT)[-1]
    run, steps = sup.open_run(engine.recorder, session, final.run_id)
    assert run["stores"] == ["answers:answers-tiny"] and run["settings"]["answers"] is True
    assert any("answers" in (s["accepted_sources"] or []) for s in steps)
    assert engine.recorder.get_run(final.run_id)["output"] == engine.recorder.get_run(plain_run.run_id)["output"]


def test_the_general_text_store_build_steps_aside_while_a_visitor_decodes(tiny, tiny_store, tmp_path, session):
    started, release, waited = threading.Event(), threading.Event(), []

    def factory(slot, pause, st):
        started.set()
        release.wait(30)
        t0 = time.time()
        pause()  # between two tokens of the build
        waited.append(time.time() - t0)
        return None

    engine = answers_engine(tiny, tiny_store, tmp_path / "t.sqlite", factory)
    slot = engine.model(TINY.model)
    st = engine.start_answers(slot)
    assert started.wait(30) and st.state == "building"
    assert "general-text store is being built" in engine.status() and not engine.ready()
    with slot.lock:  # a decode holds the model
        release.set()
        time.sleep(0.4)
        assert not st.finished.is_set(), "the build waits while the model is busy"
    assert st.finished.wait(30) and waited[0] >= 0.3 and st.state == "off"


def test_a_visitor_decodes_while_the_dense_store_is_built(tiny, tiny_store, tmp_path, session):
    """The dense build holds the model one chunk of documents at a time: a decode asked for in the middle of the
    build runs between two chunks (not after the build) and decodes what it decodes once the build is done."""
    from contextlib import contextmanager

    from datastores import TokenDatastore, build_dense_store
    from rest_core.hidden import layer_count, model_fingerprint, state_reader

    answers = TokenDatastore.open(tiny_store.path, name="answers-tiny", source="answers")
    docs = [(list(range(100 + i, 160 + i)), 5) for i in range(24)]  # 60 tokens each: a chunk each
    read, decoded = [], threading.Event()

    def factory(slot, turn):
        @contextmanager
        def chunk():  # the engine's turn around one chunk, as slow as a chunk of the real model until the decode
            with turn():
                read.append(decoded.is_set())
                time.sleep(0 if decoded.is_set() else 0.25)
                yield
        layer = layer_count(slot.lm.model)
        return build_dense_store(tmp_path / "dense", docs, state_reader(slot.lm.model, layer, turn=chunk), None,
                                 {"name": "tiny", "fingerprint": model_fingerprint(slot.lm.model)}, layer, 16,
                                 progress=False, chunk_tokens=60)

    engine = sup.Engine(lm_factory=lambda name: tiny, store_factory=lambda tok: None, cost_factory=no_chooser,
                        recorder=TraceRecorder(tmp_path / "t.sqlite"), answers_factory=lambda slot, pause, st: answers,
                        dense_factory=factory)
    slot = engine.model(TINY.model)
    assert engine.start_static(slot).finished.wait(30)
    engine.start_answers(slot)
    deadline = time.time() + 30
    while not read and time.time() < deadline:
        time.sleep(0.01)
    assert read and slot.dense.state == "building" and "dense store is being built" in engine.status()
    settings = replace(TINY, static=sup.NO_STATIC, request_store=False, history_store=False, model_drafts=False)
    during = run_turn(engine, session, settings, PROMPT)[-1]
    chunks_before, state_then = len(read), slot.dense.state
    decoded.set()
    assert state_then == "building" and chunks_before < len(docs), "the decode waited for the whole build"
    assert slot.dense.finished.wait(30) and slot.dense.state == "ready" and len(slot.dense.store) > 0
    assert len(read) == len(docs) and read[-1], "the build went on after the decode"
    after = run_turn(engine, session, settings, PROMPT)[-1]
    assert engine.recorder.get_run(during.run_id)["output"] == engine.recorder.get_run(after.run_id)["output"]


def test_a_visitors_history_never_drafts_from_another_visitors_answers(engine, session):
    settings = replace(TINY, static=sup.NO_STATIC, history_store=True, request_store=False, model_drafts=False)
    first = run_turn(engine, session, settings, PROMPT)[-1]
    mine = run_turn(engine, session, settings, PROMPT)[-1]  # my second answer drafts from my first
    other = sup.Session(id="visitor-b")
    theirs = run_turn(engine, other, settings, PROMPT)[-1]  # the same question from someone else
    rec = engine.recorder
    assert rec.get_run(first.run_id)["output"] == rec.get_run(theirs.run_id)["output"]
    assert any("history" in (s["accepted_sources"] or []) for s in rec.load_steps(mine.run_id))
    assert node_sources(rec, theirs.run_id) <= {""}, "nothing of visitor a's text is drafted for visitor b"



def test_the_budget_learns_per_kind_of_prompt(engine, session):
    """Chat and completion turns get their own budget choosers (acceptance is learned per kind of text)."""
    import numpy as np

    from rest_core.cost import GRID, CostModel

    run_turn(engine, session, replace(TINY, budget_mode="auto", max_new_tokens=8), PROMPT)
    slot = engine.model(TINY.model)
    assert [key[0] for key in slot.costs] == ["text"]  # a completion turn: the "text" chooser
    slot.cost_factory = lambda lm, stores, kind: CostModel(times_ms=np.array([50.0 + q for q in GRID]), kind=kind)
    slot.costs.clear()
    stores = [engine.start_static(slot).store]
    chat, text = slot.chooser(stores, kind="chat"), slot.chooser(stores, kind="text")
    assert chat is not text and chat.kind == "chat" and text.kind == "text"
    assert slot.chooser(stores, kind="chat") is chat  # one per kind and set of stores, kept


def test_explanation_says_why_the_cost_model_kept_what_it_kept():
    node = {"node": 0, "parent": -1, "depth": 0, "token_text": "b", "accepted": 1, "model_choice_text": "x",
            "chosen": None}
    cut = {"step": 4, "draft_size": 0, "matched_len": {"static": 3}, "branches": [], "new_tokens": [7],
           "bonus_text": "x", "accepted_sources": [], "query_text": "ab", "nodes": [node],
           "budget_choice": {"candidates": 6, "kept": 0, "expected_accepted": 0.0, "relative_cost": 1.0,
                             "request_factors": {"static": 0.62, "request": 1.01}}}
    text = sup.explain_step(cut, {"settings": {}})
    assert "offered 6 candidate draft tokens" in text and "kept none" in text and "ordinary one" in text
    assert "landed 0.62× as often as its counts say" in text and "1.01" not in text  # ~1: not worth a word
    assert "nothing to draft" not in text
    agreed = dict(cut, budget_choice=dict(cut["budget_choice"], agreed=2, agreement_factors=[0.9, 1.25, 1.4]))
    assert "2 of the candidates were drafted by more than one store" in sup.explain_step(agreed, {"settings": {}})
    assert "landed 1.25× as often" in sup.explain_step(agreed, {"settings": {}})
    plain_agreed = dict(cut, budget_choice=dict(cut["budget_choice"], agreed=2, agreement_factors=[1.0, 1.02, 1.4]))
    assert "more than one store" not in sup.explain_step(plain_agreed, {"settings": {}})  # ~1: not worth a word
    kept = dict(cut, draft_size=2, budget_choice={"candidates": 9, "kept": 2, "expected_accepted": 0.84,
                                                  "relative_cost": 1.12, "request_factors": {"request": 1.3}},
                nodes=[node, {"node": 1, "parent": 0, "depth": 1, "token_text": "x", "accepted": 1,
                              "model_choice_text": "y", "chosen": 1},
                       {"node": 2, "parent": 1, "depth": 2, "token_text": "z", "accepted": 0,
                        "model_choice_text": "w", "chosen": 0}],
                accepted_sources=["request"], new_tokens=[7, 8])
    text = sup.explain_step(kept, {"settings": {}})
    assert "Of 9 candidate draft tokens the cost model kept 2" in text and "expected 0.84" in text
    assert "1.12× a one-token pass" in text and "landed 1.30×" in text


def test_the_first_answer_after_start_waits_for_the_general_text_store_being_opened(tiny, tiny_store, tmp_path,
                                                                                     session):
    from datastores import TokenDatastore

    def slow_open(slot, pause, st):  # opening takes a moment after the built-in store is ready
        time.sleep(0.5)
        return TokenDatastore.open(tiny_store.path, name="answers-tiny", source="answers")

    engine = answers_engine(tiny, tiny_store, tmp_path / "t.sqlite", slow_open)
    only = replace(TINY, static=sup.NO_STATIC, request_store=False, model_drafts=False, history_store=False,
                   answers=sup.ANSWERS_ALWAYS)
    first = run_turn(engine, session, only, PROMPT)[-1]  # asked for before the store finished opening
    assert engine.recorder.get_run(first.run_id)["stores"] == ["answers:answers-tiny"]


def test_a_decode_explains_its_speed_with_its_own_cost_model():
    """The 'why this speed' panel reads the cost curve of the cost model that chose this decode's budgets (its
    level follows the machine's speed of the decode's own steps); with a fixed budget, the model's calibration."""
    from rest_core.app.decoding import Prepared
    from rest_core.cost import GRID, CostModel

    chooser = CostModel(times_ms=[50.0 + q for q in GRID])
    calibrated = SimpleNamespace(forward_curve=lambda: (lambda q: 1.0))
    chosen = Prepared(calibrated, None, [1], SimpleNamespace(budget_chooser=chooser), "")
    assert chosen.forward_curve()(1) == chooser.forward_ms(1) == 51.0
    fixed = Prepared(calibrated, None, [1], SimpleNamespace(budget_chooser=None), "")
    assert fixed.forward_curve()(1) == 1.0


def test_kept_or_shipped_answers_open_at_once_and_only_a_real_build_waits_for_the_built_in_store(monkeypatch):
    """The general-text store opens at once when its answers are kept or ship with the package, even while the
    built-in store is still being built (a fresh machine's first chat drafts from it); only when the model has to
    answer the requests does it wait for the built-in store's build to end (one build at a time on the cores)."""
    calls = []

    def fake_open(spec, name, tokenizer, generate=None, progress=True):
        calls.append(generate is None)
        if generate is None and shipped:
            return "store from shipped answers"
        if generate is None:
            raise DatastoreError("not built yet")
        return "store the model answered"

    monkeypatch.setattr(engine_module, "open_answers", fake_open)
    monkeypatch.delenv("REST_LAB_ANSWERS", raising=False)
    slot = SimpleNamespace(lm=SimpleNamespace(name="m", tokenizer=None),
                           static=SimpleNamespace(finished=threading.Event()))
    st = engine_module.StoreSlot()
    shipped = True
    assert engine_module.default_answers_factory(slot, lambda: None, st) == "store from shipped answers"
    assert calls == [True]  # the built-in store (not finished) was not waited for
    shipped, got = False, []
    worker = threading.Thread(target=lambda: got.append(engine_module.default_answers_factory(slot, lambda: None, st)))
    worker.start()
    worker.join(0.5)
    assert worker.is_alive() and not got  # the model would answer: it waits for the built-in store's build
    slot.static.finished.set()
    worker.join(5)
    assert got == ["store the model answered"] and calls == [True, True, False]


def test_live_redraws_mark_the_model_disturbed_while_they_are_built_and_drawn(engine, session, monkeypatch):
    """While the live view builds and sends its figures (and the browser draws them, DRAW_SETTLE_S after), the
    model's slot says the cores were taken, so the steps timed then teach the cost curve nothing; afterwards it
    says so no longer."""
    from rest_core.app import live, pacing

    monkeypatch.setattr(pacing, "FIGURE_INTERVAL_S", 0.0)  # redraw at every chance (a tiny decode is quick)
    monkeypatch.setattr(pacing, "TEXT_INTERVAL_S", 0.0)
    seen = []
    figures = live.LiveAnswer.figures

    def spying(self, rows, step_no, run=None):
        seen.append(self.drawing.quiet_since(time.perf_counter()))  # a step starting now: disturbed
        return figures(self, rows, step_no, run)

    monkeypatch.setattr(live.LiveAnswer, "figures", spying)
    final = run_turn(engine, session, TINY, PROMPT)[-1]
    assert final.done and seen and not any(seen)
    drawing = engine.model("tiny").drawing
    assert drawing.until < float("inf") and drawing.quiet_since(drawing.until + 1e-6)
    assert drawing.until - time.perf_counter() <= pacing.DRAW_SETTLE_S  # settled: it ends a moment after the last draw


def test_the_chat_estimates_its_speedup_against_plain_decoding_as_measured(engine, session, monkeypatch):
    """Before the first chat a short plain decode measures plain decoding's pace (a one-token forward pass is
    not plain decoding: the estimate read low against races); every race measures it again; the Chat tab's
    estimate is REST's wall time against the fastest of the latest measurements."""
    from rest_core.app import decoding

    slot = engine.model("tiny")
    assert slot.plain_token_ms is None
    paced = []
    real = decoding.plain_generate
    monkeypatch.setattr(decoding, "plain_generate", lambda lm, ids, cfg: paced.append(cfg.max_new_tokens) or
                        real(lm, ids, cfg))
    final = run_turn(engine, session, TINY, PROMPT)[-1]
    assert paced == [decoding.PLAIN_PACE_TOKENS] and slot.plain_token_ms > 0
    assert "plain decoding as measured in this server" in final.metrics
    before = slot.plain_token_ms
    run_turn(engine, session, TINY, PROMPT)
    assert paced == [decoding.PLAIN_PACE_TOKENS] and slot.plain_token_ms == before, "measured once per process"
    last = list(sup.race(engine, session, TINY, PROMPT))[-1]
    assert last.done and len(slot.plain_paces) == 2  # the race's plain decode measured it again
    assert slot.plain_token_ms == min(slot.plain_paces)  # the fastest: a plain decode slowed by the page reads slow
    rows = engine.recorder.load_steps(last.run_id)
    run = engine.recorder.get_run(last.run_id)
    tokens = sum(len(r["new_tokens"]) for r in rows)
    from rest_core.app.panels import metrics_html

    html = metrics_html(rows, run["wall_s"], None, "done", slot.plain_token_ms)
    estimate = float(re.search(r"([0-9.]+)×</div><div class=\"metric-k\">speedup", html).group(1))
    assert estimate == pytest.approx(tokens * slot.plain_token_ms / (1e3 * run["wall_s"]), abs=0.006)


def test_the_first_live_figures_wait_a_redraw_interval_after_the_decode_began(engine, session, monkeypatch):
    """No figures at the very first steps (the browser would draw them while the decode is getting going);
    the finished answer has them."""
    from rest_core.app import pacing

    monkeypatch.setattr(pacing, "FIGURE_INTERVAL_S", 60.0)  # longer than the tiny decode, shorter than uptime
    monkeypatch.setattr(pacing, "TEXT_INTERVAL_S", 0.0)
    views = run_turn(engine, session, TINY, PROMPT)
    assert len(views) > 3 and all(v.tree is None for v in views[:-1]) and views[-1].tree is not None


def test_a_redraws_cost_on_the_decode_is_the_extra_forward_time_of_the_steps_it_overlapped():
    """Steps 3 and 4 ran while the browser drew figures (0.2 s and 0.05 s longer than a pass of their size
    takes); the others set what a pass of each size takes here, relative to the cost curve."""
    from rest_core.app.pacing import redraw_cost_s

    def curve(q):
        return 30.0 + 2.0 * q

    rows = [{"step": i, "draft_size": q, "t_forward_ms": 1.1 * curve(q + 1)} for i, q in enumerate([0, 4, 8, 2, 6, 5])]
    rows[3]["t_forward_ms"] += 200.0
    rows[4]["t_forward_ms"] += 50.0
    assert redraw_cost_s(rows, {3, 4}, curve) == pytest.approx(0.25)
    assert redraw_cost_s(rows, {1}, curve) == pytest.approx(0.0)  # an undisturbed pace costs nothing
    assert redraw_cost_s(rows[:1], {0}, curve) == 0.0  # nothing to compare with


def test_a_costly_redraw_spaces_the_next_ones(engine, session, monkeypatch):
    """When the latest redraw cost the decode much (a browser on the same cores), the next answer's live figures
    wait for that cost / FIGURE_SHARE; with no cost they come at the page's interval."""
    from rest_core.app import pacing

    monkeypatch.setattr(pacing, "FIGURE_INTERVAL_S", 0.0)
    monkeypatch.setattr(pacing, "TEXT_INTERVAL_S", 0.0)
    slot = engine.model("tiny")
    slot.drawing.cost_s = 30.0  # half a minute of the decode per redraw: 600 s between redraws
    views = run_turn(engine, session, TINY, PROMPT)
    assert all(v.tree is None for v in views[:-1]) and views[-1].tree is not None
    slot.drawing.cost_s = 0.0
    views = run_turn(engine, session, TINY, PROMPT)
    assert any(v.tree is not None for v in views[:-1])


def test_a_costly_text_update_spaces_the_streamed_text(engine, session, monkeypatch):
    """When a text update costs the decode much (a browser re-rendering the answer on the same cores), the answer
    streams at most once before it is done; when it costs nothing, at the page's pace."""
    from rest_core.app import pacing

    monkeypatch.setattr(pacing, "FIGURE_INTERVAL_S", 1e9)
    monkeypatch.setattr(pacing, "TEXT_INTERVAL_S", 0.0)
    slot = engine.model("tiny")
    slot.drawing.text_cost_s = 30.0  # half a minute of the decode per update
    views = run_turn(engine, session, TINY, PROMPT)
    streamed = [v for v in views[:-1] if v.chat is not None and v.metrics]
    assert views[-1].done and len(streamed) <= 1
    slot.drawing.text_cost_s = 0.0
    views = run_turn(engine, session, TINY, PROMPT)
    assert len([v for v in views[:-1] if v.chat is not None and v.metrics]) > 2
