"""The phases of one REST step: one list, one wording, one timer.

Every place that names, times, stores or draws a phase uses `PHASES` and
`PHASE_NOTES` from here: the decode loop, the traces, the figures, the app and
the README.

    retrieve  look the newest context tokens up in every store
    tree      merge the continuations into one draft tree (and size it)
    forward   one model pass over the flattened tree, with the tree mask
    verify    walk the tree with the model's choices: accepted path + bonus token
    commit    keep the accepted path in the KV cache, append the new tokens
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

PHASES = ("retrieve", "tree", "forward", "verify", "commit")

PHASE_NOTES = {
    "retrieve": "look the newest context tokens (the suffix) up in every store; each returns the continuations "
                "that followed it",
    "tree": "merge the continuations into one draft tree and keep the best nodes, up to the draft budget",
    "forward": "one forward pass of the model over the flattened tree; the tree mask lets each node see the "
               "prefix, itself and its ancestors only",
    "verify": "walk from the root while the drafted token is the model's own choice; where they part, the "
              "model's token is the bonus token",
    "commit": "keep the accepted path in the KV cache and append the new tokens to the context",
}


class PhaseTimer:
    """Wall-clock milliseconds per phase of one step: ``with timer("tree"): ...``.

    `sync` (e.g. a CUDA synchronize) runs before each clock reading so asynchronous
    device work is charged to the phase that queued it.
    """

    def __init__(self, sync: Optional[Callable[[], None]] = None):
        self.ms: dict[str, float] = {}
        self._sync = sync

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase not in PHASES:
            raise KeyError(f"unknown phase {phase!r}; phases are {PHASES}")
        if self._sync is not None:
            self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.ms[phase] = self.ms.get(phase, 0.0) + (time.perf_counter() - start) * 1e3
