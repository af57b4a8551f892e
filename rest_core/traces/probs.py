"""What the model thought at one node of a recorded step: its likeliest next tokens as bars, the
drafted children among them, the token it chose, and for a sampled step the uniform number drawn;
and the same draw repeated many times, to see why exact sampling is exact (`sampling_check`).

Pure functions of a `StepDetail` (`TraceRecorder.load_step`), like `rest_core.traces.figures`.
A step recorded before probabilities were stored has none: `has_probs` says so and the figure
says so in its title.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import plotly.graph_objects as go
import torch

from rest_core.sampling import draw_uniform, token_at
from rest_core.traces.origins import source_words
from rest_core.traces.palette import BONUS, FONT, GREY, source_color, source_marker, source_pattern
from rest_core.traces.rows import StepDetail
from rest_core.traces.tokens import label, prob_text


def has_probs(step: Mapping) -> bool:
    """The step was recorded with the model's probabilities."""
    return bool(step["nodes"]) and all(n.get("top_tokens") is not None for n in step["nodes"])


def node_rows(step: Mapping, node: int) -> list[dict]:
    """The bars of one node: its likeliest next tokens, then any drafted child outside them, each with
    its probability, whether it was drafted (and by which source) and whether the model chose it."""
    nodes = step["nodes"]
    n = nodes[node]
    children = {c["token_id"]: c for c in nodes if c["parent"] == node}
    rows = []
    for tok, text, p in zip(n.get("top_tokens") or [], n.get("top_texts") or [], n.get("top_probs") or []):
        child = children.pop(tok, None)
        rows.append({"token": tok, "text": text, "p": p, "child": child, "chosen": tok == n["model_choice"]})
    for tok, child in children.items():  # drafted, but not among the model's likeliest
        rows.append({"token": tok, "text": child["token_text"], "p": child.get("prob"), "child": child,
                     "chosen": tok == n["model_choice"]})
    if not any(r["chosen"] for r in rows) and n.get("choice_prob") is not None:
        rows.append({"token": n["model_choice"], "text": n["model_choice_text"], "p": n["choice_prob"],
                     "child": None, "chosen": True})
    return rows


def node_choice_sentence(step: Mapping, node: int) -> str:
    """One sentence: what the model gave its choice after `node`, and what the draft offered there."""
    rows = node_rows(step, node)
    if not rows:
        return ""
    n = step["nodes"][node]
    choice = next(r for r in rows if r["chosen"])
    words = f"After “{label(n['token_text'])}” the model gave “{label(choice['text'])}” {prob_text(choice['p'])}"
    offered = [r for r in rows if r["child"] is not None and not r["chosen"]]
    if offered:
        words += ", the draft offered " + ", ".join(f"“{label(r['text'])}” at {prob_text(r['p'])}"
                                                    for r in offered[:4])
    return words + "."


def node_probs_figure(step: StepDetail, node: int, sampled: Optional[bool] = None) -> go.Figure:
    """Bars of the model's next-token probabilities after one node: drafted children in their source's
    colour and pattern, the model's choice outlined in the bonus colour, the rest grey; for a node a
    sampled step visited, the uniform number drawn there and what it selected."""
    nodes = step["nodes"]
    node = max(0, min(int(node), len(nodes) - 1))
    n = nodes[node]
    rows = node_rows(step, node)
    fig = go.Figure()
    if not rows:
        return _style(fig, f"Node {node} “{label(n['token_text'])}”: probabilities were not recorded for this step",
                      160)
    rest = max(0.0, 1.0 - sum(r["p"] or 0.0 for r in rows))
    texts = [f"{label(r['text'])}" for r in rows] + ["all other tokens"]
    values = [r["p"] or 0.0 for r in rows] + [rest]
    colours = [source_color(r["child"]["source"]) if r["child"] else GREY for r in rows] + ["#DDDDDD"]
    patterns = [source_pattern(r["child"]["source"]) if r["child"] else "" for r in rows] + [""]
    outline = [BONUS if r["chosen"] else "white" for r in rows] + ["white"]
    hover = [_bar_hover(r, n) for r in rows] + [f"every other token together: {prob_text(rest)}"]
    fig.add_trace(go.Bar(y=texts, x=values, orientation="h", name="probability", hovertext=hover, showlegend=False,
                         hoverinfo="text", text=[prob_text(v) for v in values], textposition="outside",
                         marker=dict(color=colours, pattern=dict(shape=patterns, fillmode="overlay", size=8),
                                     line=dict(color=outline, width=[3 if r["chosen"] else 1 for r in rows] + [1])),
                         customdata=[r["token"] for r in rows] + [-1]))
    for source in sorted({r["child"]["source"] for r in rows if r["child"]}):  # a legend of the drafted marks
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"drafted by {source_words(source)}",
                                 marker=dict(color=source_color(source), symbol=source_marker(source),
                                             size=12)))
    u = n.get("uniform")
    title = f"After node {node} “{label(n['token_text'])}”: the model's next token"
    if u is not None or sampled:
        title += " (drawn from this distribution)"
    if u is not None:
        fig.add_annotation(text=f"uniform number drawn here: u = {u:.4f} → “{label(n['model_choice_text'])}”",
                           xref="paper", yref="paper", x=0, y=1.0, yanchor="bottom", xanchor="left",
                           showarrow=False, font=dict(size=14, color=BONUS))
    fig.update_layout(showlegend=True, legend=dict(orientation="h", y=-0.25, x=0))
    fig.update_xaxes(title_text="probability", range=[0, min(1.0, max(values) * 1.3 + 0.05)])
    fig.update_yaxes(autorange="reversed", type="category")
    return _style(fig, title, 120 + 34 * len(texts))


