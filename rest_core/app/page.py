"""The page's state and its event handlers: what each button, box and timer of app.py does.

`Page` holds the page's components by name (app.py's builders set them) and the engine
every visitor shares; each handler takes the page first and returns {component: value}.
app.py binds them to the events with `bound`.
"""
from __future__ import annotations

import html
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MethodType
from typing import Any, Optional

import anyio
import gradio as gr

from rest_core.app.engine import Engine
from rest_core.app.explorer import explore
from rest_core.app.guard import Refused, Reservation, UploadLedger, folder_usage, sweep
from rest_core.app.live import View, chat_turn, race, take_turn
from rest_core.app.policy import markdown_text
from rest_core.app.recording import STORE_ERRORS
from rest_core.app.replay import (
    EXAMPLE_RUN_ID,
    check_panel,
    check_run,
    example_run,
    node_panel,
    run_choices,
    run_panels,
    run_table,
    step_count,
    step_panel,
    whole,
)
from rest_core.app.session import Session, build_upload_store, save_uploads, upload_bytes, upload_summary
from rest_core.app.settings import UPLOADED, Settings, UploadError, message_of, settings_from
from rest_core.app.tour import STOPS, card_html, tour_step
from rest_core.app.visitors import Visitors, forget_sessions, request_address
from rest_core.app.whatif import WhatIf, own_settings
from rest_core.app.whatif_view import what_if_views

try:  # on Hugging Face Spaces with ZeroGPU the decode handlers borrow a GPU
    import spaces

    on_gpu = spaces.GPU(duration=120)
    GPU_WRAPPER = "spaces.GPU"  # a no-op where ZeroGPU is not set up
except ImportError:
    def on_gpu(fn: Callable) -> Callable:
        return fn

    GPU_WRAPPER = ""


class Page:
    """The page's components by name (set by the builders), the engine its handlers share and, on a public
    server, the sessions of each client address and the ledger of uploads."""

    def __init__(self, engine: Engine, preload: bool):
        self.engine, self.preload = engine, preload
        self.settings: dict[str, Any] = {}  # setting name -> its control, in Settings' field order
        policy = engine.policy
        self.visitors = Visitors(policy.max_sessions_per_address, policy.session_idle_s) if policy.public else None
        self.uploads_ledger: Optional[UploadLedger] = None  # set by build_demo on a public server

    def settings_of(self, values: tuple) -> Settings:
        """The settings from the values of the controls, passed in the order of page.settings."""
        return settings_from(dict(zip(self.settings, values)))


def bound(handler: Callable, page: Page) -> Callable:
    """A module-level handler with the page as its first argument, as Gradio calls it (a bound method
    keeps the handler's signature and type hints, which Gradio reads for gr.Request and gr.SelectData)."""
    return MethodType(handler, page)


def visitor(page: Page, state: Any, request: Any) -> Session:
    """The visitor behind a request: the session the page holds (a new one named after the request when it holds
    none) and the client address the request came from.  On a public server that address's least recently
    used sessions past `max_sessions_per_address`, and sessions idle too long, are forgotten (their state and
    folder go)."""
    sess = Session.ensure(state, request)
    sess.address = request_address(request, page.engine.policy.trusted_proxies)
    if page.visitors is not None and request is not None:
        gone = page.visitors.admit(sess.address, sess.id)
        if gone:
            holder = getattr(getattr(page, "demo", None), "state_holder", None)
            try:  # on the server's event loop, where Gradio's own expiry walks the same sessions
                anyio.from_thread.run_sync(forget_sessions, holder, gone)
            except RuntimeError:  # not on one of the server's worker threads (a handler called directly)
                forget_sessions(holder, gone)
    return sess


def warn(text: str) -> None:
    """A toast on the visitor's page (its text shown as it is: the toast renders HTML)."""
    gr.Warning(html.escape(text, quote=False))


def notice_update(text: Optional[str]) -> Any:
    return gr.Markdown(value=f"⚠ {markdown_text(text, 600)}" if text else "", visible=bool(text))


