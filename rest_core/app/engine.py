"""The models, built-in stores, cost models and trace store every visitor of one server shares.

Models load on first use (or in the background when the first page opens), the
built-in store of each tokenizer is opened or built in the background, and one
decode runs at a time per model (a lock per model, on top of the page's queue).
Nothing here touches the cache folder before it is needed: the trace store is
opened on first use.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from datastores import Store, default_store_path, open_default_store, store_labels
from rest_core.app.settings import MAX_MODELS, log, message_of
from rest_core.cost import CostModel
from rest_core.model import DEFAULT_MODEL, LoadedModel, load_model, load_tokenizer
from rest_core.traces.recorder import TraceRecorder

CostFactory = Callable[[LoadedModel, Sequence[Store]], Any]


@dataclass
class StoreSlot:
    """The built-in store for one tokenizer: built once, in the background."""

    state: str = "idle"  # idle | building | ready | failed | off
    store: Any = None
    error: str = ""
    started: float = 0.0
    path: Optional[Path] = None  # where it is being built (for progress), when known
    finished: threading.Event = field(default_factory=threading.Event)


@dataclass
class ModelSlot:
    """A loaded model, its lock, its built-in store and its cost models (one per set of stores)."""

    lm: LoadedModel
    cost_factory: CostFactory
    lock: threading.Lock = field(default_factory=threading.Lock)  # one decode at a time on this model
    static: StoreSlot = field(default_factory=StoreSlot)
    costs: dict[tuple[str, ...], Any] = field(default_factory=dict)  # store labels -> budget chooser
    _cost_lock: threading.Lock = field(default_factory=threading.Lock)

    def chooser(self, stores: Sequence[Store]) -> Any:
        """The automatic budget's cost model for these stores (the forward-pass cost is measured once
        per process and model; acceptance is learned per set of stores)."""
        key = tuple(store_labels(stores))
        with self._cost_lock:
            if key not in self.costs:
                self.costs[key] = self.cost_factory(self.lm, stores)
            return self.costs[key]

    @property
    def measured(self) -> bool:
        """A cost model exists already (the next one reuses its forward-pass measurements)."""
        return bool(self.costs)

    def plain_ms(self) -> Optional[float]:
        """A one-token forward pass as calibrated, when a cost model exists already."""
        return next((c.forward_ms(1) for c in list(self.costs.values()) if hasattr(c, "forward_ms")), None)


def default_cost_factory(lm: LoadedModel, stores: Sequence[Store]) -> CostModel:
    return CostModel.for_model(lm, stores=stores)


def default_store_factory(tokenizer: Any) -> Any:
    return open_default_store(tokenizer, progress=True)


def _store_build_dir(tokenizer: Any) -> Optional[Path]:
    try:
        return default_store_path(tokenizer)
    except Exception:  # only used to show progress
        return None


def _store_line(engine: Engine, st: StoreSlot) -> str:
    return {
        "idle": "built-in datastore not opened yet",
        "building": "building the built-in datastore from Python sources (first time on this machine "
                    f"only; it takes a few minutes: {engine.store_progress(st)}). Until it is ready, "
                    "answers draft from the request and history stores only",
        "ready": f"built-in datastore ready ({getattr(st.store, 'n_tokens', 0):,} tokens)",
        "failed": f"⚠ built-in datastore unavailable: {st.error}",
        "off": "no built-in datastore",
    }[st.state]


class Engine:
    """Models and the built-in store, shared by all sessions of one server.

    The factories replace the default model loader, built-in store and cost model (tests);
    `recorder` (or `trace_db`, a path) the trace store, opened on first use otherwise.
    """

    def __init__(self, lm_factory: Callable[[str], LoadedModel] | None = None,
                 store_factory: Callable[[Any], Any] | None = None,
                 cost_factory: CostFactory | None = None,
                 recorder: TraceRecorder | None = None, trace_db: str | Path | None = None):
        self.lm_factory = lm_factory or load_model
        self.store_factory = store_factory or default_store_factory
        self.watch_store_build = store_factory is None
        self.cost_factory = cost_factory or default_cost_factory
        self.trace_db = trace_db
        self._recorder = recorder
        self.models: dict[str, ModelSlot] = {}
        self.loading: dict[str, float] = {}  # model name -> when its load began
        self.load_errors: dict[str, str] = {}
        self._tokenizers: dict[str, Any] = {}
        self._preloading = False
        self._load_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self.workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rest-decode")

    @property
    def recorder(self) -> TraceRecorder:
        """The trace store, opened (and its schema created) on first use."""
        with self._state_lock:
            if self._recorder is None:
                self._recorder = TraceRecorder(self.trace_db)
            return self._recorder

    @staticmethod
    def canonical(name: Optional[str]) -> str:
        name = (name or "").strip()
        return DEFAULT_MODEL if name.lower() in ("", "default", DEFAULT_MODEL.lower()) else name

    def model(self, name: Optional[str]) -> ModelSlot:
        """The loaded model (loading it now if needed; raises ModelLoadError with a clear message)."""
        name = self.canonical(name)
        slot = self.models.get(name)
        if slot is not None:
            return slot
        with self._load_lock:  # one load at a time: two visitors asking for the same model share it
            slot = self.models.get(name)
            if slot is not None:
                return slot
            self.loading[name] = time.time()
            try:
                lm = self.lm_factory(name)
            except Exception as err:
                self.load_errors[name] = message_of(err)
                raise
            finally:
                self.loading.pop(name, None)
            self.load_errors.pop(name, None)
            slot = ModelSlot(lm=lm, cost_factory=self.cost_factory)
            while len(self.models) >= MAX_MODELS:  # forget the oldest; a decode holding it keeps it alive
                self.models.pop(next(iter(self.models)))
            self.models[name] = slot
            return slot

    def start_static(self, slot: ModelSlot) -> StoreSlot:
        """Open (or build, the first time on this machine) the built-in store in the background."""
        st = slot.static
        with self._state_lock:
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
            st.error, st.state = message_of(err), "failed"
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
            self.start_static(self.model(DEFAULT_MODEL))
        except Exception as err:  # the status line shows it
            log.warning("preloading the default model failed: %s", message_of(err))

    def store_progress(self, st: StoreSlot) -> str:
        elapsed = time.time() - st.started
        done = ""
        if st.path is not None:
            sizes = [p.stat().st_size for p in st.path.parent.glob(f".{st.path.name}.building-*/tokens.u32")
                     if p.exists()]
            if sizes:
                done = f", {max(sizes) // 4 / 1e6:.1f}M tokens so far"
        return f"{elapsed:.0f} s{done}"

    def status(self) -> str:
        """One line per model: loading / loaded, and the state of its built-in store."""
        lines = []
        for name, since in list(self.loading.items()):
            lines.append(f"Loading model **{name}** ({time.time() - since:.0f} s so far; the very first load "
                         "on a machine converts the offline copy, about 30 s).")
        for name, error in list(self.load_errors.items()):
            if name not in self.models:
                lines.append(f"⚠ Model **{name}** could not be loaded: {error}")
        for name, slot in list(self.models.items()):
            lm = slot.lm
            lines.append(f"✓ Model **{name}** on {lm.device.type} ({str(lm.dtype).split('.')[-1]}); "
                         f"{_store_line(self, slot.static)}.")
        return "\n\n".join(lines) or "Starting: the model loads on first use."

    def tokenizer_for(self, name: Optional[str]) -> Any:
        """A tokenizer for replaying a run: a loaded model's, else loaded alone (no weights), else None."""
        name = self.canonical(name)
        loaded = [s.lm for key, s in list(self.models.items()) if name in (key, s.lm.name)]
        if loaded:
            return loaded[0].tokenizer
        if name not in self._tokenizers:
            try:
                self._tokenizers[name] = load_tokenizer(name)
            except Exception:  # replay works without one (token ids shown instead)
                self._tokenizers[name] = None
        return self._tokenizers[name]

    def ready(self) -> bool:
        """Nothing is loading or building (the page stops polling the status)."""
        return not self.loading and bool(self.models or self.load_errors) and \
            all(s.static.state != "building" for s in self.models.values())
