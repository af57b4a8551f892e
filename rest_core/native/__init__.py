"""REST Lab's own CPU kernels, built on this machine at first use.

`blocked_linear.cpp` computes y = x W^T + b for linear layers over a few rows, with W stored once in
16-column panels, so a verify pass over a handful of tree nodes streams each weight from memory once, as a
one-token step does, and uses every loaded weight for every row (blocks of 8 rows read in place with
AVX-512, 6 with AVX2; with AVX-512 also "tall" blocks of 16 rows read from a transposed copy: which one pays
is measured per machine, `rest_core.kernels`).  `row_top_k.cpp` finds each logits row's k largest ids in
one pass, each row read in one stretch per thread (the model's choices every step hands to the stores that
learn from it).
`attention.cpp` computes attention for a few query rows over the key/value cache (grouped-query heads, a
tree mask), reading the cache where it lies.
`cache_rows.cpp` moves the accepted tree nodes' rows next to the prefix in every layer of the cache at once
(REST's compaction after a verify pass).  `draft_tree.cpp` merges the retrieved continuations into the draft
tree's best prefixes in one call (the numpy path's nodes and bit-equal scores, without its ~60 numpy operations,
each of which runs from cold caches right after a pass); `rank_tree.cpp` ranks that tree's nodes by the cost
model's chances (its numpy path's ~40 operations in one call, bit-equal too).  Each is compiled with the
machine's C++ compiler for this very CPU (-march=native) into the cache (`<cache>/native/`, one file per CPU,
compiler and source, by `rest_base.native_build.build`; the linear kernels linked to the OpenMP runtime torch
already uses) and loaded with ctypes: no build step at install time, nothing to download.  Where there is no compiler,
the build fails, or REST_LAB_NATIVE=0, `library()` / `top_k_library()` / `attention_library()` /
`cache_rows_library()` / `draft_tree_library()` / `rank_tree_library()` return None and `unavailable()` says
why for the linear kernel; the callers then keep their torch (or numpy) paths.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from rest_base import native_build
from rest_base.native_build import ENV, address  # ENV "0" / "off": never build or load the kernel

SOURCE = Path(__file__).with_name("blocked_linear.cpp")
TOP_K_SOURCE = Path(__file__).with_name("row_top_k.cpp")
ATTENTION_SOURCE = Path(__file__).with_name("attention.cpp")
CACHE_ROWS_SOURCE = Path(__file__).with_name("cache_rows.cpp")
DRAFT_TREE_SOURCE = Path(__file__).with_name("draft_tree.cpp")
RANK_TREE_SOURCE = Path(__file__).with_name("rank_tree.cpp")
MAX_TOP_K = 64  # the largest k row_top_k.cpp takes
PANEL = 16  # output columns per panel (the kernel's NB; checked against the library at load)
LINEAR_ABI = 2  # the linear kernel's calling convention (every buffer's length passed), checked at load
PROFILE_NAME = "rest_lab::blocked_linear"  # what a torch profile calls the kernel
ATTENTION_PROFILE_NAME = "rest_lab::attention"

_lib: Optional[ctypes.CDLL] = None
_why: Optional[str] = None
_tried = False
_optional: dict[str, Optional[ctypes.CDLL]] = {}  # the top-k and attention libraries, by stem, once tried


def unavailable() -> Optional[str]:
    """Why the kernel is not available (None when it is, or before `library()` was first asked)."""
    return _why


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernel library, built first if this machine has none yet; None when it cannot be had."""
    global _lib, _why, _tried, _kernel, _kernel_tall
    if _tried:
        return _lib
    _tried = True
    if switched_off():
        _why = f"switched off ({ENV}={os.environ[ENV]})"
        return None
    try:
        lib = load_library(SOURCE, "blocked-linear")
        _lib = lib
        _kernel = lib.rest_lab_panel_linear
        _kernel_tall = lib.rest_lab_panel_linear_tall
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        _why = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
    return _lib


def load_library(source: Path, stem: str) -> ctypes.CDLL:
    """A blocked-kernel library built from `source` (compiled when this machine has no build of it yet), loaded
    and checked; OSError / SubprocessError when it cannot be built or is not one."""
    path = _built(source, stem, openmp=True)
    lib = ctypes.CDLL(str(path))
    abi = lib.rest_lab_linear_abi() if hasattr(lib, "rest_lab_linear_abi") else 1
    if abi != LINEAR_ABI:
        raise OSError(f"{path.name} is built from a source with calling convention {abi}, not {LINEAR_ABI} "
                      "(a source from before the kernels took buffer lengths)")
    _declare(lib)
    if lib.rest_lab_panel_width() != PANEL:
        raise OSError(f"{path.name} packs {lib.rest_lab_panel_width()} columns per panel, not {PANEL}")
    return lib


