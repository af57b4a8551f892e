"""REST Lab's page: one builder per tab and the wiring of the page's events to their handlers.

`python app.py` (a checkout) and `rest-lab-app` (an installed package) serve it on
127.0.0.1:7860 (GRADIO_SERVER_NAME and GRADIO_SERVER_PORT, or --host and --port, override).
Handlers live in rest_core/app/page.py, what they do with the decoder in rest_core.app,
the figures in rest_core.traces.figures.  Tests build the page with a small model and store:
`build_demo(lm_factory=..., store_factory=...)`.  Importing this module touches no file but
the page's own assets: the trace store opens on first use, old session folders are pruned on launch.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import gradio as gr
from starlette.middleware import Middleware

from rest_core import app as lab
from rest_core.app.guard import UploadGuard, UploadLedger, refuse_url_files
from rest_core.app.page import (
    GPU_WRAPPER,
    Page,
    bound,
    on_build,
    on_chat,
    on_clear,
    on_explore,
    on_load,
    on_race,
    on_sampling_check,
    on_steps_tab,
    on_table,
    open_run_steps,
    pick_history,
    refresh_runs,
    show_node,
    show_step,
    tick_play,
    tick_status,
    to_steps_tab,
    toggle_play,
)
from rest_core.app.policy import Policy
from rest_core.app.settings import assets_dir, log
from rest_core.app.ui_teach import build_tour, build_tour_button, build_what_if, wire_teach
from rest_core.model import DEFAULT_MODEL
from rest_core.phases import PHASE_NOTES, PHASES

ASSETS = assets_dir()
CSS = (ASSETS / "app.css").read_text(encoding="utf-8")
HEAD = f"<script>{(ASSETS / 'tour.js').read_text(encoding='utf-8')}</script>"  # the tour's highlight, the keys
LAUNCH_OPTIONS = dict(css=CSS, head=HEAD, theme=gr.themes.Soft(primary_hue="blue"), max_file_size="20mb")
UPLOAD_TYPES = ["text", ".py", ".md", ".json", ".js", ".ts", ".c", ".h", ".cpp", ".java", ".rs", ".go", ".rb", ".sh",
                ".toml", ".yaml", ".yml", ".csv", ".html", ".css", ".ipynb", ".tex", ".rst"]
EXAMPLES = [["Write a Python function that checks whether a string is a palindrome.", "chat"],
            ["What is speculative decoding? Answer in two sentences.", "chat"],
            ["import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser(", "completion"],
            ["class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
             "completion"]]

INTRO = (ASSETS / "intro.md").read_text(encoding="utf-8")
READING_THE_PAGE = (ASSETS / "reading-the-page.md").read_text(encoding="utf-8")


def how_it_works() -> str:
    """The "How it works" tab: the phases of one step, in rest_core.phases' words."""
    steps = "\n".join(f"{i}. **{phase.capitalize()}**: {PHASE_NOTES[phase]}." for i, phase in enumerate(PHASES, 1))
    return f"### One REST step\n{steps}\n\n{READING_THE_PAGE}"


def phase_heading(*phases: str) -> str:
    """A step-through panel's heading: its phases' numbers and names, and what each does."""
    notes = " ".join(f"{phase.capitalize()}: {PHASE_NOTES[phase]}." for phase in phases)
    return f"##### {' → '.join(lab.phase_title(p) for p in phases)}\n{notes}"


def upload_note(policy: Policy) -> str:
    """What happens to a visitor's files, as the upload box says it."""
    if policy.public:
        return (f"Only you can draft from the files you upload; they are deleted about "
                f"{policy.session_idle_s / 60:.0f} minutes after you upload them, or when you leave.")
    return "Only you can draft from the files you upload; they are deleted about an hour after you leave."


# ---------------------------------------------------------------- builders, one per part of the page

