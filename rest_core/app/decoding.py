"""A decode as the page runs it: its stores put together, its run recorded step by step.

`prepare` turns the page's settings and prompt into a model, a prompt and a decoder;
`rest_work` (a chat turn) and `race_work` (a race) are what a worker thread runs (see streaming), holding
the model's lock; after a REST decode the app saves what it owns (the cost model's
acceptance counts; a visitor's history and table of the model's own predictions stay in
memory, in their session, and are never saved).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from datastores import assemble_stores, store_labels
from rest_core.app.engine import Engine
from rest_core.app.recording import Recording, start_recording
from rest_core.app.session import Session, open_upload_store
from rest_core.app.settings import NO_STATIC, STORE_WAIT_S, UPLOADED, Cancelled, Settings, message_of
from rest_core.app.slots import ModelSlot
from rest_core.app.streaming import Emit
from rest_core.app.visitors import address_tag
from rest_core.decode import (
    DecodeConfig,
    DecodeResult,
    PromptError,
    RestDecoder,
    plain_generate,
    plain_steps,
    run_through,
)
from rest_core.model import encode_prompt
from rest_core.trace import StepTrace

V = TypeVar("V")
EMPTY_PROMPT = "The prompt is empty: type a question (chat) or some text or code to continue (completion)."


@dataclass
class Prepared:
    """Everything a decode needs, checked before it starts."""

    slot: ModelSlot
    cfg: DecodeConfig
    prompt_ids: list[int]
    decoder: RestDecoder
    notice: str  # a notice for the page ("" when none)
    history: list[dict] = field(default_factory=list)  # the earlier chat turns the prompt holds (the oldest may
    # have been dropped)
    dropped: str = ""  # what the page says, to the answer's end, when the oldest turns were dropped

    def forward_curve(self) -> Optional[Callable[[int], float]]:
        """The forward-pass time of q tokens as this decode's cost model holds it (at the machine's speed of
        its latest steps), else as calibrated for the model (a fixed budget: no cost model decides)."""
        chooser = self.decoder.budget_chooser
        return getattr(chooser, "forward_ms", None) or self.slot.forward_curve()


def prompt_ids_of(slot: ModelSlot, settings: Settings, message: str, history: list[dict]) -> list[int]:
    """The prompt's tokens: the chat template with the turns so far, or the text as it is."""
    if not (message or "").strip():
        raise PromptError(EMPTY_PROMPT)
    chat = settings.mode == "chat"
    if chat and not getattr(slot.lm.tokenizer, "chat_template", None):
        raise PromptError(f"{slot.lm.name} has no chat template: switch the prompt format to completion.")
    return encode_prompt(slot.lm.tokenizer, message, chat=chat, history=history if chat else None)


def fit_history(slot: ModelSlot, settings: Settings, message: str, history: list[dict],
                max_tokens: Optional[int]) -> tuple[list[int], list[dict]]:
    """The prompt's tokens with as many of the latest chat turns as fit in `max_tokens` (None: every turn), the
    oldest dropped first, and the turns kept."""
    ids = prompt_ids_of(slot, settings, message, history)
    while max_tokens is not None and len(ids) > max_tokens and history:
        history = history[2:]  # one turn: the visitor's message and the answer
        ids = prompt_ids_of(slot, settings, message, history)
    return ids, history


def dropped_note(dropped: int, max_tokens: int) -> str:
    """What the page says when a chat's oldest turns no longer fit its token budget."""
    return (f"This server keeps a conversation to its newest {max_tokens:,} tokens: your {dropped} oldest "
            f"turn{'s' if dropped != 1 else ''} {'were' if dropped != 1 else 'was'} dropped from what the model "
            "reads.")


def static_store_for(engine: Engine, slot: ModelSlot, session: Session, settings: Settings) -> tuple[Any, str]:
    """(the static store the settings ask for, or None; a notice for the page)."""
    if settings.static == NO_STATIC:
        return None, ""
    if settings.static == UPLOADED:
        return open_upload_store(session, slot, engine.canonical(settings.model)), ""
    st = engine.start_static(slot)
    st.finished.wait(STORE_WAIT_S)  # opening a built store takes milliseconds; a first build, minutes
    if st.state == "ready":
        return st.store, ""
    if st.state == "building":
        return None, ("The built-in datastore is still being built (first time on this machine: a few minutes, "
                      f"{engine.store_progress(st)}); this answer drafts from the request and history stores only.")
    if st.state == "failed":
        return None, f"The built-in datastore is unavailable ({st.error}); drafting from the other stores only."
    return None, ""


