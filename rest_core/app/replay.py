"""Recorded runs, replayed without the model: which runs a visitor may see, the run table,
and one step taken apart (`step_view`) and told in plain words (`explain_step`).

Beside the trace store's runs, every visitor sees the example run that ships with the page
(assets/example-run.json, run id EXAMPLE_RUN_ID): read-only, the same for everyone, replayed
from the file alone."""
from __future__ import annotations

import html
from functools import lru_cache
from typing import Any, Optional

from rest_core.app.engine import Engine
from rest_core.app.explain import explain_step, recycled_after
from rest_core.app.markup import token_html
from rest_core.app.panels import fit, panel
from rest_core.app.policy import markdown_text
from rest_core.app.recording import STORE_ERRORS
from rest_core.app.session import Session
from rest_core.app.settings import assets_dir, log
from rest_core.phases import PHASES
from rest_core.traces import figures, probs
from rest_core.traces.exported import ExportedRun, ExportError
from rest_core.traces.recorder import TokenTexts, TraceRecorder
from rest_core.traces.runs import RUN_COLUMNS

RUN_TABLE_HEADERS = [header for header, _ in RUN_COLUMNS]
BRANCH_HEADERS = ["store", "continuation", "count"]
CHOICE_HEADERS = ["node", "depth", "draft token", "drafted by", "score", "p (draft)", "model's next token",
                  "model's likeliest", "accepted"]
NO_RUN = "Choose a run first (decode something in the Chat or Race tab to record one)."


EXAMPLE_RUN_ID = -1  # the example run's id on the page (the trace store's ids start at 1)
EXAMPLE_FILE = "example-run.json"


@lru_cache(maxsize=1)
def example_run() -> Optional[ExportedRun]:
    """The example run that ships with the page (None, logged, when its file is missing or unreadable)."""
    try:
        return ExportedRun.from_file(assets_dir() / EXAMPLE_FILE, run_id=EXAMPLE_RUN_ID)
    except ExportError as err:
        log.warning("the example run is not available: %s", err)
        return None


def reader(recorder: TraceRecorder, run: dict) -> Any:
    """What a run's steps are read from: the example's file for the example run, else the trace store."""
    example = example_run()
    return example if run["id"] == EXAMPLE_RUN_ID and example is not None else recorder


class KnownTexts:
    """A stand-in tokenizer that decodes only the token ids a recorded run holds texts for (the example run's
    prompt and output), so its steps read as text with no tokenizer loaded."""

    def __init__(self, texts: dict):
        self.texts = {int(k): str(v) for k, v in (texts or {}).items()}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(self.texts.get(int(i), f"⟨{int(i)}⟩") for i in ids)


def visible_runs(recorder: TraceRecorder, session: Session, limit: int = 500) -> list[dict]:
    """This visitor's runs, and runs recorded outside the page (the command line); never another visitor's
    (the newest `limit`, read without their outputs)."""
    return [run for run in recorder.list_runs(limit=limit, owner=session.id) if may_see(run, session)]


def may_see(run: dict, session: Session) -> bool:
    """A run of this visitor's, or one recorded outside the page."""
    owner = (run.get("settings") or {}).get("app_session")
    return owner == session.id or (owner is None and run["id"] not in session.run_ids)


def run_label(run: dict) -> str:
    prompt = (run.get("prompt") or "").replace("\n", " ")
    prompt = prompt if len(prompt) <= 48 else prompt[:47] + "…"
    extra = f", {run['speedup']:.2f}×" if run.get("speedup") else ""
    mine = "" if (run.get("settings") or {}).get("app_session") else " [command line]"
    return f"#{run['id']} {run['status']}: {run.get('steps') or 0} steps{extra}: {prompt}{mine}"


def example_label(run: dict) -> str:
    prompt = (run.get("prompt") or "").replace("\n", " ")
    return f"Example run (ships with REST Lab): {run.get('steps') or 0} steps: {prompt[:40]}…"


def run_choices(recorder: TraceRecorder, session: Session) -> list[tuple[str, int]]:
    """The run picker's choices: this visitor's runs, newest first, then the example run."""
    example = example_run()
    tail = [(example_label(example.run), EXAMPLE_RUN_ID)] if example is not None else []
    return [(run_label(r), int(r["id"])) for r in visible_runs(recorder, session)] + tail


