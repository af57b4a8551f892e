"""Figures of recorded REST runs: pure functions from stored rows to plotly figures.

Inputs are the dicts `TraceRecorder.load_step` (one step: its nodes, branches and
`mask_block`, a `StepDetail`) and `TraceRecorder.load_steps` (the step rows of a run,
`StepRow`s) return, and the run dict of `get_run` (a `RunRow`).  No model or
tokenizer is needed: token texts were stored when the step was recorded.

Colours (`rest_core.traces.palette`): Okabe-Ito, one fixed colour per known source
and a stable fallback for any other source name; fonts sized for a projector.  The
tinted output text (`origin_spans`, `origin_text_html`) lives in
`rest_core.traces.origins` and is re-exported here.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Optional

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from rest_core.phases import PHASES
from rest_core.traces.origins import (
    ORIGIN_STYLES,
    origin_spans,
    origin_text_html,
    source_words,
    step_counts,
    token_origins,
)
from rest_core.traces.palette import (
    ACCEPTED,
    BLUE,
    BONUS,
    FONT,
    GREY,
    PHASE_COLOURS,
    SOURCE_COLOURS,
    VERMILLION,
    source_color,
    source_marker,
    source_order,
)
from rest_core.traces.rows import NodeRow, RunRow, StepDetail, StepRow
from rest_core.traces.tokens import label as _label
from rest_core.traces.tokens import label_room, prob_text, short_label, show_token
from rest_core.tree import ancestors

__all__ = ["ORIGIN_STYLES", "SOURCE_COLOURS", "acceptance_histogram", "continuation_tree_figure",
           "disagreement", "draft_tree_figure", "mask_heatmap", "origin_spans", "origin_text_html", "phase_breakdown",
           "show_token", "source_color", "source_words", "speed_figure", "step_counts", "token_origins", "tree_layout"]


LABEL_PLOT_PX = 560.0  # the narrowest a tree figure is drawn (a half-width panel): labels are cut to fit it
TREE_EXTRA_UNITS = 2.6  # depth units a draft tree figure adds to its deepest node: the bonus token and labels


def _style(fig: go.Figure, title: str, **layout) -> go.Figure:
    fig.update_layout(title=dict(text=title, font=dict(size=22), x=0.01, xanchor="left"), font=FONT,
                      template="plotly_white", hoverlabel=dict(font_size=15), **layout)
    return fig


# ------------------------------------------------------------------ draft tree

def tree_layout(parents: Sequence[int]) -> list[float]:
    """y of every node in a tidy layout: leaves on consecutive rows in depth-first
    order, each parent centred on its first and last child (parents[i] < i)."""
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    y = [0.0] * n
    row, stack = 0, [0] if n else []
    while stack:  # depth-first, children in index order
        i = stack.pop()
        if not children[i]:
            y[i], row = float(row), row + 1
        stack.extend(reversed(children[i]))
    for i in reversed(range(n)):  # children have larger indices than their parent
        if children[i]:
            y[i] = (y[children[i][0]] + y[children[i][-1]]) / 2
    return y


def disagreement(step: StepDetail) -> tuple[int, list[str], str]:
    """(last accepted node, texts of its drafted children, the model's token there)."""
    nodes = step["nodes"]
    last = [n["node"] for n in nodes if n["accepted"]][-1]
    drafted = [n["token_text"] for n in nodes if n["parent"] == last]
    return last, drafted, nodes[last]["model_choice_text"]


def _tree_skeleton(nodes: Sequence[Mapping]) -> tuple[go.Figure, list, list]:
    """A figure holding the tree's edges, and the node coordinates (x = depth, y = tidy layout)."""
    parents = [n["parent"] for n in nodes]
    y = tree_layout(parents)
    x = [n["depth"] for n in nodes]
    fig = go.Figure()
    ex, ey = [], []
    for i in range(1, len(nodes)):
        ex += [x[parents[i]], x[i], None]
        ey += [y[parents[i]], y[i], None]
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#BBBBBB", width=1.5),
                             hoverinfo="skip", name="draft edges", showlegend=False))
    return fig, x, y