def answers_store_for(engine: Engine, slot: ModelSlot, settings: Settings) -> Any:
    """The general-text store when the settings (and the prompt format) ask for it and it is ready; else None
    (while it is being built, the status line says so).  A store still being opened -- the first request
    after the page starts, a moment after the built-in store -- is waited for as the built-in store is, so
    that answer drafts from it too; a build that is answering its requests (`total` set) is not."""
    if not settings.use_answers:
        return None
    st = engine.start_answers(slot)
    if st.state == "building" and not st.total:
        st.finished.wait(STORE_WAIT_S)
    return st.store if st.state == "ready" else None


def dense_store_for(slot: ModelSlot, settings: Settings) -> Any:
    """The dense store (the general-text store's answers, read by the model's hidden state) when it is ready and
    the settings ask for the general-text store: it drafts from the same answers, by meaning."""
    return slot.dense.store if settings.use_answers and slot.dense.state == "ready" else None


def make_decoder(engine: Engine, slot: ModelSlot, session: Session, settings: Settings,
                 cfg: DecodeConfig) -> tuple[RestDecoder, str]:
    """The decoder over the stores the settings switch on (and a notice for the page)."""
    static, notice = static_store_for(engine, slot, session, settings)
    answers = answers_store_for(engine, slot, settings)
    history = session.history_store(slot.lm.name, cfg) if settings.history_store else None
    model = session.recycle_store(slot) if settings.model_drafts else None
    if model is not None:  # it learns from this decode: one of the tables visitors hold of their own
        slot.learning(model, engine.policy.max_session_tables if engine.policy.public else None)
    stores = assemble_stores(static=static, answers=answers, request=settings.request_store, history=history,
                             model=model, dense=dense_store_for(slot, settings), n_max=cfg.retrieve.n_max,
                             n_min=cfg.retrieve.n_min)
    chooser = slot.chooser(stores, kind="chat" if settings.mode == "chat" else "text") \
        if cfg.draft_budget is None else None
    return RestDecoder(slot.lm, stores=stores, budget_chooser=chooser, undisturbed=slot.drawing.quiet_since), notice