def runs_update(page: Page, sess: Session, value: Optional[int] = None, first: bool = False) -> Any:
    """The run picker: this visitor's runs and the example run; `value` chosen, or with `first` the newest run (the
    example run when the visitor has none), so Step through never opens empty."""
    try:
        choices = run_choices(page.engine.recorder, sess)
        if first and value is None and choices:
            value = choices[0][1]
        return gr.Dropdown(choices=choices, value=value)
    except STORE_ERRORS as err:  # the page works on; the runs come back when the store does
        warn(f"The recorded runs cannot be read now ({type(err).__name__}); the status line says more.")
        return gr.Dropdown(choices=[], value=None)


def outputs(page: Page, values: dict, names: dict[str, str], skip_none: bool = False) -> dict:
    """{component: value}: `names` maps keys of `values` to the page's component names."""
    return {getattr(page, name): values[key] for key, name in names.items()
            if not (skip_none and values[key] is None)}


def view_outputs(page: Page, view: View, names: dict[str, str]) -> dict:
    """The components a View changes (its None fields change nothing); its warning shows as a toast."""
    out = outputs(page, vars(view), names, skip_none=True)
    if view.notice is not None:
        out[page.notice] = notice_update(view.notice)
    if view.warning:
        warn(view.warning)
    return out


CHAT_VIEW = {"chat": "chatbot", "tree": "tree_plot", "mask": "mask_plot", "speed": "speed_plot", "metrics": "metrics"}
RACE_VIEW = {"plain": "race_plain", "rest": "race_rest", "metrics": "race_verdict", "speed": "race_speed"}
STEP_PANEL = {"explanation": "explanation", "suffix": "suffix", "branches": "branches", "choices": "choices",
              "path": "path", "tree": "step_tree", "mask": "step_mask", "node_probs": "node_probs"}
RUN_PANELS = {"text": "history_text", "speed": "history_speed", "accept": "history_accept",
              "phases": "history_phases"}
EXPLORER = {"summary": "explore_summary", "suffix": "explore_suffix", "continuations": "explore_rows",
            "tree": "explore_tree"}


def on_load(page: Page, state: Any, request: gr.Request) -> dict:
    sess = visitor(page, state, request)
    sweep(page.engine.policy)
    if page.preload:
        page.engine.preload()
    return {page.session: sess, page.run_pick: runs_update(page, sess), page.status: page.engine.status()}


def tick_status(page: Page) -> dict:
    return {page.status: page.engine.status(), page.status_timer: gr.Timer(active=not page.engine.ready())}


@on_gpu
def on_chat(page: Page, text: str, state: Any, request: gr.Request, *values: Any) -> Iterator[dict]:
    sess = visitor(page, state, request)
    first = True
    for view in chat_turn(page.engine, sess, page.settings_of(values), text):
        out = {page.session: sess, **view_outputs(page, view, CHAT_VIEW)}
        if first:
            out[page.message] = ""
        if first or view.done:
            out[page.status] = page.engine.status()
        if view.run_id:
            out[page.run_pick] = runs_update(page, sess, view.run_id)
        first = False
        yield out


def on_clear(page: Page, state: Any, request: gr.Request) -> dict:
    sess = visitor(page, state, request)
    sess.clear_chat()
    return {page.chatbot: [], page.session: sess, page.notice: notice_update("")}


@on_gpu
def on_race(page: Page, text: str, state: Any, request: gr.Request, *values: Any) -> Iterator[dict]:
    sess = visitor(page, state, request)
    for view in race(page.engine, sess, page.settings_of(values), text):
        out = {page.session: sess, **view_outputs(page, view, RACE_VIEW)}
        if view.run_id:
            out[page.run_pick] = runs_update(page, sess, view.run_id)
        yield out


STORE_BYTES_PER_TOKEN = 12  # a built store on disk, per token (tokens, suffix array, dead ends)


