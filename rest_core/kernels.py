"""Linear-layer kernels chosen per machine, so a verify pass over a few tree nodes stays cheap on a CPU.

A one-token step reads every weight once and is bound by memory bandwidth; a verify pass over q tree nodes
reads the same weights, so in principle it costs little more.  On CPUs the default GEMM path for 2..64 rows
is often far from that bound (SmolLM2-135M's 49152 x 576 output layer costs two to three times more for 8
rows than for one).  Other ways to compute the same product may stay closer to it, or not, per CPU, shape
and row count:

* "packed": oneDNN with the weight reordered once into its blocked layout (an extra copy of it);
* "transposed": W @ x.T, transposed back (some libraries stream W better for a wide right-hand side);
* "blocked": REST Lab's own kernel (`rest_core.native`, built for this CPU at first use; not a candidate
  where no C++ compiler is found), the weight copied once into 16-column panels, every weight read once per
  call for blocks of 8 rows (AVX-512; 6 with AVX2);
* "blocked_tall": the same panels in blocks of 16 rows read from a transposed copy of the input (AVX-512
  only; timed only above 8 rows, below which both run the same code).

`tune_linears(model, name)` swaps every `nn.Linear` of a CPU float32 model for a `TunedLinear` and times,
per weight shape and row count, every kernel over all the model's layers in model order (the weights come
from memory as in a forward pass), the kernels taking turns, fastest of several rounds.  A layer picks its
kernel per call from the row count.  The choice is kept per model and machine key (`machine_key`: CPU,
instruction set, threads, torch) and measured again when the key changes, with REST_LAB_RECALIBRATE=1, or
when a quick probe at load finds its one-row pick slow (`probe_disagrees`).  Plain decoding gets the same
choice for one row, so a comparison with it stays honest.  Results differ from the default only by rounding.

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
from typing import Optional

import torch
from torch import nn

from rest_base.calibration import CalibrationFile
from rest_core import native
from rest_core.machine import machine_key
from rest_core.rows import ROWS, row_neighbours, row_ranges
from rest_core.tuned_linear import BLOCKED_KINDS, KERNELS, Shape, TunedLinear, packing_available

ROUNDS = 9  # interleaved timing rounds per row count
PROBE_ROUNDS, PROBE_SLACK = 3, 0.25  # the quick check of a cached choice at load (`probe_disagrees`)
PROBE_FLOOR_MS = 0.05  # difference below this per one-token pass is not worth timing every kernel again
MARGIN = 0.05  # another kernel must be this much faster than the default: ties keep the default
MARGIN_ONE_ROW = 0.15  # for one row (every step of plain decoding) only a clear win counts: a layer timed
# alone showed the output layer 12% faster prepacked at one row, yet whole one-token passes ran 2-4% slower
ENV = "REST_LAB_KERNELS"  # "auto" (default): measure and choose; "default": transformers' layers unchanged
VERSION = 5  # of the cached file's layout and of the timing method (5: the blocked kernel's two block heights)
UNTIMED = float("inf")  # the time of a kernel not run (not available here): it never wins
NAMES = {"packed": "oneDNN prepacked", "transposed": "transposed product (W @ x.T)"}  # blocked: _kernel_name

Report = Callable[[str], None]  # told what a measurement does before it starts, and what it found
Progress = Callable[[int, int], None]  # (row counts done, row counts in all) while the kernels are timed


def kernels_mode() -> str:
    """'auto' or 'default', from REST_LAB_KERNELS; anything else is refused with a message."""
    mode = (os.environ.get(ENV) or "auto").strip().lower()
    if mode not in ("auto", "default"):
        raise ValueError(f"{ENV}={mode!r} is not understood: use 'auto' (measure and choose the faster linear "
                         f"kernel per row count) or 'default' (transformers' own layers).")
    return mode


@dataclass
class KernelChoice:
    """Per weight shape and row count: which kernel (a name in KERNELS) is the fastest on this machine.
    Shared by every TunedLinear of one model."""

    kernel: dict[Shape, dict[int, str]] = field(default_factory=dict)  # shape -> rows -> kernel name
    timings_ms: dict[Shape, dict[int, dict[str, float]]] = field(default_factory=dict)  # shape -> rows -> kernel -> ms
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
        plans = {shape: tuple(KERNELS.index(k) for k in self.plan_of(shape)) for shape in self.kernel}
        for layer in self.layers:
            plan = plans.get(layer.shape, ())
            layer.plan = plan if self._enabled and any(plan) else ()

    def plan_of(self, shape: Shape) -> tuple[str, ...]:
        """Per row count 0..MAX_ROWS, the kernel this shape runs: the one chosen at the measured counts around
        it when they agree (the count itself where it was measured), else the fastest on the times
        interpolated between them."""
        table = self.kernel[shape]
        times = self.timings_ms.get(shape, {})
        out = []
        for r, (below, above) in enumerate(row_neighbours(sorted(table))):
            if table[below] == table[above] or below not in times or above not in times:
                out.append(table[below])
            else:
                w = (r - below) / (above - below)
                out.append(fastest({k: (1 - w) * times[below].get(k, UNTIMED) + w * times[above].get(k, UNTIMED)
                                    for k in KERNELS}, r))
        return tuple(out)

    def uses(self, shape: Shape, kernel: str) -> bool:
        """Whether some row count of this shape runs `kernel`."""
        return kernel in self.plan_of(shape)

    def _chosen(self) -> dict[str, dict[str, list[int]]]:
        """shape text -> kernel -> the row counts (1..MAX_ROWS) that run it, other kernels than the default only."""
        out: dict[str, dict[str, list[int]]] = {}
        for (o, i) in sorted(self.kernel):
            for r, k in enumerate(self.plan_of((o, i))[1:], start=1):
                if k != "default":
                    out.setdefault(f"{o}x{i}", {}).setdefault(k, []).append(r)
        return out

    def key(self) -> str:
        """A short tag for what the layers do now ('' when every layer runs the default kernel): the cost
        curve is calibrated per tag."""
        chosen = self._chosen()
        if not self._enabled or not chosen:
            return ""
        return "k" + hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:8]

    def describe(self) -> str:
        """One line for a report: which shapes use which kernel at which row counts."""
        if not self._enabled:
            return "default linear kernels (tuned kernels switched off)"
        why_not = native.unavailable()
        missing = f" (blocked kernel not available: {why_not})" if why_not else ""
        chosen = self._chosen()
        if not chosen:
            return "default linear kernels (measured fastest at every row count)" + missing
        parts = []
        for kernel in KERNELS[1:]:
            shapes = [f"{shape}: rows {row_ranges(by[kernel])}" for shape, by in chosen.items() if kernel in by]
            if shapes:
                parts.append(f"{_kernel_name(kernel)} for " + "; ".join(shapes))
        return " and ".join(parts) + missing


def _kernel_name(kernel: str) -> str:
    """A kernel's name in a report; the blocked kernel's says how many rows it holds in registers here."""
    if kernel == "blocked":
        return f"blocked kernel (weights in {native.PANEL}-column panels, {native.register_rows()} rows in registers)"
    if kernel == "blocked_tall":
        return f"blocked kernel in tall blocks ({native.tall_rows()} rows in registers, inputs transposed)"
    return NAMES[kernel]


@torch.inference_mode()
def measure_layers(layers: list[TunedLinear], rows: tuple[int, ...] = ROWS, rounds: int = ROUNDS,
                   progress: Optional[Progress] = None,
                   kernels: tuple[str, ...] = KERNELS) -> dict[Shape, dict[int, dict[str, float]]]:
    """Per weight shape, row count and kernel: milliseconds for the shape's layers of one forward pass.

    Every layer runs in `layers`' order (the model's) as in a forward pass, so each weight comes from
    memory as it then does; each call is timed alone and summed per shape.  The kernels take turns (the
    order rotating per round; the first round warms up) and each keeps its fastest round: other programs
    on the machine only ever add time, and a kernel's own spread is small."""
    gen = torch.Generator().manual_seed(0)
    shapes = list(dict.fromkeys(layer.shape for layer in layers))
    out: dict[Shape, dict[int, dict[str, float]]] = {shape: {} for shape in shapes}
    clock = time.perf_counter
    panels = all(layer.panels is not None for layer in layers)
    available = [k for k in kernels if k not in BLOCKED_KINDS or (panels and _can_run(k))]
    short = native.register_rows() or 0
    for done, r in enumerate(rows):
        if progress is not None:
            progress(done, len(rows))
        # up to `short` rows a tall call runs the very code of a blocked one: timed once, as "blocked"
        runs = [k for k in available if k != "blocked_tall" or r > short]
        inputs = {n: torch.randn(1, r, n, generator=gen) for n in {layer.in_features for layer in layers}}
        calls = [(layer.shape, inputs[layer.in_features]) for layer in layers]
        best = {shape: {k: UNTIMED for k in KERNELS} for shape in shapes}
        for rnd in range(rounds + 1):
            turn = rnd % len(runs)
            for k in runs[turn:] + runs[:turn]:
                fns = [layer.kernel(KERNELS.index(k)) for layer in layers]
                spent = dict.fromkeys(shapes, 0.0)
                for fn, (shape, x) in zip(fns, calls):
                    t0 = clock()
                    fn(x)
                    spent[shape] += clock() - t0
                if rnd:
                    for shape, sec in spent.items():
                        best[shape][k] = min(best[shape][k], sec * 1e3)
        for shape in shapes:
            out[shape][r] = best[shape]
    if progress is not None:
        progress(len(rows), len(rows))
    return out


