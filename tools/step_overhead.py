"""What a REST step costs around its forward pass, for steps with and without a draft, beside a plain step.

Decodes prompts with rest_full's stores (the Python store, the general-text store in chat, the request
store, a history and the model's own predictions, the last two in memory and empty at first), then the
same prompts plainly, and reports per kind of step the milliseconds spent outside the forward pass:
looking the stores up, building and sizing the tree, verifying, committing (KV cache, the stores told
what was committed and what the model predicted) and the cost model learning from the step.  A step
with no draft does everything a plain step does plus that work, so its overhead over a plain step is
what REST costs where it cannot help.  The plain loop's own work around its pass (the input tensor, the
argmax over logits just written, the generator) is timed the same way -- each step's time less the model
call -- and so is the part of REST's forward phase outside the model call (the tree's ids and positions):
the difference of the two is what a step with no draft costs over a plain step.

With --never-draft it measures that cost whole instead: the same stores and cost model, but every tree cut
to its root after the cost model's decision (so each step looks up, builds and ranks its candidates, then
runs one token as a plain step does, and teaches the stores), against the plain loop on the same prompts,
the two interleaved prompt by prompt over --rounds rounds, their outputs checked identical: time per step
from the first step to the last, everything included.

    .venv/bin/python tools/step_overhead.py --suite chat --limit 8
    .venv/bin/python tools/step_overhead.py --suite humaneval --limit 8
    .venv/bin/python tools/step_overhead.py --suite chat --limit 8 --never-draft --rounds 2
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rest_core.bench.methods import rest_full_stores
from rest_core.bench.suites import load_suite
from rest_core.cost import CostModel
from rest_core.decode import DecodeConfig, RestDecoder, plain_generate
from rest_core.machine import cpu_info, cpu_line
from rest_core.model import load_model
from rest_core.phases import PHASES
from rest_core.tree import root_only

PHASES_AROUND = tuple(p for p in PHASES if p != "forward")  # a step's timed phases besides the forward pass


class _TimedChooser:
    """The decoder's budget chooser, with the time of each `observe` (the cost model learning) kept."""

    def __init__(self, chooser):
        self._chooser = chooser
        self.last_observe_ms = 0.0

    def observe(self, *args, **kwargs):
        t0 = time.perf_counter()
        self._chooser.observe(*args, **kwargs)
        self.last_observe_ms = (time.perf_counter() - t0) * 1e3

    def __getattr__(self, name):
        return getattr(self._chooser, name)


class _TimedModelCalls:
    """The model's `forward`, with each call's ms kept (`calls`), put on the LoadedModel instance for a while."""

    def __init__(self, lm):
        self.lm, self.calls = lm, []

    def __enter__(self):
        inner = self.lm.forward

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.calls.append((time.perf_counter() - t0) * 1e3)

        self.lm.forward = timed
        return self

    def __exit__(self, *exc):
        del self.lm.forward  # the class's method again


class _RootOnly:
    """The decoder's budget chooser, deciding as ever and then cutting every tree to its root."""

    def __init__(self, chooser):
        self._chooser = chooser

    def decide(self, tree):
        self._chooser.decide(tree)
        return root_only(int(tree.tokens[0])), None

    def __getattr__(self, name):
        return getattr(self._chooser, name)


def never_drafting(decoder: RestDecoder, prompts: Sequence[Sequence[int]], cfg: DecodeConfig, rounds: int) -> dict:
    """ms per step of REST cut to the root and of the plain loop, interleaved per prompt (the order flips every
    round); per prompt the median over rounds of REST's time over plain's."""
    chooser = decoder.budget_chooser
    decoder.budget_chooser = _RootOnly(chooser)
    per: dict[str, list[list[float]]] = {"rest": [[] for _ in prompts], "plain": [[] for _ in prompts]}
    try:
        for r in range(rounds):
            for i, ids in enumerate(prompts):
                outputs = {}
                for method in (("rest", "plain") if r % 2 == 0 else ("plain", "rest")):
                    res = decoder.generate(list(ids), cfg) if method == "rest" else \
                        plain_generate(decoder.lm, list(ids), cfg)
                    per[method][i].append((res.wall_s - res.prefill_s) / res.steps * 1e3)
                    outputs[method] = res.tokens
                if outputs["rest"] != outputs["plain"]:
                    raise AssertionError(f"prompt {i}: REST cut to the root decoded other tokens than plain")
    finally:
        decoder.budget_chooser = chooser
    ratios = [float(np.median(np.array(a) / np.array(b))) for a, b in zip(per["rest"], per["plain"])]
    mean = {m: float(np.mean([x for xs in v for x in xs])) for m, v in per.items()}
    return {"rest_ms_per_step": mean["rest"], "plain_ms_per_step": mean["plain"], "per_prompt": ratios}


