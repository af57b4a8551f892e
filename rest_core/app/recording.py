"""A decode's recording in the trace store, which never stops the decode.

When the trace store fails (full, as on a full disk or past its size limit; locked by another
program; unreadable) the decode goes on: the steps already committed stay, later steps are not
recorded, `stopped` says why (the page shows it) and the run is marked 'partial'.  A run whose
outcome could not be written is finished later, when the store takes writes again.  On a public
server, old runs are pruned before each new one (per visitor, per client address, in all, and by size).
"""
from __future__ import annotations

import sqlite3
from typing import Any, Optional

from rest_core.app.engine import Engine
from rest_core.app.settings import log
from rest_core.trace import StepTrace

STORE_ERRORS = (sqlite3.Error, OSError)


def stopped_because(err: BaseException, recorded: int) -> str:
    """Why recording stopped, in the page's words."""
    text = str(err).lower()
    if "full" in text or getattr(err, "errno", None) == 28:
        why = "the trace store is full (its size limit, or the disk)"
    elif "locked" in text or "busy" in text:
        why = "the trace store is locked by another program"
    else:
        why = f"the trace store failed ({type(err).__name__})"
    return (f"Recording stopped after {recorded} step{'s' if recorded != 1 else ''}: {why}. The answer goes on; "
            "its later steps are not recorded.")


class Recording:
    """One run's recording: `hook` stores each step, `finish` its outcome; neither ever raises for a
    failing store.  run_id None: nothing could be recorded (stopped says why)."""

    def __init__(self, engine: Engine, run_id: Optional[int], tokenizer: Any = None, stopped: str = ""):
        self.engine, self.run_id, self.stopped = engine, run_id, stopped
        self.recorded = 0  # steps stored
        self._store = engine.recorder.step_hook(run_id, tokenizer) if run_id is not None else None

    def hook(self, trace: StepTrace) -> None:
        if self._store is None or self.stopped:
            return
        try:
            self._store(trace)
            self.recorded += 1
        except STORE_ERRORS as err:
            log.warning("run %s: recording stopped at step %d: %s", self.run_id, trace.step, err)
            self.stopped = stopped_because(err, self.recorded)

    def finish(self, **outcome: Any) -> None:
        """Write the run's outcome (status 'done' becomes 'partial' when steps are missing)."""
        if self.run_id is None:
            return
        if self.stopped and outcome.get("status") == "done":
            outcome.update(status="partial", error=self.stopped)
        finish_run(self.engine, self.run_id, outcome)


def finish_run(engine: Engine, run_id: int, outcome: dict) -> None:
    """Write a run's outcome now, or keep it for later when the store refuses the write."""
    try:
        engine.recorder.finish_run(run_id, **outcome)
        engine.unfinished.pop(run_id, None)
    except STORE_ERRORS as err:
        log.warning("run %s: its outcome could not be written yet (%s)", run_id, err)
        engine.unfinished[run_id] = {**engine.unfinished.get(run_id, {}), **outcome}


def finish_later(engine: Engine) -> None:
    """Write the outcomes kept for later (each a run otherwise left 'running')."""
    for run_id, outcome in list(engine.unfinished.items()):
        finish_run(engine, run_id, outcome)


def start_recording(engine: Engine, owner: str, tokenizer: Any, run: dict, address: str = "") -> Recording:
    """A new run recorded for visitor `owner` from `address` (a tag; run: start_run's fields), after making room
    for it on a public server; when the store refuses, a Recording that records nothing and says why."""
    policy = engine.policy
    try:
        rec = engine.recorder
        finish_later(engine)
        if policy.public:
            rec.prune(keep=policy.max_runs, owner=owner, keep_per_owner=policy.max_runs_per_visitor,
                      max_bytes=policy.max_trace_bytes, address=address or None,
                      keep_per_address=policy.max_runs_per_address)
        run_id = rec.start_run(**run)
    except STORE_ERRORS as err:
        log.warning("a run could not be recorded: %s", err)
        return Recording(engine, None, stopped=stopped_because(err, 0))
    return Recording(engine, run_id, tokenizer)