def probe_disagrees(choice: KernelChoice, layers: list[TunedLinear]) -> Optional[str]:
    """A quick check of a cached choice at one row (every step of plain decoding): per shape, its pick timed
    against the other kernels its layers can run as they are (the fastest of PROBE_ROUNDS rounds), then once
    more to confirm.  Says where the pick was both times more than PROBE_SLACK (and PROBE_FLOOR_MS) slower than
    another (a choice timed while other programs ran the cores), else None."""
    for shape, table in choice.kernel.items():
        group = [layer for layer in layers if layer.shape == shape]
        runs = ["default", "transposed"] + (["packed"] if all(g.packed is not None for g in group) else [])
        runs += ["blocked"] if all(g.panels is not None for g in group) else []
        why = None
        for rounds in (PROBE_ROUNDS, 2 * PROBE_ROUNDS):
            times = measure_layers(group, rows=(1,), rounds=rounds, kernels=tuple(runs))[shape][1]
            picked, best = table[1], min(runs, key=lambda k: times.get(k, UNTIMED))
            took = times.get(picked, UNTIMED)
            if took <= times[best] * (1.0 + PROBE_SLACK) or took - times[best] <= PROBE_FLOOR_MS:
                why = None
                break
            why = (f"{shape[0]}x{shape[1]} at one row: the kept pick {picked} took {took:.2f} ms, "
                   f"{best} {times[best]:.2f}")
        if why is not None:
            return why
    return None


