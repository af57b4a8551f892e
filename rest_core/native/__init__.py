"""REST Lab's own CPU kernel for linear layers over a few rows, built on this machine at first use.

`blocked_linear.cpp` computes y = x W^T + b with W stored once in 16-column panels, so a verify pass
over a handful of tree nodes streams each weight from memory once, as a one-token step does, and uses
every loaded weight for every row (up to 16 rows at a time with AVX-512, 6 with AVX2).  It is compiled
with the machine's C++ compiler for this very CPU (-march=native) into the cache (`<cache>/native/`,
one file per machine key and source), linked to the OpenMP runtime torch already uses, and loaded with
ctypes: no build step at install time, nothing to download.  Where there is no compiler, the build
fails, or REST_LAB_NATIVE=0, `library()` returns None and `unavailable()` says why; the caller then keeps
its other kernels.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

from datastores.common import cache_dir
from rest_core.machine import machine_key

SOURCE = Path(__file__).with_name("blocked_linear.cpp")
ENV = "REST_LAB_NATIVE"  # "0" / "off": never build or load the kernel
PANEL = 16  # output columns per panel (the kernel's NB; checked against the library at load)
PROFILE_NAME = "rest_lab::blocked_linear"  # what a torch profile calls the kernel

_lib: Optional[ctypes.CDLL] = None
_why: Optional[str] = None
_tried = False


def unavailable() -> Optional[str]:
    """Why the kernel is not available (None when it is, or before `library()` was first asked)."""
    return _why


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernel library, built first if this machine has none yet; None when it cannot be had."""
    global _lib, _why, _tried, _kernel
    if _tried:
        return _lib
    _tried = True
    if (os.environ.get(ENV) or "").strip().lower() in ("0", "off", "no", "false"):
        _why = f"switched off ({ENV}={os.environ[ENV]})"
        return None
    try:
        path = _built()
        lib = ctypes.CDLL(str(path))
        _declare(lib)
        if lib.rest_lab_panel_width() != PANEL:
            raise OSError(f"{path.name} packs {lib.rest_lab_panel_width()} columns per panel, not {PANEL}")
        _lib = lib
        _kernel = lib.rest_lab_panel_linear
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        _why = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
    return _lib


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.rest_lab_pack_panels.argtypes = [ptr, ptr, i64, i64, cint]
    lib.rest_lab_pack_panels.restype = None
    lib.rest_lab_panel_linear.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, cint]
    lib.rest_lab_panel_linear.restype = None
    lib.rest_lab_panel_width.argtypes = []
    lib.rest_lab_panel_width.restype = cint
    lib.rest_lab_register_rows.argtypes = []
    lib.rest_lab_register_rows.restype = cint


def register_rows() -> Optional[int]:
    """How many rows of sums the kernel holds in registers on this machine (16 with AVX-512, 6 with AVX2),
    None when the kernel is not available."""
    lib = library()
    return None if lib is None else int(lib.rest_lab_register_rows())


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise OSError("no C++ compiler found (set CXX, or install g++): the blocked linear kernel is not built")


def source_tag() -> str:
    """A short hash of the kernel's source: a choice of kernels measured with another version is measured again."""
    try:
        return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]
    except OSError:
        return "missing"


def _built() -> Path:
    """The compiled library for this machine and source, compiled now when missing (atomically)."""
    out = cache_dir() / "native" / f"blocked-linear-{machine_key()}-{source_tag()}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    cxx = _compiler()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        base = [cxx, "-O3", "-std=c++17", "-fPIC", "-shared", str(SOURCE), "-o", str(target)]
        openmp = ["-fopenmp", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
        first_error = ""
        for flags in (["-march=native"] + openmp, openmp, ["-march=native"]):  # the best first
            run = subprocess.run(base + flags, capture_output=True, text=True, timeout=120)
            if run.returncode == 0:
                os.replace(target, out)
                return out
            first_error = first_error or ((run.stderr or run.stdout).strip().splitlines() or ["no output"])[-1]
        raise OSError(f"{cxx} could not build {SOURCE.name}: {first_error}")


def pack(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N x K, float32, CPU) as panels (ceil(N/16), K, 16), and the bias zero-padded to ceil(N/16) * 16."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the blocked linear kernel is not available: {_why}")
    w = weight.detach().contiguous()
    n, k = w.shape
    count = -(-n // PANEL)
    panels = torch.empty(count, k, PANEL, dtype=torch.float32)
    lib.rest_lab_pack_panels(w.data_ptr(), panels.data_ptr(), k, n, torch.get_num_threads())
    padded = torch.zeros(count * PANEL, dtype=torch.float32)
    if bias is not None:
        padded[:n] = bias.detach()
    return panels, padded


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (..., K) float32 on the CPU -> (..., out_features), from `pack`'s panels and padded bias.  Called for
    every linear layer of every pass: no more Python work than it takes."""
    if x.dtype != torch.float32:  # the kernel reads raw float32 memory: anything else would be misread
        raise TypeError(f"the blocked linear kernel takes float32 input, not {x.dtype}: convert it, or use "
                        f"REST_LAB_KERNELS=default")
    if not x.is_contiguous():
        x = x.contiguous()
    k = panels.shape[1]
    out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
    args = (x.data_ptr(), panels.data_ptr(), bias.data_ptr(), out.data_ptr(), x.numel() // k, k, out_features,
            torch.get_num_threads())
    if torch.autograd._profiler_enabled():  # named in a torch profile like any operator
        with torch.profiler.record_function(PROFILE_NAME):
            _kernel(*args)
    else:
        _kernel(*args)
    return out


def _kernel(*args) -> None:
    """The compiled rest_lab_panel_linear (bound when the library loads)."""
    raise RuntimeError(f"the blocked linear kernel is not available: {_why}")
