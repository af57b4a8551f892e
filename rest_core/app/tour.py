"""The tour: a handful of highlighted stops over the example run, short enough to project in a class.

Each stop names the part of the page it highlights (an element id) and says in a few sentences
what that part shows, with the numbers of the step the tour stands on (`tour_step`: the example's
step that committed most tokens for its one forward pass).  The page's script (assets/tour.js)
highlights the element the card names and binds the keys.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from rest_core.app.markup import token_html


@dataclass(frozen=True)
class Stop:
    target: str  # the element id the stop highlights
    title: str
    text: str  # str.format fields: the facts of `step_facts`


STOPS = (
    Stop("run-pick", "A recorded run, step by step",
         "This run ships with REST Lab: the default model continuing the start of a Python script, every step "
         "recorded. It replays from its trace, without the model. We stand on step {step}: one forward pass of the "
         "model. ← and → walk through the steps."),
    Stop("step-suffix", "1. Retrieve",
         "REST looks the newest tokens of the text (the suffix) up in every store. The coloured tail is the longest "
         "suffix each store holds ({matched}); the table lists what followed it there."),
    Stop("step-tree", "2. Draft tree",
         "Those continuations are merged into one tree of {drafted} draft tokens, the best-supported first. Colour "
         "and marker shape say which store drafted a token; the red path is what the model accepted. Hover a node "
         "for the model's probabilities."),
    Stop("step-mask", "3. One forward pass",
         "The model reads all {q} tokens of the tree in a single pass. The tree attention mask lets each token see "
         "the text before the tree and its own ancestors only, so every branch is checked as if it stood alone."),
    Stop("step-path", "4. Verify and commit",
         "From the root, a drafted token is kept while it is the model's own choice: {accepted} drafted tokens "
         "here, then the model adds “{bonus}” itself. {committed} tokens for one pass where plain decoding gets "
         "one, and exactly the tokens plain decoding would write."),
    Stop("node-probs", "How sure was the model?",
         "The model's next-token probabilities where it parted from the draft: drafted tokens in their store's "
         "colour and pattern, the model's own choice outlined. A draft is accepted only when it is the model's "
         "choice."),
    Stop("whatif", "What if?",
         "With the model loaded, run this step again with another draft budget, suffix lengths or stores: the new "
         "tree and what the model would accept appear beside what happened. The tokens stay the same; only how "
         "many one pass brings can change."),
)


def tour_step(steps: list[dict]) -> int:
    """The step the tour stands on: the one that committed most tokens (the earliest of those)."""
    return max(steps, key=lambda s: (len(s["new_tokens"]), -s["step"]))["step"] if steps else 0


def _matched(step: dict) -> str:
    parts = [f"the {'model' if source == 'model' else source} store {n} token{'s' if n != 1 else ''}"
             if source != "model" else "the model's own predictions look at 1 token"
             for source, n in (step.get("matched_len") or {}).items() if n]
    return ", ".join(parts) if parts else "none found a match at this step"


def step_facts(step: dict) -> dict[str, Any]:
    """The numbers a stop's text names, from one recorded step (with its nodes)."""
    return {"step": step["step"], "drafted": step["draft_size"], "q": step["draft_size"] + 1,
            "accepted": step["accepted_len"], "committed": len(step["new_tokens"]),
            "bonus": token_html(step.get("bonus_text") or ""), "matched": html.escape(_matched(step))}


def card_html(index: int, step: dict) -> str:
    """The tour's card for stop `index`: its count, title and text; data-target names what to highlight."""
    stop = STOPS[index]
    text = stop.text.format(**step_facts(step))
    return (f'<div class="tour-card" data-target="{stop.target}" data-stop="{index + 1}">'
            f'<div class="tour-count">{index + 1} / {len(STOPS)}</div><h3>{html.escape(stop.title)}</h3>'
            f'<p>{text}</p><div class="tour-keys">→ next · ← back · Esc close</div></div>')