def fastest(times: dict[str, float], rows: int) -> str:
    """The kernel to use at this row count: the fastest other kernel when it beats the default by MARGIN
    (MARGIN_ONE_ROW for one row), else the default."""
    margin = MARGIN_ONE_ROW if rows == 1 else MARGIN
    other = min(KERNELS[1:], key=lambda k: times.get(k, UNTIMED))
    return other if times.get(other, UNTIMED) < times["default"] * (1.0 - margin) else "default"


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


def tune_linears(model: nn.Module, name: str, cache: bool = True, report: Optional[Report] = None,
                 progress: Optional[Progress] = None) -> Optional[KernelChoice]:
    """Swap the model's linear layers for TunedLinear and choose, per weight shape and row count, the fastest
    kernel on this machine (read from the cache when it was measured here before).  When it has to measure,
    `report` is told so before it starts and what it found after (`python -m rest_core tune` does this step on
    its own, with `progress`).

    Returns the shared KernelChoice, or None when nothing is swapped: REST_LAB_KERNELS=default, a GPU or
    half-precision model, a torch without oneDNN, or no nn.Linear."""
    if kernels_mode() == "default" or not packing_available(model):
        return None
    layers = _swap(model)
    if not layers:
        return None
    shapes = {layer.shape for layer in layers}
    calibration = _calibration_file(name)
    choice = _read_cache(calibration, shapes) if cache and os.environ.get("REST_LAB_RECALIBRATE") != "1" else None
    if choice is not None and not _fits_here(choice, shapes):
        choice = None  # timed where other kernels could run than here: measured again
    from_cache = choice is not None  # a kept choice is checked by a quick probe; a fresh one was just measured
    if choice is None:
        choice = _measure_and_keep(layers, calibration, cache, report, progress,
                                   f"timing {len(KERNELS)} linear kernels for {name}'s {len(shapes)} weight shapes "
                                   f"at {len(ROWS)} row counts on this machine (once per model and machine)")
    _pack_for(choice, layers, shapes)
    why = probe_disagrees(choice, layers) if from_cache else None
    if why is not None:
        choice = _measure_and_keep(layers, calibration, cache, report, progress,
                                   f"the kept kernel choice disagrees with a quick probe ({why}): timing them again")
        _pack_for(choice, layers, shapes)
    choice.layers = layers
    choice.enabled = True
    return choice