def on_build(page: Page, files: Any, state: Any, model_name: str, request: gr.Request,
             progress: gr.Progress = gr.Progress(track_tqdm=True)) -> Iterator[dict]:
    """Copy the visitor's uploads into their folder and build their store (on a public server after a turn in the
    line of decodes, the room it takes reserved, the tokenizer loaded without the model, at most max_upload_tokens
    tokens)."""
    sess = visitor(page, state, request)
    engine, ticket, reservation = page.engine, None, None
    try:
        progress(0.0, desc="Checking the files")
        paths = [getattr(f, "name", f) for f in (files or []) if isinstance(getattr(f, "name", f), str)]
        name = engine.canonical(model_name)
        engine.policy.check_model(name)
        cache = Path(page.demo.GRADIO_CACHE).resolve()
        if engine.policy.public:
            ticket = yield from take_turn(engine, sess, lambda text: {page.upload_status: markdown_text(text),
                                                                      page.session: sess})
            reservation = _reserve_copy(page, sess, paths, cache)
        docs = save_uploads(sess, paths, upload_root=cache, policy=engine.policy)
        progress(0.05, desc="Loading the model's tokenizer")
        tokenizer = engine.tokenizer_for(name, in_turn=True)
        if tokenizer is None:
            raise UploadError(f"The tokenizer of {name} could not be loaded; try again in a minute.")
        limit = engine.policy.max_upload_tokens if engine.policy.public else None
        store = build_upload_store(sess, docs, tokenizer, name, max_tokens=limit)
    except Exception as err:  # a clear message, never a stack trace
        text = message_of(err)
        warn(text)
        yield {page.upload_status: f"⚠ {markdown_text(text, 600)}", page.session: sess,
               page.notice: notice_update(text)}
        return
    finally:
        if reservation is not None:  # what the visitor's folder holds now counts, in place of the reservation
            page.uploads_ledger.settle(reservation, *folder_usage([sess.folder]))
        if ticket is not None:
            ticket.leave()
    yield {page.upload_status: upload_summary(sess, store), page.settings["static"]: UPLOADED,
           page.session: sess, page.notice: notice_update("")}


def _reserve_copy(page: Page, sess: Session, paths: list[str], cache: Path) -> Reservation:
    """Reserve in the uploads' ledger the room a visitor's files take once copied into their folder, and the store
    built from them (UploadError when there is none)."""
    policy = page.engine.policy
    sweep(policy)
    size = upload_bytes([p for p in paths[:policy.max_upload_files + 1] if Path(p).resolve().is_relative_to(cache)])
    try:
        return page.uploads_ledger.reserve(sess.address, size + STORE_BYTES_PER_TOKEN * min(size,
                                                                                            policy.max_upload_tokens),
                                           per_address=False)
    except Refused as refusal:
        raise UploadError(str(refusal).replace("Upload refused: ", "")) from None


def show_step(page: Page, run_id: Any, index: Any, state: Any, request: gr.Request) -> dict:
    sess = visitor(page, state, request)
    shown = step_panel(page.engine, sess, run_id, index)
    return {page.session: sess, **outputs(page, shown, STEP_PANEL), **node_pick_update(page, shown)}


def node_pick_update(page: Page, shown: dict) -> dict:
    """The node picker of the step-through: the step's nodes, the one shown selected."""
    return {page.node_pick: gr.Dropdown(choices=shown["node_choices"], value=shown["node"])}


def on_sampling_check(page: Page, run_id: Any, index: Any, node: Any, state: Any, request: gr.Request) -> Any:
    """Draw the picked node many times and show the frequencies over the model's distribution."""
    try:
        return check_panel(page.engine, visitor(page, state, request), run_id, index, node)
    except (KeyError, ValueError, TypeError, *STORE_ERRORS) as err:
        warn(message_of(err))
        return gr.skip()


def show_node(page: Page, run_id: Any, index: Any, node: Any, state: Any, request: gr.Request) -> dict:
    """The probability bars of the node picked in the step-through."""
    shown = node_panel(page.engine, visitor(page, state, request), run_id, index, node)
    return {page.node_probs: shown["node_probs"]}


