"""Decodes as the page watches them: a chat turn and a race, each a stream of `View`s.

The decoder runs on a worker thread and records every step; the page is redrawn
from the recorded rows (what is shown is what is stored), throttled so drawing
never slows the decode much.
"""
from __future__ import annotations

import html
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional, TypeVar

import plotly.graph_objects as go

from rest_core.app.decoding import EMPTY_PROMPT, Prepared, prepare, race_work, rest_work, start_run
from rest_core.app.engine import Engine
from rest_core.app.markup import plain_answer_html, user_bubble
from rest_core.app.pacing import Pacing
from rest_core.app.panels import (
    StepRows,
    best_step,
    compact,
    live_figures,
    metrics_html,
    plain_estimate_ms,
    step_ms,
    why_speed_html,
)
from rest_core.app.policy import markdown_safe
from rest_core.app.recording import STORE_ERRORS, Recording
from rest_core.app.session import Session
from rest_core.app.settings import TEXT_INTERVAL_S, Settings, message_of
from rest_core.app.streaming import Throttle, drain, stream_in_thread
from rest_core.app.turns import Ticket
from rest_core.compare import first_difference, identical
from rest_core.decode import DecodeResult
from rest_core.traces import figures

V = TypeVar("V")
TURN_POLL_S = 1.0  # a waiting decode tells its visitor its place in line this often
CHAT_TURNS_SHOWN = 20  # a public server keeps the newest turns of a visitor's chat on the page (each a message and
# its answer), whatever the model still reads of them (policy.max_chat_tokens)

@dataclass
class View:
    """What one redraw of the page changes (None: leave it as it is)."""

    chat: Optional[list] = None
    tree: Optional[go.Figure] = None
    mask: Optional[go.Figure] = None
    speed: Optional[go.Figure] = None
    metrics: Optional[str] = None
    notice: Optional[str] = None  # the error / notice box ("" clears it)
    warning: Optional[str] = None  # also shown as a toast
    plain: Optional[str] = None  # race: the plain decode's text
    rest: Optional[str] = None  # race: REST's coloured text
    run_id: Optional[int] = None  # set once a run is recorded
    done: bool = False


def special_texts(tokenizer: Any) -> frozenset:
    return frozenset(getattr(tokenizer, "all_special_tokens", None) or ())


# ---------------------------------------------------------------- a chat turn