def run_table(recorder: TraceRecorder, session: Session) -> list[list]:
    """The run table's rows: the columns the `traces list` command shows too."""
    return [[get(r) for _, get in RUN_COLUMNS] for r in visible_runs(recorder, session)]


def whole(value: Any, what: str = "step") -> int:
    """A run id or step number from the page or the API (ValueError naming it when it is not one)."""
    try:
        number = int(value or 0)
        if number != float(value or 0) or not -2**62 < number < 2**62:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"The {what} must be a whole number, not {str(value)[:40]!r}.") from None
    return number


def check_run(recorder: TraceRecorder, session: Session, run_id: Any) -> dict:
    """A run this visitor may see (KeyError with a clear message otherwise; ValueError for a bad id)."""
    if run_id in (None, ""):
        raise KeyError(NO_RUN)
    run_id = whole(run_id, "run")
    if run_id == EXAMPLE_RUN_ID and example_run() is not None:
        return example_run().get_run(run_id)
    try:
        run = recorder.get_run(run_id)
    except KeyError:
        run = None
    if run is None or not may_see(run, session):
        raise KeyError(f"There is no run {run_id} among your runs.")
    return run


def open_run(recorder: TraceRecorder, session: Session, run_id: Any) -> tuple[dict, list[dict]]:
    """A run this visitor may see, and all its step rows."""
    run = check_run(recorder, session, run_id)
    return run, reader(recorder, run).load_steps(run["id"])


def step_count(recorder: TraceRecorder, session: Session, run_id: Any) -> Optional[int]:
    """How many steps a run has (None when this visitor may not see it)."""
    try:
        run = check_run(recorder, session, run_id)
        return reader(recorder, run).step_count(run["id"])
    except (KeyError, ValueError, *STORE_ERRORS):
        return None


def run_panels(recorder: TraceRecorder, session: Session, run_id: Any) -> dict:
    """The Run history tab's view of a run: its tinted text, speed, accepted drafts and phase times
    (KeyError / ValueError when this visitor may not see it)."""
    run, steps = open_run(recorder, session, run_id)
    return {"text": figures.origin_text_html(steps, prompt=run.get("prompt")),
            "speed": fit(figures.speed_figure(steps, run), 460),
            "accept": panel(figures.acceptance_histogram(steps), 420),
            "phases": panel(figures.phase_breakdown(steps), 420)}


class TextsOfRun(dict):
    """Token id -> text for a recorded run: what was stored, else the tokenizer's when there is one."""

    def __init__(self, steps_detail: list[dict], tokenizer: Any = None):
        super().__init__()
        self.tokenizer = TokenTexts(tokenizer) if tokenizer is not None else None
        for s in steps_detail:
            for tok, text in zip(s.get("new_tokens", []), s.get("new_texts", [])):
                self[int(tok)] = text
            for n in s.get("nodes", []):
                self[int(n["token_id"])] = n["token_text"]

    def __missing__(self, token_id: int) -> str:
        if self.tokenizer is not None:
            try:
                return self.tokenizer[token_id]
            except Exception:  # an id this tokenizer does not know
                pass
        return f"⟨{token_id}⟩"


def suffix_html(step: dict, texts: dict) -> str:
    """The query suffix, its matched tail underlined per store."""
    cells = [token_html(texts[int(t)]) for t in step["query"]]
    rows = [f'<div class="suffix-row"><b>context tail</b> {"".join(f"<span class=q>{c}</span>" for c in cells)}'
            "</div>"]
    for source, m in (step.get("matched_len") or {}).items():
        colour = figures.source_color(source)
        matched = f"background:color-mix(in srgb, {colour} 20%, transparent);border-bottom:3px solid {colour}"
        spans = "".join(f'<span class="q" style="{matched if i >= len(cells) - m else "opacity:.35"}">{c}</span>'
                        for i, c in enumerate(cells))
        if source == "dense":
            rows.append(_neighbours_html(colour, (step.get("neighbours") or {}).get(source, [])))
            continue
        spans = "".join(f'<span class="q" style="{matched if i >= len(cells) - m else "opacity:.35"}">{c}</span>'
                        for i, c in enumerate(cells))
        what = ((f"recycled its predictions after {recycled_after(m)}" if m else "has no prediction to recycle yet")
                if source == "model" else f'matched {m} token{"s" if m != 1 else ""}')
        rows.append(f'<div class="suffix-row"><b>{html.escape(source)}</b> {what} {spans}</div>')
    return f'<div class="suffix">{"".join(rows)}</div>'


