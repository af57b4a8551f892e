"""The models, built-in stores, cost models and trace store every visitor of one server shares.

Models load on first use (or in the background when the first page opens), the
built-in store of each tokenizer is opened or built in the background, and one
decode runs at a time per model (a lock per model, on top of the page's queue).
Nothing here touches the cache folder before it is needed: the trace store is
opened on first use.
"""
from __future__ import annotations

import gc
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any, Optional

from datastores import DatastoreError, Store, default_store_path, open_answers, open_default_store
from datastores.answer_prompts import answer_prompts
from rest_core.app.policy import Policy, markdown_text
from rest_core.app.settings import MAX_MODELS, STORE_RETRY_S, log, message_of
from rest_core.app.slots import CostFactory, ModelSlot, StoreSlot
from rest_core.app.status import status_text, store_progress
from rest_core.app.turns import Busy, Turns, between_decodes
from rest_core.cost import CostModel
from rest_core.hidden import open_model_dense
from rest_core.model import DEFAULT_MODEL, LoadedModel, ModelLoadError, generate_batch, load_model, load_tokenizer
from rest_core.traces.recorder import TraceRecorder, default_db_path

MAX_TOKENIZERS = 8  # tokenizers kept for replaying runs of models that are not loaded
AnswersFactory = Callable[[ModelSlot, Callable[[], None], StoreSlot], Any]  # (slot, pause, its StoreSlot) -> store
# (slot, turn) -> store; every model pass of the build runs inside `with turn():`, which holds the model's lock
DenseFactory = Callable[[ModelSlot, Callable[[], AbstractContextManager]], Any]
MAX_LOAD_ERRORS = 3  # the status line names the latest failed loads only
TRACE_BUSY_S = 5.0  # how long a write waits for a trace store another program holds
TOKENIZER_WAIT_S = 120.0  # how long loading a tokenizer for a replay waits for its turn (then ids are shown)
TOKENIZER_RETRY_S = 60.0  # a tokenizer that failed to load is tried again this long after


def default_cost_factory(lm: LoadedModel, stores: Sequence[Store], kind: str) -> CostModel:
    return CostModel.for_model(lm, stores=stores, kind=kind)


def default_store_factory(tokenizer: Any) -> Any:
    return open_default_store(tokenizer, progress=True)


