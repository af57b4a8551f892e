"""`python -m rest_core tune`: choose this machine's kernels and measure the forward-pass cost curve, as a step
of its own with progress, instead of as the first load's side effect.

A model's first load on a machine times the linear kernels (`rest_core.kernels`) and the attention kernels
(`rest_core.attention`) for it, and its first REST decode measures the cost curve the draft budget reads
(`rest_core.cost`); each is kept per machine in the cache and read back later.  This command does all three now,
says what it chose and where it is kept, and with --again measures even what is cached.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

from tqdm import tqdm

from rest_core.cost import GRID, CostModel
from rest_core.model import load_model, say_on_stderr


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser("tune", help="time the kernels and the forward-pass cost curve on this machine "
                                       "(the first load and the first decode do it otherwise)")
    tune.add_argument("--model", default=None,
                      help="a Hugging Face id or a local folder (default: the offline SmolLM2-135M-Instruct)")
    tune.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    tune.add_argument("--again", action="store_true",
                      help="measure again even where this machine's choice is cached (REST_LAB_RECALIBRATE=1)")
    tune.set_defaults(func=cmd_tune)


class _Bars:
    """One progress bar per measurement: a count that starts again from 0 opens a new bar."""

    def __init__(self) -> None:
        self.bar: Optional[tqdm] = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None or done == 0:
            self.close()
            self.bar = tqdm(total=total, unit="size", file=sys.stderr, leave=False)
        self.bar.n = done
        self.bar.refresh()
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _where(source: str, measured_s: float) -> str:
    return f"measured now in {measured_s:.0f} s" if source == "measured" else f"read from {source}"


def cmd_tune(args: argparse.Namespace) -> int:
    if args.again:
        os.environ["REST_LAB_RECALIBRATE"] = "1"
    bars = _Bars()
    start = time.perf_counter()
    try:
        lm = load_model(args.model, device=args.device, report=say_on_stderr, progress=bars)
    finally:
        bars.close()
    print(f"{lm.name} on {lm.device.type} ({str(lm.dtype).split('.')[-1]}), loaded and tuned in "
          f"{time.perf_counter() - start:.0f} s")
    kernels, attn = lm.kernels, lm.attention
    if kernels is None:
        print("Linear kernels: transformers' own (a GPU, half precision, REST_LAB_KERNELS=default or no oneDNN)")
    else:
        where = _where(kernels.source, kernels.measured_s)
        print(f"Linear kernels ({where}): {kernels.describe()}")
    if attn is None:
        print("Attention: torch SDPA throughout (no native kernel for this model or machine)")
    else:
        where = _where(attn.source, attn.measured_s)
        print(f"Attention ({where}): {attn.describe()}")
    say_on_stderr("checking the forward-pass cost curve (measured again when a quick probe disagrees with it)")
    t0 = time.perf_counter()
    curve = CostModel.for_model(lm).times_ms
    print(f"Forward-pass cost curve ({time.perf_counter() - t0:.0f} s): "
          + ", ".join(f"{q} tokens {ms:.1f} ms ({ms / curve[0]:.2f}x)" for q, ms in zip(GRID, curve)))
    return 0
