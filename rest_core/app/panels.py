"""The figures and running numbers beside the chat, drawn from stored step rows.

The page is redrawn from what the trace store holds (what is shown is what is
stored); `StepRows` reads only the steps recorded since the last redraw.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import plotly.graph_objects as go

from rest_core.phases import PHASES
from rest_core.traces import figures
from rest_core.traces.recorder import TraceRecorder


class StepRows:
    """A run's step rows as read so far; `refresh` reads only the steps recorded since."""

    def __init__(self, recorder: TraceRecorder, run_id: int):
        self.recorder, self.run_id = recorder, run_id
        self.rows: list[dict] = []

    def refresh(self) -> list[dict]:
        since = self.rows[-1]["step"] + 1 if self.rows else 0
        self.rows += self.recorder.load_steps(self.run_id, since_step=since)
        return self.rows


def best_step(steps: list[dict]) -> int:
    """The step to show when a run is over: the one that accepted most drafts (latest on ties)."""
    return max(steps, key=lambda s: (s["accepted_len"], s["step"]))["step"]


def fit(fig: go.Figure, height: Optional[int] = None) -> go.Figure:
    """Let a stored-size figure follow its container's width."""
    fig.update_layout(width=None, autosize=True, **({"height": height} if height else {}))
    return fig


def compact(fig: go.Figure, height: int, bottom: int = 70) -> go.Figure:
    """A figure sized for the live side panel: smaller fonts and margins."""
    fig.update_layout(width=None, autosize=True, height=height, font=dict(size=12),
                      title=dict(font=dict(size=16)), margin=dict(l=40, r=20, t=56, b=bottom))
    fig.update_annotations(font_size=12)
    return fig


