""""What if" as the page runs it: a recorded step run again on the run's model, beside what happened.

`what_if_views` takes its turn in the line of decodes (rest_core.app.turns) like a chat answer
or a race, loads the run's model as the engine allows it (public mode: only the operator's
models), runs the step again (rest_core.app.whatif) and draws both trees with their accepted
paths and the numbers of each: drafted, accepted, tokens for the pass and what the pass costs by
the cost model's measured curve.
"""
from __future__ import annotations

import html
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Optional

import plotly.graph_objects as go

from rest_core.app.decoding import static_store_for
from rest_core.app.engine import Engine
from rest_core.app.live import take_turn
from rest_core.app.markup import token_html
from rest_core.app.replay import check_run, path_html, reader, tree_panel, whole
from rest_core.app.session import Session
from rest_core.app.settings import BUILT_IN, NO_STATIC, Settings, message_of
from rest_core.app.slots import ModelSlot
from rest_core.app.whatif import WhatIf, replay_plan, replay_step, step_context
from rest_core.traces.recorder import TokenTexts
from rest_core.traces.rows import step_detail


@dataclass
class WhatIfView:
    """What one update of the what-if panel shows (None: leave it as it is)."""

    summary: str
    recorded: Optional[go.Figure] = None
    what_if: Optional[go.Figure] = None
    recorded_path: Optional[str] = None
    what_if_path: Optional[str] = None
    done: bool = False
    step: Optional[dict] = None  # the step run again, as the trace store's readers give a step


def _say(text: str) -> WhatIfView:
    return WhatIfView(summary=f'<div class="whatif-summary"><p>{html.escape(text, quote=False)}</p></div>')


def _static(engine: Engine, slot: ModelSlot, session: Session, run: dict, wi: WhatIf) -> tuple[Any, list[str]]:
    """The static store to search again (the kind the run used; the built-in one when it used none) and
    notes on it."""
    if "static" not in wi.sources:
        return None, []
    kind = (run.get("settings") or {}).get("static") or BUILT_IN
    store, notice = static_store_for(engine, slot, session, Settings(static=BUILT_IN if kind == NO_STATIC else kind))
    notes = [notice] if notice else []
    recorded = [str(label) for label in run.get("stores") or [] if str(label).startswith("static")]
    if store is not None and recorded and recorded[0] != store.label:
        notes.append(f"The run drafted from the static store {_name(recorded[0])}; this what-if searches "
                     f"{_name(store.label)}, so its static drafts can differ from the recorded ones.")
    elif store is not None and not recorded:
        notes.append(f"The run had no static store; this what-if searches {_name(store.label)}.")
    return store, notes


def _name(label: str) -> str:
    """A static store's label as a name, never a server path ("static:/srv/x/store" -> "store")."""
    return label.split(":", 1)[-1].rstrip("/").rsplit("/", 1)[-1] or label


def _cost(curve: Optional[Callable[[int], float]], q: int) -> Optional[float]:
    return curve(q) / curve(1) if curve is not None else None


def _numbers(step: dict, curve: Optional[Callable[[int], float]]) -> dict[str, str]:
    """One side's numbers: what was drafted and accepted, the tokens of this pass and its estimated cost."""
    q, committed = step["draft_size"] + 1, len(step["new_tokens"])
    cost = _cost(curve, q)
    fwd = step.get("t_forward_ms")
    return {"drafted tokens": f"{step['draft_size']}", "accepted drafts": f"{step['accepted_len']}",
            "tokens per pass": f"{committed}",
            "est. cost of the pass": "–" if cost is None else f"{cost:.2f}× a one-token pass ({q} tokens)",
            "est. speedup of this step": "–" if cost is None else f"{committed / cost:.2f}×",
            "forward pass (measured)": "–" if not fwd else f"{fwd:.0f} ms"}


def _agreement(recorded_next: list[int], new: list[int], texts: TokenTexts, greedy_on_sampled: bool) -> str:
    """Whether the step run again committed the tokens the run produced next."""
    shown = token_html("".join(texts[t] for t in new))
    same = recorded_next[:len(new)] == new if len(recorded_next) >= len(new) else new[:len(recorded_next)] == \
        recorded_next
    if same:
        return (f"✓ The what-if commits “{shown}”: the very tokens the run produced next. The draft tree changes "
                "how many tokens one pass brings, never which tokens they are.")
    why = ("greedy acceptance of a sampled run picks the likeliest tokens, not the ones drawn" if greedy_on_sampled
           else "a near-tie between two tokens decided differently by rounding")
    return f"✗ The what-if commits “{shown}”, not the run's next tokens ({why})."