def current_kernel():
    """The function every blocked layer calls (the loaded library's, unless `use_kernel` swapped it), and the
    one layers on tall blocks call, as a pair."""
    return _kernel, _kernel_tall


def use_kernel(fn, tall=None) -> None:
    """Have every blocked layer call `fn` (same arguments as rest_lab_panel_linear), and every layer on tall
    blocks `tall` (`fn` when not given: a build with one entry point serves both): another build of the kernel
    compared side by side (tools/kernel_ab.py), or a timing wrapper.  `use_kernel(*current_kernel())` puts
    back what was there."""
    global _kernel, _kernel_tall
    _kernel, _kernel_tall = fn, (fn if tall is None else tall)


def switched_off() -> bool:
    """Whether REST Lab's native code is switched off for this process (REST_LAB_NATIVE=0)."""
    return native_build.switched_off()


def _optional_library(source: Path, stem: str, openmp: bool, declare) -> Optional[ctypes.CDLL]:
    """A library that only makes something faster: built at first use, loaded and declared once; None when it
    cannot be had (the caller keeps its torch path)."""
    return native_build.optional_library(_optional, stem, lambda: _built(source, stem, openmp), declare)


def _declare_top_k(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rest_lab_row_top_k.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, i64, ctypes.c_int]
    lib.rest_lab_row_top_k.restype = ctypes.c_int