def default_answers_factory(slot: ModelSlot, pause: Callable[[], None], st: StoreSlot) -> Any:
    """The general-text store of this model: opened, or built (the model answers a few hundred requests;
    the build steps aside, between two tokens, whenever a visitor's decode runs).  REST_LAB_ANSWERS=none
    turns it off (the page then drafts chat answers from the other stores)."""
    if os.environ.get("REST_LAB_ANSWERS", "").strip().lower() in ("none", "off", "0"):
        return None
    lm = slot.lm

    def generate(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:  # called only to build
        st.total = st.total or len(answer_prompts())
        out = generate_batch(lm, prompts, max_new_tokens, between_steps=pause)
        st.done += len(prompts)
        return out
    try:  # kept from an earlier build, or shipped with the package: indexed in about a second, at once
        return open_answers("default", lm.name, lm.tokenizer, progress=False)
    except DatastoreError:
        slot.static.finished.wait()  # the model answers for minutes: one build at a time on these cores
    return open_answers("default", lm.name, lm.tokenizer, generate=generate, progress=False)


def default_dense_factory(slot: ModelSlot, turn: Callable[[], AbstractContextManager]) -> Any:
    """The dense store of this model (its hidden states over the general-text store's answers): opened, or built
    once (the model reads its answers in chunks of about a second, each inside `turn()`, so a visitor's decode waits
    for one chunk at most).  REST_LAB_DENSE=none turns it off."""
    if os.environ.get("REST_LAB_DENSE", "").strip().lower() in ("none", "off", "0"):
        return None
    return open_model_dense(slot.lm, "default", progress=False, turn=turn)


def _store_build_dir(tokenizer: Any) -> Optional[Path]:
    try:
        return default_store_path(tokenizer)
    except Exception:  # only used to show progress
        return None


class Engine:
    """Models and the built-in store, shared by all sessions of one server.

    The factories replace the default model loader, built-in store and cost model (tests);
    `recorder` (or `trace_db`, a path) the trace store, opened on first use otherwise; `tokenizer_factory`
    loads a model's tokenizer without its weights (default: rest_core.model.load_tokenizer; with a model
    factory of its own and none given, the tokenizer of that factory's model).
    """

    def __init__(self, lm_factory: Callable[[str], LoadedModel] | None = None,
                 store_factory: Callable[[Any], Any] | None = None,
                 cost_factory: CostFactory | None = None,
                 recorder: TraceRecorder | None = None, trace_db: str | Path | None = None,
                 policy: Policy | None = None, answers_factory: AnswersFactory | None = None,
                 dense_factory: DenseFactory | None = None,
                 tokenizer_factory: Callable[[str], Any] | None = None):
        self.policy = policy or Policy.from_env()
        public = self.policy.public
        self.turns = Turns(self.policy.max_waiting if public else None, one_each=public,
                           per_address=self.policy.max_waiting_per_address if public else None)
        self.trace_notice = ""  # what went wrong with the trace store, for the status line
        self.unfinished: dict[int, dict] = {}  # run id -> the outcome its finish could not write yet
        self.lm_factory = lm_factory or load_model
        self.tokenizer_factory = tokenizer_factory or (load_tokenizer if lm_factory is None else
                                                       (lambda name: self.lm_factory(name).tokenizer))
        self.store_factory = store_factory or default_store_factory
        self.watch_store_build = store_factory is None
        # a server with its own store factory (tests) builds no general-text store unless given a factory
        self.answers_factory = answers_factory or (default_answers_factory if store_factory is None else None)
        # the dense store reads the general-text store's answers: built by default only with the default one
        self.dense_factory = dense_factory or (default_dense_factory if answers_factory is None and store_factory
                                               is None else None)
        self.cost_factory = cost_factory or default_cost_factory
        self.trace_db = trace_db
        self._recorder = recorder
        self.models: dict[str, ModelSlot] = {}
        self.loading: dict[str, float] = {}  # model name -> when its load began
        self.load_errors: dict[str, str] = {}
        self._tokenizers: dict[str, Any] = {}
        self._tokenizer_failed: dict[str, float] = {}  # name -> when loading its tokenizer last failed
        self._preloading = False
        self._load_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self.workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rest-decode")

    @property
    def recorder(self) -> TraceRecorder:
        """The trace store, opened (and its schema created) on first use.  An unreadable file is kept
        beside under another name and a fresh store started (the status line says so); a store that
        cannot be opened at all raises sqlite3.Error / OSError, which the handlers turn into a message."""
        with self._state_lock:
            if self._recorder is None:
                self._recorder = self._open_recorder()
            return self._recorder

    def _open_recorder(self) -> TraceRecorder:
        limit = self.policy.max_trace_bytes if self.policy.public else None
        try:
            return TraceRecorder(self.trace_db, busy_timeout_s=TRACE_BUSY_S, max_bytes=limit)
        except sqlite3.DatabaseError as err:
            if isinstance(err, sqlite3.OperationalError):  # locked, unwritable: not the file's fault
                raise
            path = Path(self.trace_db) if self.trace_db is not None else default_db_path()
            kept = path.with_name(f"{path.stem}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
            log.error("trace store %s is unreadable (%s); kept as %s, starting a fresh one", path, err, kept)
            for suffix in ("", "-wal", "-shm"):
                src = path.with_name(path.name + suffix)
                if src.exists():
                    src.rename(kept.with_name(kept.name + suffix))
            self.trace_notice = (f"⚠ The trace store was unreadable ({markdown_text(str(err), 80)}); it was kept as "
                                 f"{kept.name} and new runs are recorded in a fresh one.")
            return TraceRecorder(self.trace_db, busy_timeout_s=TRACE_BUSY_S, max_bytes=limit)

    @staticmethod
    def canonical(name: Optional[str]) -> str:
        if not isinstance(name, (str, type(None))):
            raise ModelLoadError(f"The model must be given by its name, not a {type(name).__name__}.")
        name = (name or "").strip()
        return DEFAULT_MODEL if name.lower() in ("", "default", DEFAULT_MODEL.lower()) else name

    def model(self, name: Optional[str]) -> ModelSlot:
        """The loaded model (loading it now if needed; raises ModelLoadError with a clear message, also for a
        model a public server does not offer)."""
        name = self.canonical(name)
        self.policy.check_model(name)
        slot = self._touch(name)
        if slot is not None:
            return slot
        with self._load_lock:  # one load at a time: two visitors asking for the same model share it
            slot = self._touch(name)
            if slot is not None:
                return slot
            self._evict(MAX_MODELS - 1)  # make room before loading, not after
            self.loading[name] = time.time()
            try:
                lm = self.lm_factory(name)
            except Exception as err:
                self.load_errors.pop(name, None)
                self.load_errors[name] = message_of(err)
                while len(self.load_errors) > MAX_LOAD_ERRORS:
                    self.load_errors.pop(next(iter(self.load_errors)))
                raise
            finally:
                self.loading.pop(name, None)
            self.load_errors.pop(name, None)
            slot = ModelSlot(lm=lm, cost_factory=self.cost_factory)
            self._evict(MAX_MODELS - 1)
            self.models[name] = slot
            return slot

    def _touch(self, name: str) -> Optional[ModelSlot]:
        """The loaded model, now the most recently used one (None when not loaded)."""
        with self._state_lock:
            slot = self.models.pop(name, None)
            if slot is not None:
                self.models[name] = slot
            return slot

    def _evict(self, keep: int) -> None:
        """Forget the least recently used models until `keep` remain (a decode holding one keeps it alive
        until it ends); their memory is freed now."""
        with self._state_lock:
            if len(self.models) <= keep:
                return
            while len(self.models) > max(0, keep):
                self.models.pop(next(iter(self.models)))
        gc.collect()

    def start_static(self, slot: ModelSlot) -> StoreSlot:
        """Open (or build, the first time on this machine) the built-in store in the background."""
        st = slot.static
        with self._state_lock:
            if st.state == "failed" and time.time() - st.failed_at >= STORE_RETRY_S:
                st.state, st.error, st.finished = "idle", "", threading.Event()  # try the build again
            if st.state != "idle":
                return st
            st.state, st.started = "building", time.time()
            st.path = _store_build_dir(slot.lm.tokenizer) if self.watch_store_build else None
        threading.Thread(target=self._build_static, args=(slot,), name="rest-store-build", daemon=True).start()
        return st

    def _build_static(self, slot: ModelSlot) -> None:
        st = slot.static
        try:
            st.store = self.store_factory(slot.lm.tokenizer)
            st.state = "ready" if st.store is not None else "off"
        except Exception as err:  # shown on the page
            st.error, st.state, st.failed_at = message_of(err), "failed", time.time()
        finally:
            st.finished.set()

    def start_answers(self, slot: ModelSlot) -> StoreSlot:
        """Open (or build, once per model on this machine) the general-text store in the background, after the
        built-in store is ready; the build pauses while any decode on this model runs."""
        st = slot.answers
        with self._state_lock:
            if st.state == "failed" and time.time() - st.failed_at >= STORE_RETRY_S:
                st.state, st.error, st.finished = "idle", "", threading.Event()
            if st.state != "idle":
                return st
            if self.answers_factory is None:
                st.state = "off"
                st.finished.set()
                return st
            st.state, st.started, st.done = "building", time.time(), 0
        threading.Thread(target=self._build_answers, args=(slot,), name="rest-answers-build", daemon=True).start()
        return st

    def _build_answers(self, slot: ModelSlot) -> None:
        st = slot.answers
        try:
            def pause() -> None:  # between two tokens: wait while a visitor's decode holds the model
                while slot.lock.locked():
                    time.sleep(0.05)
            st.store = self.answers_factory(slot, pause, st)
            st.state = "ready" if st.store is not None else "off"
        except Exception as err:  # shown on the page
            st.error, st.state, st.failed_at = message_of(err), "failed", time.time()
        finally:
            st.finished.set()
        self._build_dense(slot)

    def _build_dense(self, slot: ModelSlot) -> None:
        """After the general-text store: the dense store over its answers (built once), or off.  The build reads
        the answers a chunk at a time holding the model's lock (a chunk hooks the model's layer: no decode may run
        meanwhile), and lets a decode that is waiting for the model go first between two chunks."""
        st = slot.dense
        if self.dense_factory is None or slot.answers.state != "ready":
            st.state = "off"
            st.finished.set()
            return
        st.state, st.started = "building", time.time()
        try:
            slot.static.finished.wait()  # one build at a time on these cores
            st.store = self.dense_factory(slot, partial(between_decodes, slot.lock))
            st.state = "ready" if st.store is not None else "off"
        except Exception as err:  # shown on the page
            st.error, st.state, st.failed_at = message_of(err), "failed", time.time()
        finally:
            st.finished.set()

    def preload(self) -> Optional[threading.Thread]:
        """Load the default model, then open or build the built-in store, in the background (once)."""
        with self._state_lock:
            if self._preloading:
                return None
            self._preloading = True
        thread = threading.Thread(target=self._preload, name="rest-preload", daemon=True)
        thread.start()
        return thread

    def _preload(self) -> None:
        try:
            slot = self.model(DEFAULT_MODEL)
            self.start_static(slot)
            self.start_answers(slot)
        except Exception as err:  # the status line shows it
            log.warning("preloading the default model failed: %s", message_of(err))

    def store_progress(self, st: StoreSlot) -> str:
        return store_progress(st)

    def status(self) -> str:
        """One line per model: loading / loaded, and the state of its built-in store (rest_core.app.status)."""
        return status_text(self)

    def tokenizer_for(self, name: Optional[str], owner: str = "", address: str = "", in_turn: bool = False) -> Any:
        """A tokenizer for replaying a run or building a visitor's store: a loaded model's, else one loaded alone
        (no weights; kept, up to MAX_TOKENIZERS), else None.  On a public server a load takes its turn in the
        line of decodes as `owner` from `address` (None when the line refuses it), unless the caller holds a
        turn already (`in_turn`)."""
        name = self.canonical(name)
        loaded = [s.lm for key, s in list(self.models.items()) if name in (key, s.lm.name)]
        if loaded:
            return loaded[0].tokenizer
        if not self.policy.offers(name):  # a public server never fetches what a recorded run names
            return None
        if name in self._tokenizers:
            return self._tokenizers[name]
        if time.monotonic() - self._tokenizer_failed.get(name, -TOKENIZER_RETRY_S) < TOKENIZER_RETRY_S:
            return None  # it failed a moment ago: replays show ids meanwhile
        ticket = None
        try:
            if self.policy.public and not in_turn:
                ticket = self.turns.join(owner, address)
                if not ticket.wait(TOKENIZER_WAIT_S):
                    return None
            with self._load_lock:
                if name not in self._tokenizers:
                    tokenizer = self._load_tokenizer(name)
                    if tokenizer is None:
                        self._tokenizer_failed[name] = time.monotonic()
                        return None
                    self._keep_tokenizer(name, tokenizer)
                return self._tokenizers[name]
        except Busy:
            return None
        finally:
            if ticket is not None:
                ticket.leave()

    def _load_tokenizer(self, name: str) -> Any:
        try:
            return self.tokenizer_factory(name)
        except Exception:  # replay works without one (token ids shown instead)
            return None

    def _keep_tokenizer(self, name: str, tokenizer: Any) -> None:
        with self._state_lock:
            while len(self._tokenizers) >= MAX_TOKENIZERS:  # forget the oldest
                self._tokenizers.pop(next(iter(self._tokenizers)))
            self._tokenizers[name] = tokenizer

    def ready(self) -> bool:
        """Nothing is loading or building (the page stops polling the status)."""
        return not self.loading and bool(self.models or self.load_errors) and \
            all("building" not in (s.static.state, s.answers.state, s.dense.state) for s in self.models.values())