def step_slider(count: int, value: int = 0) -> Any:
    """The step slider of a run with `count` steps, standing on step `value`."""
    top = max(0, count - 1)
    return gr.Slider(minimum=0, maximum=max(1, top), value=max(0, min(value, top)), step=1, label=f"Step (0–{top})",
                     interactive=top > 0)


def open_run_steps(page: Page, run_id: Any, state: Any, request: gr.Request) -> dict:
    """A run chosen: the slider at its first step; the example run opens at its most telling step (the tour's)."""
    count = step_count(page.engine.recorder, visitor(page, state, request), run_id) or 0
    example = example_run()
    start = tour_step(example.load_steps(EXAMPLE_RUN_ID)) if run_id == EXAMPLE_RUN_ID and example is not None else 0
    return {page.step_slider: step_slider(count, start), page.play_timer: gr.Timer(active=False),
            page.playing: False, page.play: gr.Button("▶ Play")}


def toggle_play(page: Page, is_playing: bool) -> dict:
    now = not is_playing
    return {page.playing: now, page.play_timer: gr.Timer(active=now),
            page.play: gr.Button("⏸ Pause" if now else "▶ Play")}


def tick_play(page: Page, run_id: Any, index: Any, state: Any, request: gr.Request) -> dict:
    count = step_count(page.engine.recorder, visitor(page, state, request), run_id)
    try:
        nxt = whole(index) + 1
    except ValueError:
        nxt = 0
    if count is None or nxt >= count:
        return {page.playing: False, page.play_timer: gr.Timer(active=False), page.play: gr.Button("▶ Play")}
    return {page.step_slider: nxt, page.playing: True}


def refresh_runs(page: Page, state: Any, request: gr.Request) -> dict:
    return {page.run_pick: runs_update(page, visitor(page, state, request))}


def on_steps_tab(page: Page, run_id: Any, state: Any, request: gr.Request) -> dict:
    """Step through opened: with no run chosen yet, the visitor's newest run, else the example run (drawn only
    now, when the visitor looks, not when the page opens: that would take the cores from a first chat)."""
    sess = visitor(page, state, request)
    return {page.run_pick: gr.update() if run_id not in (None, "") else runs_update(page, sess, first=True),
            page.session: sess}


def on_table(page: Page, state: Any, request: gr.Request) -> dict:
    sess = visitor(page, state, request)
    try:
        rows = run_table(page.engine.recorder, sess)
    except STORE_ERRORS as err:
        warn(f"The recorded runs cannot be read now ({type(err).__name__}); the status line says more.")
        rows = []
    return {page.runs_table: rows, page.session: sess}


def pick_history(page: Page, state: Any, evt: gr.SelectData, request: gr.Request) -> dict:
    sess = visitor(page, state, request)
    try:
        run_id = whole(evt.row_value[0], "run")
        panels = run_panels(page.engine.recorder, sess, run_id)
    except (KeyError, ValueError, TypeError, IndexError, *STORE_ERRORS) as err:
        warn(str(err).strip("'\""))
        return {page.session: sess}
    return {**outputs(page, panels, RUN_PANELS), page.run_pick: runs_update(page, sess, run_id), page.session: sess}


def to_steps_tab(page: Page) -> dict:
    return {page.tabs: gr.Tabs(selected="steps")}


def on_explore(page: Page, text: str, budget_value: Any, state: Any, request: gr.Request,
               *values: Any) -> Iterator[dict]:
    """What each store holds for the context (on a public server after a turn in the line of decodes: it may
    load a model)."""
    sess = visitor(page, state, request)
    engine, ticket = page.engine, None
    try:
        settings = engine.policy.check_settings(page.settings_of(values))
        budget = whole(budget_value, "draft budget")
        if not 1 <= budget <= 64:
            raise ValueError(f"The draft budget must be between 1 and 64, not {budget}.")
        context = engine.policy.check_text(text, "The context")
        if engine.policy.public:
            ticket = yield from take_turn(engine, sess, lambda line: {page.explore_summary: markdown_text(line),
                                                                      page.session: sess})
        found = explore(engine, sess, settings, context, budget)
    except Exception as err:  # a clear message, never a stack trace
        msg = message_of(err)
        warn(msg)
        found = {"summary": f"⚠ {markdown_text(msg, 600)}", "suffix": "", "continuations": [], "tree": None}
    finally:
        if ticket is not None:
            ticket.leave()
    yield {**outputs(page, found, EXPLORER), page.session: sess}


