"""The page's teaching parts: the "What if" panel of the step-through, the tour's card and button,
and their wiring (handlers in rest_core/app/page.py; the highlight and the keys in assets/tour.js)."""
from __future__ import annotations

import gradio as gr

from rest_core.app.page import (
    Page,
    bound,
    on_what_if,
    tour_back,
    tour_close,
    tour_next,
    tour_start,
    what_if_defaults,
)
from rest_core.app.whatif import AS_RECORDED, AUTO, FIXED, WhatIf

WHAT_IF_NOTE = ("Run the step shown above again on the run's model, with another draft budget, suffix lengths, "
                "continuation length or set of stores: the context is the run's prompt and everything committed "
                "before this step. The new draft tree and the path the model accepts appear beside what happened. "
                "It waits for its turn like a chat answer.")
SOURCE_CHOICES = [("static store", "static"), ("request store", "request"),
                  ("history store (replayed from the trace)", "history"),
                  ("model's own predictions (replayed from the trace)", "model"),
                  ("general-text store (replayed from the trace)", "answers")]


def build_what_if(page: Page) -> None:
    """The "What if" panel under the step-through's panels: its settings, button and the two sides."""
    own = WhatIf()
    with gr.Accordion("What if… this step ran with other settings?", open=True, elem_id="whatif"):
        gr.Markdown(WHAT_IF_NOTE)
        with gr.Row(equal_height=False):
            c = page.whatif_controls = {}
            c["budget_mode"] = gr.Radio([AS_RECORDED, AUTO, FIXED], value=own.budget_mode, label="Draft budget",
                                        elem_id="whatif-budget-mode", info="as recorded: the nodes the run kept; "
                                        "auto: the cost model now; fixed: the number on the right")
            c["budget"] = gr.Slider(0, 64, value=own.budget, step=1, label="Fixed budget (draft tokens)",
                                    elem_id="whatif-budget")
            c["n_max"] = gr.Slider(1, 32, value=own.n_max, step=1, label="Longest suffix (n_max)",
                                   elem_id="whatif-n-max")
            c["n_min"] = gr.Slider(1, 8, value=own.n_min, step=1, label="Shortest suffix (n_min)",
                                   elem_id="whatif-n-min")
            c["continuation_len"] = gr.Slider(1, 32, value=own.continuation_len, step=1,
                                              label="Continuation length", elem_id="whatif-continuation")
        c["sources"] = gr.CheckboxGroup(SOURCE_CHOICES, value=list(own.sources), label="Stores",
                                        elem_id="whatif-sources")
        page.whatif_btn = gr.Button("What if? Run this step again", variant="primary", elem_id="whatif-btn")
        page.whatif_summary = gr.HTML(elem_id="whatif-summary")
        with gr.Row(equal_height=False):
            with gr.Column():
                gr.Markdown("#### What happened")
                page.whatif_recorded = gr.Plot(show_label=False, elem_id="whatif-recorded")
                page.whatif_recorded_path = gr.HTML(elem_id="whatif-recorded-path")
            with gr.Column():
                gr.Markdown("#### What if")
                page.whatif_tree = gr.Plot(show_label=False, elem_id="whatif-tree")
                page.whatif_path = gr.HTML(elem_id="whatif-path")


def build_tour_button(page: Page) -> None:
    page.tour_btn = gr.Button("▶ Take the tour", size="sm", variant="primary", elem_id="tour-start", scale=0)


def build_tour(page: Page) -> None:
    """The tour's card: fixed at the bottom of the window, large text, Back / Next / Close."""
    page.tour_at = gr.State(-1)
    with gr.Column(visible=False, elem_id="tour") as page.tour_box:
        page.tour_card = gr.HTML(elem_id="tour-card")
        with gr.Row():
            page.tour_back = gr.Button("← Back", elem_id="tour-back", size="lg")
            page.tour_next = gr.Button("Next →", elem_id="tour-next", variant="primary", size="lg")
            page.tour_close = gr.Button("Close", elem_id="tour-close", size="lg")


def wire_teach(page: Page, decode_handlers: int) -> None:
    """The tour's buttons and the "What if" panel."""
    private = dict(api_visibility="private")
    tour_out = [page.tabs, page.run_pick, page.step_slider, page.tour_box, page.tour_card, page.tour_at,
                page.tour_back, page.tour_next, page.session]
    page.tour_btn.click(bound(tour_start, page), [page.session], tour_out, **private)
    page.tour_next.click(bound(tour_next, page), [page.tour_at, page.session], tour_out, **private)
    page.tour_back.click(bound(tour_back, page), [page.tour_at, page.session], tour_out, **private)
    page.tour_close.click(bound(tour_close, page), [page.session], tour_out, **private)
    controls = list(page.whatif_controls.values())
    outs = [page.whatif_summary, page.whatif_recorded, page.whatif_tree, page.whatif_recorded_path, page.whatif_path]
    page.run_pick.change(bound(what_if_defaults, page), [page.run_pick, page.session], [*outs, *controls], **private)
    page.whatif_btn.click(bound(on_what_if, page), [page.run_pick, page.step_slider, *controls, page.session],
                          [*outs, page.session], api_name="what_if", concurrency_id="model",
                          concurrency_limit=decode_handlers, show_progress="minimal")
