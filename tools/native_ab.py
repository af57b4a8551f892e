"""What the native lookups and ranking buy around each pass, side by side in one process.

Two decoders with `rest_full`'s stores (each its own, the request store, the history and the model's own
predictions empty every round, as in the benchmark) and a cost model each decode the suite's prompts taking turns
(the order flips every prompt): "native" looks the static stores up with `static_lookup.cpp`, the request store
and a small history with `request_scan.cpp`, drafts the model source with `recycle_grow.cpp` and ranks every
candidate tree with `rank_tree.cpp`; "python" answers the same with the Python / numpy paths (the tests hold the
two to the same answers).  Both decode the same tokens (checked); their drafts can part where the cost model, which
learns each pass's time as it goes, weighs a budget differently, so tokens per pass are reported too.  Reports per
variant ms per step, the retrieve and tree phases per step, tokens/s, and per prompt the ratio of tokens/s (median
over rounds).

    .venv/bin/python tools/native_ab.py --suite chat --limit 16 --rounds 2
    .venv/bin/python tools/native_ab.py --suite humaneval --limit 16 --rounds 2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rest_base.native_policy import PYTHON
from rest_core.bench.methods import rest_full_decoders, suite_arguments
from rest_core.bench.suites import load_suite
from rest_core.cost import CostModel
from rest_core.decode import DecodeConfig, RestDecoder
from rest_core.machine import cpu_info, cpu_line
from rest_core.model import load_model

VARIANTS = ("native", "python")


def python_paths(stores, chooser: CostModel) -> None:
    """Have these stores and this cost model answer with their Python / numpy paths."""
    for store in stores:
        store.use_native(PYTHON)
    chooser.native = PYTHON


def fresh_decoders(lm, suite: str) -> dict[str, RestDecoder]:
    def setup(variant, stores, chooser) -> None:
        if variant == "python":
            python_paths(stores, chooser)

    return rest_full_decoders(lm, suite, VARIANTS, setup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    suite_arguments(ap, rounds=2)
    args = ap.parse_args()
    lm = load_model()
    prompts = load_suite(args.suite, lm.tokenizer, limit=args.limit, pick=args.prompts)
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens)
    for decoder in fresh_decoders(lm, args.suite).values():  # warm-up: every native library built and loaded
        decoder.generate(list(prompts[0].ids), DecodeConfig(max_new_tokens=16))
    print(f"{cpu_line(cpu_info())}, torch threads {torch.get_num_threads()}; {args.suite}, {len(prompts)} prompts, "
          f"{args.rounds} round(s)")
    totals = {v: {"tokens": 0, "steps": 0, "wall": 0.0, "retrieve": 0.0, "tree": 0.0, "around": 0.0}
              for v in VARIANTS}
    ratios: dict[str, list[float]] = {p.id: [] for p in prompts}
    n = 0
    for _ in range(args.rounds):
        decoders = fresh_decoders(lm, args.suite)
        for p in prompts:
            order = VARIANTS if n % 2 == 0 else VARIANTS[::-1]
            n += 1
            got, speed = {}, {}
            for variant in order:
                res = decoders[variant].generate(list(p.ids), cfg)
                t = totals[variant]
                t["tokens"] += len(res.tokens)
                t["steps"] += res.steps
                t["wall"] += res.wall_s - res.prefill_s
                t["retrieve"] += res.phase_ms["retrieve"]
                t["tree"] += res.phase_ms["tree"]
                t["around"] += sum(ms for phase, ms in res.phase_ms.items() if phase != "forward")
                got[variant] = res.tokens
                speed[variant] = len(res.tokens) / (res.wall_s - res.prefill_s)
            if got["native"] != got["python"]:
                raise AssertionError(f"{p.id}: the two variants decoded different tokens")
            ratios[p.id].append(speed["native"] / speed["python"])
    for variant in VARIANTS:
        t = totals[variant]
        steps = t["steps"]
        print(f"{variant:6s}: {t['wall'] / steps * 1e3:.2f} ms per step, around the pass {t['around'] / steps:.2f} "
              f"(retrieve {t['retrieve'] / steps:.2f}, tree {t['tree'] / steps:.2f}), {t['tokens'] / steps:.3f} "
              f"tokens/pass, {t['tokens'] / t['wall']:.2f} tokens/s")
    med = [float(np.median(v)) for v in ratios.values()]
    speed = {v: totals[v]["tokens"] / totals[v]["wall"] for v in VARIANTS}
    print(f"tokens/s native / python, per prompt (median of rounds): median {np.median(med):.3f} "
          f"({min(med):.3f}-{max(med):.3f}); overall {speed['native'] / speed['python']:.3f}")
    print("outputs identical")


if __name__ == "__main__":
    main()