NEIGHBOURS_SHOWN = 5  # a dense source's nearest places listed in the step-through


def _neighbours_html(colour: str, neighbours: list[dict]) -> str:
    """A dense source's row: the places of its corpus where the model's state was nearest, each with its
    similarity and the text around it (the part after the place, what was drafted from, underlined)."""
    if not neighbours:
        return ('<div class="suffix-row"><b>dense</b> no neighbours in this step (the store is searched only where '
                'the other sources have no draft worth a pass)</div>')
    style = f"border-bottom:3px solid {colour}"
    places = "".join(
        f'<div class="suffix-row" style="margin-left:1em">{n["similarity"]:.2f}: '
        f'<span style="opacity:.6">{token_html(n.get("before_text", ""))}</span>'
        f'<span style="{style}">{token_html(n.get("after_text", ""))}</span></div>'
        for n in neighbours[:NEIGHBOURS_SHOWN])
    more = len(neighbours) - NEIGHBOURS_SHOWN
    return (f'<div class="suffix-row"><b>dense</b> nearest places of the model\'s hidden state (similarity: text '
            f'there; underlined: what followed)</div>{places}'
            + (f'<div class="suffix-row" style="margin-left:1em">and {more} more</div>' if more > 0 else ""))


def phase_title(phase: str) -> str:
    """A step-through panel's title: the phase's number and name, as rest_core.phases has them."""
    return f"{PHASES.index(phase) + 1}. {phase.capitalize()}"


def step_view(recorder: TraceRecorder, run: dict, index: int, tokenizer: Any = None) -> dict:
    """Everything the step-through panel shows for one step of a run, loading that step only
    (tokenizer: optional, for the texts of context tokens the step did not produce itself)."""
    step = reader(recorder, run).load_step(run["id"], index)
    texts = TextsOfRun([step], tokenizer)
    step["query_text"] = "".join(texts[int(t)] for t in step["query"][-8:])
    branches = [[b["source"], figures.show_token(b["text"]), b["count"]] for b in step["branches"][:60]]
    choices = [[n["node"], n["depth"], figures.show_token(n["token_text"]), n["source"] or "root",
                round(n["score"] or 0.0, 3), "" if n.get("prob") is None else figures.prob_text(n["prob"]),
                figures.show_token(n["model_choice_text"]), _likeliest(n), "✓" if n["accepted"] else ""]
               for n in step["nodes"]]
    return {"step": step, "suffix": suffix_html(step, texts), "branches": branches, "choices": choices,
            "path": path_html(step), "explanation": explain_step(step, run), "tree": tree_panel(step),
            "mask": panel(figures.mask_heatmap(step), 560), **node_view(step, run)}


def path_html(step: dict) -> str:
    """A step's accepted path, its bonus token and what it committed, in one line."""
    accepted = [n for n in step["nodes"] if n["accepted"]][1:]
    path = "".join(f'<span class="acc">{token_html(n["token_text"])}</span>' for n in accepted)
    return (f'<div class="path">accepted path: {path or "<i>no draft token</i>"} + bonus '
            f'<span class="bonus">{token_html(step["bonus_text"])}</span> → committed '
            f'{len(step["new_tokens"])} token(s)</div>')


def tree_panel(step: dict) -> Any:
    """A step's draft tree for a half-width panel, tall enough for its depth."""
    tree = figures.draft_tree_figure(step)
    return panel(tree, min(1400, max(480, int(tree.layout.height or 480))))


