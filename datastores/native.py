"""Native helpers built on this machine at first use: the compiler step, and the stores' lookups.

`build` compiles one C++ source into a shared library in the cache (`<cache>/native/`), trying a list of flag
sets best first (this CPU's own instructions, then portable ones), atomically, so two processes never load a
half-written file; rest_core.native builds its kernels with it too.  `static_lookup_library()` is
`static_lookup.cpp` loaded with ctypes: a static store's whole lookup in one call (the Python path's binary
searches probe for probe, each probe a few memory reads instead of a few microseconds of interpreter work).
`request_scan_library()` is `request_scan.cpp`: the request store's lookup as one scan of its few thousand
tokens, so the store needs no hashed index of its own.  `recycle_grow_library()` is `recycle_grow.cpp`: the
model source's draft (its tree of recorded successors, as rows) in one call.  Where there is no compiler, the
build fails, or REST_LAB_NATIVE=0, they are None and the stores keep their Python paths, with the same answers.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from datastores.common import cache_dir

ENV = "REST_LAB_NATIVE"  # "0" / "off": never build or load native code
STATIC_LOOKUP_SOURCE = Path(__file__).with_name("static_lookup.cpp")
REQUEST_SCAN_SOURCE = Path(__file__).with_name("request_scan.cpp")
RECYCLE_GROW_SOURCE = Path(__file__).with_name("recycle_grow.cpp")

_libraries: dict[str, Optional[ctypes.CDLL]] = {}  # by stem, once tried


def switched_off() -> bool:
    return (os.environ.get(ENV) or "").strip().lower() in ("0", "off", "no", "false")


def compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise OSError("no C++ compiler found (set CXX, or install g++): REST Lab's native code is not built")


def source_tag(source: Path) -> str:
    """A short hash of a source file: a changed source is built again."""
    try:
        return hashlib.sha256(source.read_bytes()).hexdigest()[:10]
    except OSError:
        return "missing"


def cpu_key() -> str:
    """A short key of this CPU's model and instruction set (what -march=native compiles for)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            seen = {}
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags") and key not in seen:
                    seen[key] = value.strip()
                if len(seen) == 2:
                    break
        text += "|" + "|".join(f"{k}={v}" for k, v in sorted(seen.items()))
    except OSError:
        text += "|" + platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def build(source: Path, name: str, attempts: list[list[str]], find_compiler: Callable[[], str] = compiler) -> Path:
    """`<cache>/native/<name>.so` compiled from `source` when missing: the first of `attempts` (extra compiler
    flags) that builds wins; OSError with the compiler's first complaint when none does.  `find_compiler` is
    asked only when there is something to compile."""
    out = cache_dir() / "native" / f"{name}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = find_compiler()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        base = [cxx, "-O3", "-std=c++17", "-fPIC", "-shared", str(source), "-o", str(target)]
        first_error = ""
        for flags in attempts:  # the best first
            run = subprocess.run(base + flags, capture_output=True, text=True, timeout=120)
            if run.returncode == 0:
                os.replace(target, out)
                return out
            first_error = first_error or ((run.stderr or run.stdout).strip().splitlines() or ["no output"])[-1]
        raise OSError(f"{cxx} could not build {source.name}: {first_error}")


def _declare_static_lookup(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rest_lab_static_lookup.argtypes = [ptr, i64, ptr, ptr, i64, ctypes.c_int, ptr, i64, ptr, i64, i64, i64, i64,
                                           i64, ptr, ptr]
    lib.rest_lab_static_lookup.restype = i64


def optional_library(tried: dict, stem: str, path: Callable[[], Path], declare) -> Optional[ctypes.CDLL]:
    """A library that only makes something faster, loaded and declared once per process (`tried` remembers it by
    `stem`, None included): `path()` gives its built file; None when it cannot be had (the caller keeps its
    Python or torch path)."""
    if stem not in tried:
        lib = None
        if not switched_off():
            try:
                lib = ctypes.CDLL(str(path()))
                declare(lib)
            except (OSError, subprocess.SubprocessError, ValueError, AttributeError):
                lib = None
        tried[stem] = lib
    return tried[stem]


def _library(source: Path, stem: str, declare) -> Optional[ctypes.CDLL]:
    """A store's native lookup, built for this CPU at first use."""
    return optional_library(_libraries, stem, lambda: build(source, f"{stem}-{cpu_key()}-{source_tag(source)}",
                                                            [["-march=native"], []]), declare)


_addresses: dict[int, tuple[weakref.ref, int]] = {}  # id -> (the object, weakly; its data address)


def address(x) -> int:
    """The data address of a numpy array or an `array.array` that lives long (a constant table, a store's tables,
    a source's counts), looked up once while it lives: asking numpy costs ~2 microseconds a time.  Only a weak
    reference is kept, so a replaced table is freed as ever."""
    got = _addresses.get(id(x))
    if got is None or got[0]() is not x:
        if len(_addresses) > 256:
            _addresses.clear()
        at = x.ctypes.data if hasattr(x, "ctypes") else x.buffer_info()[0]
        got = _addresses[id(x)] = (weakref.ref(x), at)
    return got[1]


def static_lookup_library() -> Optional[ctypes.CDLL]:
    """The loaded static-lookup library, built first if this machine has none yet; None when it cannot be had."""
    return _library(STATIC_LOOKUP_SOURCE, "static-lookup", _declare_static_lookup)


def _declare_request_scan(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rest_lab_request_scan.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr]
    lib.rest_lab_request_scan.restype = i64


def request_scan_library() -> Optional[ctypes.CDLL]:
    """The loaded request-scan library, built first if this machine has none yet; None when it cannot be had."""
    return _library(REQUEST_SCAN_SOURCE, "request-scan", _declare_request_scan)


def _declare_recycle_grow(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rest_lab_recycle_grow.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_uint64, i64, ptr, i64, ptr, i64, ptr,
                                          i64, i64, i64, i64, ctypes.c_double, i64, ptr, ptr]
    lib.rest_lab_recycle_grow.restype = i64


def recycle_grow_library() -> Optional[ctypes.CDLL]:
    """The loaded model-source library, built first if this machine has none yet; None when it cannot be had."""
    return _library(RECYCLE_GROW_SOURCE, "recycle-grow", _declare_recycle_grow)
