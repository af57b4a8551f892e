"""The attention kernel per machine: REST Lab's own (`rest_core/native/attention.cpp`) or torch's SDPA, measured.

Every pass of decoding attends a few query rows (one per head for a one-token step, a draft tree's nodes for a
verify pass) to the whole key/value cache.  torch's CPU SDPA kernel is built for long query blocks; for a few
rows much of its time goes into arranging the work, and it reads a cache that is a view of a larger buffer
(`rest_core.kv_cache`) by copying it first.  The native kernel reads the cache where it lies and spreads the
keys over the threads.  Which is faster depends on the CPU, the head shape, the number of rows and the length
of the cache, so it is measured here:

`tune_attention(model)` times both on the model's head shape (query heads, key/value heads, head size)
for every row count of the cost curve's grid (`rest_core.rows.ROWS`) over caches of 256 and 1,024
positions, each call on its own set of keys and values per layer (as a pass reads one layer's cache after
another, from memory), the kernels taking turns, fastest of several rounds.  A pass uses the native kernel where
it was faster by MARGIN (MARGIN_ONE_ROW for one row) at its row count and the measured cache length nearest its
own (on a log scale: up to 512 positions the 256 figures, beyond the 1,024 ones); a row count between two
measured ones where both of them were.  The choice is cached per head shape and machine key
(`rest_core.machine.machine_key`) and measured again when the key or the kernel's source changes, or with
REST_LAB_RECALIBRATE=1.  Plain one-token decoding uses the
choice for one row: the plain baseline gets what applies to it.  REST_LAB_KERNELS=default (or REST_LAB_NATIVE=0)
keeps torch's attention everywhere; `AttentionChoice.enabled` switches it off for side-by-side runs.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rest_base.calibration import CalibrationFile
from rest_core import native
from rest_core.kernels import Progress, Report, kernels_mode
from rest_core.machine import machine_key
from rest_core.rows import ROWS, row_neighbours, row_ranges

LENGTHS = (256, 1024)  # cache lengths timed
ROUNDS = 5  # timing rounds after a warm-up round
MARGIN = 0.05  # the native kernel must be this much faster than SDPA
MARGIN_ONE_ROW = 0.15  # for one row (every step of plain decoding) only a clear win counts: timed alone over 1,024
# positions the native kernel took 0.91x SDPA's time for one row, yet whole plain decodes on the Xeon ran 10-12%
# slower with it than with SDPA in two runs out of two (the linear kernels' choice has the same rule)
VERSION = 3  # 2: the choice per cache length; 3: MARGIN_ONE_ROW
KERNELS = ("sdpa", "native")

HeadShape = tuple[int, int, int]  # (query heads, key/value heads, head size)


@dataclass
class AttentionChoice:
    """For one head shape: per measured cache length, the row counts (1..MAX_ROWS) that run the native kernel,
    and the timings behind it."""

    shape: HeadShape
    timings_ms: dict[int, dict[int, dict[str, float]]] = field(default_factory=dict)  # length -> rows -> kernel
    native_rows: dict[int, frozenset[int]] = field(default_factory=dict)  # length -> rows
    measured_s: float = 0.0
    source: str = "measured"
    enabled: bool = True

    def rows_at(self, length: int) -> frozenset[int]:
        """The native kernel's row counts at the measured length nearest `length` on a log scale (of two equally
        near, the shorter): asked by every attention call, so integer arithmetic only."""
        lengths = sorted(self.native_rows)
        i = 0
        while i + 1 < len(lengths) and length * length > lengths[i] * lengths[i + 1]:  # past their geometric mean
            i += 1
        return self.native_rows[lengths[i]]

    def describe(self) -> str:
        parts = [f"{row_ranges(rows)} rows at {n} positions"
                 for n, rows in sorted(self.native_rows.items()) if rows]
        if not parts:
            return f"torch SDPA for every row count (heads {self.shape[0]}/{self.shape[1]}, size {self.shape[2]})"
        return f"native kernel for {'; '.join(parts)}; torch SDPA otherwise"


_choices: dict[HeadShape, AttentionChoice] = {}


def uses_native(shape: HeadShape, rows: int, length: int) -> bool:
    """Whether a pass of `rows` query rows over `length` cached positions runs the native kernel."""
    choice = _choices.get(shape)
    if choice is None or not choice.enabled or not choice.native_rows:
        return False
    return rows in choice.rows_at(length)


def head_shape(model: nn.Module) -> Optional[HeadShape]:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads <= 0:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    size = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    return (heads, int(kv), int(size)) if size else None


def tune_attention(model: nn.Module, cache: bool = True, report: Optional[Report] = None,
                   progress: Optional[Progress] = None) -> Optional[AttentionChoice]:
    """Measure (or read) which attention kernel each row count uses for this CPU float32 model's head shape, and
    put the choice in force for every layer of that shape (`report` is told when it has to measure, and what it
    found; `progress` counts the cache lengths and row counts timed).  None where nothing is chosen:
    REST_LAB_KERNELS=default, a GPU or half-precision model, an unusual head shape, or no native kernel here."""
    shape = head_shape(model)
    param = next(model.parameters(), None)
    if (kernels_mode() == "default" or shape is None or param is None or param.device.type != "cpu"
            or param.dtype != torch.float32 or native.attention_library() is None):
        return None
    heads, kv_heads, size = shape
    probe = torch.zeros(1, heads, 1, size), torch.zeros(1, kv_heads, 2, size)
    if native.attention(probe[0], probe[1], probe[1], None, 1.0) is None:
        return None  # a head shape the kernel has no layout for (see attention.cpp): SDPA throughout
    calibration = CalibrationFile("kernels", f"attention-{heads}x{kv_heads}x{size}", machine_key(), VERSION,
                                  {"native": native.source_tag(native.ATTENTION_SOURCE), "shape": list(shape),
                                   "rows": list(ROWS)})
    choice = _read(calibration, shape) if cache and os.environ.get("REST_LAB_RECALIBRATE") != "1" else None
    if choice is None:
        if report is not None:
            report(f"timing the attention kernels for heads {heads}x{kv_heads}x{size} at {len(ROWS)} row counts and "
                   f"{len(LENGTHS)} cache lengths on this machine (once per machine)")
        choice = measure(shape, progress=progress)
        if cache:
            _write(calibration, choice)
        if report is not None:
            report(f"attention kernels measured in {choice.measured_s:.0f} s"
                   + (f", kept in {calibration.path}" if cache else ""))
    _choices[shape] = choice
    return choice


@torch.inference_mode()
def measure(shape: HeadShape, layers: int = 24, lengths: tuple[int, ...] = LENGTHS, rows: tuple[int, ...] = ROWS,
            rounds: int = ROUNDS, progress: Optional[Progress] = None) -> AttentionChoice:
    """Time both kernels on `layers` sets of keys and values per cache length and row count and choose."""
    heads, kv_heads, size = shape
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    scale = size ** -0.5
    timings: dict[int, dict[int, dict[str, float]]] = {}
    for length in lengths:
        timings[length] = {}
        # keys and values as views of a buffer with room to spare, as the decoder's cache hands them
        buffers = [torch.randn(2, 1, kv_heads, 2 * (length + max(rows)), size, generator=gen) for _ in range(layers)]
        for r in rows:
            if progress is not None:
                progress(sum(map(len, timings.values())), len(rows) * len(lengths))
            t = length + r
            kv = [buf[:, :, :, :t] for buf in buffers]
            queries = [torch.randn(1, r, heads, size, generator=gen).transpose(1, 2) for _ in range(layers)]
            mask = None
            if r > 1:  # a chain of draft nodes: the prefix and the nodes before each
                allowed = torch.ones(r, t, dtype=torch.bool)
                allowed[:, length:] = torch.tril(torch.ones(r, r, dtype=torch.bool))
                mask = torch.zeros(1, 1, r, t).masked_fill(~allowed, torch.finfo(torch.float32).min)
            best = {k: float("inf") for k in KERNELS}
            for rnd in range(rounds + 1):
                for name in (KERNELS if rnd % 2 == 0 else KERNELS[::-1]):
                    fn = native.attention if name == "native" else _sdpa
                    t0 = time.perf_counter()
                    for (k, v), q in zip(kv, queries):
                        if fn(q, k, v, mask, scale) is None:
                            raise RuntimeError(f"the native attention kernel refused heads {shape}")
                    if rnd:
                        best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
            timings[length][r] = best
    if progress is not None:
        progress(len(rows) * len(lengths), len(rows) * len(lengths))
    choice = AttentionChoice(shape, timings, _native_rows(timings), time.perf_counter() - start)
    return choice


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float):
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous()


def _native_rows(timings: dict[int, dict[int, dict[str, float]]]) -> dict[int, frozenset[int]]:
    """Per cache length, the row counts the native kernel was faster at by MARGIN (between two measured counts:
    where it was at both)."""
    out = {}
    for length, table in timings.items():
        measured = sorted(table)
        wins = {r for r in measured
                if table[r]["native"] < (1 - (MARGIN_ONE_ROW if r == 1 else MARGIN)) * table[r]["sdpa"]}
        out[length] = frozenset(r for r, (lo, hi) in enumerate(row_neighbours(measured))
                                if r and lo in wins and hi in wins)
    return out


def _write(calibration: CalibrationFile, choice: AttentionChoice) -> None:
    calibration.write({"measured_s": round(choice.measured_s, 3),
                       "timings_ms": {str(n): {str(r): {k: round(ms, 5) for k, ms in t.items()}
                                               for r, t in table.items()}
                                      for n, table in choice.timings_ms.items()}})


def _read(calibration: CalibrationFile, shape: HeadShape) -> Optional[AttentionChoice]:
    data = calibration.read()
    if data is None:
        return None
    try:
        timings = {int(n): {int(r): {k: float(t[k]) for k in KERNELS} for r, t in table.items()}
                   for n, table in data["timings_ms"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not timings or any(set(t) != set(ROWS) for t in timings.values()):
        return None
    return AttentionChoice(shape, timings, _native_rows(timings), source=str(calibration.path))

