"""REST Lab: watch retrieval-based speculative decoding draft, verify and accept tokens.

`python app.py` serves the page on 127.0.0.1:7860 (GRADIO_SERVER_NAME and
GRADIO_SERVER_PORT override).  This module is the page only: decoding lives in
rest_core, the page's helpers in rest_core/app_support.py, figures in
rest_core/figures.py.  Tests build the page with a small model and store:
`build_demo(lm_factory=..., store_factory=...)`.
"""
from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import gradio as gr

from rest_core.app import support as sup
from rest_core.model import DEFAULT_MODEL
from rest_core.traces.recorder import TraceRecorder

try:  # on Hugging Face Spaces with ZeroGPU the decode handlers borrow a GPU
    import spaces

    on_gpu = spaces.GPU(duration=120)
except ImportError:
    def on_gpu(fn):
        return fn

ASSETS = Path(__file__).resolve().parent / "assets"
CSS = (ASSETS / "app.css").read_text(encoding="utf-8")
LAUNCH_OPTIONS = dict(css=CSS, theme=gr.themes.Soft(primary_hue="blue"), max_file_size="20mb")

INTRO = """# REST Lab
**Retrieval-based speculative decoding you can watch.** Each step looks the newest tokens up in the
datastores, merges what followed them into a *draft tree*, checks every branch with **one** forward
pass of the model (tree attention), and keeps the longest path the model agrees with, plus one token
of its own. Greedy answers are exactly the model's; they just arrive in fewer passes."""

HOW_IT_WORKS = """
### One REST step
1. **Retrieve.** The last *n* tokens of the context (the *suffix*, from `n_max` down to `n_min`) are looked
   up in each store: the built-in datastore (Python sources), your uploaded files, the **request store**
   (the prompt and the answer so far) and the **history store** (your earlier answers). Each store returns
   the *continuations*: the tokens that followed the suffix there.
2. **Draft tree.** Continuations are merged into a prefix tree; the most frequent prefixes are kept, up to
   the **draft budget** (automatic: chosen per step by a cost model measured on this machine).
3. **Verify.** The tree is flattened and sent through the model in one forward pass. The **tree mask**
   lets each token see the prefix, itself and its ancestors only, so every branch is scored as if alone.
4. **Accept.** Walking from the root, a drafted token is kept while it is what the model itself would
   produce. Where they part, the model's own token (the *bonus token*) is added. One pass, one or more tokens.

### Reading the page
* **Chat**: tokens are tinted by origin: blue, orange, green = accepted drafts from the built-in, request
  and history stores; pink = the model's own token. A grey bar marks the start of each step.
* **Race**: the same prompt decoded plainly and with REST, one after the other, each timed alone.
* **Step through**: any recorded run, one step at a time; **Run history** lists your runs.
* **Datastore explorer**: what retrieval would draft for a context, without running the model.

Every run is recorded step by step in a SQLite trace store; all figures are drawn from those records.
"""


def _settings(values) -> sup.Settings:
    return sup.Settings(*values)


def _notice(text):
    if text is None:
        return gr.skip()
    return gr.Markdown(value=f"⚠ {text}" if text else "", visible=bool(text))


def _fig(fig):
    return gr.skip() if fig is None else fig


