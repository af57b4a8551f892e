"""REST Lab's native code: the C++ build step, and data addresses for the calls.

`build` compiles one C++ source into a shared library in the cache (`<cache>/native/<stem>-<key>-<source>.so`),
trying a list of flag sets best first (this CPU's own instructions, then portable ones), atomically, so two
processes never load a half-written file.  The key names what the library was compiled for and with: this CPU and
its instruction set (`rest_base.machine.cpu_key`) and the compiler; the source's hash follows it.  Nothing else
goes in (a thread count or a torch version does not change the machine code).  A new build removes the stem's
older libraries (an old source, an old compiler) but the KEEP newest: the cache is shared by every checkout on the
machine.  `optional_library` loads such a library once per process where it only makes something faster.
REST_LAB_NATIVE=0 (or "off") switches native code off for the process: nothing is built or loaded.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from rest_base.files import cache_dir
from rest_base.machine import cpu_key

ENV = "REST_LAB_NATIVE"  # "0" / "off": never build or load native code
COMPILERS = ("c++", "g++", "clang++")  # tried in this order after $CXX
KEEP = 3  # libraries kept per stem: the newest build and two before it (other checkouts' sources)


def switched_off() -> bool:
    """Whether REST Lab's native code is switched off for this process (REST_LAB_NATIVE=0)."""
    return (os.environ.get(ENV) or "").strip().lower() in ("0", "off", "no", "false")


def _compiler_name() -> Optional[str]:
    for name in (os.environ.get("CXX"), *COMPILERS):
        if name and shutil.which(name):
            return name
    return None


def compiler() -> str:
    """The C++ compiler's command ($CXX, else the first of COMPILERS found); OSError when there is none."""
    name = _compiler_name()
    if name is None:
        raise OSError("no C++ compiler found (set CXX, or install g++): REST Lab's native code is not built")
    return name


def compiler_tag() -> str:
    """Which compiler a build would use, as the file it runs (links resolved: /usr/bin/c++ -> .../g++-12), without
    running it; "none" where there is none."""
    name = _compiler_name()
    found = shutil.which(name) if name else None
    return os.path.realpath(found) if found else "none"


def source_tag(source: Path) -> str:
    """A short hash of a source file: a changed source is built again."""
    try:
        return hashlib.sha256(source.read_bytes()).hexdigest()[:10]
    except OSError:
        return "missing"


def build_key() -> str:
    """What a library is compiled for and with: this CPU and its instruction set, and the compiler (10 hex)."""
    return hashlib.sha256(f"{cpu_key()}|{compiler_tag()}".encode()).hexdigest()[:10]


def library_path(source: Path, stem: str) -> Path:
    """Where the library of `source` built under this machine's key lies (or will)."""
    return cache_dir() / "native" / f"{stem}-{build_key()}-{source_tag(source)}.so"


def _remove_stale(out: Path, stem: str) -> None:
    """Remove the stem's libraries built under other keys or from other sources, all but the KEEP newest (this one
    included): the cache is shared by every checkout on the machine, so two checkouts of different sources keep
    theirs while the older builds go (a process that loaded one keeps its mapping)."""
    mine = re.compile(re.escape(stem) + r"-[0-9a-f]{10}-(?:[0-9a-f]{10}|missing)\.so")
    others = []
    for old in out.parent.glob(f"{stem}-*.so"):
        if old != out and mine.fullmatch(old.name):
            try:
                others.append((old.stat().st_mtime, old))
            except OSError:
                pass
    for _, old in sorted(others, reverse=True)[KEEP - 1:]:
        try:
            old.unlink()
        except OSError:
            pass


def build(source: Path, stem: str, attempts: list[list[str]], find_compiler: Callable[[], str] = compiler) -> Path:
    """`library_path(source, stem)`, compiled from `source` when missing: the first of `attempts` (extra compiler
    flags) that builds wins, and the stem's stale libraries go; OSError with the compiler's first complaint when
    none builds.  `find_compiler` is asked only when there is something to compile."""
    out = library_path(source, stem)
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
                _remove_stale(out, stem)
                return out
            first_error = first_error or ((run.stderr or run.stdout).strip().splitlines() or ["no output"])[-1]
        raise OSError(f"{cxx} could not build {source.name}: {first_error}")


def optional_library(tried: dict, stem: str, path: Callable[[], Path], declare) -> Optional[ctypes.CDLL]:
    """A library that only makes something faster, loaded and declared once per process (`tried` remembers it by
    `stem`, None included): `path()` gives its built file; None when it cannot be had or native code is switched
    off (the caller keeps its Python or torch path)."""
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
