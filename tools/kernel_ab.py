"""Two builds of the blocked linear kernel side by side, in one process: what a change to it buys.

Builds `rest_core/native/blocked_linear.cpp` as it is at a git revision (--base) and as it is in the work
tree, loads both, and times forward passes over q tokens after a fixed random prefix (as `--suite verify`
does), swapping which build every blocked layer calls: each round runs every q with one build, then with
the other, the order alternating, so both see the same stretch of the machine.  Every call of the kernel
is timed too, so the report gives the kernel's own milliseconds per pass beside the pass.  The layers use
the kernel choice measured for the work tree's build (`rest_core.kernels`); where that choice is not the
blocked kernel, both builds run the same other kernel.  The two builds' logits are compared on the first
pass of each size: a change that is meant to reorder nothing should show a difference of 0.

    .venv/bin/python tools/kernel_ab.py --base HEAD~1
    .venv/bin/python tools/kernel_ab.py --base c32da6f~1 --prefix 256 1024 --q 1 8 12 16 24 32 --rounds 15
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rest_core import native
from rest_core.bench.verify_pass import PrefixPass
from rest_core.machine import cpu_info, cpu_line
from rest_core.model import LoadedModel, load_model

ROOT = Path(__file__).resolve().parents[1]
SOURCE_IN_REPO = "rest_core/native/blocked_linear.cpp"


def source_at(rev: str, folder: Path) -> Path:
    """The kernel's source at git revision `rev`, written into `folder`; ValueError naming the revision if git
    cannot give it."""
    run = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{SOURCE_IN_REPO}"], capture_output=True,
                         text=True)
    if run.returncode:
        why = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"git has no {SOURCE_IN_REPO} at {rev!r} ({why}): give a commit that holds the kernel")
    path = folder / "blocked_linear.cpp"
    path.write_text(run.stdout)
    return path


def load_build(source: Path) -> tuple[Callable, Callable]:
    """The kernel functions of `source` (blocks read in place; tall blocks), compiled for this machine (cached
    like the kernel itself); OSError for a source from before the kernels took buffer lengths."""
    lib = native.load_library(source, "blocked-linear")
    return lib.rest_lab_panel_linear, lib.rest_lab_panel_linear_tall


class _Timed:
    """A build's two kernel functions, their calls' time summed."""

    def __init__(self, fns: tuple[Callable, Callable]):
        self.fns, self.seconds = fns, 0.0

    def _run(self, fn: Callable, args) -> None:
        t0 = time.perf_counter()
        fn(*args)
        self.seconds += time.perf_counter() - t0

    def short(self, *args) -> None:
        self._run(self.fns[0], args)

    def tall(self, *args) -> None:
        self._run(self.fns[1], args)


@torch.inference_mode()
def compare(lm: LoadedModel, builds: dict[str, tuple[Callable, Callable]], prefixes: Sequence[int], qs: Sequence[int],
            rounds: int) -> dict:
    """{prefix: {build: {q: {"pass_ms", "kernel_ms", "x_one"}}}, "max_logit_diff": {prefix: {q: float}}}: medians
    over `rounds` interleaved rounds after one untimed warm-up round."""
    if native.library() is None:
        raise RuntimeError(f"the blocked linear kernel is not available here: {native.unavailable()}")
    names = list(builds)
    timed = {name: _Timed(fn) for name, fn in builds.items()}
    kept = native.current_kernel()
    out: dict = {"max_logit_diff": {}}
    try:
        for p in prefixes:
            run = PrefixPass(lm, p)
            samples: dict = defaultdict(lambda: defaultdict(list))
            for r in range(rounds + 1):
                ids = {q: run.random_ids(q) for q in qs}  # the same tokens for both builds in a round
                logits: dict = defaultdict(list)
                for name in (names if r % 2 else names[::-1]):
                    native.use_kernel(timed[name].short, timed[name].tall)
                    for q in qs:
                        timed[name].seconds = 0.0
                        ms = run(q, ids[q])
                        if r:
                            samples[name][q].append((ms, timed[name].seconds * 1e3))
                        else:  # the warm-up round: each build's logits, compared below
                            logits[q].append(run.logits)
                if not r:
                    out["max_logit_diff"][p] = {q: float((a - b).abs().max()) for q, (a, b) in logits.items()}
            out[p] = {}
            for name in names:
                med = {q: np.median(np.array(samples[name][q]), axis=0) for q in qs}  # (pass ms, kernel ms)
                out[p][name] = {q: {"pass_ms": round(float(med[q][0]), 2), "kernel_ms": round(float(med[q][1]), 2),
                                    "x_one": round(float(med[q][0] / med[qs[0]][0]), 3)} for q in qs}
    finally:
        native.use_kernel(*kept)
    return out


def report(out: dict, names: Sequence[str], qs: Sequence[int]) -> str:
    lines = []
    for p in (k for k in out if k != "max_logit_diff"):
        lines += [f"## Prefix {p}: median ms per pass (x a one-token pass of the same build); the kernel's own ms",
                  "", "| q | " + " | ".join(f"{n}: pass | {n}: kernel" for n in names) + " | logits differ by |",
                  "|---|" + "---|---|" * len(names) + "---|"]
        for q in qs:
            cells = " | ".join(f"{out[p][n][q]['pass_ms']:.1f} ({out[p][n][q]['x_one']:.3f}) | "
                               f"{out[p][n][q]['kernel_ms']:.1f}" for n in names)
            lines.append(f"| {q} | {cells} | {out['max_logit_diff'][p][q]:.2e} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD~1", help="git revision of the build to compare with (default HEAD~1)")
    ap.add_argument("--model", default=None, help="model id or folder (default: the offline default model)")
    ap.add_argument("--prefix", type=int, nargs="+", default=[256, 1024], help="prefix lengths (default 256 1024)")
    ap.add_argument("--q", type=int, nargs="+", default=[1, 8, 12, 16, 24, 32],
                    help="tokens per pass; the first is the one the others are compared with (default 1 8 12 16 24 32)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or min(args.q) < 1 or min(args.prefix) < 1:
        ap.error("--rounds, --q and --prefix take positive numbers")
    with tempfile.TemporaryDirectory() as tmp:  # the revision first: a wrong one is told before the model loads
        try:
            base = load_build(source_at(args.base, Path(tmp)))
        except ValueError as exc:
            ap.error(str(exc))
        except (OSError, subprocess.SubprocessError) as exc:
            ap.error(f"the kernel at {args.base} could not be built or loaded: {exc}")
    lm = load_model(args.model)
    if lm.device.type != "cpu":
        ap.error("the blocked kernel runs on the CPU only; this model loaded on " + lm.device.type)
    builds = {args.base: base, "work tree": load_build(native.SOURCE)}
    out = compare(lm, builds, args.prefix, args.q, args.rounds)
    print(f"# Two builds of the blocked kernel: {cpu_line(cpu_info())}, torch threads {torch.get_num_threads()}\n")
    print(f"Kernels: {lm.kernels.describe() if lm.kernels is not None else 'none swapped'}\n")
    print(report(out, list(builds), args.q))
    return 0


if __name__ == "__main__":
    sys.exit(main())