def _measure_and_keep(layers: list[TunedLinear], calibration: CalibrationFile, cache: bool, report: Optional[Report],
                      progress: Optional[Progress], why: str) -> KernelChoice:
    if report is not None:
        report(why)
    choice = _measure(layers, progress=progress)
    kept = cache and not native.switched_off()  # a run with the native code switched off keeps its choice
    if kept:
        _write_cache(calibration, choice)
    if report is not None:
        where = f", kept in {calibration.path}" if kept else ""
        report(f"linear kernels measured in {choice.measured_s:.0f} s{where}")
    return choice


def _pack_for(choice: KernelChoice, layers: list[TunedLinear], shapes: set[Shape]) -> None:
    packed = {shape for shape in shapes if choice.uses(shape, "packed")}
    panels = {shape for shape in shapes if any(choice.uses(shape, k) for k in BLOCKED_KINDS)}
    for layer in layers:  # keep the packed copies only where they are used
        if layer.shape in packed:
            layer.pack()
        else:
            layer.packed = None
        if layer.shape in panels:
            layer.pack_panels()
        else:
            layer.panels = None


def _can_run(kernel: str) -> bool:
    """Whether a blocked kind of kernel can run here (the library built; tall blocks only where it has them)."""
    if native.library() is None:
        return False
    return kernel != "blocked_tall" or native.tall_rows() > 0


def _fits_here(choice: KernelChoice, shapes: set[Shape]) -> bool:
    """Whether a cached choice was timed with the kernels this process can run: not where a blocked kernel was
    built that cannot be built now (it would be chosen and fail), nor where the blocked kernel could not run
    (switched off, no compiler) while it runs here (it would never be chosen: `measure_layers` times it at every
    row count where it can run, so a choice without a time for it was made without it)."""
    if any(choice.uses(s, k) for s in shapes for k in BLOCKED_KINDS if not _can_run(k)):
        return False
    return not (_can_run("blocked") and any(t.get("blocked", UNTIMED) == UNTIMED
                                            for table in choice.timings_ms.values() for t in table.values()))


def _measure(layers: list[TunedLinear], progress: Optional[Progress] = None) -> KernelChoice:
    start = time.perf_counter()
    for layer in layers:
        layer.pack()
        layer.pack_panels()
    choice = KernelChoice(timings_ms=measure_layers(layers, progress=progress))
    choice.kernel = {shape: {r: fastest(t, r) for r, t in table.items()} for shape, table in choice.timings_ms.items()}
    choice.measured_s = time.perf_counter() - start
    return choice


def _calibration_file(name: str) -> CalibrationFile:
    """Where the choice for this model on this machine is kept, and what it must have been timed with: these row
    counts, these kernels, this version of the blocked kernel's source."""
    return CalibrationFile("kernels", f"{name}-cpu-float32", machine_key(), VERSION,
                           {"rows": list(ROWS), "kernels": list(KERNELS), "native": native.source_tag()})


def _write_cache(calibration: CalibrationFile, choice: KernelChoice) -> None:
    calibration.write({"measured_s": round(choice.measured_s, 3),
                       "shapes": {f"{o}x{i}": {str(r): {k: round(ms, 5) for k, ms in t.items()}
                                               for r, t in table.items()}
                                  for (o, i), table in choice.timings_ms.items()}})


def _read_cache(calibration: CalibrationFile, shapes: set[Shape]) -> Optional[KernelChoice]:
    """The choice stored for this model and machine key; None when missing, unreadable, timed with other kernels or
    for other shapes."""
    data = calibration.read()
    if data is None:
        return None
    try:
        choice = KernelChoice(source=str(calibration.path))
        for text, table in data["shapes"].items():
            o, i = (int(v) for v in text.split("x"))
            choice.timings_ms[(o, i)] = {int(r): {k: float(t[k]) for k in KERNELS} for r, t in table.items()}
            choice.kernel[(o, i)] = {r: fastest(t, r) for r, t in choice.timings_ms[(o, i)].items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    if set(choice.kernel) != shapes or any(set(t) != set(ROWS) for t in choice.kernel.values()):
        return None
    return choice