def build_sidebar(page: Page, defaults: lab.Settings) -> None:
    """The settings, one control per field of Settings (page.settings), and the upload box."""
    with gr.Sidebar(open=True, width=340):
        gr.Markdown("### Settings")
        s = page.settings
        policy = page.engine.policy
        if policy.public:  # the operator's models only
            s["model"] = gr.Dropdown(list(policy.models), value=policy.models[0], label="Model", elem_id="model",
                                     allow_custom_value=False, info="The models this server offers.")
        else:
            s["model"] = gr.Dropdown(sorted({DEFAULT_MODEL, defaults.model}), value=defaults.model, label="Model",
                                     elem_id="model", allow_custom_value=True,
                                     info="The offline default, or a Hugging Face id / local folder where the hub "
                                          "is reachable.")
        s["mode"] = gr.Radio(["chat", "completion"], value=defaults.mode, label="Prompt format",
                             info="chat: the model's chat template, multi-turn. completion: the text or code is "
                                  "continued as it is.")
        s["static"] = gr.Radio([lab.BUILT_IN, lab.UPLOADED, lab.NO_STATIC], value=defaults.static, label="Datastore",
                               info="The static store drafts are retrieved from.")
        s["answers"] = gr.Radio([lab.ANSWERS_CHAT, lab.ANSWERS_ALWAYS, lab.ANSWERS_NEVER], value=defaults.answers,
                                label="General-text store: the model's own answers", elem_id="answers-store",
                                info="Drafts from the model's answers to 514 varied requests (writing, role play, "
                                     "maths, coding, ...), built once per model on this machine. Chat answers "
                                     "read like them; code continued as is reads like the Python store.")
        s["request_store"] = gr.Checkbox(defaults.request_store,
                                         label="Request store: the prompt and the answer so far")
        s["history_store"] = gr.Checkbox(defaults.history_store, label="History store: your earlier answers",
                                         info="Yours only: another visitor's text is never drafted for you.")
        s["model_drafts"] = gr.Checkbox(defaults.model_drafts, label="Model's own predictions (recycled tokens)",
                                        elem_id="model-drafts",
                                        info="What the model predicted after a token earlier is drafted again. "
                                             "Learned from your decodes (on top of command-line runs'); never "
                                             "saved or shared.")
        with gr.Accordion("Your files → your datastore", open=False):
            page.uploads = gr.File(file_count="multiple", elem_id="uploads", file_types=UPLOAD_TYPES,
                                   label=f"Text or code files ({policy.max_upload_bytes / 2**20:.0f} MB in all)")
            page.build_btn = gr.Button("Build my datastore", size="sm", elem_id="build-btn")
            page.upload_status = gr.Markdown(upload_note(page.engine.policy), elem_id="upload-status")
        most = policy.max_new_tokens if policy.public else 512
        s["max_new_tokens"] = gr.Slider(1, most, value=min(defaults.max_new_tokens, most), step=1,
                                        label="Max new tokens")
        s["decoding"] = gr.Radio(["greedy", "sampling"], value=defaults.decoding, label="Decoding",
                                 info="greedy: REST output = plain output, token for token. sampling: exact "
                                      "speculative sampling, same distribution as plain sampling.")
        with gr.Group():
            s["temperature"] = gr.Slider(0.05, 2.0, value=defaults.temperature, step=0.05, label="Temperature")
            s["top_p"] = gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="Top-p")
            s["seed"] = gr.Number(defaults.seed, precision=0, label="Seed (empty: random)")
        s["budget_mode"] = gr.Radio(["auto", "fixed"], value=defaults.budget_mode, label="Draft budget",
                                    info="auto: the number of draft tokens per step is chosen from this machine's "
                                         "measured forward-pass cost. fixed: always the budget below.")
        s["budget"] = gr.Slider(0, 64, value=defaults.budget, step=1, label="Fixed budget (draft tokens per step)")
        s["n_max"] = gr.Slider(1, 32, value=defaults.n_max, step=1, label="Longest suffix looked up (n_max)",
                               info="The last n_max tokens are searched first, then shorter suffixes.")
        s["n_min"] = gr.Slider(1, 8, value=defaults.n_min, step=1, label="Shortest suffix that counts (n_min)")
        s["continuation_len"] = gr.Slider(1, 32, value=defaults.continuation_len, step=1,
                                          label="Continuation length (deepest draft)")
    page.settings = {name: s[name] for name in lab.SETTING_NAMES}  # Settings' order, every field