class LiveAnswer:
    """The chat's side of a running REST decode: the tinted answer and the side panel, redrawn from
    the steps stored so far (the text and the figures each as often as what they cost allows: `Pacing`).  Tokens
    decoded after recording stopped are shown as plain text after the tinted ones."""

    def __init__(self, engine: Engine, prep: Prepared, recording: Recording, chat: list):
        self.engine, self.recording, self.run_id, self.chat = engine, recording, recording.run_id, chat
        self.steps = StepRows(engine.recorder, self.run_id) if self.run_id is not None else None
        self.slot = prep.slot
        self.drawing = prep.slot.drawing
        self.tokenizer = prep.slot.lm.tokenizer
        self.curve = prep.forward_curve()
        self.hide = special_texts(self.tokenizer)
        self.pacing = Pacing(self.drawing, self.curve)
        self.text = Throttle(self.pacing.text_interval)
        self.latest, self.shown, self.started, self.last_fig = -1, -1, 0.0, 0.0
        self.ids: list[int] = []  # every token decoded so far
        self.notice = prep.dropped  # what the page says about this answer to its end

    def paces(self) -> tuple[Optional[float], Optional[float]]:
        """Plain decoding's time per token: (a one-token pass as calibrated, as measured by a plain decode)."""
        return self.slot.plain_ms(), self.slot.plain_token_ms

    def metrics(self, rows: list[dict], elapsed_s: float, state: str = "running") -> str:
        calibrated, measured = self.paces()
        return metrics_html(rows, elapsed_s, calibrated, state, measured)

    def rows(self) -> list[dict]:
        """The steps stored so far (those read before, when the store cannot be read now)."""
        if self.steps is None:
            return []
        try:
            return self.steps.refresh()
        except STORE_ERRORS:
            return self.steps.rows

    def answer(self, rows: list[dict]) -> str:
        """The stored steps tinted by origin, then any token decoded but not recorded, as plain text."""
        text = figures.origin_spans(rows, self.hide) if rows else ""
        tail = self.ids[sum(len(r["new_tokens"]) for r in rows):]
        if tail:
            text += plain_answer_html(self.tokenizer.decode(tail, skip_special_tokens=True))
        return text

    def figures(self, rows: list[dict], step_no: int, run: Optional[dict] = None) -> tuple:
        try:
            return live_figures(self.engine.recorder, self.run_id, rows, step_no, run)
        except STORE_ERRORS:
            return None, None, None

    def views(self, batch: list) -> Iterator[View]:
        for kind, value in batch:
            if kind == "started":  # the first figures a redraw interval after the decode began
                self.started = self.last_fig = value
            elif kind == "step":
                self.latest = value
                self.pacing.step(value, time.perf_counter())
            elif kind == "tokens":
                self.ids += value
        self.text.interval_s = self.pacing.text_interval
        if self.latest <= self.shown or not self.text.ready():
            return
        self.shown, now = self.latest, self.text.last
        rows = self.rows()
        self.pacing.weigh(rows, now)
        self.chat[-1]["content"] = self.answer(rows)
        view = View(chat=self.chat, metrics=self.metrics(rows, now - self.started))
        if not (rows and not self.recording.stopped and now - self.last_fig >= self.pacing.fig_interval):
            self.pacing.text_sending(time.perf_counter())
            yield view
            return
        self.pacing.figures_building()
        try:
            view.tree, view.mask, view.speed = self.figures(rows, rows[-1]["step"])
            yield view
        finally:  # built and sent (or the visitor left): slow machines redraw less often
            self.last_fig = time.perf_counter()
            self.pacing.figures_sent(now, self.last_fig)

    def failed(self, err: Exception) -> View:
        text = message_of(err)
        self.chat[-1]["content"] = self.answer(self.rows()) + f"<p>⚠ {html.escape(text)}</p>"
        return View(chat=self.chat, notice=text, warning=text, run_id=self.run_id, done=True)

    def finished(self, result: DecodeResult) -> View:
        rows = self.rows()
        self.chat[-1]["content"] = self.answer(rows)
        stopped = self.recording.stopped or None
        per_token, how = plain_estimate_ms(rows, *self.paces())
        partial = len(rows) < result.steps  # recording stopped: the figures are those of the recorded steps
        elapsed = sum(step_ms(r) for r in rows) / 1e3 if partial else result.wall_s
        metrics = self.metrics(rows, elapsed, "done")
        if partial:
            metrics += (f'<div class="metric-note">Figures of the {len(rows)} recorded steps; the whole answer: '
                        f"{len(result.tokens)} tokens in {result.steps} forward passes "
                        f"({result.tokens_per_s:.1f} tokens/s).</div>")
        per_pass = 1e3 * elapsed / len(rows) if rows and not partial else None  # the wall time, as a race's
        view = View(chat=self.chat, metrics=metrics + why_speed_html(rows, per_token, per_pass, self.curve,
                                                                     f"from {how}"),
                    run_id=self.run_id, done=True, notice=" ".join(filter(None, [self.notice, stopped])),
                    warning=stopped)
        if rows:  # the run is over: show its most telling step (the one that accepted most drafts)
            try:
                run = self.engine.recorder.get_run(self.run_id)
            except STORE_ERRORS:
                run = None
            view.tree, view.mask, view.speed = self.figures(rows, best_step(rows), run)
        return view


def _say_in_chat(chat: list, text: str) -> View:
    chat[-1]["content"] = markdown_safe(text)  # the chat renders Markdown
    return View(chat=chat, notice="")


def take_turn(engine: Engine, session: Session, say: Callable[[str], V]) -> Generator[V, None, Ticket]:
    """A place in the line of decodes, waited for (Busy when there is none); yields say(where it is)
    while waiting.  The caller leaves the line in a finally; a visitor who leaves while waiting leaves it."""
    ticket = engine.turns.join(session.id, session.address)
    try:
        while not ticket.wait(TURN_POLL_S):
            ahead = ticket.ahead()
            yield say(f"Waiting for your turn: {ahead} decode{'s' if ahead != 1 else ''} ahead of yours…")
    except BaseException:
        ticket.leave()
        raise
    return ticket


def checked(engine: Engine, settings: Settings, message: Any) -> tuple[Settings, str]:
    """The settings and prompt as the policy allows them (ValueError naming the problem otherwise)."""
    return engine.policy.check_settings(settings), engine.policy.check_text(message)