def _node_traces(nodes: Sequence[Mapping], x: list, y: list, extra_units: float):
    """Per draft source: its nodes and one marker+label trace for them, coloured by the source and sized
    by score (the root largest), each label above and right of its node (clear of the edges), cut so it
    ends before the next depth (markers shrink in deep trees to leave room); callers add their own text
    colours, outlines, hover and legend name."""
    top = max((n["score"] or 0.0 for n in nodes[1:]), default=0.0) or 1.0
    unit_px = LABEL_PLOT_PX / (max(x, default=0) + extra_units)
    biggest = max(10.0, min(32.0, 0.4 * unit_px))  # the root's size; a draft node's grows with its score
    room = label_room(x, extra_units, LABEL_PLOT_PX, marker_px=biggest)
    for source in source_order(n["source"] for n in nodes):
        members = [n for n in nodes if n["source"] == source]
        yield source, members, go.Scatter(
            x=[x[n["node"]] for n in members], y=[y[n["node"]] for n in members],
            customdata=[n["node"] for n in members], mode="markers+text",
            text=[short_label(n["token_text"], room) for n in members], textposition="top right",
            hoverinfo="text",
            marker=dict(color=source_color(source), symbol=source_marker(source),
                        size=[biggest * 0.7 if n["node"] == 0 else
                              8 + (biggest - 8) * np.sqrt(max(n["score"] or 0, 0) / top)
                              for n in members]))


def draft_tree_figure(step: StepDetail) -> go.Figure:
    """The draft tree of one step: depth left to right, the accepted path in
    vermillion, node size by retrieval score, colour by source, and at the last
    accepted node what the draft offered against what the model chose."""
    nodes = step["nodes"]
    path = [n["node"] for n in nodes if n["accepted"]]
    last, drafted, model_text = disagreement(step)
    fig, x, y = _tree_skeleton(nodes)
    fig.add_trace(go.Scatter(x=[x[i] for i in path], y=[y[i] for i in path], customdata=path,
                             mode="lines", line=dict(color=ACCEPTED, width=6), hoverinfo="skip",
                             name="accepted path"))

    room = label_room(x, TREE_EXTRA_UNITS)
    for source, members, trace in _node_traces(nodes, x, y, TREE_EXTRA_UNITS):
        trace.update(textfont=dict(size=13, color=[ACCEPTED if n["accepted"] else "#222" for n in members]),
                     hovertext=[_node_hover(n) for n in members],
                     name="root (last committed token)" if source == "" else f"drafted by {source}")
        trace.marker.line = dict(color=[BONUS if n["node"] == last else ACCEPTED if n["accepted"] else "white"
                                        for n in members], width=[4 if n["accepted"] else 1 for n in members])
        fig.add_trace(trace)

    bonus_y = max(y) + 1  # a row of its own: the model's token is not part of the draft
    fig.add_trace(go.Scatter(x=[x[last], x[last] + 1], y=[y[last], bonus_y], mode="lines",
                             line=dict(color=BONUS, width=3, dash="dash"), hoverinfo="skip", showlegend=False,
                             name="model's choice"))
    bonus_p = nodes[last].get("choice_prob")
    fig.add_trace(go.Scatter(
        x=[x[last] + 1], y=[bonus_y], mode="markers+text", text=[short_label(step["bonus_text"], room)],
        textposition="middle right", textfont=dict(size=13, color=BONUS),
        marker=dict(symbol="star", size=24, color=BONUS), name="bonus token (the model's own)",
        hovertext=[(f"bonus token {_label(step['bonus_text'])} (id {step['bonus_token']})"
                    + (f", probability {prob_text(bonus_p)}" if bonus_p is not None else "") + "<br>"
                    "produced by the verifying forward pass after the last accepted node")],
        hoverinfo="text"))
    fig.add_annotation(text=disagreement_note(step), xref="paper", yref="paper", x=0, y=1.0, xanchor="left",
                       yanchor="bottom", showarrow=False, font=dict(size=15, color=BONUS),
                       bgcolor="rgba(255,255,255,0.9)", bordercolor=BONUS, name="disagreement")
    n_leaves = len(nodes) - len({n["parent"] for n in nodes} - {-1})
    accepted = len(path) - 1
    return _style(
        fig, f"Step {step['step']}: {len(nodes) - 1} draft tokens, {accepted} accepted + 1 from the model",
        height=max(420, 30 * (n_leaves + 2) + 190), showlegend=True,
        legend=dict(orientation="h", y=-0.12, x=0),
        xaxis=dict(title="depth in the draft tree (0 = last committed token)", dtick=1, zeroline=False,
                   range=[-0.4, max(x) + TREE_EXTRA_UNITS - 0.4]),
        yaxis=dict(visible=False, range=[bonus_y + 0.8, -0.8]),  # first leaf on top
        margin=dict(l=30, r=30, t=110, b=110))