def _likeliest(n: dict, k: int = 3) -> str:
    """A node's likeliest next tokens with their probabilities, for a table cell."""
    pairs = list(zip(n.get("top_texts") or [], n.get("top_probs") or []))[:k]
    return " · ".join(f"{figures.show_token(t)} {figures.prob_text(p)}" for t, p in pairs)


def node_view(step: dict, run: dict, node: Optional[int] = None) -> dict:
    """The node picker's choices and value and the chosen node's probability bars (default: the node where
    the model parted from the draft)."""
    node = probs.last_accepted(step["nodes"]) if node is None else node
    sampled = float((run.get("settings") or {}).get("temperature") or 0) > 0
    return {"node_choices": probs.node_choices(step), "node": node,
            "node_probs": fit(probs.node_probs_figure(step, node, sampled))}


def step_index(source: Any, run: dict, index: Any) -> int:
    """A step number from the page or the API, checked against the run's steps (ValueError naming the range)."""
    k, count = whole(index), source.step_count(run["id"])
    if not 0 <= k < count:
        raise ValueError(f"Step {k} is not in run {run['id']}: its steps are 0–{count - 1}." if count else
                         f"Run {run['id']} recorded no step.")
    return k


def node_index(step: dict, node: Any) -> int:
    """A node of a step from the page or the API (default: where the model parted from the draft), checked against
    the step's nodes (ValueError naming the range)."""
    nodes = step["nodes"]
    n = probs.last_accepted(nodes) if node in (None, "") else whole(node, "node")
    if not 0 <= n < len(nodes):
        raise ValueError(f"Node {n} is not in step {step['step']}: its nodes are 0–{len(nodes) - 1}.")
    return n


def node_panel(engine: Engine, session: Session, run_id: Any, index: Any, node: Any) -> dict:
    """The probability bars of one node of a recorded step (a message in the title when there is none)."""
    try:
        run = check_run(engine.recorder, session, run_id)
        source = reader(engine.recorder, run)
        step = source.load_step(run["id"], step_index(source, run, index))
        return node_view(step, run, node_index(step, node))
    except (KeyError, ValueError, TypeError, *STORE_ERRORS):
        return {"node_choices": [], "node": None, "node_probs": None}


CHECK_DRAWS = 2000  # draws of the sampling check


def check_panel(engine: Engine, session: Session, run_id: Any, index: Any, node: Any) -> Any:
    """The sampling check of one node of a recorded step: many draws with the verifier's rule against the
    model's recorded distribution (ValueError / KeyError with a message when there is nothing to draw, or the
    step or node is not in the run)."""
    run = check_run(engine.recorder, session, run_id)
    source = reader(engine.recorder, run)
    k = step_index(source, run, index)
    step = source.load_step(run["id"], k)
    return fit(probs.sampling_check_figure(probs.sampling_check(step, node_index(step, node), CHECK_DRAWS, seed=k)))


EMPTY_STEP = {"explanation": "", "suffix": "", "branches": [], "choices": [], "path": "", "tree": None, "mask": None,
              "node_choices": [], "node": None, "node_probs": None}


def step_panel(engine: Engine, session: Session, run_id: Any, index: Any) -> dict:
    """What the step-through tab shows for step `index` of a run (clamped to the run's steps), or a
    message in place of the explanation when there is nothing to show."""
    if run_id in (None, ""):
        return dict(EMPTY_STEP)
    try:
        rec = engine.recorder
        run = check_run(rec, session, run_id)
        count = reader(rec, run).step_count(run["id"])
        if not count:
            return {**EMPTY_STEP, "explanation": "This run recorded no step."}
        index = max(0, min(whole(index), count - 1))
        tokenizer = KnownTexts(run.get("token_texts")) if run["id"] == EXAMPLE_RUN_ID else \
            engine.tokenizer_for(run.get("model"), session.id, session.address)
        return step_view(rec, run, index, tokenizer)
    except (KeyError, ValueError) as err:
        return {**EMPTY_STEP, "explanation": f"⚠ {markdown_text(str(err).strip(chr(39)), 300)}"}
    except STORE_ERRORS as err:
        return {**EMPTY_STEP, "explanation": f"⚠ The trace store cannot be read now ({type(err).__name__}); "
                                             "try again in a moment."}