def comparison_html(k: int, recorded: dict, what_if: dict, curve: Optional[Callable[[int], float]],
                    agreement: str, notes: list[str]) -> str:
    """The two sides' numbers in one table, the agreement check and the notes on how the step was run again."""
    left, right = _numbers(recorded, curve), _numbers(what_if, curve)
    rows = "".join(f"<tr><th>{html.escape(key, quote=False)}</th><td>{left[key]}</td><td>{right[key]}</td></tr>"
                   for key in left)
    cost_note = ("The cost of a pass is read from the forward-pass times measured on this machine "
                 "(rest_core/cost.py); the speedup of a step is its tokens ÷ that cost."
                 if curve is not None else "No forward-pass cost is measured on this machine yet, so no cost is "
                                           "estimated.")
    items = "".join(f"<li>{html.escape(n, quote=False)}</li>" for n in [*notes, cost_note])
    return (f'<div class="whatif-summary" data-step="{k}"><b>What if, at step {k}</b>'
            f'<table class="whatif-table"><tr><th></th><th>what happened</th><th>what if</th></tr>{rows}</table>'
            f'<p class="whatif-check">{agreement}</p><ul class="whatif-notes">{items}</ul></div>')


def what_if_views(engine: Engine, session: Session, run_id: Any, index: Any, wi: WhatIf) -> Iterator[WhatIfView]:
    """Run step `index` of a recorded run again with the settings `wi`, after waiting for a turn; the last
    view shows both sides (or a message saying why not)."""
    ticket = None
    try:
        wi = wi.check()
        run = check_run(engine.recorder, session, run_id)
        source, k = reader(engine.recorder, run), whole(index)
        steps = source.load_steps(run["id"])
        step = source.load_step(run["id"], k)
        step_context(run, steps, k)  # a step that cannot be rebuilt is refused before waiting in line
        ticket = yield from take_turn(engine, session, _say)
        yield from _run_again(engine, session, run, steps, step, k, wi)
    except Exception as err:  # every failure becomes a message in the panel
        text = str(err).strip("'\"") if isinstance(err, KeyError) else message_of(err)  # KeyError: no such run
        yield replace(_say(f"⚠ {text}"), done=True)
    finally:
        if ticket is not None:
            ticket.leave()


def _run_again(engine: Engine, session: Session, run: dict, steps: list, step: dict, k: int,
               wi: WhatIf) -> Iterator[WhatIfView]:
    name = engine.canonical(run.get("model"))
    if name not in engine.models:
        yield _say(f"Loading {name} (once; the first load on a machine takes longer)…")
    slot = engine.model(name)
    if not slot.measured:
        yield _say("Measuring this machine's forward-pass cost (once)…")
    static, notes = _static(engine, slot, session, run, wi)
    plan = replay_plan(run, steps, k, step, wi, static, slot.chooser, slot.lm.max_positions)
    yield _say(f"Running step {k} again: the context ({len(plan.context)} tokens) through the model, then "
               "retrieve, draft tree and one forward pass…")
    with slot.lock:
        slot.chooser(plan.stores)  # the cost curve the estimate reads
        result = replay_step(slot.lm, plan, k)
    texts = TokenTexts(slot.lm.tokenizer)
    again = step_detail(result.trace(k), texts, run["id"])
    following = [int(t) for s in steps[k:] for t in s["new_tokens"]]
    sampled = float((run.get("settings") or {}).get("temperature") or 0) > 0
    agreement = _agreement(following, [int(t) for t in result.new_tokens], texts,
                           sampled and plan.cfg.sampling.greedy)
    yield WhatIfView(summary=comparison_html(k, step, again, slot.forward_curve(), agreement, notes + plan.notes),
                     recorded=tree_panel(step), what_if=tree_panel(again), recorded_path=path_html(step),
                     what_if_path=path_html(again), done=True, step=again)
