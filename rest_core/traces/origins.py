"""Where each committed token came from: an accepted draft token of some source (one of them,
"model", is the model's own earlier prediction, recycled), or the bonus token the model adds
at the end of every step (origin "bonus"); drawn as tinted text for the chat and the export page."""
from __future__ import annotations

import html
from collections import Counter
from collections.abc import Sequence
from typing import Optional

from rest_core.traces.palette import BONUS, source_color, tint
from rest_core.traces.rows import StepRow

ORIGIN_STYLES = {  # the known origins: background tint (dark text stays legible), description
    "static": (tint(source_color("static"), 0.25), "accepted draft, static store"),
    "answers": (tint(source_color("answers"), 0.22), "accepted draft, general-text store (the model's answers)"),
    "request": (tint(source_color("request"), 0.35), "accepted draft, this request (prompt + output)"),
    "history": (tint(source_color("history"), 0.30), "accepted draft, history of past outputs"),
    "model": (tint(source_color("model"), 0.50), "accepted draft, model's own prediction (recycled)"),
    "dense": (tint(source_color("dense"), 0.35), "accepted draft, dense store (where the model's state was near)"),
    "bonus": (tint(BONUS, 0.30), "from the model (bonus token)"),
}
SOURCE_WORDS = {"model": "the model's own earlier predictions (recycled)",  # how a sentence names a source
                "answers": "the general-text store (the model's own answers to other requests)",
                "dense": "the dense store (corpus places where the model's hidden state was near)"}
STEP_EDGE = "border-left:1px solid rgba(0,0,0,0.35);"  # marks the first token of each step


def step_counts(step: StepRow) -> tuple[int, int]:
    """(accepted draft tokens, bonus tokens) among the tokens a step committed
    (an EOS or length cut can drop some of either)."""
    committed = len(step["new_tokens"])
    drafted = min(step["accepted_len"], committed)
    return drafted, committed - drafted


def token_origins(steps: Sequence[StepRow]) -> list[tuple[int, str, str]]:
    """(step, origin, text) for every committed token; origin is the source of an
    accepted draft token (the source 'model' included), or 'bonus' for the token the model added itself."""
    out = []
    for s in steps:
        drafted, _ = step_counts(s)
        sources = s.get("accepted_sources") or []
        for k, text in enumerate(s["new_texts"]):
            origin = (sources[k] if k < len(sources) else "draft") if k < drafted else "bonus"
            out.append((s["step"], origin, text))
    return out


def source_words(source: str) -> str:
    """A source as a sentence names it: "the static store", "the model's own earlier predictions (recycled)"."""
    return SOURCE_WORDS.get(source) or f"the {source} store"


def origin_style(origin: str) -> tuple[str, str]:
    """(background colour, description) of an origin; any source name gets one."""
    return ORIGIN_STYLES.get(origin) or (tint(source_color(origin), 0.35), f"accepted draft, {origin}")


def one_line(text: str) -> str:
    """Text escaped for HTML on a single line: Markdown ends a raw HTML block at a line break
    (and four spaces after it start a code block), so newlines become `&#10;`."""
    return html.escape(text).replace("\r", "").replace("\n", "&#10;")


def origin_spans(steps: Sequence[StepRow], hide: frozenset = frozenset()) -> str:
    """The committed tokens, each tinted by where it came from (hover: step and origin), a thin
    left border on the first token of each step, on one line; `hide`: token texts left out
    (e.g. the end-of-sequence marker)."""
    out, previous = [], None
    for step, origin, text in token_origins(steps):
        if text in hide:
            continue
        colour, what = origin_style(origin)
        edge = STEP_EDGE if step != previous else ""
        previous = step
        out.append(f'<span class="tok {html.escape(origin)}" style="background:{colour};{edge}" '
                   f'title="step {step}: {html.escape(what)}">{one_line(text)}</span>')
    return f'<div class="rest-answer">{"".join(out)}</div>'


def origin_text_html(steps: Sequence[StepRow], prompt: Optional[str] = None) -> str:
    """The output text with every token tinted by where it came from, and a legend."""
    counts = Counter(origin for _, origin, _ in token_origins(steps))
    total = max(1, sum(counts.values()))
    legend = "".join(
        f'<span style="background:{origin_style(o)[0]};padding:2px 8px;margin-right:12px;border-radius:4px">'
        f'{html.escape(origin_style(o)[1])}: {counts[o]} ({100 * counts[o] / total:.0f}%)</span>'
        for o in list(ORIGIN_STYLES) + sorted(set(counts) - set(ORIGIN_STYLES)) if counts[o])
    head = (f'<div style="color:#666;white-space:pre-wrap;margin-bottom:6px">{html.escape(prompt)}</div>'
            if prompt else "")
    return (f'<div class="rest-origin" style="font:17px/1.7 DejaVu Sans Mono, monospace;color:#111">'
            f'<div style="font-family:DejaVu Sans, sans-serif;font-size:15px;margin-bottom:10px">{legend}'
            f'<span style="color:#666">a grey bar marks the start of each step</span></div>{head}'
            f'<div style="white-space:pre-wrap">{origin_spans(steps)}</div></div>')
