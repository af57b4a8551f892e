"""Recorded REST runs: store every step, read it back, draw it.

* `TraceRecorder` (recorder) -- runs and their steps in one SQLite file, by default
  `default_db_path()`; its readers return `RunRow` / `StepRow` / `StepDetail` dicts (rows).
* figures -- plotly figures of a step or a run (`draft_tree_figure`, `mask_heatmap`,
  `speed_figure`, `acceptance_histogram`, `phase_breakdown`, `continuation_tree_figure`),
  `source_color` for any source name, and the tinted output text (`origin_spans`,
  `origin_text_html`: every token tinted by its origin, a draft source such as "model" -- the
  model's own recycled predictions -- or "bonus", the token the model adds at each step).
* `RUN_COLUMNS`, `tokens_per_s` (runs) -- the one run table.
* `add_traces_parser`, `run_traces` (cli) -- ``python -m rest_core traces list | show | export``.
"""
from rest_core.traces.cli import add_traces_parser, run_traces
from rest_core.traces.figures import (
                                      acceptance_histogram,
                                      continuation_tree_figure,
                                      draft_tree_figure,
                                      mask_heatmap,
                                      origin_spans,
                                      origin_text_html,
                                      phase_breakdown,
                                      source_color,
                                      speed_figure,
)
from rest_core.traces.recorder import TraceRecorder, default_db_path
from rest_core.traces.rows import RunRow, StepDetail, StepRow
from rest_core.traces.runs import RUN_COLUMNS, tokens_per_s

__all__ = ["RUN_COLUMNS", "RunRow", "StepDetail", "StepRow", "TraceRecorder", "acceptance_histogram",
           "add_traces_parser", "continuation_tree_figure", "default_db_path", "draft_tree_figure", "mask_heatmap",
           "origin_spans", "origin_text_html", "phase_breakdown", "run_traces", "source_color", "speed_figure",
           "tokens_per_s"]
