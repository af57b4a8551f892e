"""Does torch.compile make a verify pass over a few tree nodes cheaper on this CPU?

Most of a pass's arithmetic is in the decoder layers' MLPs (gate, up and down projections: three
quarters of the decoder layers' weights, 59% of all the default model's linear weights with the
output layer).  This times every layer's MLP in model order over q rows, as a pass runs them (so the
weights come from memory, not from a cache one layer would fit in), as one call (compiled: one graph,
guarded once, as a compiled whole model would be), eager and compiled side by side: every round runs
each mode once per row count, and each keeps its fastest round.  Modes:

* eager        -- transformers' layers as they are (the reference);
* default      -- torch.compile, dynamic shapes (one graph serves every row count);
* max-autotune -- torch.compile with Inductor's C++ GEMM template among the candidates, weights
                  frozen into the graph, one graph per row count (the template wants static shapes).

It reports per mode the seconds compiling took, the fastest ms per row count, each over eager at
one row (or over the first mode's, without eager), and the largest difference from eager's outputs
(another kernel changes the last bits; plain decoding must then run it too).

    .venv/bin/python scripts/compile_probe.py                       # all three modes, ~5 min
    .venv/bin/python scripts/compile_probe.py --modes eager default
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config as inductor
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("eager", "default", "max-autotune")
# Dynamo's limits on compiled variants per code object (named one way or the other by torch version)
_LIMITS = ("recompile_limit", "accumulated_recompile_limit", "cache_size_limit", "accumulated_cache_size_limit")


@contextmanager
def _inductor_settings(mode: str):
    """Inductor's settings for a mode, put back as they were afterwards."""
    dynamo = torch._dynamo.config
    limits = [name for name in _LIMITS if hasattr(dynamo, name)]
    saved = ({name: getattr(dynamo, name) for name in limits}, inductor.max_autotune_gemm_backends, inductor.freezing)
    for name in limits:  # one compiled variant per row count (max-autotune: static shapes)
        setattr(dynamo, name, 4096)
    if mode == "max-autotune":
        inductor.max_autotune_gemm_backends = "CPP,ATEN"
        inductor.freezing = True  # the C++ template packs weights it may treat as constants
    try:
        yield
    finally:
        for name, value in saved[0].items():
            setattr(dynamo, name, value)
        inductor.max_autotune_gemm_backends, inductor.freezing = saved[1:]


class _Layers(nn.Module):
    """Every layer's MLP applied to the same input, in model order: one call, so a compiled version is one
    graph (guarded and dispatched once, as a compiled whole model would be) instead of one per layer."""

    def __init__(self, mlps: Sequence[nn.Module]):
        super().__init__()
        self.mlps = nn.ModuleList(mlps)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(m(x) for m in self.mlps)


def _compiled(layers: _Layers, mode: str, rows: Sequence[int], hidden: int) -> tuple[nn.Module, float]:
    """The layers compiled for a mode (eager: as they are), called once per row count; and the seconds that
    took (compiling happens on those first calls)."""
    if mode == "eager":
        return layers, 0.0
    start = time.perf_counter()
    fn = torch.compile(layers, mode=None if mode == "default" else mode, dynamic=mode == "default")
    for q in rows:
        fn(torch.randn(1, q, hidden))
    return fn, time.perf_counter() - start


def measure(mlps: Sequence[nn.Module], hidden: int, modes: Sequence[str] = MODES,
            rows: Sequence[int] = (1, 2, 3, 4, 8, 16), rounds: int = 7, seed: int = 0) -> dict:
    """Per mode: compile_s, ms (row count -> fastest ms for all layers), max_diff from eager on 3 rows."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}: choose from {MODES}")
    torch.manual_seed(seed)
    layers = _Layers(mlps)
    out: dict = {}
    fns = {}
    with torch.inference_mode():
        for mode in modes:
            torch._dynamo.reset()  # each mode compiles from a clean slate
            with _inductor_settings(mode):
                fns[mode], took = _compiled(layers, mode, rows, hidden)
            out[mode] = {"compile_s": took, "ms": {q: float("inf") for q in rows}}
        for mode in modes:  # a mode compiled before a reset compiles again (from Inductor's cache) on its next
            with _inductor_settings(mode):  # call: that happens here, with its own settings, untimed
                for q in rows:
                    fns[mode](torch.randn(1, q, hidden))
        for _ in range(rounds):
            for q in rows:
                x = torch.randn(1, q, hidden)
                for mode in modes:
                    start = time.perf_counter()
                    fns[mode](x)
                    ms = (time.perf_counter() - start) * 1e3
                    out[mode]["ms"][q] = min(out[mode]["ms"][q], ms)
        x = torch.randn(1, 3, hidden)
        for mode in modes:
            out[mode]["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(fns[mode](x), layers(x)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default=None, help="a model id or folder (default: the built-in model)")
    args = ap.parse_args()
    os.environ["REST_LAB_KERNELS"] = "default"  # transformers' own layers, untouched by the kernel choice
    from rest_core.bench.report import cpu_line
    from rest_core.machine import cpu_info
    from rest_core.model import load_model

    lm = load_model(args.model)
    mlps = [layer.mlp for layer in lm.model.model.layers]
    hidden = lm.model.config.hidden_size
    out = measure(mlps, hidden, args.modes, args.rows, args.rounds)
    print(f"{cpu_line(cpu_info())}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}; {len(mlps)} MLPs of {lm.name}, fastest of {args.rounds} rounds")
    ref = "eager" if "eager" in args.modes else args.modes[0]
    base = out[ref]["ms"][args.rows[0]]
    print("| mode | compile s | " + " | ".join(f"q = {q}" for q in args.rows) + " | max diff from eager |")
    print("|---|---|" + "---|" * len(args.rows) + "---|")
    for mode in args.modes:
        r = out[mode]
        cells = " | ".join(f"{r['ms'][q]:.2f} ms ({r['ms'][q] / base:.2f}×)" for q in args.rows)
        print(f"| {mode} | {r['compile_s']:.0f} | {cells} | {r['max_diff']:.2g} |")


if __name__ == "__main__":
    main()