def _declare_attention(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rest_lab_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ptr, i64,
                                       i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.rest_lab_attention.restype = ctypes.c_int


def _declare_cache_rows(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rest_lab_keep_rows.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64, ptr, i64]
    lib.rest_lab_keep_rows.restype = ctypes.c_int


def cache_rows_library() -> Optional[ctypes.CDLL]:
    """The loaded cache-compaction library, built first if this machine has none yet; None when it cannot be had."""
    return _optional_library(CACHE_ROWS_SOURCE, "cache-rows", False, _declare_cache_rows)


def keep_rows(buffers: list[torch.Tensor], start: int, nodes: np.ndarray) -> bool:
    """In every buffer, move row start + nodes[j] to start + j (j = 0, 1, ...) along dim 2, in place
    (`cache_rows.cpp`): the buffers contiguous CPU tensors of one shape and dtype, (B, H, capacity, D), `nodes`
    increasing int64.  False, with nothing moved, when the library cannot be had or the buffers or nodes are not
    of that kind (the caller then moves the rows with torch)."""
    lib = cache_rows_library()
    if lib is None or not buffers or nodes.dtype != np.int64 or not nodes.flags.c_contiguous:
        return False
    first = buffers[0]
    shape, dtype = first.shape, first.dtype
    if (len(shape) != 4 or (len(nodes) and start + int(nodes[-1]) >= shape[2])
            or any(t.shape != shape or t.dtype != dtype or not t.is_cpu or not t.is_contiguous()
                   for t in buffers)):
        return False
    b, h, capacity, d = shape
    pointers = (ctypes.c_void_p * len(buffers))(*[t.data_ptr() for t in buffers])
    return not lib.rest_lab_keep_rows(pointers, len(buffers), first.numel() * first.element_size(), b * h, capacity,
                                      d, first.element_size(), start, nodes.ctypes.data, len(nodes))


def _declare_draft_tree(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rest_lab_draft_tree.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ctypes.c_double,
                                        ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64]
    lib.rest_lab_draft_tree.restype = i64


def draft_tree_library() -> Optional[ctypes.CDLL]:
    """The loaded draft-tree library, built first if this machine has none yet; None when it cannot be had."""
    return _optional_library(DRAFT_TREE_SOURCE, "draft-tree", False, _declare_draft_tree)


def draft_tree(rows: np.ndarray, src: np.ndarray, unit: np.ndarray, budget: int, root: int,
               total: float) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The draft tree's `budget` best prefixes of the rows (`draft_tree.cpp`; rest_core.tree's numpy path gives
    the same nodes and bit-equal scores): rows (k, L) int64 token ids (-1 after a row's end), src (k,) int64
    each row's source index into unit (S,) float64, the weight of one row per source; `total` the root's score.
    Returns (5, n) int64 (token, parent, depth, source index, sources with rows through the node; the root
    first, its parent and source -1, its count 0) and (3, n) float64 (score, share, support), or None when the
    library cannot be had or the input is not of that kind (the caller then takes the numpy path)."""
    lib = draft_tree_library()
    if (lib is None or rows.ndim != 2 or rows.dtype != np.int64 or src.dtype != np.int64
            or unit.dtype != np.float64 or src.shape != rows.shape[:1] or not rows.flags.c_contiguous
            or not src.flags.c_contiguous or not unit.flags.c_contiguous or budget < 0):
        return None
    ints = np.empty((5, budget + 1), dtype=np.int64)
    floats = np.empty((3, budget + 1), dtype=np.float64)
    row = 8 * (budget + 1)  # bytes per row of either array
    token, parent, depth, source, agree = (ints.ctypes.data + i * row for i in range(5))
    score, share, support = (floats.ctypes.data + i * row for i in range(3))
    n = lib.rest_lab_draft_tree(rows.ctypes.data, rows.shape[0], rows.shape[1], src.ctypes.data, unit.ctypes.data,
                                unit.size, budget, root, total, token, parent, depth, score, source, share, support,
                                agree, budget + 1)
    if n < 1:
        return None
    return ints[:, :n], floats[:, :n]


def _declare_rank_tree(lib: ctypes.CDLL) -> None:
    ptr, i64, f64, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
    lib.rest_lab_rank_tree.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, flag, ptr, i64, flag,
                                       ptr, i64, ptr, i64, i64, f64, f64, f64, ptr, ptr, i64, ptr, ptr, ptr, i64]
    lib.rest_lab_rank_tree.restype = ctypes.c_int


def rank_tree_library() -> Optional[ctypes.CDLL]:
    """The loaded tree-ranking library, built first if this machine has none yet; None when it cannot be had."""
    return _optional_library(RANK_TREE_SOURCE, "rank-tree", False, _declare_rank_tree)


def _f64(x: np.ndarray) -> bool:
    return x.dtype == np.float64 and x.flags.c_contiguous


def _i64(x: np.ndarray) -> bool:
    return x.dtype == np.int64 and x.flags.c_contiguous


def rank_tree(parents: np.ndarray, depths: np.ndarray, shares: np.ndarray, support: np.ndarray,
              source: np.ndarray, agree: Optional[np.ndarray], counts: list[np.ndarray], factors: np.ndarray,
              apply_request: bool, level_factors: np.ndarray, apply_agreement: bool, bins: np.ndarray,
              support_edges: np.ndarray, depth_cells: int, prior_scaled: float, prior_weight: float,
              max_chance: float, budgets: Optional[np.ndarray] = None, budget_ms: Optional[np.ndarray] = None,
              ) -> Optional[tuple[np.ndarray, np.ndarray, int]]:
    """The cost model's ranking of a tree's n draft nodes (`rank_tree.cpp`; rest_core.cost's numpy path gives the
    same order and bit-equal chances): parents, depths, support (n,) of the draft nodes (tree nodes 1..n), shares
    (n + 1,), source (n + 1,) int64 indices into counts / factors and agree (n + 1,) the sources with rows through
    each node (None: one each), the root's first; counts one (2, cells) float64 array per source (their
    addresses are remembered while they live).  With the candidate draft sizes `budgets` (m,) int64 and
    `budget_ms` (m,) the pass's time at each size plus the root, also the best size (`CostModel._best_budget`),
    else -1.  Returns (order (n,) 1-based nodes best first, their path chances (n,), the best size), or None when
    the library cannot be had or the input is not of that kind (the caller then takes the numpy path)."""
    lib = rank_tree_library()
    n = parents.size
    with_budget = budgets is not None and budget_ms is not None
    if (lib is None or not all(_i64(x) for x in (parents, depths, source)) or (agree is not None and not _i64(agree))
            or not all(_f64(x) for x in (shares, support, factors, level_factors, bins, support_edges))
            or not all(_f64(c) for c in counts) or depths.size != n or support.size != n
            or (agree is not None and agree.size != n + 1) or shares.size != n + 1 or source.size != n + 1
            or factors.size != len(counts)
            or (with_budget and (not _i64(budgets) or not _f64(budget_ms) or budgets.size != budget_ms.size))):
        return None
    cells = (ctypes.c_void_p * max(1, len(counts)))(*[address(c) for c in counts])
    out = np.empty(2 * n + 1, dtype=np.int64)  # order, then the chances' bits, then the best size
    at = out.ctypes.data
    if lib.rest_lab_rank_tree(n, parents.ctypes.data, depths.ctypes.data, shares.ctypes.data, support.ctypes.data,
                              source.ctypes.data, None if agree is None else agree.ctypes.data, cells, len(counts),
                              factors.ctypes.data, int(apply_request), level_factors.ctypes.data, level_factors.size,
                              int(apply_agreement), address(bins), bins.size, address(support_edges),
                              support_edges.size, depth_cells, prior_scaled, prior_weight, max_chance,
                              address(budgets) if with_budget else None,
                              budget_ms.ctypes.data if with_budget else None, budgets.size if with_budget else 0,
                              at, at + 8 * n, at + 16 * n, n):
        return None
    return out[:n], out[n:2 * n].view(np.float64), int(out[2 * n]) if with_budget else -1


def top_k_library() -> Optional[ctypes.CDLL]:
    """The loaded top-k library, built first if this machine has none yet; None when it cannot be had."""
    return _optional_library(TOP_K_SOURCE, "row-top-k", True, _declare_top_k)


def attention_library() -> Optional[ctypes.CDLL]:
    """The loaded attention library, built first if this machine has none yet; None when it cannot be had."""
    return _optional_library(ATTENTION_SOURCE, "attention", True, _declare_attention)


def row_top_k(x: torch.Tensor, k: int) -> Optional[np.ndarray]:
    """(q, V) float32 CPU logits -> (q, k) int64: each row's k largest ids, largest first (of equal values the
    lower id first, so column 0 is the argmax).  None when the library cannot be had, k is out of its range,
    or a row holds a NaN: the caller then uses torch."""
    lib = top_k_library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 \
            or not 1 <= k <= min(MAX_TOP_K, x.shape[1]):
        return None
    x = x.contiguous()
    out = np.empty((x.shape[0], k), dtype=np.int64)
    if lib.rest_lab_row_top_k(x.data_ptr(), x.numel(), x.shape[0], x.shape[1], k, out.ctypes.data, out.size,
                              torch.get_num_threads()):
        return None
    return out


_Strides3 = ctypes.c_int64 * 3
_Strides2 = ctypes.c_int64 * 2


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
              scale: float) -> Optional[torch.Tensor]:
    """softmax(q k^T * scale + mask) v for grouped-query heads with `attention.cpp`: query (B, H, Q, D), key and
    value (B, KVH, T, D) (any strides with D contiguous: views of a larger cache are read in place), mask
    None (every key visible to every query) or (B | 1, 1, Q, T) float32 (added) or bool (True: visible).
    Returns (B, Q, H, D) contiguous, as transformers' attention functions do, or None when the library cannot
    be had or does not take these inputs (the caller then uses torch's attention)."""
    lib = attention_library()
    if lib is None or query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    b, h, q, d = query.shape
    kvh, t = key.shape[1], key.shape[2]
    if (tuple(key.shape) != (b, kvh, t, d) or value.shape != key.shape or kvh == 0 or h % kvh
            or any(x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(3) != 1
                   for x in (query, key, value))):
        return None
    kind, mask_ptr, mask_strides = 0, None, _Strides2(0, 0)
    if mask is not None:
        if (mask.dim() != 4 or mask.device.type != "cpu" or mask.shape[0] not in (1, b) or mask.shape[1] != 1
                or tuple(mask.shape[2:]) != (q, t) or mask.stride(3) != 1):
            return None
        kind = 1 if mask.dtype == torch.float32 else 2 if mask.dtype == torch.bool else 0
        if kind == 0:
            return None
        mask_ptr = mask.data_ptr()
        mask_strides = _Strides2(mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2))
    out = torch.empty((b, q, h, d), dtype=torch.float32)
    args = (query.data_ptr(), _Strides3(*query.stride()[:3]), key.data_ptr(), _Strides3(*key.stride()[:3]),
            value.data_ptr(), _Strides3(*value.stride()[:3]), mask_ptr, mask_strides, kind, out.data_ptr(),
            out.numel(), b, h, kvh, q, t, d, scale, torch.get_num_threads())
    if torch.autograd._profiler_enabled():  # named in a torch profile like any operator
        with torch.profiler.record_function(ATTENTION_PROFILE_NAME):
            refused = lib.rest_lab_attention(*args)
    else:
        refused = lib.rest_lab_attention(*args)
    return None if refused else out


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.rest_lab_pack_panels.argtypes = [ptr, i64, ptr, i64, i64, i64, cint]
    lib.rest_lab_pack_panels.restype = cint
    for name in ("rest_lab_panel_linear", "rest_lab_panel_linear_tall"):
        getattr(lib, name).argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, cint]
        getattr(lib, name).restype = cint
    lib.rest_lab_panel_width.argtypes = []
    lib.rest_lab_panel_width.restype = cint
    lib.rest_lab_register_rows.argtypes = []
    lib.rest_lab_register_rows.restype = cint
    lib.rest_lab_tall_rows.argtypes = []
    lib.rest_lab_tall_rows.restype = cint