def waiting_figure(text: str, height: int = 220) -> go.Figure:
    """An empty panel saying what will be drawn there.  Shown when the page opens, it also has the browser
    load its plotting library then, not in the middle of the first answer (on 2 cores that took the cores
    from the decode for a second)."""
    fig = go.Figure()
    fig.add_annotation(text=text, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=13, color="#666"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(height=height, autosize=True, margin=dict(l=10, r=10, t=10, b=10),
                      plot_bgcolor="rgba(0,0,0,0)", paper_bgcolor="rgba(0,0,0,0)")
    return fig


def panel(fig: go.Figure, height: int) -> go.Figure:
    """A stored-size figure for a half-width panel."""
    fig = compact(fig, height, bottom=120)
    fig.update_layout(font=dict(size=13), legend=dict(y=-0.22, font=dict(size=12)))
    return fig


def live_figures(rec: TraceRecorder, run_id: int, steps: list[dict], step_no: int,
                 run: Optional[dict] = None) -> tuple[go.Figure, go.Figure, go.Figure]:
    """Draft tree and tree mask of one stored step, and the run's speed so far, for the side panel."""
    step = rec.load_step(run_id, step_no)
    tree = compact(figures.draft_tree_figure(step), 520, bottom=110)
    tree.update_layout(legend=dict(y=-0.28, font=dict(size=11)))
    mask = compact(figures.mask_heatmap(step), 420, bottom=110)
    speed = compact(figures.speed_figure(steps, run), 360, bottom=110)
    speed.update_layout(legend=dict(y=-0.35, font=dict(size=11)))
    return tree, mask, speed


def step_ms(step: dict) -> float:
    """A stored step's time, all phases together."""
    return sum(step.get(f"t_{p}_ms") or 0.0 for p in PHASES)


def plain_estimate_ms(steps: list[dict], calibrated_ms: Optional[float],
                      measured_ms: Optional[float] = None) -> tuple[Optional[float], str]:
    """Time per token of plain decoding: as measured by a plain decode in this process, else estimated by the
    median time of this run's draft-free steps (one token per pass, same load, same context), else the
    one-token pass calibrated on this machine."""
    if measured_ms:
        return measured_ms, "plain decoding as measured in this server"
    free = sorted(step_ms(s) for s in steps if s["draft_size"] == 0 and s.get("t_forward_ms"))
    if len(free) >= 3:
        return free[len(free) // 2], f"the median of this run's {len(free)} draft-free steps"
    if calibrated_ms:
        return calibrated_ms, "the one-token forward pass calibrated on this machine"
    return None, ""


def metrics_html(steps: list[dict], elapsed_s: float, plain_ms: Optional[float] = None,
                 state: str = "running", measured_ms: Optional[float] = None) -> str:
    """Running figures: tokens per forward pass, tokens/s and the estimated speedup (REST's wall time so far
    against plain decoding's time per token, `measured_ms` when a plain decode measured it)."""
    tokens = sum(len(s["new_tokens"]) for s in steps)
    passes = len(steps)
    drafted = sum(figures.step_counts(s)[0] for s in steps)
    per_pass = tokens / passes if passes else 0.0
    rate = tokens / elapsed_s if elapsed_s > 0 else 0.0
    cells = [("tokens", f"{tokens}"), ("forward passes", f"{passes}"), ("tokens / pass", f"{per_pass:.2f}"),
             ("from drafts", f"{100 * drafted / tokens:.0f}%" if tokens else "–"), ("tokens / s", f"{rate:.1f}")]
    note = ""
    per_token, how = plain_estimate_ms(steps, plain_ms, measured_ms)
    rest_ms = max(sum(step_ms(s) for s in steps), 1e3 * elapsed_s)  # the wall time, as a race times REST
    if per_token and rest_ms:
        cells.append(("speedup (est.)", f"{tokens * per_token / rest_ms:.2f}×"))
        note = (f'<div class="metric-note">Speedup estimated against plain decoding at {per_token:.1f} ms per '
                f"token ({how}); the Race tab measures it side by side.</div>")
    body = "".join(f'<div class="metric"><div class="metric-v">{v}</div><div class="metric-k">{k}</div></div>'
                   for k, v in cells)
    return f'<div class="metrics" data-state="{state}">{body}</div>{note}'


def why_speed_html(steps: list[dict], plain_ms_per_token: Optional[float], rest_ms_per_pass: Optional[float] = None,
                   curve: Optional[Callable[[int], float]] = None, measured: str = "") -> str:
    """The break-even arithmetic of a run on this machine: tokens per forward pass, what a pass over a
    tree of that size costs against a one-token pass, and the speedup they make (tokens per pass ÷ cost
    per pass relative to a plain token).  `plain_ms_per_token`: plain decoding's time per token (measured
    by a race, else estimated); `rest_ms_per_pass`: REST's time per step (default: the sum of the stored
    phases); `curve(q)`: the forward-pass time of q tokens as calibrated on this machine."""
    passes = len(steps)
    if not passes or not plain_ms_per_token:
        return ""
    tokens = sum(len(s["new_tokens"]) for s in steps)
    per_pass = tokens / passes
    rest_ms = rest_ms_per_pass or sum(step_ms(s) for s in steps) / passes
    forward = [s["t_forward_ms"] for s in steps if s.get("t_forward_ms")]
    fwd_ms = sum(forward) / len(forward) if forward else None
    q = sum(s["draft_size"] + 1 for s in steps) / passes
    relative = rest_ms / plain_ms_per_token
    speedup = per_pass / relative
    lines = [f"<b>tokens per pass</b>: {tokens} tokens in {passes} forward passes = <b>{per_pass:.2f}</b> "
             f"(plain decoding: 1.00)"]
    if curve is not None:
        one, tree = curve(1), curve(max(1, round(q)))
        lines.append(f"<b>cost of a tree pass</b>: the model's pass over {q:.1f} tokens (this run's mean tree, root "
                     f"included) costs {tree:.0f} ms on this machine against {one:.0f} ms for one token: "
                     f"<b>{tree / one:.2f}×</b> (the measured cost curve)")
    if fwd_ms:
        lines.append(f"<b>this run's steps</b>: forward pass {fwd_ms:.0f} ms, the whole step (retrieve, tree, "
                     f"forward, verify, commit{', trace' if rest_ms_per_pass else ''}) {rest_ms:.0f} ms")
    lines.append(f"<b>cost per pass</b>: {rest_ms:.0f} ms ÷ {plain_ms_per_token:.0f} ms per plain token "
                 f"({measured or 'estimated'}) = <b>{relative:.2f}×</b>")
    verdict = "faster" if speedup >= 1 else "slower: each pass costs more than the tokens it brings"
    lines.append(f"<b>speedup</b> = tokens per pass ÷ cost per pass = {per_pass:.2f} ÷ {relative:.2f} = "
                 f"<b>{speedup:.2f}×</b> ({verdict}); to break even a pass must bring {relative:.2f} tokens")
    items = "".join(f"<li>{line}</li>" for line in lines)
    return f'<div class="why-speed" id="why-speed"><b>Why this speed</b><ul>{items}</ul></div>'
