"""What the REST Lab page (app.py) needs besides its widgets.

Public face:

* `Engine` (engine) -- models, built-in stores, cost models and the trace store shared by
  every visitor; one decode at a time per model.
* `Session` (session) -- one visitor's folder, uploads and the store built from them, chat,
  past answers, their table of the model's own predictions (source "model", never saved) and
  runs; `save_uploads`, `build_upload_store`, `prune_sessions`.
* `Settings` (settings) -- every control of the page, by name; limits and `message_of`.
* `chat_turn`, `race` (live) -- a decode as a stream of `View`s, redrawn from the recorded steps.
* `step_view`, `explain_step`, `run_table` (replay) -- recorded runs replayed without the model.
* `explore` (explorer) -- what retrieval would draft for a context.
* `Page` and the event handlers (page) -- what each control of the page does; `build_demo`,
  `launch`, `main` (ui) -- the page itself, one builder per tab (app.py and `rest-lab-app` serve
  it). Neither is re-exported here: both need gradio.

* `Policy` (policy) -- public mode: which models a visitor may use, and every limit; `Visitors`
  (visitors) -- who a visitor is (the client address behind a request) and the sessions one address
  holds; `Turns` (turns) -- the line of decodes; `Recording` (recording) -- a run's recording, which
  never stops its decode; `UploadLedger` and `UploadGuard` (guard) -- the room uploads take on a public
  server, and the upload route's guard; `status_text` (status) -- the status line.

* `WhatIf`, `replay_plan`, `replay_step` (whatif) and `what_if_views` (whatif_view) -- a recorded
  step run again with other settings on the run's model, beside what happened; `STOPS` (tour) -- the
  tour over the example run that ships with the page (replay's `example_run`).

Modules import downstream only: settings → policy → status, visitors, turns, streaming → slots → engine →
session → recording → decoding / panels, markup → explain → live, replay → whatif → whatif_view, tour, explorer → page
→ ui_teach → ui; guard after session.
"""
from rest_core.app.engine import Engine
from rest_core.app.explorer import explore
from rest_core.app.live import View, chat_turn, race, race_verdict, special_texts
from rest_core.app.markup import origin_legend_html, plain_answer_html, token_html, user_bubble
from rest_core.app.panels import best_step, compact, fit, live_figures, metrics_html, panel, waiting_figure
from rest_core.app.replay import (
    BRANCH_HEADERS,
    CHOICE_HEADERS,
    RUN_TABLE_HEADERS,
    check_run,
    explain_step,
    open_run,
    phase_title,
    run_choices,
    run_panels,
    run_table,
    step_count,
    step_panel,
    step_view,
    visible_runs,
)
from rest_core.app.session import (
    Session,
    build_upload_store,
    discard_session,
    open_upload_store,
    prune_sessions,
    save_uploads,
    sessions_root,
    upload_summary,
)
from rest_core.app.settings import (
    ANSWERS_ALWAYS,
    ANSWERS_CHAT,
    ANSWERS_NEVER,
    BUILT_IN,
    NO_STATIC,
    SETTING_NAMES,
    UPLOADED,
    Cancelled,
    Settings,
    UploadError,
    message_of,
    settings_from,
)
from rest_core.app.slots import ModelSlot, StoreSlot
from rest_core.app.streaming import drain, stream_in_thread

__all__ = ["ANSWERS_ALWAYS", "ANSWERS_CHAT", "ANSWERS_NEVER",
           "BRANCH_HEADERS", "BUILT_IN", "CHOICE_HEADERS", "NO_STATIC", "RUN_TABLE_HEADERS", "SETTING_NAMES",
           "UPLOADED", "Cancelled", "Engine", "ModelSlot", "Session", "Settings", "StoreSlot", "UploadError", "View",
           "best_step", "build_upload_store", "chat_turn", "check_run", "compact", "discard_session", "drain",
           "explain_step", "explore", "fit", "live_figures", "message_of", "metrics_html", "open_run",
           "open_upload_store", "origin_legend_html", "panel", "phase_title", "plain_answer_html", "prune_sessions",
           "race", "race_verdict", "run_choices", "run_panels", "run_table", "save_uploads", "sessions_root",
           "settings_from", "special_texts", "step_count", "step_panel", "step_view", "stream_in_thread", "token_html",
           "upload_summary", "user_bubble", "visible_runs", "waiting_figure"]
