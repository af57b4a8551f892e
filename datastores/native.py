"""The stores' native lookups, built on this machine at first use (`rest_base.native_build`).

`static_lookup_library()` is `static_lookup.cpp` loaded with ctypes: a static store's whole lookup in one call (the
Python path's binary searches probe for probe, each probe a few memory reads instead of a few microseconds of
interpreter work).  `request_scan_library()` is `request_scan.cpp`: the request store's lookup as one scan of its
few thousand tokens, so the store needs no hashed index of its own.  `recycle_grow_library()` is
`recycle_grow.cpp`: the model source's draft (its tree of recorded successors, as rows) in one call.  Where there
is no compiler, the build fails, or REST_LAB_NATIVE=0, they are None and the stores keep their Python paths, with
the same answers.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

from rest_base.native_build import build, optional_library

STATIC_LOOKUP_SOURCE = Path(__file__).with_name("static_lookup.cpp")
REQUEST_SCAN_SOURCE = Path(__file__).with_name("request_scan.cpp")
RECYCLE_GROW_SOURCE = Path(__file__).with_name("recycle_grow.cpp")

_libraries: dict[str, Optional[ctypes.CDLL]] = {}  # by stem, once tried


def _library(source: Path, stem: str, declare) -> Optional[ctypes.CDLL]:
    """A store's native lookup, built for this CPU at first use."""
    return optional_library(_libraries, stem, lambda: build(source, stem, [["-march=native"], []]), declare)


def _declare_static_lookup(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rest_lab_static_lookup.argtypes = [ptr, i64, ptr, ptr, i64, ctypes.c_int, ptr, i64, ptr, i64, i64, i64, i64,
                                           i64, ptr, i64, ptr, i64]
    lib.rest_lab_static_lookup.restype = i64


def static_lookup_library() -> Optional[ctypes.CDLL]:
    """The loaded static-lookup library, built first if this machine has none yet; None when it cannot be had."""
    return _library(STATIC_LOOKUP_SOURCE, "static-lookup", _declare_static_lookup)


def _declare_request_scan(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rest_lab_request_scan.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64]
    lib.rest_lab_request_scan.restype = i64


def request_scan_library() -> Optional[ctypes.CDLL]:
    """The loaded request-scan library, built first if this machine has none yet; None when it cannot be had."""
    return _library(REQUEST_SCAN_SOURCE, "request-scan", _declare_request_scan)


def _declare_recycle_grow(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rest_lab_recycle_grow.argtypes = [ptr, i64, i64, ptr, ptr, i64, ctypes.c_uint64, i64, ptr, i64, ptr, i64,
                                          ptr, i64, i64, i64, i64, ctypes.c_double, i64, ptr, i64, ptr, i64]
    lib.rest_lab_recycle_grow.restype = i64


def recycle_grow_library() -> Optional[ctypes.CDLL]:
    """The loaded model-source library, built first if this machine has none yet; None when it cannot be had."""
    return _library(RECYCLE_GROW_SOURCE, "recycle-grow", _declare_recycle_grow)