def register_rows() -> Optional[int]:
    """How many rows of sums the kernel holds in registers per block read in place on this machine (8 with
    AVX-512, 6 with AVX2), None when the kernel is not available."""
    lib = library()
    return None if lib is None else int(lib.rest_lab_register_rows())


def tall_rows() -> int:
    """Rows per tall block (read from a transposed copy of the input) on this machine: 16 with AVX-512, 0 where
    the build has none or the kernel is not available."""
    lib = library()
    return 0 if lib is None else int(lib.rest_lab_tall_rows())


def _compiler() -> str:
    return native_build.compiler()


def source_tag(source: Path = SOURCE) -> str:
    """A short hash of a kernel's source (by default the linear kernel's: a choice of kernels measured with
    another version of it is measured again)."""
    return native_build.source_tag(source)


def _built(source: Path, stem: str, openmp: bool) -> Path:
    """The compiled library of one source for this machine, compiled now when missing (atomically)."""
    torch_lib = Path(torch.__file__).parent / "lib"
    threads = ["-fopenmp", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"] if openmp else []
    attempts = [["-march=native"] + threads, threads, ["-march=native"]] if openmp else [["-march=native"], []]
    return native_build.build(source, stem, attempts, find_compiler=lambda: _compiler())  # as patched now


def pack(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N x K, float32, CPU) as panels (ceil(N/16), K, 16), and the bias zero-padded to ceil(N/16) * 16."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the blocked linear kernel is not available: {_why}")
    w = weight.detach().contiguous()
    if w.dtype != torch.float32 or w.dim() != 2 or not w.is_cpu:
        raise ValueError(f"the blocked linear kernel packs a 2-D float32 CPU weight, not {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    count = -(-n // PANEL)
    panels = torch.empty(count, k, PANEL, dtype=torch.float32)
    if lib.rest_lab_pack_panels(w.data_ptr(), w.numel(), panels.data_ptr(), panels.numel(), k, n,
                                torch.get_num_threads()):
        raise ValueError(f"the blocked linear kernel refused to pack a {n} x {k} weight")
    padded = torch.zeros(count * PANEL, dtype=torch.float32)
    if bias is not None:
        if bias.numel() != n:
            raise ValueError(f"a bias of {bias.numel()} values for a weight of {n} rows")
        padded[:n] = bias.detach()
    return panels, padded


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor, out_features: int,
           tall: bool = False) -> torch.Tensor:
    """x (..., K) float32 on the CPU -> (..., out_features), from `pack`'s panels and padded bias, in blocks of
    `register_rows()` rows read in place or (tall) of `tall_rows()` rows read transposed.  An input of another
    dtype or width is refused (TypeError / ValueError), and the kernel itself checks every buffer's length
    against the shapes it is given.  Called for every linear layer of every pass: no more Python work than it
    takes."""
    if x.dtype != torch.float32:  # the kernel reads raw float32 memory: anything else would be misread
        raise TypeError(f"the blocked linear kernel takes float32 input, not {x.dtype}: convert it, or use "
                        f"REST_LAB_KERNELS=default")
    k = panels.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"the blocked linear kernel multiplies rows of {k} values, not {x.shape[-1]}")
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
    args = (x.data_ptr(), x.numel(), panels.data_ptr(), panels.numel(), bias.data_ptr(), bias.numel(), out.data_ptr(),
            out.numel(), x.numel() // k if k else 0, k, out_features, torch.get_num_threads())
    kernel = _kernel_tall if tall else _kernel
    if torch.autograd._profiler_enabled():  # named in a torch profile like any operator
        with torch.profiler.record_function(PROFILE_NAME):
            refused = kernel(*args)
    else:
        refused = kernel(*args)
    if refused:
        raise ValueError(f"the blocked linear kernel refused buffers of {x.numel()}, {panels.numel()}, {bias.numel()} "
                         f"and {out.numel()} floats for {tuple(x.shape)} x ({out_features}, {k})")
    return out


def _kernel(*args) -> None:
    """The compiled rest_lab_panel_linear (bound when the library loads)."""
    raise RuntimeError(f"the blocked linear kernel is not available: {_why}")


_kernel_tall = _kernel  # the compiled rest_lab_panel_linear_tall, bound when the library loads