def build_chat_tab(page: Page) -> None:
    with gr.Tab("Chat", id="chat"), gr.Row(equal_height=False):
        with gr.Column(scale=4, min_width=380):
            gr.HTML(lab.origin_legend_html())
            page.chatbot = gr.Chatbot(height=600, label="REST's answer, tinted by origin", show_label=False,
                                      elem_id="chatbot", buttons=["copy"], feedback_options=None,
                                      placeholder="Ask something, or switch to completion and paste code.")
            page.message = gr.Textbox(placeholder="Ask a question, or paste code to continue… (Enter sends)",
                                      lines=1, max_lines=12, show_label=False, elem_id="prompt", submit_btn=True,
                                      stop_btn=True)
            with gr.Row():
                page.clear = gr.Button("Clear chat", size="sm", variant="secondary")
            gr.Examples(EXAMPLES, inputs=[page.message, page.settings["mode"]], label="Examples")
        with gr.Column(scale=7, min_width=480):
            page.metrics = gr.HTML(lab.metrics_html([], 0.0, state="idle"), elem_id="metrics")
            page.tree_plot = gr.Plot(label="Draft tree of the latest step (accepted path in red)",
                                     elem_id="tree-plot")
            page.mask_plot = gr.Plot(label="Tree attention mask of the latest step", elem_id="mask-plot")
            page.speed_plot = gr.Plot(label="Speed", elem_id="speed-plot")