def measure(decoder: RestDecoder, prompts: Sequence[Sequence[int]], cfg: DecodeConfig) -> dict:
    """Per kind of step ("no draft", "with draft"): steps, median and mean ms around the pass, mean ms per
    phase and of the cost model's learning; and the plain loop's mean ms per step on the same prompts, with its
    median ms around the pass (a step's time less its model call)."""
    chooser = decoder.budget_chooser
    timed = _TimedChooser(chooser) if chooser is not None else None
    decoder.budget_chooser = timed
    rows: list[tuple[bool, dict, float, float]] = []  # (drafted, phase ms, learning ms, model call ms) per step

    with _TimedModelCalls(decoder.lm) as model_calls:
        def hook(trace) -> None:
            rows.append((len(trace.tree_tokens) > 1, dict(trace.timings_ms), timed.last_observe_ms if timed else 0.0,
                         model_calls.calls[-1]))

        try:
            for ids in prompts:
                decoder.generate(list(ids), cfg, hook=hook)
        finally:
            decoder.budget_chooser = chooser
        plain_steps = plain_s = 0.0
        plain_around: list[float] = []
        for ids in prompts:
            model_calls.calls.clear()
            res = plain_generate(decoder.lm, list(ids), cfg)
            plain_steps += res.steps
            plain_s += res.wall_s - res.prefill_s
            calls = model_calls.calls[-res.steps:]  # the steps' calls (the prefill's came first)
            step_ms = (res.wall_s - res.prefill_s) * 1e3 / res.steps
            plain_around.append(step_ms - float(np.mean(calls)))
    out: dict = {"plain_ms_per_step": plain_s / plain_steps * 1e3 if plain_steps else 0.0,
                 "plain_around_ms": float(np.median(plain_around)) if plain_around else 0.0}
    for kind, drafted in (("no draft", False), ("with draft", True)):
        chosen = [(ms, learn, call) for d, ms, learn, call in rows if d == drafted]
        around = [sum(ms[p] for p in PHASES_AROUND) + learn + (ms["forward"] - call) for ms, learn, call in chosen]
        out[kind] = {"steps": len(chosen),
                     "median_ms": float(np.median(around)) if around else 0.0,
                     "mean_ms": float(np.mean(around)) if around else 0.0,
                     "phases_ms": {p: float(np.mean([ms[p] for ms, _, _ in chosen])) if chosen else 0.0
                                   for p in (*PHASES_AROUND, "forward")},
                     "outside_call_ms": float(np.mean([ms["forward"] - c for ms, _, c in chosen])) if chosen else 0.0,
                     "learning_ms": float(np.mean([learn for _, learn, _ in chosen])) if chosen else 0.0}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=("chat", "humaneval"), default="chat")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--never-draft", action="store_true",
                    help="time whole decodes of REST with every tree cut to its root against plain ones")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of --never-draft (default 2)")
    args = ap.parse_args()
    lm = load_model()
    stores, kind = rest_full_stores(lm, args.suite)
    decoder = RestDecoder(lm, stores=stores, budget_chooser=CostModel.for_model(lm, stores=stores, kind=kind))
    prompts = [p.ids for p in load_suite(args.suite, lm.tokenizer, limit=args.limit)]
    decoder.generate(list(prompts[0]), DecodeConfig(max_new_tokens=16))  # warm-up
    print(f"{cpu_line(cpu_info())}, torch threads "
          f"{torch.get_num_threads()}")
    if args.never_draft:
        out = never_drafting(decoder, prompts, DecodeConfig(max_new_tokens=args.max_new_tokens), args.rounds)
        rest, plain, ratios = out["rest_ms_per_step"], out["plain_ms_per_step"], out["per_prompt"]
        print(f"plain {plain:.2f} ms per step, REST with every tree cut to its root {rest:.2f}: "
              f"{rest / plain - 1:+.1%}; per prompt (median of {args.rounds}) {np.median(ratios):.3f}x "
              f"({min(ratios):.3f}-{max(ratios):.3f}); outputs identical")
        return
    out = measure(decoder, prompts, DecodeConfig(max_new_tokens=args.max_new_tokens))
    plain, plain_around = out["plain_ms_per_step"], out["plain_around_ms"]
    print(f"plain: {plain:.2f} ms per step, around its pass {plain_around:.2f} ms (median over prompts)")
    for kind in ("no draft", "with draft"):
        k = out[kind]
        phases = ", ".join(f"{p} {v:.2f}" for p, v in k["phases_ms"].items() if p != "forward")
        over = k["median_ms"] - plain_around
        print(f"{kind}: {k['steps']} steps, around the pass median {k['median_ms']:.2f} ms "
              f"({k['median_ms'] / plain:.1%} of a plain step; over the plain loop's own {over:.2f} ms, "
              f"{over / plain:.1%}), mean {k['mean_ms']:.2f} (mean ms: {phases}, forward phase outside the model "
              f"call {k['outside_call_ms']:.2f}, cost model learning {k['learning_ms']:.2f}; "
              f"forward {k['phases_ms']['forward']:.1f})")


if __name__ == "__main__":
    main()