def build_demo(lm_factory=None, store_factory=None, cost_factory=None, trace_db=None,
               preload: bool = True, defaults: sup.Settings | None = None) -> gr.Blocks:
    """The page. Factories replace the default model, built-in store and cost model (tests);
    `defaults` sets the controls' initial values; `preload` loads the default model and store
    in the background when the first page opens."""
    engine = sup.Engine(lm_factory=lm_factory, store_factory=store_factory, cost_factory=cost_factory,
                        recorder=TraceRecorder(trace_db) if trace_db else None)
    rec = engine.recorder
    defaults = defaults or sup.Settings()
    sup.prune_sessions()

    with gr.Blocks(title="REST Lab", fill_width=True) as demo:
        demo.engine = engine
        session = gr.State(None, delete_callback=sup.discard_session)

        # ------------------------------------------------------------ settings
        with gr.Sidebar(open=True, width=340):
            gr.Markdown("### Settings")
            model = gr.Dropdown(sorted({DEFAULT_MODEL, defaults.model}), value=defaults.model, allow_custom_value=True,
                                label="Model",
                                info="The offline default, or a Hugging Face id / local folder where the hub "
                                     "is reachable.")
            mode = gr.Radio(["chat", "completion"], value=defaults.mode, label="Prompt format",
                            info="chat: the model's chat template, multi-turn. completion: the text or code "
                                 "is continued as it is.")
            static = gr.Radio([sup.BUILT_IN, sup.UPLOADED, sup.NO_STATIC], value=defaults.static,
                              label="Datastore", info="The static store drafts are retrieved from.")
            request_store = gr.Checkbox(defaults.request_store, label="Request store: the prompt and the answer so far")
            history_store = gr.Checkbox(defaults.history_store, label="History store: your earlier answers")
            with gr.Accordion("Your files → your datastore", open=False):
                uploads = gr.File(file_count="multiple", label="Text or code files (20 MB in all)", elem_id="uploads",
                                  file_types=["text", ".py", ".md", ".json", ".js", ".ts", ".c", ".h", ".cpp",
                                              ".java", ".rs", ".go", ".rb", ".sh", ".toml", ".yaml", ".yml",
                                              ".csv", ".html", ".css", ".ipynb", ".tex", ".rst"])
                build_btn = gr.Button("Build my datastore", size="sm", elem_id="build-btn")
                upload_status = gr.Markdown("Only you can draft from the files you upload; they are deleted "
                                            "when you leave.", elem_id="upload-status")
            max_new_tokens = gr.Slider(1, 512, value=defaults.max_new_tokens, step=1, label="Max new tokens")
            decoding = gr.Radio(["greedy", "sampling"], value=defaults.decoding, label="Decoding",
                                info="greedy: REST output = plain output, token for token. sampling: exact "
                                     "speculative sampling, same distribution as plain sampling.")
            with gr.Group():
                temperature = gr.Slider(0.05, 2.0, value=defaults.temperature, step=0.05, label="Temperature")
                top_p = gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="Top-p")
                seed = gr.Number(defaults.seed, precision=0, label="Seed (empty: random)")
            budget_mode = gr.Radio(["auto", "fixed"], value=defaults.budget_mode, label="Draft budget",
                                   info="auto: the number of draft tokens per step is chosen from this "
                                        "machine's measured forward-pass cost. fixed: always the budget below.")
            budget = gr.Slider(0, 64, value=defaults.budget, step=1, label="Fixed budget (draft tokens per step)")
            n_max = gr.Slider(1, 32, value=defaults.n_max, step=1, label="Longest suffix looked up (n_max)",
                              info="The last n_max tokens are searched first, then shorter suffixes.")
            n_min = gr.Slider(1, 8, value=defaults.n_min, step=1, label="Shortest suffix that counts (n_min)")
            continuation_len = gr.Slider(1, 32, value=defaults.continuation_len, step=1,
                                         label="Continuation length (deepest draft)")
        settings = [model, mode, static, request_store, history_store, max_new_tokens, decoding, temperature,
                    top_p, seed, budget_mode, budget, n_max, n_min, continuation_len]
        assert [f.name for f in fields(sup.Settings)] == [
            "model", "mode", "static", "request_store", "history_store", "max_new_tokens", "decoding",
            "temperature", "top_p", "seed", "budget_mode", "budget", "n_max", "n_min", "continuation_len"]

        gr.Markdown(INTRO, elem_classes="intro")
        status = gr.Markdown(engine.status(), elem_classes="status")
        notice = gr.Markdown("", visible=False, elem_classes="notice", elem_id="notice")
        status_timer = gr.Timer(2.0)

        with gr.Tabs() as tabs:
            # -------------------------------------------------------- chat
            with gr.Tab("Chat", id="chat"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=4, min_width=380):
                        gr.HTML(f'<div class="origin-legend">{sup.LEGEND_HTML}</div>')
                        chatbot = gr.Chatbot(height=600, label="REST's answer, tinted by origin", show_label=False,
                                             elem_id="chatbot", buttons=["copy"], feedback_options=None,
                                             placeholder="Ask something, or switch to completion and paste code.")
                        message = gr.Textbox(placeholder="Ask a question, or paste code to continue… (Enter sends)",
                                             lines=1,
                                             max_lines=12, show_label=False, elem_id="prompt", submit_btn=True,
                                             stop_btn=True)
                        with gr.Row():
                            clear = gr.Button("Clear chat", size="sm", variant="secondary")
                        gr.Examples(
                            [["Write a Python function that checks whether a string is a palindrome.", "chat"],
                             ["What is speculative decoding? Answer in two sentences.", "chat"],
                             ["import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser(",
                              "completion"],
                             ["class Stack:\n    def __init__(self):\n        self.items = []\n\n"
                              "    def push(self, item):\n", "completion"]],
                            inputs=[message, mode], label="Examples")
                    with gr.Column(scale=7, min_width=480):
                        metrics = gr.HTML(sup.metrics_html([], 0.0, state="idle"), elem_id="metrics")
                        tree_plot = gr.Plot(label="Draft tree of the latest step (accepted path in red)",
                                            elem_id="tree-plot")
                        mask_plot = gr.Plot(label="Tree attention mask of the latest step", elem_id="mask-plot")
                        speed_plot = gr.Plot(label="Speed", elem_id="speed-plot")

            # -------------------------------------------------------- race
            with gr.Tab("Race", id="race"):
                gr.Markdown("The same prompt, decoded **plainly** (one forward pass per token) and **with REST**, "
                            "with the settings on the left. On one machine they run **one after the other**, each "
                            "timed alone; the check compares the two outputs token by token.")
                race_prompt = gr.Textbox(label="Prompt", lines=3, elem_id="race-prompt",
                                         value="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
                with gr.Row():
                    race_btn = gr.Button("Race", variant="primary", elem_id="race-btn")
                    race_stop = gr.Button("Stop", variant="stop")
                with gr.Row(equal_height=True):
                    with gr.Column():
                        gr.Markdown("#### Plain decoding")
                        race_plain = gr.Textbox(lines=12, max_lines=24, show_label=False, elem_id="race-plain")
                    with gr.Column():
                        gr.Markdown("#### REST (tinted by origin)")
                        race_rest = gr.HTML(elem_id="race-rest", elem_classes="race-rest")
                race_verdict = gr.HTML(elem_id="race-verdict")
                race_speed = gr.Plot(label="Speed", elem_id="race-speed")

            # -------------------------------------------------------- step through
            with gr.Tab("Step through", id="steps"):
                with gr.Row():
                    run_pick = gr.Dropdown([], label="Run", scale=4, elem_id="run-pick", allow_custom_value=False)
                    refresh_runs = gr.Button("↻ Refresh", scale=0, size="sm")
                step_slider = gr.Slider(0, 1, value=0, step=1, label="Step", elem_id="step-slider")
                with gr.Row():
                    back = gr.Button("◀ Back", elem_id="step-back")
                    play = gr.Button("▶ Play", elem_id="step-play")
                    forward = gr.Button("Forward ▶", elem_id="step-forward")
                explanation = gr.Markdown(elem_id="step-explanation", elem_classes="explanation")
                with gr.Row(equal_height=False):
                    with gr.Column():
                        gr.Markdown("##### 1. Suffix → 2. retrieved continuations")
                        suffix = gr.HTML(elem_id="step-suffix")
                        branches = gr.Dataframe(headers=sup.BRANCH_HEADERS, interactive=False, max_height=300,
                                                wrap=True, column_widths=["18%", "66%", "16%"])
                    with gr.Column():
                        gr.Markdown("##### 5. The model's choices → 6. accepted path")
                        path = gr.HTML(elem_id="step-path")
                        choices = gr.Dataframe(headers=sup.CHOICE_HEADERS, interactive=False, max_height=300,
                                               wrap=True, column_widths=["9%", "9%", "20%", "14%", "11%", "24%",
                                                                         "13%"])
                with gr.Row(equal_height=False):
                    step_tree = gr.Plot(label="3. Draft tree", elem_id="step-tree")
                    step_mask = gr.Plot(label="4. Tree attention mask", elem_id="step-mask")
                play_timer = gr.Timer(1.5, active=False)
                playing = gr.State(False)

            # -------------------------------------------------------- run history
            with gr.Tab("Run history", id="history") as history_tab:
                gr.Markdown("Your runs (and runs recorded from the command line), replayed from the trace store "
                            "without the model. Click a row to open it.")
                refresh_table = gr.Button("↻ Refresh", size="sm")
                runs_table = gr.Dataframe(headers=sup.RUN_TABLE_HEADERS, interactive=False, max_height=320,
                                          elem_id="runs-table")
                with gr.Row():
                    open_steps = gr.Button("Step through this run", size="sm")
                history_text = gr.HTML(elem_id="history-text")
                history_speed = gr.Plot(label="Speed", elem_id="history-speed")
                with gr.Row():
                    history_accept = gr.Plot(label="Accepted draft tokens per step")
                    history_phases = gr.Plot(label="Where the time goes")

            # -------------------------------------------------------- explorer
            with gr.Tab("Datastore explorer", id="explorer"):
                gr.Markdown("Type a context: see the longest suffix each store holds, what followed it there, "
                            "and the draft tree REST would build from it (no model run; the stores and suffix "
                            "lengths come from the settings on the left).")
                with gr.Row():
                    explore_text = gr.Textbox("    for i in range(len(", label="Context", lines=3, scale=4,
                                              elem_id="explore-text")
                    with gr.Column(scale=1):
                        explore_budget = gr.Slider(1, 64, value=24, step=1, label="Draft budget")
                        explore_btn = gr.Button("Look up", variant="primary", elem_id="explore-btn")
                explore_summary = gr.Markdown(elem_id="explore-summary")
                explore_suffix = gr.HTML()
                with gr.Row(equal_height=False):
                    explore_rows = gr.Dataframe(headers=sup.BRANCH_HEADERS, interactive=False, max_height=520,
                                                wrap=True, scale=2, column_widths=["18%", "66%", "16%"])
                    explore_tree = gr.Plot(label="Draft tree", elem_id="explore-tree", scale=3)

            with gr.Tab("How it works", id="about"):
                gr.Markdown(HOW_IT_WORKS)

        # ------------------------------------------------------------ handlers
        def runs_update(sess, value=None):
            return gr.Dropdown(choices=sup.run_choices(rec, sess), value=value)

        def on_load(state, request: gr.Request):
            sess = sup.Session.ensure(state, request)
            if preload:
                engine.preload()
            return sess, runs_update(sess), engine.status()

        def tick_status():
            return engine.status(), gr.Timer(active=not engine.ready())

        @on_gpu
        def on_chat(text, state, request: gr.Request, *values):
            sess = sup.Session.ensure(state, request)
            first = True
            for view in sup.chat_turn(engine, sess, _settings(values), text):
                if view.warning:
                    gr.Warning(view.warning)
                yield (gr.skip() if view.chat is None else view.chat, _fig(view.tree), _fig(view.mask),
                       _fig(view.speed), gr.skip() if view.metrics is None else view.metrics, _notice(view.notice),
                       "" if first else gr.skip(), sess,
                       runs_update(sess, view.run_id) if view.run_id else gr.skip(),
                       engine.status() if (first or view.done) else gr.skip())
                first = False

        def on_clear(state, request: gr.Request):
            sess = sup.Session.ensure(state, request)
            sess.clear_chat()
            return [], sess, _notice("")

        @on_gpu
        def on_race(text, state, request: gr.Request, *values):
            sess = sup.Session.ensure(state, request)
            for view in sup.race(engine, sess, _settings(values), text):
                if view.warning:
                    gr.Warning(view.warning)
                yield (gr.skip() if view.plain is None else view.plain,
                       gr.skip() if view.rest is None else view.rest,
                       gr.skip() if view.metrics is None else view.metrics, _fig(view.speed), _notice(view.notice),
                       sess, runs_update(sess, view.run_id) if view.run_id else gr.skip())

        def on_build(files, state, model_name, request: gr.Request, progress=gr.Progress(track_tqdm=True)):
            sess = sup.Session.ensure(state, request)
            try:
                progress(0.0, desc="Checking the files")
                docs = sup.save_uploads(sess, [getattr(f, "name", f) for f in (files or [])],
                                        upload_root=Path(demo.GRADIO_CACHE))
                progress(0.05, desc="Loading the model's tokenizer")
                slot = engine.model(model_name)
                store = sup.build_upload_store(sess, docs, slot)
            except Exception as err:  # noqa: BLE001 - a clear message, never a stack trace
                text = sup.message_of(err)
                gr.Warning(text)
                return f"⚠ {text}", gr.skip(), sess, _notice(text)
            return sup.upload_summary(sess, store), sup.UPLOADED, sess, _notice("")

        def show_step(run_id, index, state, request: gr.Request):
            sess = sup.Session.ensure(state, request)
            empty = ("", "", [], [], "", None, None)
            if run_id in (None, ""):
                return (*empty, sess)
            try:
                run, steps = sup.open_run(rec, sess, run_id)
                if not steps:
                    return ("This run recorded no step.", "", [], [], "", None, None, sess)
                v = sup.step_view(rec, run, max(0, min(int(index or 0), len(steps) - 1)),
                                  engine.tokenizer_for(run.get("model")))
            except (KeyError, ValueError) as err:
                return (f"⚠ {str(err).strip(chr(39))}", "", [], [], "", None, None, sess)
            return (v["explanation"], v["suffix"], v["branches"], v["choices"], v["path"], v["tree"], v["mask"],
                    sess)

        def open_run(run_id, state, request: gr.Request):
            sess = sup.Session.ensure(state, request)
            try:
                _, steps = sup.open_run(rec, sess, run_id)
            except (KeyError, ValueError):
                steps = []
            top = max(0, len(steps) - 1)
            return (gr.Slider(minimum=0, maximum=max(1, top), value=0, step=1, label=f"Step (0–{top})",
                              interactive=len(steps) > 1), gr.Timer(active=False), False, gr.Button("▶ Play"))

        def move(delta):
            def go(run_id, index, state, request: gr.Request):
                sess = sup.Session.ensure(state, request)
                try:
                    _, steps = sup.open_run(rec, sess, run_id)
                except (KeyError, ValueError):
                    return gr.skip()
                return max(0, min(int(index or 0) + delta, len(steps) - 1))
            return go

        def toggle_play(is_playing):
            now = not is_playing
            return now, gr.Timer(active=now), gr.Button("⏸ Pause" if now else "▶ Play")

        def tick_play(run_id, index, state, request: gr.Request):
            sess = sup.Session.ensure(state, request)
            try:
                _, steps = sup.open_run(rec, sess, run_id)
            except (KeyError, ValueError):
                return gr.skip(), False, gr.Timer(active=False), gr.Button("▶ Play")
            nxt = int(index or 0) + 1
            if nxt >= len(steps):
                return gr.skip(), False, gr.Timer(active=False), gr.Button("▶ Play")
            return nxt, True, gr.skip(), gr.skip()

        def table(state, request: gr.Request):
            sess = sup.Session.ensure(state, request)
            return sup.run_table(rec, sess), sess

        def pick_history(state, evt: gr.SelectData, request: gr.Request):
            sess = sup.Session.ensure(state, request)
            try:
                run_id = int(evt.row_value[0])
                run, steps = sup.open_run(rec, sess, run_id)
            except (KeyError, ValueError, TypeError, IndexError) as err:
                gr.Warning(str(err))
                return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), sess
            from rest_core.traces import figures

            return (figures.origin_text_html(steps, prompt=run.get("prompt")),
                    sup.fit(figures.speed_figure(steps, run), 460), sup.panel(figures.acceptance_histogram(steps), 420),
                    sup.panel(figures.phase_breakdown(steps), 420), runs_update(sess, run_id), sess)

        def on_explore(text, budget_value, state, request: gr.Request, *values):
            sess = sup.Session.ensure(state, request)
            try:
                out = sup.explore(engine, sess, _settings(values), text, int(budget_value))
            except Exception as err:  # noqa: BLE001
                msg = sup.message_of(err)
                gr.Warning(msg)
                return f"⚠ {msg}", "", [], None, sess
            return out["summary"], out["suffix"], out["continuations"], out["tree"], sess

        # ------------------------------------------------------------ wiring
        demo.load(on_load, [session], [session, run_pick, status])
        status_timer.tick(tick_status, None, [status, status_timer], show_progress="hidden",
                          concurrency_limit=None, api_visibility="private")

        chat_outputs = [chatbot, tree_plot, mask_plot, speed_plot, metrics, notice, message, session, run_pick,
                        status]
        chat_event = message.submit(on_chat, [message, session, *settings], chat_outputs, api_name="chat",
                                    concurrency_id="model", concurrency_limit=1, show_progress="minimal")
        message.stop(None, None, None, cancels=[chat_event])
        clear.click(on_clear, [session], [chatbot, session, notice], api_name="clear")

        race_event = race_btn.click(on_race, [race_prompt, session, *settings],
                                    [race_plain, race_rest, race_verdict, race_speed, notice, session, run_pick],
                                    api_name="race", concurrency_id="model", concurrency_limit=1,
                                    show_progress="minimal")
        race_stop.click(None, None, None, cancels=[race_event])

        build_btn.click(on_build, [uploads, session, model], [upload_status, static, session, notice],
                        api_name="build_datastore", concurrency_id="build", concurrency_limit=1)

        step_outputs = [explanation, suffix, branches, choices, path, step_tree, step_mask, session]
        run_pick.change(open_run, [run_pick, session], [step_slider, play_timer, playing, play],
                        api_visibility="private").then(
            show_step, [run_pick, step_slider, session], step_outputs, api_visibility="private")
        step_slider.change(show_step, [run_pick, step_slider, session], step_outputs, api_name="step",
                           trigger_mode="always_last", concurrency_limit=4, show_progress="hidden")
        back.click(move(-1), [run_pick, step_slider, session], [step_slider], api_visibility="private")
        forward.click(move(+1), [run_pick, step_slider, session], [step_slider], api_visibility="private")
        play.click(toggle_play, [playing], [playing, play_timer, play], api_visibility="private")
        play_timer.tick(tick_play, [run_pick, step_slider, session], [step_slider, playing, play_timer, play],
                        show_progress="hidden", api_visibility="private")
        refresh_runs.click(lambda s, r=None: runs_update(sup.Session.ensure(s)), [session], [run_pick],
                           api_visibility="private")

        refresh_table.click(table, [session], [runs_table, session], api_name="runs")
        history_tab.select(table, [session], [runs_table, session], api_visibility="private")
        runs_table.select(pick_history, [session],
                          [history_text, history_speed, history_accept, history_phases, run_pick, session],
                          api_visibility="private")
        open_steps.click(lambda: gr.Tabs(selected="steps"), None, [tabs], api_visibility="private")

        explore_btn.click(on_explore, [explore_text, explore_budget, session, *settings],
                          [explore_summary, explore_suffix, explore_rows, explore_tree, session], api_name="explore",
                          concurrency_limit=2)
        explore_text.submit(on_explore, [explore_text, explore_budget, session, *settings],
                            [explore_summary, explore_suffix, explore_rows, explore_tree, session],
                            api_visibility="private", concurrency_limit=2)
    return demo


def launch(app: gr.Blocks, **options):
    """Launch with the page's look and upload limit (tests pass prevent_thread_lock, a port...)."""
    return app.launch(**{**LAUNCH_OPTIONS, **options})


demo = build_demo()

if __name__ == "__main__":
    demo.queue(max_size=64)
    launch(demo, server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
           server_port=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