def disagreement_note(step: StepDetail) -> str:
    """Where draft and model parted, with the model's probabilities when they were recorded:
    "draft: ␣cat 0.21, model: ␣dog 0.62" (the drafted children of the last accepted node, the model's token)."""
    nodes = step["nodes"]
    last = [n["node"] for n in nodes if n["accepted"]][-1]
    children = [n for n in nodes if n["parent"] == last]

    def said(text: str, p: Optional[float]) -> str:
        return _label(text) + (f" {prob_text(p)}" if p is not None else "")

    model = said(nodes[last]["model_choice_text"], nodes[last].get("choice_prob"))
    if children:
        offered = ", ".join(said(n["token_text"], n.get("prob")) for n in children[:6])
        more = f" (+{len(children) - 6} more)" if len(children) > 6 else ""
        return f"draft: {offered}{more}, model: {model}"
    if len(nodes) == 1:
        return f"no draft this step, model: {model}"
    return f"draft ends here (leaf), model: {model}"


def top_choices_text(n: Mapping, limit: int = 5) -> str:
    """A node's likeliest next tokens with their probabilities, for a hover ("" when not recorded)."""
    if not n.get("top_texts"):
        return ""
    pairs = list(zip(n["top_texts"], n["top_probs"]))[:limit]
    return "the model's likeliest next tokens: " + ", ".join(f"{_label(t)} {prob_text(p)}" for t, p in pairs)


def _node_hover(n: NodeRow) -> str:
    if n["node"] == 0:
        head = f"root: last committed token {_label(n['token_text'])} (id {n['token_id']})"
        score = f"total retrieval weight {n['score']:g}"
    else:
        head = f"node {n['node']}, depth {n['depth']}: {_label(n['token_text'])} (id {n['token_id']})"
        score = (f"score {n['score']:g}: the model's own earlier prediction after its parent token (recycled)"
                 if n["source"] == "model" else
                 f"retrieval score {n['score']:g}, mostly from {source_words(n['source'])}")
    verdict = "on the accepted path" if n["accepted"] else (
        "matches the model's choice at its parent" if n["chosen"] else "not what the model chose")
    if n.get("prob") is not None:
        verdict += f"; the model gave this token {prob_text(n['prob'])} at its parent"
    if n.get("chance") is not None:
        verdict += f"<br>the cost model's estimate that it would be accepted: {prob_text(n['chance'])}"
    after = f"the model's choice after it: {_label(n['model_choice_text'])}"
    if n.get("choice_prob") is not None:
        after += f" ({prob_text(n['choice_prob'])})"
    top = top_choices_text(n)
    return f"{head}<br>{score}<br>{verdict}<br>{after}" + (f"<br>{top}" if top else "")


# ------------------------------------------------------------------ tree mask

def mask_heatmap(step: StepDetail, show_prefix: bool = True) -> go.Figure:
    """The tree block of the attention mask the model received (row = query node,
    column = key node), labelled with node tokens; an extra column stands for the
    prefix, which every node sees whole."""
    block = np.asarray(step["mask_block"], dtype=bool)
    nodes = step["nodes"]
    labels = [f"{n['node']} {short_label(n['token_text'], 10)}" for n in nodes]
    full = [f"{n['node']} {_label(n['token_text'])}" for n in nodes]
    hover = [[f"query {full[r]} → key {full[c]}: {'may attend' if block[r, c] else 'blocked'}"
              for c in range(len(nodes))] for r in range(len(nodes))]
    scale = [[0, "#EEEEEE"], [0.5, "#EEEEEE"], [0.5, BLUE], [1, BLUE]]
    fig = go.Figure()
    if show_prefix:
        prefix = f"prefix ({step['prefix_len']} tokens)"
        fig.add_trace(go.Heatmap(z=[[1] for _ in nodes], x=[prefix], y=labels, zmin=0, zmax=1, colorscale=scale,
                                 showscale=False, name="prefix", xgap=1, ygap=1, hoverinfo="text",
                                 hovertext=[[f"query {lab} sees all {step['prefix_len']} prefix tokens"]
                                            for lab in full]))
    fig.add_trace(go.Heatmap(
        z=block.astype(int).tolist(), x=labels, y=labels, zmin=0, zmax=1, colorscale=scale, xgap=1, ygap=1,
        name="tree mask", hovertext=hover, hoverinfo="text",
        colorbar=dict(tickvals=[0.25, 0.75], ticktext=["blocked", "may attend"], len=0.4, thickness=18)))
    wrong = int((block != ancestors([n["parent"] for n in nodes])).sum())
    note = ("each node sees the whole prefix, itself and its ancestors" if not wrong else
            f"⚠ {wrong} cells differ from the draft tree's ancestry")
    fig.add_annotation(text=note, xref="paper", yref="paper", x=0, y=1.0, yanchor="bottom", showarrow=False,
                       font=dict(size=15, color=VERMILLION if wrong else "#444"))
    side = max(480, 22 * len(nodes) + 260)
    return _style(fig, f"Step {step['step']}: tree attention mask ({len(nodes)} query tokens, "
                       f"dtype {step.get('mask_dtype', '?')})",
                  width=side + 120, height=side,
                  xaxis=dict(title="key: prefix, then tree nodes", tickangle=-60, tickfont=dict(size=12),
                             side="bottom", type="category"),
                  yaxis=dict(title="query node", autorange="reversed", tickfont=dict(size=12), type="category"),
                  margin=dict(l=140, r=30, t=100, b=140))