def _bar_hover(row: Mapping, n: Mapping) -> str:
    what = []
    if row["child"] is not None:
        what.append(f"drafted here (node {row['child']['node']}, by {source_words(row['child']['source'])})")
    if row["chosen"]:
        what.append("the model's token here")
    return (f"{label(row['text'])} (id {row['token']}): {prob_text(row['p'])}"
            + ("<br>" + "; ".join(what) if what else ""))


def _style(fig: go.Figure, title: str, height: int) -> go.Figure:
    fig.update_layout(title=dict(text=title, font=dict(size=17), x=0.01, xanchor="left"), font=FONT,
                      template="plotly_white", height=max(260, height), margin=dict(l=110, r=40, t=80, b=70),
                      hoverlabel=dict(font_size=14))
    return fig


def node_choices(step: Mapping) -> list[tuple[str, int]]:
    """(label, node) for a node picker: every node, the accepted path marked."""
    return [(f"{n['node']}: {label(n['token_text'])}{' ✓' if n['accepted'] else ''}", int(n["node"]))
            for n in step["nodes"]]


def last_accepted(nodes: Sequence[Mapping]) -> int:
    """The node where the model parted from the draft (the last accepted one)."""
    return [n["node"] for n in nodes if n["accepted"]][-1]


def sampling_check(step: Mapping, node: int, draws: int = 2000, seed: int = 0) -> dict:
    """Draw the token after `node` `draws` times with the verifier's rule and with the reference code's
    biased rule, from the distribution recorded there (its likeliest tokens exactly, every other token as
    one bucket), and count what each commits at this position.

    Exact rule (rest_core.verify): draw y ~ p with one uniform; a drafted child equal to y is accepted,
    else y is the bonus token: every token is committed with probability p.  Biased rule: accept each
    drafted child c with probability p(c) in turn, and on rejecting all draw a fresh y ~ p: drafted tokens
    come out more often than p says."""
    rows = node_rows(step, node)
    if not rows:
        raise ValueError(f"Step {step['step']} was recorded without the model's probabilities.")
    p = torch.tensor([r["p"] or 0.0 for r in rows] + [max(0.0, 1.0 - sum(r["p"] or 0.0 for r in rows))],
                     dtype=torch.float64)
    drafted = [i for i, r in enumerate(rows) if r["child"] is not None]
    gen = torch.Generator().manual_seed(seed)
    exact = torch.zeros(len(p), dtype=torch.long)
    biased = torch.zeros(len(p), dtype=torch.long)
    for _ in range(draws):
        exact[token_at(p, draw_uniform(gen))] += 1  # accepted when drafted, else the bonus: the same token
        for i in drafted:
            if draw_uniform(gen) < float(p[i]):
                biased[i] += 1
                break
        else:
            biased[token_at(p, draw_uniform(gen))] += 1
    return {"texts": [label(r["text"]) for r in rows] + ["all other tokens"], "p": p.tolist(),
            "drafted": drafted, "exact": (exact.double() / draws).tolist(),
            "biased": (biased.double() / draws).tolist(), "draws": draws, "node": node}


def sampling_check_figure(check: Mapping) -> go.Figure:
    """The model's probabilities beside how often each token came out of the exact rule and the biased
    one, with the binomial 3-sigma band of `draws` draws around each probability."""
    n, texts = check["draws"], check["texts"]
    sigma = [3 * (p * (1 - p) / n) ** 0.5 for p in check["p"]]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=texts, y=check["p"], name="the model's probability", marker_color=GREY,
                         error_y=dict(type="data", array=sigma, color="#555", thickness=1.5),
                         hovertemplate="%{x}: p = %{y:.3f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=texts, y=check["exact"], mode="markers", name="committed by REST's rule (exact)",
                             marker=dict(symbol="diamond", size=14, color=BONUS, line=dict(color="white", width=1)),
                             hovertemplate="%{x}: %{y:.3f} of the draws<extra>exact</extra>"))
    fig.add_trace(go.Scatter(x=texts, y=check["biased"], mode="markers", name="a biased rule (re-draw on reject)",
                             marker=dict(symbol="x", size=12, color="#333"),
                             hovertemplate="%{x}: %{y:.3f} of the draws<extra>biased</extra>"))
    worst = max(abs(e - p) / s if s else 0.0 for e, p, s in zip(check["exact"], check["p"], sigma))
    drafted = ", ".join(texts[i] for i in check["drafted"]) or "none"
    fig.add_annotation(text=f"drafted: {drafted} · REST within {worst:.2f}× the 3-sigma band", xref="paper",
                       yref="paper", x=0, y=1.0, yanchor="bottom", xanchor="left", showarrow=False,
                       font=dict(size=14, color=BONUS))
    fig.update_layout(legend=dict(orientation="h", y=-0.3, x=0), showlegend=True, barmode="overlay")
    fig.update_xaxes(type="category")
    fig.update_yaxes(title_text="probability / frequency")
    return _style(fig, f"{n:,} draws after node {check['node']}: what is committed", 420)
