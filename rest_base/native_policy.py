"""Which of REST Lab's optional native paths are taken: one policy object, handed to the stores and the cost model.

Each such path (a static store's lookup in `static_lookup.cpp`, the request and history stores' scan in
`request_scan.cpp`, the model source's draft in `recycle_grow.cpp`, the cost model's ranking in `rank_tree.cpp`)
has a Python / numpy twin that gives the same answers (the tests hold them to it); the native one is only faster.
A store or cost model takes its native path where its policy allows it and the library can be had (built for this
machine: `rest_base.native_build`); `NativePolicy(on=False)` takes the Python paths, for a side-by-side run
(tools/native_ab.py) or a test.  REST_LAB_NATIVE=0 switches native code off for the whole process, whatever a
policy says: nothing is built or loaded.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class NativePolicy:
    """Whether the native paths are taken (`on`); what each owner asks through `library`."""

    on: bool = True

    def library(self, get: Callable[[], Optional[ctypes.CDLL]]) -> Optional[ctypes.CDLL]:
        """The library `get()` loads (None where it cannot be had) when this policy takes native paths; None
        otherwise (the caller keeps its Python path)."""
        return get() if self.on else None


NATIVE = NativePolicy()  # the default: native paths wherever they can be had
PYTHON = NativePolicy(on=False)  # the Python / numpy paths throughout