# ------------------------------------------------------------------ a run's steps

def speed_figure(steps: Sequence[StepRow], run: Optional[RunRow] = None) -> go.Figure:
    """Tokens per forward pass against plain decoding's one, per step and in total,
    and tokens per second against plain decoding when the run was compared."""
    run = run or {}
    compared = run.get("plain_tokens_per_s") is not None and run.get("wall_s")
    titles = ["tokens produced vs forward passes", "tokens committed per step"] + (
        ["tokens per second"] if compared else [])
    fig = make_subplots(rows=1, cols=len(titles), subplot_titles=titles,
                        column_widths=[0.4, 0.4, 0.2][:len(titles)], horizontal_spacing=0.08)
    passes = list(range(1, len(steps) + 1))
    total = list(accumulate(len(s["new_tokens"]) for s in steps))
    fig.add_trace(go.Scatter(x=passes, y=total, mode="lines+markers", name="REST", line=dict(color=BLUE, width=4),
                             hovertemplate="after %{x} forward passes: %{y} tokens<extra>REST</extra>"), 1, 1)
    fig.add_trace(go.Scatter(x=[0] + passes, y=[0] + passes, mode="lines", name="plain decoding: 1 token per pass",
                             line=dict(color=GREY, width=3, dash="dash"),
                             hovertemplate="%{x} passes: %{y} tokens<extra>plain</extra>"), 1, 1)
    counts = [step_counts(s) for s in steps]
    x = [s["step"] for s in steps]
    fig.add_trace(go.Bar(x=x, y=[c[0] for c in counts], name="accepted draft tokens", marker_color=ACCEPTED,
                         hovertemplate="step %{x}: %{y} accepted draft tokens<extra></extra>"), 1, 2)
    fig.add_trace(go.Bar(x=x, y=[c[1] for c in counts], name="token from the model (bonus)", marker_color=BONUS,
                         hovertemplate="step %{x}: %{y} from the model<extra></extra>"), 1, 2)
    if compared:
        rest = (run.get("new_tokens") or (total[-1] if total else 0)) / run["wall_s"]
        plain = run["plain_tokens_per_s"]
        same = {1: "identical output", 0: "output differs"}.get(run.get("identical"), "")
        speedup = run["speedup"] if run.get("speedup") is not None else rest / plain
        fig.add_trace(go.Bar(x=["plain", "REST"], y=[plain, rest], marker_color=[GREY, BLUE], showlegend=False,
                             text=[f"{plain:.1f}", f"{rest:.1f}"], textposition="outside", name="tokens per second",
                             hovertemplate="%{x}: %{y:.2f} tokens/s<extra></extra>"), 1, 3)
        # two lines, so the title fits the narrow third panel; room above the bars for their labels
        fig.layout.annotations[2].text = f"tokens per second<br>({speedup:.2f}×{', ' + same if same else ''})"
        fig.update_yaxes(title_text="tokens / s", row=1, col=3, range=[0, 1.2 * max(plain, rest, 1e-9)])
    per_pass = total[-1] / len(steps) if steps else 0.0
    fig.update_xaxes(title_text="forward passes", row=1, col=1)
    fig.update_yaxes(title_text="tokens produced", row=1, col=1)
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_yaxes(title_text="tokens", row=1, col=2)
    fig.update_annotations(font_size=18)
    return _style(fig, f"Speed: {total[-1] if total else 0} tokens in {len(steps)} forward passes "
                       f"({per_pass:.2f} tokens per pass)", barmode="stack", height=520,
                  legend=dict(orientation="h", y=-0.2, x=0), margin=dict(t=110, b=130))


