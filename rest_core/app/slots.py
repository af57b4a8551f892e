"""What the server holds per loaded model: the model, its lock, its stores being opened or built in the
background, its cost models and the table of its own predictions visitors' tables fork from."""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from datastores import DatastoreError, RecycleStore, Store, default_recycle_path, store_labels
from rest_core.app.settings import log
from rest_core.app.streaming import Disturbance
from rest_core.model import LoadedModel

PLAIN_PACES = 4  # plain decoding's pace: the fastest of this many latest measurements
CostFactory = Callable[[LoadedModel, Sequence[Store], str], Any]  # (model, stores, kind of prompt) -> budget chooser


@dataclass
class StoreSlot:
    """The built-in store for one tokenizer: built once, in the background."""

    state: str = "idle"  # idle | building | ready | failed | off
    store: Any = None
    error: str = ""
    started: float = 0.0
    path: Optional[Path] = None  # where it is being built (for progress), when known
    finished: threading.Event = field(default_factory=threading.Event)
    failed_at: float = 0.0
    done: int = 0  # general-text store: requests answered so far
    total: int = 0  # general-text store: requests to answer, set when answering starts (0 while it is only opened)


@dataclass
class ModelSlot:
    """A loaded model, its lock, its built-in store and its cost models (one per set of stores)."""

    lm: LoadedModel
    cost_factory: CostFactory
    lock: threading.Lock = field(default_factory=threading.Lock)  # one decode at a time on this model
    drawing: Disturbance = field(default_factory=Disturbance)  # the live view's redraws (their steps teach no curve)
    plain_paces: deque = field(default_factory=lambda: deque(maxlen=PLAIN_PACES))  # plain decoding's ms per token,
    # as the latest timed plain decodes ran it (every race, and one before the first chat)
    static: StoreSlot = field(default_factory=StoreSlot)
    answers: StoreSlot = field(default_factory=StoreSlot)  # the general-text store (the model's own answers)
    dense: StoreSlot = field(default_factory=StoreSlot)  # the dense store over those answers (hidden states)
    costs: dict[tuple[str, ...], Any] = field(default_factory=dict)  # (kind, *store labels) -> budget chooser
    _cost_lock: threading.Lock = field(default_factory=threading.Lock)
    _recycle_base: Optional[RecycleStore] = None  # the table visitors' tables start from (read-only)
    _learning: OrderedDict = field(default_factory=OrderedDict)  # id -> weakref of forks that learned, oldest first

    def recycle_fork(self) -> RecycleStore:
        """A visitor's own table of the model's predictions: a fork (copy on write) of the table command-line
        and benchmark runs keep for this model, read once, or of an empty one when there is none that fits."""
        with self._cost_lock:
            if self._recycle_base is None:
                base = RecycleStore(self.lm.vocab_size)  # no path: nothing is ever written
                try:
                    path = default_recycle_path(self.lm.name, self.lm.tokenizer)
                    if path.is_file():
                        base.load(path)
                except (DatastoreError, OSError) as err:  # a missing or unreadable table: start empty
                    log.info("%s: visitors' tables of the model's predictions start empty (%s)", self.lm.name, err)
                self._recycle_base = base
            return self._recycle_base.fork()

    def learning(self, store: RecycleStore, limit: Optional[int]) -> None:
        """`store` (a fork) is about to learn from a decode, so it holds tables of its own: at most `limit` forks
        do (None: any number); the ones that learned least recently go back to the shared table."""
        with self._cost_lock:
            self._learning.pop(id(store), None)
            self._learning[id(store)] = weakref.ref(store)
            for key, ref in list(self._learning.items()):
                if ref() is None:
                    del self._learning[key]
            while limit is not None and len(self._learning) > max(1, limit):
                oldest = self._learning.popitem(last=False)[1]()
                if oldest is not None and self._recycle_base is not None:
                    oldest.share(self._recycle_base)

    def chooser(self, stores: Sequence[Store], kind: str = "") -> Any:
        """The automatic budget's cost model for these stores and this kind of prompt ("chat" or "text"; the
        forward-pass cost is measured once per process and model; acceptance is learned per store and kind)."""
        key = (kind, *store_labels(stores))
        with self._cost_lock:
            if key not in self.costs:
                self.costs[key] = self.cost_factory(self.lm, stores, kind)
            return self.costs[key]

    @property
    def measured(self) -> bool:
        """A cost model exists already (the next one reuses its forward-pass measurements)."""
        return bool(self.costs)

    def forward_curve(self) -> Optional[Callable[[int], float]]:
        """The forward-pass time of q tokens as calibrated on this machine, when a cost model exists already."""
        return next((c.forward_ms for c in list(self.costs.values()) if hasattr(c, "forward_ms")), None)

    @property
    def plain_token_ms(self) -> Optional[float]:
        """Plain decoding's time per token: the fastest of the latest measurements (a plain decode that the page,
        the browser or another program slowed reads slow; none reads fast)."""
        return min(self.plain_paces) if self.plain_paces else None

    def plain_ms(self) -> Optional[float]:
        """A one-token forward pass as calibrated, when a cost model exists already (plain decoding as measured
        is `plain_token_ms`)."""
        curve = self.forward_curve()
        return curve(1) if curve is not None else None
