"""Linear-layer kernels chosen per machine, so a verify pass over a few tree nodes stays cheap on a CPU.

A one-token step reads every weight once and is bound by memory bandwidth; a verify pass over
q tree nodes reads the same weights, so in principle it costs little more.  On CPUs the default
GEMM path for 2..64 rows is often far from that bound (the output layer of SmolLM2-135M,
49152 x 576, costs two to three times more for 8 rows than for one), while oneDNN with the weight
reordered once into its blocked layout ("prepacked") may stay close to it -- or may not, on
another CPU, for another shape or for one row.

`tune_linears(model, name)` swaps every `nn.Linear` of a CPU float32 model for a `TunedLinear`
and measures, per weight shape and row count, which of the two kernels is faster on this machine
(all layers of a shape swept in turn, so the timing sees the weights come from memory as in a
real pass; both kernels interleaved, median of several rounds).  A layer then picks its kernel per
call from the row count.  The choice is kept on disk per model and machine key
(`rest_core.machine.machine_key`: CPU, instruction set, threads, torch version) and measured again
when the key changes or with REST_LAB_RECALIBRATE=1.  Plain one-token decoding gets the same
choice for one row, so a comparison with plain decoding stays honest.  The results differ from
the default kernel only by float rounding.

REST_LAB_KERNELS=default keeps transformers' own linear layers (nothing swapped, nothing measured);
`KernelChoice.enabled` switches a tuned model back to the default kernel for side-by-side runs.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from datastores.common import cache_dir, safe_file_name, write_atomic
from rest_core.machine import machine_key

ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts measured; others use the nearest below
MAX_ROWS = 64  # above this, the choice at 64 rows applies (prefill)
SWEEP_LAYERS = 8  # layers of one shape timed in turn (more weight than the caches hold)
ROUNDS = 9  # interleaved timing rounds per row count
MARGIN = 0.05  # the prepacked kernel must be this much faster: ties keep the default (no extra memory)
MARGIN_ONE_ROW = 0.15  # for one row (every step of plain decoding) only a clear win counts: a layer timed
# alone showed the output layer 12% faster prepacked at one row, yet whole one-token passes ran 2-4% slower
ENV = "REST_LAB_KERNELS"  # "auto" (default): measure and choose; "default": transformers' layers unchanged
VERSION = 1  # of the cached file's layout and of the timing method

Shape = tuple[int, int]  # (out_features, in_features)


def kernels_mode() -> str:
    """'auto' or 'default', from REST_LAB_KERNELS; anything else is refused with a message."""
    mode = (os.environ.get(ENV) or "auto").strip().lower()
    if mode not in ("auto", "default"):
        raise ValueError(f"{ENV}={mode!r} is not understood: use 'auto' (measure and choose the faster linear "
                         f"kernel per row count) or 'default' (transformers' own layers).")
    return mode


def packing_available(model: nn.Module) -> bool:
    """oneDNN prepacking applies to float32 models on the CPU of a torch build with oneDNN."""
    param = next(model.parameters(), None)
    return (param is not None and param.device.type == "cpu" and param.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class TunedLinear(nn.Module):
    """An nn.Linear that also keeps its weight in oneDNN's blocked layout and uses, per call, the kernel
    measured faster for that many rows.  x: (..., in_features) -> (..., out_features).  The weight and bias
    are the original parameters (tied embeddings stay tied); the packed copy is made once and not updated."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed: Optional[torch.Tensor] = None  # oneDNN layout; a plain attribute, never saved or moved
        self.use_packed: tuple[bool, ...] = ()  # per row count 0..MAX_ROWS; empty: always the default kernel

    @property
    def shape(self) -> Shape:
        return (self.out_features, self.in_features)

    def pack(self) -> None:
        if self.packed is None:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def default_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use = self.use_packed
        if use and use[min(x.numel() // self.in_features, MAX_ROWS)] and x.is_cpu and not torch.is_grad_enabled():
            return self.packed_forward(x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@dataclass
class KernelChoice:
    """Per weight shape and row count: is the prepacked kernel the faster one on this machine?
    Shared by every TunedLinear of one model."""

    packed: dict[Shape, dict[int, bool]] = field(default_factory=dict)  # shape -> rows -> use prepacked
    timings_ms: dict[Shape, dict[int, tuple[float, float]]] = field(default_factory=dict)  # (default, packed)
    measured_s: float = 0.0  # how long the measurement took (0 when read from the cache)
    source: str = "measured"  # "measured" or the cache file it came from
    layers: list[TunedLinear] = field(default_factory=list, repr=False)
    _enabled: bool = True

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """False: every layer uses the default kernel (for side-by-side measurements); True: the choice."""
        self._enabled = bool(on)
        for layer in self.layers:
            table = self.packed.get(layer.shape, {})
            layer.use_packed = row_table(table) if self._enabled and any(table.values()) else ()

    def key(self) -> str:
        """A short tag for what the layers do now ('' when every layer runs the default kernel): the cost
        curve is calibrated per tag."""
        on = {f"{o}x{i}": sorted(r for r, p in t.items() if p) for (o, i), t in sorted(self.packed.items())}
        on = {k: v for k, v in on.items() if v}
        if not self._enabled or not on:
            return ""
        return "k" + hashlib.sha256(json.dumps(on).encode()).hexdigest()[:8]

    def describe(self) -> str:
        """One line for a report: which shapes use the prepacked kernel at which row counts."""
        if not self._enabled:
            return "default linear kernels (tuned kernels switched off)"
        parts = [f"{o}x{i}: rows {_ranges([r for r, on in sorted(t.items()) if on])}"
                 for (o, i), t in sorted(self.packed.items()) if any(t.values())]
        if not parts:
            return "default linear kernels (measured faster at every row count)"
        return "oneDNN prepacked linear for " + "; ".join(parts)


def row_table(table: dict[int, bool]) -> tuple[bool, ...]:
    """Per row count 0..MAX_ROWS, the choice measured at the nearest row count at or below it."""
    measured = sorted(table)
    out = []
    for r in range(MAX_ROWS + 1):
        below = [m for m in measured if m <= r]
        out.append(table[below[-1] if below else measured[0]])
    return tuple(out)


def _ranges(rows: list[int]) -> str:
    if not rows:
        return "none"
    return ", ".join(str(r) for r in rows)


def _sweep_ms(kernels: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> float:
    """Milliseconds to run x through every kernel in turn."""
    start = time.perf_counter()
    for f in kernels:
        f(x)
    return (time.perf_counter() - start) * 1e3


@torch.inference_mode()
def measure_shape(layers: list[TunedLinear], rows: tuple[int, ...] = ROWS,
                  rounds: int = ROUNDS) -> dict[int, tuple[float, float]]:
    """(default, prepacked) milliseconds to run x through every layer in `layers` in turn, per row count: the
    fastest of `rounds` rounds, the two kernels interleaved (the order alternating).  The fastest, not the
    median: other programs on the machine only ever add time, and a kernel's own spread is small."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for r in rows:
        x = torch.randn(1, r, layers[0].in_features, generator=gen)
        kernels = ([lay.default_forward for lay in layers], [lay.packed_forward for lay in layers])
        samples: tuple[list[float], list[float]] = ([], [])
        for k in range(rounds + 1):
            for which in ((0, 1) if k % 2 else (1, 0)):
                ms = _sweep_ms(kernels[which], x)
                if k:  # the first round warms up
                    samples[which].append(ms)
        out[r] = (min(samples[0]), min(samples[1]))
    return out


def faster(default_ms: float, packed_ms: float, rows: int) -> bool:
    """Whether the prepacked kernel wins at this row count: by MARGIN, and by MARGIN_ONE_ROW for one row."""
    return packed_ms < default_ms * (1.0 - (MARGIN_ONE_ROW if rows == 1 else MARGIN))


def _swap(module: nn.Module) -> list[TunedLinear]:
    swapped = []
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            layer = TunedLinear(child)
            setattr(module, name, layer)
            swapped.append(layer)
        else:
            swapped.extend(_swap(child))
    return swapped


def tune_linears(model: nn.Module, name: str, cache: bool = True) -> Optional[KernelChoice]:
    """Swap the model's linear layers for TunedLinear and choose, per weight shape and row count, the faster
    kernel on this machine (read from the cache when it was measured here before).

    Returns the shared KernelChoice, or None when nothing is swapped: REST_LAB_KERNELS=default, a GPU or
    half-precision model, a torch without oneDNN, or no nn.Linear."""
    if kernels_mode() == "default" or not packing_available(model):
        return None
    layers = _swap(model)
    if not layers:
        return None
    by_shape: dict[Shape, list[TunedLinear]] = {}
    for layer in layers:
        by_shape.setdefault(layer.shape, []).append(layer)
    path = _cache_path(name)
    choice = _read_cache(path, set(by_shape)) if cache and os.environ.get("REST_LAB_RECALIBRATE") != "1" else None
    if choice is None:
        choice = _measure(by_shape)
        if cache:
            _write_cache(path, choice)
    for shape, group in by_shape.items():  # keep the packed copies only where they are used
        for layer in group:
            if any(choice.packed[shape].values()):
                layer.pack()
            else:
                layer.packed = None
    choice.layers = layers
    choice.enabled = True
    return choice


def _measure(by_shape: dict[Shape, list[TunedLinear]]) -> KernelChoice:
    start = time.perf_counter()
    choice = KernelChoice()
    for shape, group in by_shape.items():
        sweep = group[:SWEEP_LAYERS]
        for layer in sweep:
            layer.pack()
        timings = measure_shape(sweep)
        choice.timings_ms[shape] = timings
        choice.packed[shape] = {r: faster(d, p, r) for r, (d, p) in timings.items()}
    choice.measured_s = time.perf_counter() - start
    return choice


def _cache_path(name: str) -> Path:
    return cache_dir() / "kernels" / f"{safe_file_name(name)}-cpu-float32-{machine_key()}.json"


def _write_cache(path: Path, choice: KernelChoice) -> None:
    data = {"version": VERSION, "rows": list(ROWS), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "measured_s": round(choice.measured_s, 3),
            "shapes": {f"{o}x{i}": {str(r): [round(d, 5), round(p, 5), choice.packed[(o, i)][r]]
                                    for r, (d, p) in t.items()} for (o, i), t in choice.timings_ms.items()}}
    try:
        write_atomic(path, json.dumps(data).encode("utf-8"))
    except OSError:  # a cache that cannot be written is skipped: the choice holds for this process
        pass


def _read_cache(path: Path, shapes: set[Shape]) -> Optional[KernelChoice]:
    """The choice stored for this model and machine key; None when missing, unreadable or for other shapes."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != VERSION or data.get("rows") != list(ROWS):
            return None
        choice = KernelChoice(source=str(path))
        for text, table in data["shapes"].items():
            o, i = (int(v) for v in text.split("x"))
            choice.timings_ms[(o, i)] = {int(r): (float(v[0]), float(v[1])) for r, v in table.items()}
            choice.packed[(o, i)] = {int(r): faster(float(v[0]), float(v[1]), int(r)) for r, v in table.items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    if set(choice.packed) != shapes or any(set(t) != set(ROWS) for t in choice.packed.values()):
        return None
    return choice