# ---------------------------------------------------------------- the tour and "what if"

def show_tour(page: Page, stop: int, state: Any, request: gr.Request) -> dict:
    """Tour stop `stop` over the example run (the tour closes before the first and after the last)."""
    sess = visitor(page, state, request)
    closed = {page.tour_box: gr.Column(visible=False), page.tour_card: "", page.tour_at: -1, page.session: sess}
    example = example_run()
    if not 0 <= stop < len(STOPS):
        return closed
    if example is None:
        warn("The example run that ships with the page cannot be read, so the tour cannot start.")
        return closed
    steps = example.load_steps(EXAMPLE_RUN_ID)
    k = tour_step(steps)
    return {page.tabs: gr.Tabs(selected="steps"), page.run_pick: runs_update(page, sess, EXAMPLE_RUN_ID),
            page.step_slider: step_slider(len(steps), k), page.tour_box: gr.Column(visible=True),
            page.tour_card: card_html(stop, example.load_step(EXAMPLE_RUN_ID, k)), page.tour_at: stop,
            page.tour_back: gr.Button(interactive=stop > 0),
            page.tour_next: gr.Button("Finish" if stop == len(STOPS) - 1 else "Next →"), page.session: sess}


def tour_start(page: Page, state: Any, request: gr.Request) -> dict:
    return show_tour(page, 0, state, request)


def tour_next(page: Page, at: Any, state: Any, request: gr.Request) -> dict:
    return show_tour(page, (at if isinstance(at, int) else -2) + 1, state, request)


def tour_back(page: Page, at: Any, state: Any, request: gr.Request) -> dict:
    return show_tour(page, max(0, (at if isinstance(at, int) else 1) - 1), state, request)


def tour_close(page: Page, state: Any, request: gr.Request) -> dict:
    return show_tour(page, -1, state, request)


WHAT_IF_VIEW = {"summary": "whatif_summary", "recorded": "whatif_recorded", "what_if": "whatif_tree",
                "recorded_path": "whatif_recorded_path", "what_if_path": "whatif_path"}


@on_gpu
def on_what_if(page: Page, run_id: Any, index: Any, budget_mode: Any, budget: Any, n_max: Any, n_min: Any,
               continuation_len: Any, sources: Any, state: Any, request: gr.Request) -> Iterator[dict]:
    """Run the shown step again with the what-if settings, beside what happened (after a turn in line)."""
    sess = visitor(page, state, request)
    try:
        wi = WhatIf(str(budget_mode), whole(budget, "fixed budget"), whole(n_max, "n_max"), whole(n_min, "n_min"),
                    whole(continuation_len, "continuation length"), tuple(sources or ()))
    except ValueError as err:
        yield {page.whatif_summary: f"⚠ {err}", page.session: sess}
        return
    for view in what_if_views(page.engine, sess, run_id, index, wi):
        yield {page.session: sess, **outputs(page, vars(view), WHAT_IF_VIEW, skip_none=True)}


def what_if_defaults(page: Page, run_id: Any, state: Any, request: gr.Request) -> dict:
    """A run chosen: the what-if starts from the run's own settings, its panel empty."""
    cleared = {page.whatif_summary: "", page.whatif_recorded: None, page.whatif_tree: None,
               page.whatif_recorded_path: "", page.whatif_path: ""}
    try:
        own = own_settings(check_run(page.engine.recorder, visitor(page, state, request), run_id))
    except (KeyError, ValueError, TypeError, *STORE_ERRORS):
        return cleared
    controls = {name: getattr(own, name) for name in page.whatif_controls}
    controls["sources"] = list(own.sources)
    return {**cleared, **{page.whatif_controls[name]: value for name, value in controls.items()}}