def chat_turn(engine: Engine, session: Session, settings: Settings, message: str) -> Iterator[View]:
    """One chat (or completion) turn: the answer streamed with live figures, every step recorded; it
    waits for its turn in the line of decodes first."""
    try:
        settings, message = checked(engine, settings, message)
    except ValueError as err:
        yield View(notice=str(err), warning=str(err), done=True)
        return
    if not message.strip():
        yield View(notice=EMPTY_PROMPT, warning=EMPTY_PROMPT, done=True)
        return
    if settings.mode != "chat":
        session.clear_chat()  # completions are independent: no earlier turns
    shown = -2 * CHAT_TURNS_SHOWN if engine.policy.public else None  # a public server shows the newest turns
    chat = (session.chat + [user_bubble(message), {"role": "assistant", "content": "…"}])[shown:]
    ticket = None
    try:
        ticket = yield from take_turn(engine, session, partial(_say_in_chat, chat))
        yield from _chat_turn(engine, session, settings, message, chat)
    except Exception as err:  # every failure becomes a message in the page
        text = message_of(err)
        chat[-1]["content"] = f"⚠ {markdown_safe(text)}"
        yield View(chat=chat, notice=text, warning=text, done=True)
    finally:
        if ticket is not None:
            ticket.leave()


def _chat_turn(engine: Engine, session: Session, settings: Settings, message: str, chat: list) -> Iterator[View]:
    prep = yield from prepare(engine, session, settings, message, session.history, partial(_say_in_chat, chat))
    chat[-1]["content"] = "thinking…"
    yield View(chat=chat, notice=prep.notice, warning=prep.notice or None)

    recording = start_run(engine, prep, settings, session, message)
    answer = LiveAnswer(engine, prep, recording, chat)
    try:
        result = yield from drain(stream_in_thread(engine, rest_work(engine, prep, recording)), answer.views)
    except Exception as err:
        session.chat = chat
        yield answer.failed(err)
        return
    session.chat = chat
    if settings.mode == "chat":
        session.history = prep.history + [{"role": "user", "content": message},
                                          {"role": "assistant", "content": result.text}]
    session.remember(prep.slot.lm.name, result.tokens)
    yield answer.finished(result)


# ---------------------------------------------------------------- a race

class RaceTexts:
    """Both sides of the race as they come, redrawn together with a throttle."""

    def __init__(self, tokenizer: Any, throttle: Throttle):
        self.tokenizer, self.throttle = tokenizer, throttle
        self.ids: dict[str, list[int]] = {"plain": [], "rest": []}

    def views(self, batch: list) -> Iterator[View]:
        for kind, value in batch:
            if kind in self.ids:
                self.ids[kind] += value
        if batch and self.throttle.ready():
            plain, rest = (self.tokenizer.decode(self.ids[s], skip_special_tokens=True) for s in ("plain", "rest"))
            yield View(plain=plain, rest=plain_answer_html(rest))


def _say_in_race(text: str) -> View:
    return View(plain=text, rest="", notice="")


def race(engine: Engine, session: Session, settings: Settings, message: str) -> Iterator[View]:
    """The same prompt decoded plainly and with REST, in turn (each side timed by its own steps); speedup and
    exactness check.  Both decodes take one turn in the line of decodes."""
    ticket = None
    try:
        settings, message = checked(engine, settings, message)
        ticket = yield from take_turn(engine, session, _say_in_race)
        yield from _race(engine, session, settings, message)
    except Exception as err:  # every failure becomes a message in the page
        text = message_of(err)
        yield View(notice=text, warning=text, done=True)
    finally:
        if ticket is not None:
            ticket.leave()


def _race(engine: Engine, session: Session, settings: Settings, message: str) -> Iterator[View]:
    try:
        prep = yield from prepare(engine, session, settings, message, [], _say_in_race)
    except Exception as err:  # every failure becomes a message in the page
        text = message_of(err)
        yield View(notice=text, warning=text, plain="", rest="", done=True)
        return
    yield View(plain="warming up…", rest="warming up…", notice=prep.notice, warning=prep.notice or None, metrics="")
    recording = start_run(engine, prep, settings, session, message)
    plain, rest = yield from drain(stream_in_thread(engine, race_work(prep, recording)),
                                   RaceTexts(prep.slot.lm.tokenizer, Throttle(TEXT_INTERVAL_S)).views)
    yield race_result(engine, prep, settings, plain, rest, recording)