def acceptance_histogram(steps: Sequence[StepRow]) -> go.Figure:
    """How many draft tokens each step accepted (the bonus token not counted)."""
    accepted = [s["accepted_len"] for s in steps]
    counts = Counter(accepted)
    xs = list(range(max(accepted, default=0) + 1))
    ys = [counts.get(k, 0) for k in xs]
    mean = sum(accepted) / len(accepted) if accepted else 0.0
    fig = go.Figure(go.Bar(x=xs, y=ys, marker_color=ACCEPTED, text=ys, textposition="outside",
                           name="steps", hovertemplate="%{y} steps accepted %{x} draft tokens<extra></extra>"))
    fig.add_vline(x=mean, line=dict(color=BLUE, width=3, dash="dash"),
                  annotation=dict(text=f"mean {mean:.2f}", font=dict(size=16, color=BLUE)))
    return _style(fig, f"Accepted draft tokens per step ({len(accepted)} steps)", height=460,
                  xaxis=dict(title="draft tokens accepted in the step (bonus token not counted)", dtick=1),
                  yaxis=dict(title="steps"), bargap=0.15)


def phase_breakdown(steps: Sequence[StepRow]) -> go.Figure:
    """Milliseconds per phase: per step (stacked) and the mean share of each phase."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.68, 0.32], horizontal_spacing=0.12,
                        subplot_titles=["per step", "mean per step"])
    x = [s["step"] for s in steps]
    means = {}
    for phase in PHASES:
        ms = [s.get(f"t_{phase}_ms") or 0.0 for s in steps]
        means[phase] = sum(ms) / len(ms) if ms else 0.0
        fig.add_trace(go.Bar(x=x, y=ms, name=phase, marker_color=PHASE_COLOURS[phase], legendgroup=phase,
                             hovertemplate=f"step %{{x}}: {phase} %{{y:.2f}} ms<extra></extra>"), 1, 1)
    whole = sum(means.values()) or 1.0
    fig.add_trace(go.Bar(y=list(PHASES), x=[means[p] for p in PHASES], orientation="h", showlegend=False,
                         marker_color=[PHASE_COLOURS[p] for p in PHASES], name="mean",
                         text=[f"{means[p]:.1f} ms ({100 * means[p] / whole:.0f}%)" for p in PHASES],
                         textposition="auto", hovertemplate="%{y}: %{x:.2f} ms per step<extra></extra>"), 1, 2)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(title_text="milliseconds", row=1, col=1)
    fig.update_xaxes(title_text="milliseconds", row=1, col=2)
    fig.update_yaxes(autorange="reversed", row=1, col=2)
    fig.update_annotations(font_size=18)
    return _style(fig, f"Where the time goes: {whole:.1f} ms per step on average", barmode="stack", height=500,
                  legend=dict(orientation="h", y=-0.2, x=0), margin=dict(t=110, b=120))


# ------------------------------------------------------------------ datastore explorer

def continuation_tree_figure(nodes: Sequence[Mapping]) -> go.Figure:
    """The draft tree retrieval would propose, before any model checks it: depth left
    to right, node size by retrieval score, colour by the store contributing most.
    `nodes`: dicts with node, parent, depth, token_text, score, source (node 0 = root)."""
    fig, x, y = _tree_skeleton(nodes)
    top = max((n["score"] or 0.0 for n in nodes[1:]), default=0.0) or 1.0
    total = nodes[0]["score"] if nodes and nodes[0]["score"] else top
    for source, members, trace in _node_traces(nodes, x, y, 2.0):
        trace.update(textfont=dict(size=13, color="#222"),
                     hovertext=[f"{_label(n['token_text'])}: depth {n['depth']}, "
                                + ("the context's last token" if n["node"] == 0 else
                                   f"share of the retrieval weight {100 * (n['score'] or 0) / total:.0f}%")
                                for n in members],
                     name="last context token" if source == "" else f"from {source_words(source)}")
        trace.marker.line = dict(color="white", width=1)
        fig.add_trace(trace)
    n_leaves = len(nodes) - len({n["parent"] for n in nodes} - {-1})
    return _style(fig, f"The draft tree retrieval proposes: {len(nodes) - 1} tokens",
                  height=max(380, 26 * (n_leaves + 1) + 160), showlegend=True,
                  legend=dict(orientation="h", y=-0.12, x=0),
                  xaxis=dict(title="depth (0 = last context token)", dtick=1, zeroline=False,
                             range=[-0.4, max(x, default=0) + 1.6]),
                  yaxis=dict(visible=False, range=[max(y, default=0) + 0.8, -0.8]),  # first leaf on top, none cut
                  margin=dict(l=30, r=30, t=70, b=100))