def build_race_tab(page: Page) -> None:
    with gr.Tab("Race", id="race"):
        gr.Markdown("The same prompt, decoded **plainly** (one forward pass per token) and **with REST**, with the "
                    "settings on the left. On one machine they run **in turn**, step by step, the one behind in the "
                    "answer going next, so a busy moment slows both alike; each is timed by its own steps. The "
                    "check compares the two outputs token by token.")
        page.race_prompt = gr.Textbox(label="Prompt", lines=3, elem_id="race-prompt",
                                      value="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
        with gr.Row():
            page.race_btn = gr.Button("Race", variant="primary", elem_id="race-btn")
            page.race_stop = gr.Button("Stop", variant="stop")
        with gr.Row(equal_height=True):
            with gr.Column():
                gr.Markdown("#### Plain decoding")
                page.race_plain = gr.Textbox(lines=12, max_lines=24, show_label=False, elem_id="race-plain")
            with gr.Column():
                gr.Markdown("#### REST (tinted by origin)")
                page.race_rest = gr.HTML(elem_id="race-rest", elem_classes="race-rest")
        page.race_verdict = gr.HTML(elem_id="race-verdict")
        page.race_speed = gr.Plot(label="Speed", elem_id="race-speed")


def build_steps_tab(page: Page) -> None:
    """Step through a recorded run: one panel per phase of the step, in the phases' order."""
    with gr.Tab("Step through", id="steps") as page.steps_tab:
        with gr.Row():
            page.run_pick = gr.Dropdown([], label="Run", scale=4, elem_id="run-pick", allow_custom_value=False)
            page.refresh_runs = gr.Button("↻ Refresh", scale=0, size="sm")
        page.step_slider = gr.Slider(0, 1, value=0, step=1, label="Step", elem_id="step-slider")
        with gr.Row():
            page.first = gr.Button("◀◀ First", elem_id="step-first", scale=0)
            page.back = gr.Button("◀ Back", elem_id="step-back")
            page.play = gr.Button("▶ Play", elem_id="step-play")
            page.forward = gr.Button("Forward ▶", elem_id="step-forward")
            page.last = gr.Button("Last ▶▶", elem_id="step-last", scale=0)
        gr.Markdown("Keys: ← → previous / next step, Home / End first / last (when no text box has the focus).",
                    elem_classes="keys-note")
        page.explanation = gr.Markdown(elem_id="step-explanation", elem_classes="explanation")
        with gr.Row(equal_height=False):
            with gr.Column():
                gr.Markdown(phase_heading("retrieve"), elem_classes="phase-head")
                page.suffix = gr.HTML(elem_id="step-suffix")
                page.branches = gr.Dataframe(headers=lab.BRANCH_HEADERS, interactive=False, max_height=300, wrap=True,
                                             column_widths=["18%", "66%", "16%"])
            with gr.Column():
                gr.Markdown(phase_heading("tree"), elem_classes="phase-head")
                page.step_tree = gr.Plot(show_label=False, elem_id="step-tree")
        with gr.Row(equal_height=False):
            with gr.Column():
                gr.Markdown(phase_heading("forward"), elem_classes="phase-head")
                page.step_mask = gr.Plot(show_label=False, elem_id="step-mask")
            with gr.Column():
                gr.Markdown(phase_heading("verify", "commit"), elem_classes="phase-head")
                page.path = gr.HTML(elem_id="step-path")
                page.node_pick = gr.Dropdown([], label="The model's probabilities after node", elem_id="node-pick",
                                             info="✓ = on the accepted path; the node where the model parted from "
                                                  "the draft is shown first")
                page.node_probs = gr.Plot(show_label=False, elem_id="node-probs")
                page.check_btn = gr.Button("Draw this node 2,000 times: is sampling exact?", size="sm",
                                           elem_id="sample-check-btn")
                page.check_plot = gr.Plot(show_label=False, elem_id="sample-check")
        # the model's choice at every drafted node: nine columns, so the whole width (in a half column the
        # headers broke inside words)
        page.choices = gr.Dataframe(headers=lab.CHOICE_HEADERS, interactive=False, max_height=320, wrap=True,
                                    elem_id="step-choices", label="The model's choice at every node of the draft tree",
                                    column_widths=["6%", "6%", "12%", "11%", "7%", "8%", "14%", "28%", "8%"])
        build_what_if(page)
        page.play_timer = gr.Timer(1.5, active=False)
        page.playing = gr.State(False)


def build_history_tab(page: Page) -> None:
    with gr.Tab("Run history", id="history") as page.history_tab:
        gr.Markdown("Your runs (and runs recorded from the command line), replayed from the trace store without "
                    "the model. Click a row to open it.")
        page.refresh_table = gr.Button("↻ Refresh", size="sm")
        page.runs_table = gr.Dataframe(headers=lab.RUN_TABLE_HEADERS, interactive=False, max_height=320,
                                       elem_id="runs-table")
        with gr.Row():
            page.open_steps = gr.Button("Step through this run", size="sm")
        page.history_text = gr.HTML(elem_id="history-text")
        page.history_speed = gr.Plot(label="Speed", elem_id="history-speed")
        with gr.Row():
            page.history_accept = gr.Plot(label="Accepted draft tokens per step")
            page.history_phases = gr.Plot(label="Where the time goes")


def build_explorer_tab(page: Page) -> None:
    with gr.Tab("Datastore explorer", id="explorer"):
        gr.Markdown("Type a context: see the longest suffix each store holds, what followed it there, and the "
                    "draft tree REST would build from it (no model run; the stores and suffix lengths come from "
                    "the settings on the left).")
        with gr.Row():
            page.explore_text = gr.Textbox("    for i in range(len(", label="Context", lines=3, scale=4,
                                           elem_id="explore-text")
            with gr.Column(scale=1):
                page.explore_budget = gr.Slider(1, 64, value=24, step=1, label="Draft budget")
                page.explore_btn = gr.Button("Look up", variant="primary", elem_id="explore-btn")
        page.explore_summary = gr.Markdown(elem_id="explore-summary")
        page.explore_suffix = gr.HTML()
        with gr.Row(equal_height=False):
            page.explore_rows = gr.Dataframe(headers=lab.BRANCH_HEADERS, interactive=False, max_height=520, wrap=True,
                                             scale=2, column_widths=["18%", "66%", "16%"])
            page.explore_tree = gr.Plot(label="Draft tree", elem_id="explore-tree", scale=3)


# ---------------------------------------------------------------- handlers (page first, bound by `bound`)

# ---------------------------------------------------------------- wiring

def decode_handlers(page: Page) -> int:
    """Chat and race handlers running at once: every decode in line waits inside its handler (telling its
    visitor its place); the decodes themselves take turns (rest_core.app.turns)."""
    return page.engine.policy.max_waiting + 1


def wire_page(page: Page) -> None:
    """Page load, the status line, the upload box and the Chat tab."""
    page.demo.load(bound(on_load, page), [page.session], [page.session, page.run_pick, page.status],
                   concurrency_limit=None)
    page.status_timer.tick(bound(tick_status, page), None, [page.status, page.status_timer], show_progress="hidden",
                           concurrency_limit=None, api_visibility="private")
    page.build_btn.click(bound(on_build, page), [page.uploads, page.session, page.settings["model"]],
                         [page.upload_status, page.settings["static"], page.session, page.notice],
                         api_name="build_datastore", concurrency_id="model", concurrency_limit=decode_handlers(page))
    chat_event = page.message.submit(
        bound(on_chat, page), [page.message, page.session, *page.settings.values()],
        [page.chatbot, page.tree_plot, page.mask_plot, page.speed_plot, page.metrics, page.notice, page.message,
         page.session, page.run_pick, page.status],
        api_name="chat", concurrency_id="model", concurrency_limit=decode_handlers(page), show_progress="minimal")
    page.message.stop(None, None, None, cancels=[chat_event])
    page.clear.click(bound(on_clear, page), [page.session], [page.chatbot, page.session, page.notice],
                     api_name="clear")
    race_event = page.race_btn.click(
        bound(on_race, page), [page.race_prompt, page.session, *page.settings.values()],
        [page.race_plain, page.race_rest, page.race_verdict, page.race_speed, page.notice, page.session,
         page.run_pick], api_name="race", concurrency_id="model", concurrency_limit=decode_handlers(page),
        show_progress="minimal")
    page.race_stop.click(None, None, None, cancels=[race_event])


def slider_move_js(delta: int) -> str:
    """The browser-side step of the step slider by `delta`, held inside the slider's range (a disabled slider,
    a run of one step, stays where it is)."""
    return ("(value) => { const range = document.querySelector('#step-slider input[type=range]');"
            " const top = range && !range.disabled ? Number(range.max) : 0;"
            f" return Math.max(0, Math.min(Math.round(Number(value) || 0) + ({delta}), top)); }}")


def wire_replay(page: Page) -> None:
    """Step through, Run history and the Datastore explorer."""
    step_in = [page.run_pick, page.step_slider, page.session]
    step_out = [page.explanation, page.suffix, page.branches, page.choices, page.path, page.step_tree,
                page.step_mask, page.node_probs, page.node_pick, page.session]
    private = dict(api_visibility="private")
    page.run_pick.change(bound(open_run_steps, page), [page.run_pick, page.session],
                         [page.step_slider, page.play_timer, page.playing, page.play], **private).then(
        bound(show_step, page), step_in, step_out, **private)
    page.step_slider.change(bound(show_step, page), step_in, step_out, api_name="step", trigger_mode="always_last",
                            concurrency_limit=4, show_progress="hidden")
    page.node_pick.input(bound(show_node, page), [page.run_pick, page.step_slider, page.node_pick, page.session],
                         [page.node_probs], api_name="node", show_progress="hidden")
    page.check_btn.click(bound(on_sampling_check, page), [page.run_pick, page.step_slider, page.node_pick,
                                                          page.session], [page.check_plot], api_name="sampling_check")
    # First, Back, Forward and Last move the slider in the browser: a click never waits on the server, so quick
    # clicks all count (a server round trip read the slider before the last click had landed and lost clicks);
    # the slider's change event then draws the step, the latest one winning.
    for button, delta in ((page.first, -2**40), (page.back, -1), (page.forward, +1), (page.last, 2**40)):
        button.click(None, [page.step_slider], [page.step_slider], js=slider_move_js(delta), **private)
    page.play.click(bound(toggle_play, page), [page.playing], [page.playing, page.play_timer, page.play], **private)
    page.play_timer.tick(bound(tick_play, page), step_in, [page.step_slider, page.playing, page.play_timer,
                                                           page.play], show_progress="hidden", **private)
    page.refresh_runs.click(bound(refresh_runs, page), [page.session], [page.run_pick], **private)
    page.refresh_table.click(bound(on_table, page), [page.session], [page.runs_table, page.session], api_name="runs")
    page.steps_tab.select(bound(on_steps_tab, page), [page.run_pick, page.session], [page.run_pick, page.session],
                          **private)
    page.history_tab.select(bound(on_table, page), [page.session], [page.runs_table, page.session], **private)
    page.runs_table.select(bound(pick_history, page), [page.session],
                           [page.history_text, page.history_speed, page.history_accept, page.history_phases,
                            page.run_pick, page.session], **private)
    page.open_steps.click(bound(to_steps_tab, page), None, [page.tabs], **private)
    explore_in = [page.explore_text, page.explore_budget, page.session, *page.settings.values()]
    explore_out = [page.explore_summary, page.explore_suffix, page.explore_rows, page.explore_tree, page.session]
    line = dict(concurrency_id="model", concurrency_limit=decode_handlers(page))  # it takes a turn in the line
    page.explore_btn.click(bound(on_explore, page), explore_in, explore_out, api_name="explore", **line)
    page.explore_text.submit(bound(on_explore, page), explore_in, explore_out, **line, **private)


def build_demo(lm_factory: Optional[Callable] = None, store_factory: Optional[Callable] = None,
               cost_factory: Optional[Callable] = None, trace_db: Optional[str] = None, preload: bool = True,
               defaults: Optional[lab.Settings] = None, policy: Optional[Policy] = None,
               **engine_options: Any) -> gr.Blocks:
    """The page. Factories replace the default model, built-in store and cost model (tests; `engine_options`:
    the Engine's others, answers_factory and tokenizer_factory);
    `defaults` sets the controls' initial values; `preload` loads the default model and store
    in the background when the first page opens; `policy` (default: from the environment) says
    whether the server is public and its limits (then a visitor's state expires after the idle
    time, the page's queue holds at most queue_size requests, uploads are counted in a ledger and
    a web address is refused as a file). Nothing is read or written until it is used."""
    policy = policy or Policy.from_env()
    page = Page(lab.Engine(lm_factory=lm_factory, store_factory=store_factory, cost_factory=cost_factory,
                           trace_db=trace_db, policy=policy, **engine_options), preload)
    cleanup = (600, max(600, int(policy.session_idle_s))) if policy.public else None  # Gradio's upload cache
    with gr.Blocks(title="REST Lab", fill_width=True, delete_cache=cleanup) as demo:
        demo.engine, page.demo = page.engine, demo
        page.session = gr.State(None, delete_callback=lab.discard_session,
                                time_to_live=policy.session_idle_s if policy.public else None)
        build_sidebar(page, defaults or lab.Settings())
        with gr.Row(equal_height=False):
            gr.Markdown(INTRO, elem_classes="intro")
            build_tour_button(page)
        build_tour(page)
        page.status = gr.Markdown(page.engine.status(), elem_classes="status")
        page.notice = gr.Markdown("", visible=False, elem_classes="notice", elem_id="notice")
        page.status_timer = gr.Timer(2.0)
        with gr.Tabs() as page.tabs:
            build_chat_tab(page)
            build_race_tab(page)
            build_steps_tab(page)
            build_history_tab(page)
            build_explorer_tab(page)
            with gr.Tab("How it works", id="about"):
                gr.Markdown(how_it_works())
        wire_page(page)
        wire_replay(page)
        wire_teach(page, decode_handlers(page))
    demo.page = page
    if policy.public:
        page.uploads_ledger = UploadLedger(policy, lambda: [lab.sessions_root(), Path(demo.GRADIO_CACHE)])
        refuse_url_files(page.uploads)
        demo.queue(max_size=policy.queue_size)
    return demo


def launch(app: gr.Blocks, **options: Any) -> Any:
    """Launch with the page's look and upload limit (tests pass prevent_thread_lock, a port...);
    session folders a previous server left behind are removed first.  A public server's upload
    route is guarded (rest_core.app.guard) and it keeps the state of at most max_sessions sessions."""
    lab.prune_sessions()
    options.setdefault("show_error", True)  # a value the page's controls refuse gets its reason, not "error"
    policy = app.engine.policy
    if policy.public:
        kwargs = options.get("app_kwargs", {})
        guard = Middleware(UploadGuard, ledger=app.page.uploads_ledger)
        options["app_kwargs"] = {**kwargs, "middleware": [*kwargs.get("middleware", []), guard]}
        options.setdefault("state_session_capacity", policy.max_sessions)
        log.warning("public mode (%s): models %s; limits in the README's \"Public mode\"",
                    policy.reason or "asked for", ", ".join(policy.models))
    return app.launch(**{**LAUNCH_OPTIONS, **options})


def main(demo: Optional[gr.Blocks] = None, argv: Optional[list[str]] = None) -> None:
    """Serve the page until interrupted (`python app.py`, `rest-lab-app`).  --host and --public decide
    public mode as GRADIO_SERVER_NAME and REST_LAB_PUBLIC do (a page built before them is rebuilt)."""
    parser = argparse.ArgumentParser(prog="rest-lab-app", description="Serve REST Lab's page in the browser.")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                        help="address to listen on (default 127.0.0.1, or GRADIO_SERVER_NAME); any other than "
                             "loopback makes the server public")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)),
                        help="port (default 7860, or GRADIO_SERVER_PORT)")
    parser.add_argument("--public", action="store_true",
                        help="public mode whatever the address (models limited, limits on; README: Public mode)")
    args = parser.parse_args(argv)
    os.environ["GRADIO_SERVER_NAME"] = args.host
    if args.public:
        os.environ["REST_LAB_PUBLIC"] = "1"
    policy = Policy.from_env()
    if demo is None or demo.engine.policy != policy:
        demo = build_demo(policy=policy)
    if GPU_WRAPPER:
        print(f"REST Lab: the decode handlers run under {GPU_WRAPPER} (the spaces package is installed).", flush=True)
    launch(demo, server_name=args.host, server_port=args.port)