def prepare(engine: Engine, session: Session, settings: Settings, message: str, history: list[dict],
            say: Callable[[str], V]) -> Generator[V, None, Prepared]:
    """Model, prompt and decoder for a decode; yields say(text) before each slow first-time step."""
    cfg = settings.decode_config()
    name = engine.canonical(settings.model)
    if name not in engine.models:
        yield say(f"Loading {name} (once; the first load on a machine takes longer)…")
    slot = engine.model(name)
    budget = engine.policy.max_chat_tokens if engine.policy.public and settings.mode == "chat" else None
    prompt_ids, kept = fit_history(slot, settings, message, history, budget)
    if cfg.draft_budget is None and not slot.measured:
        yield say("Measuring this machine's forward-pass cost for the automatic budget (once)…")
    decoder, notice = make_decoder(engine, slot, session, settings, cfg)
    dropped = dropped_note((len(history) - len(kept)) // 2, budget) if len(kept) < len(history) and budget else ""
    return Prepared(slot, cfg, prompt_ids, decoder, " ".join(filter(None, [dropped, notice])), kept, dropped)


def start_run(engine: Engine, prep: Prepared, settings: Settings, session: Session, prompt_text: str) -> Recording:
    """Record a new run of this visitor's (its steps follow as they are decoded); a store that refuses
    gives a Recording that records nothing and says why."""
    lm = prep.slot.lm
    tag = address_tag(session.address) if session.address else ""
    recording = start_recording(engine, session.id, lm.tokenizer, dict(
        model=lm.name, tokenizer_name=str(getattr(lm.tokenizer, "name_or_path", lm.name)),
        stores=store_labels(prep.decoder.stores), settings=settings.record(session.id, tag), prompt=prompt_text,
        prompt_tokens=list(prep.prompt_ids)), address=tag)
    if recording.run_id is not None:
        session.run_ids.append(recording.run_id)
    return recording


def _decode(prep: Prepared, hook: Callable[[StepTrace], None], emit: Emit) -> DecodeResult:
    """Decode, recording every step with `hook` and telling the page about each step."""
    emit(("started", time.perf_counter()))

    def each(trace: StepTrace) -> None:
        hook(trace)
        emit(("step", trace.step))
        emit(("tokens", trace.new_tokens))

    return run_through(prep.decoder.stream(prep.prompt_ids, prep.cfg), each)


def rest_work(engine: Engine, prep: Prepared, recording: Recording) -> Callable[[Emit], Any]:
    """The worker side of a REST decode: record every step, tell the page, finish the run, save the
    cost model's counts."""
    def work(emit: Emit) -> DecodeResult:
        def decode() -> DecodeResult:
            pace_plain(prep)
            return _decode(prep, recording.hook, emit)
        return _recorded(prep, recording, decode)
    return work


PLAIN_PACE_TOKENS = 12  # the short plain decode that measures plain decoding's pace before a first chat


def pace_plain(prep: Prepared) -> None:
    """Measure plain decoding's time per token on this model once per process (a few tokens of the prompt at
    hand, before its REST decode, holding the model), unless a race measured it already: the Chat tab's
    speedup is estimated against it."""
    if prep.slot.plain_token_ms is None:
        cfg = DecodeConfig(max_new_tokens=PLAIN_PACE_TOKENS, stop_at_eos=False)
        note_plain_pace(prep.slot, plain_generate(prep.slot.lm, prep.prompt_ids, cfg))


def note_plain_pace(slot: ModelSlot, plain: DecodeResult) -> None:
    """Plain decoding's time per token after the prefill, as `plain` (a timed plain decode) ran it."""
    if plain.steps and plain.wall_s > plain.prefill_s:
        slot.plain_paces.append(1e3 * (plain.wall_s - plain.prefill_s) / plain.steps)


def race_work(prep: Prepared, recording: Recording) -> Callable[[Emit], tuple[DecodeResult, DecodeResult]]:
    """The worker side of a race: the plain decode and REST's, in turn (`in_turn`), after one untimed warm-up
    pass; REST's steps are recorded after both clocks stopped, then the run is finished and the cost model's
    counts saved.  Returns (plain, REST)."""
    def work(emit: Emit) -> tuple[DecodeResult, DecodeResult]:
        lm, plain = prep.slot.lm, None

        def decode() -> DecodeResult:
            nonlocal plain
            plain_generate(lm, prep.prompt_ids, DecodeConfig(max_new_tokens=1))  # warm-up, not timed
            emit(("started", time.perf_counter()))
            plain, rest, traces = in_turn(plain_steps(lm, prep.prompt_ids, prep.cfg),
                                          prep.decoder.stream(prep.prompt_ids, prep.cfg), emit)
            note_plain_pace(prep.slot, plain)
            for trace in traces:
                recording.hook(trace)
            return rest

        rest = _recorded(prep, recording, decode)
        return plain, rest
    return work


def _recorded(prep: Prepared, recording: Recording, decode: Callable[[], DecodeResult]) -> DecodeResult:
    """Run a REST decode holding the model's lock, finish its run (done, stopped by the visitor, or failed with
    the reason) and save the cost model's counts."""
    with prep.slot.lock:
        try:
            result = decode()
        except BaseException as err:
            stopped = isinstance(err, Cancelled)
            recording.finish(status="stopped" if stopped else "failed",
                             error="stopped by the visitor" if stopped else message_of(err))
            raise
        recording.finish(output=result.text, new_tokens=result.new_tokens, steps=result.steps,
                         wall_s=result.wall_s, mean_accepted=result.mean_accepted, status="done")
        if prep.decoder.budget_chooser is not None:
            prep.decoder.budget_chooser.save_stats()
        return result


def in_turn(plain: Generator[int, None, DecodeResult], rest: Generator[StepTrace, None, DecodeResult],
            emit: Emit) -> tuple[DecodeResult, DecodeResult, list[StepTrace]]:
    """Run two decodes in turn: the one behind in the answer takes the next step (REST first on a tie), so
    both go through the answer at the same pace and a busy moment of the machine slows both alike.  Each
    side's time is the sum of its own steps (its prefill is in its first), not the wall time both shared.
    Emits ("plain", [token]) and ("rest", tokens) as they come; returns both results and REST's traces."""
    sides = {"rest": rest, "plain": plain}
    own = dict.fromkeys(sides, 0.0)
    made = dict.fromkeys(sides, 0)
    results: dict[str, DecodeResult] = {}
    traces: list[StepTrace] = []
    try:
        while len(results) < len(sides):
            side = min((s for s in sides if s not in results), key=lambda s: made[s])
            t0 = time.perf_counter()
            try:
                item = next(sides[side])
            except StopIteration as done:
                own[side] += time.perf_counter() - t0
                results[side] = done.value
                continue
            own[side] += time.perf_counter() - t0
            tokens = [item] if side == "plain" else item.new_tokens
            if side == "rest":
                traces.append(item)
            made[side] += len(tokens)
            emit((side, tokens))
    finally:
        for gen in sides.values():
            gen.close()
    for side, result in results.items():
        result.wall_s = own[side]
    return results["plain"], results["rest"], traces