def race_result(engine: Engine, prep: Prepared, settings: Settings, plain: DecodeResult, rest: DecodeResult,
                recording: Recording) -> View:
    """Compare the two decodes once, record the comparison with the run, and show it."""
    speedup = plain.wall_s / rest.wall_s if rest.wall_s else 0.0
    same = identical(plain.tokens, rest.tokens, prep.slot.lm.eos_token_ids)
    comparable = settings.greedy or prep.cfg.sampling.seed is not None
    recording.finish(status="done", comparison={
        "plain_wall_s": plain.wall_s, "plain_tokens_per_s": plain.tokens_per_s, "speedup": speedup,
        "identical": same if comparable else None})
    view = View(metrics=race_verdict(prep, settings, plain, rest, speedup, same), run_id=recording.run_id,
                done=True, notice=recording.stopped or "", warning=recording.stopped or None,
                plain=plain.text, rest=plain_answer_html(rest.text))
    if recording.run_id is None:
        return view
    try:
        rec = engine.recorder
        steps = rec.load_steps(recording.run_id)
        if len(steps) == rest.steps:  # every step stored: REST's side tinted by origin
            view.rest = figures.origin_spans(steps, special_texts(prep.slot.lm.tokenizer))
        view.speed = compact(figures.speed_figure(steps, rec.get_run(recording.run_id)), 440, bottom=110)
        view.metrics += why_speed_html(steps, 1e3 * plain.wall_s / max(1, plain.new_tokens),
                                       1e3 * rest.wall_s / max(1, rest.steps), prep.forward_curve(),
                                       "measured by the plain decode above, prefill included")
    except STORE_ERRORS:
        pass
    return view


def _check_line(prep: Prepared, settings: Settings, plain: DecodeResult, rest: DecodeResult, same: bool) -> str:
    if settings.greedy:
        return ("✓ Greedy outputs are identical, token for token." if same else
                "✗ Greedy outputs differ. " + _difference(prep, plain, rest))
    if prep.cfg.sampling.seed is not None:
        return ("✓ Same seed, same sample." if same else
                "Same seed, different samples: REST samples from exactly the same distribution, but a "
                "draw can land differently when logits differ in the last bits. " + _difference(prep, plain, rest))
    return "Sampling without a seed: outputs are not expected to match; fix a seed to compare them."


def race_verdict(prep: Prepared, settings: Settings, plain: DecodeResult, rest: DecodeResult, speedup: float,
                 same: bool) -> str:
    """The measured speedup, both decodes' numbers and the exactness check, as HTML."""
    check = _check_line(prep, settings, plain, rest, same)
    return (f'<div class="verdict"><div class="verdict-big">{speedup:.2f}× {"faster" if speedup >= 1 else "(slower)"}'
            f"</div><div>plain: {plain.new_tokens} tokens in {plain.wall_s:.2f} s "
            f"({plain.tokens_per_s:.1f} tokens/s, {plain.steps} forward passes) · REST: {rest.new_tokens} tokens in "
            f"{rest.wall_s:.2f} s ({rest.tokens_per_s:.1f} tokens/s, {rest.steps} forward passes, "
            f"{rest.mean_accepted:.2f} tokens per pass)</div><div>{check}</div>"
            '<div class="metric-note">Measured in turn on the same machine: the two decodes take steps by turns, '
            "the one behind in the answer going next, so a busy moment of the machine slows both alike; each "
            "side's time is the sum of its own steps, prefill included (after one untimed warm-up pass). REST's "
            "time includes building each step's trace; the steps are written to the trace store after both clocks "
            "stop.</div></div>")


def _difference(prep: Prepared, plain: DecodeResult, rest: DecodeResult) -> str:
    try:
        d = first_difference(prep.slot.lm, prep.prompt_ids, plain.tokens, rest.tokens)
    except Exception:  # the explanation is optional
        return ""
    if "logit_gap" not in d:
        return f"One output stops early, at token {d['first_difference']}."
    return (f"First difference at token {d['first_difference']}; the model's logit gap between the two "
            f"tokens there is {d['logit_gap']:.2e} (a near-tie, decided by rounding).")
