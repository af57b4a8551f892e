"""What the cost model's agreement correction buys, side by side in one process.

Two decoders with `rest_full`'s stores (each its own: the request store, the history and the model's own
predictions learn as they decode, and start empty every round, as in the benchmark) and a cost model each, one
weighing how many sources drafted a node (`CostModel.use_agreement`, the default) and one not, decode the
suite's prompts taking turns (the order flips every prompt). Reports per variant tokens per pass, accepted
drafts, mean budget and tokens/s, per prompt the ratio of the two variants' tokens/s (median over rounds), each
level's learned correction, and checks that both decode the same tokens (greedy).

    .venv/bin/python scripts/agreement_ab.py --suite chat --limit 16
    .venv/bin/python scripts/agreement_ab.py --suite humaneval --limit 16 --rounds 2
    .venv/bin/python scripts/agreement_ab.py --suite chat --limit 8 --calibration
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rest_core.bench.methods import rest_full_decoders, suite_arguments
from rest_core.bench.report import cpu_line
from rest_core.bench.suites import load_suite
from rest_core.decode import DecodeConfig, RestDecoder
from rest_core.machine import cpu_info
from rest_core.model import load_model

VARIANTS = ("agreement", "without")
BANDS = ((0.0, 0.1), (0.1, 0.2), (0.2, 0.35), (0.35, 0.5), (0.5, 0.7), (0.7, 1.01))  # estimated chance bands


class Calibration:
    """A step hook: per tested draft node (its parent accepted), the chance the cost model gave it once its
    parent was accepted, how many sources' retrieved rows run through it, and whether it was accepted."""

    def __init__(self) -> None:
        self.nodes: list[tuple[float, int, bool]] = []

    def __call__(self, trace) -> None:
        if len(trace.tree_tokens) < 2 or not trace.node_chances:
            return
        prefixes: dict[str, set] = {}
        for branch in trace.branches:
            seen = prefixes.setdefault(branch.source, set())
            for d in range(1, len(branch.tokens) + 1):
                seen.add(tuple(branch.tokens[:d]))
        paths, taken = {0: ()}, set(trace.accepted_nodes)
        for n in range(1, len(trace.tree_tokens)):
            parent = trace.tree_parents[n]
            paths[n] = paths[parent] + (trace.tree_tokens[n],)
            if parent not in taken:
                continue
            chance = trace.node_chances[n] / max(trace.node_chances[parent] if parent > 0 else 1.0, 1e-12)
            sources = sum(paths[n] in seen for seen in prefixes.values())
            self.nodes.append((chance, sources, n in taken))

    def report(self) -> str:
        a = np.array(self.nodes, dtype=float).reshape(-1, 3)
        lines = ["estimated chance | 1 source: nodes, estimated, accepted | 2 sources | 3 or more"]
        for lo, hi in BANDS:
            cells = []
            for level in (1, 2, 3):
                m = (a[:, 0] >= lo) & (a[:, 0] < hi) & ((a[:, 1] == level) if level < 3 else (a[:, 1] >= 3))
                cells.append(f"{int(m.sum())}, {a[m, 0].mean():.2f}, {a[m, 2].mean():.2f}" if m.any() else "-")
            lines.append(f"{lo:.2f}-{min(hi, 1.0):.2f} | " + " | ".join(cells))
        return "\n".join(lines)


def fresh_decoders(lm, suite: str) -> dict[str, RestDecoder]:
    """Both variants' decoders, each with its own stores (the history and the model's own predictions empty)
    and cost model (the acceptance counts as saved on disk)."""
    def setup(variant, stores, chooser) -> None:
        chooser.use_agreement = variant == "agreement"

    return rest_full_decoders(lm, suite, VARIANTS, setup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    suite_arguments(ap, rounds=1)
    ap.add_argument("--calibration", action="store_true",
                    help="also print, for the variant without the correction, how often the nodes of 1, 2, 3+ "
                         "sources were accepted against the chance the cost model gave them (that variant then "
                         "builds every step's trace: compare tokens per pass, not speed, in such a run)")
    args = ap.parse_args()
    lm = load_model()
    prompts = load_suite(args.suite, lm.tokenizer, limit=args.limit, pick=args.prompts)
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens)
    fresh_decoders(lm, args.suite)["without"].generate(list(prompts[0].ids), DecodeConfig(max_new_tokens=16))  # warm-up
    print(f"{cpu_line(cpu_info())}, torch threads {torch.get_num_threads()}; {args.suite}, {len(prompts)} prompts, "
          f"{args.rounds} round(s)")
    totals = {v: {"tokens": 0, "steps": 0, "accepted": 0, "budget": 0, "wall": 0.0} for v in VARIANTS}
    ratios: dict[str, list[float]] = {p.id: [] for p in prompts}
    calibration = Calibration() if args.calibration else None
    n = 0
    for _ in range(args.rounds):
        decoders = fresh_decoders(lm, args.suite)  # every round starts as the benchmark's does: empty history
        for p in prompts:
            order = VARIANTS if n % 2 == 0 else VARIANTS[::-1]
            n += 1
            got, speed = {}, {}
            for variant in order:
                hook = calibration if variant == "without" else None
                res = decoders[variant].generate(list(p.ids), cfg, hook=hook)
                t = totals[variant]
                t["tokens"] += len(res.tokens)
                t["steps"] += res.steps
                t["accepted"] += res.accepted_drafts
                t["budget"] += sum(res.budgets)
                t["wall"] += res.wall_s
                got[variant], speed[variant] = res.tokens, len(res.tokens) / res.wall_s
            if got["agreement"] != got["without"]:
                raise AssertionError(f"{p.id}: the two variants decoded different tokens")
            ratios[p.id].append(speed["agreement"] / speed["without"])
    for variant in VARIANTS:
        t = totals[variant]
        print(f"{variant:9s}: {t['tokens'] / t['steps']:.3f} tokens/pass, {t['accepted']} accepted drafts, "
              f"mean budget {t['budget'] / t['steps']:.2f}, {t['tokens'] / t['wall']:.2f} tokens/s")
    med = [float(np.median(v)) for v in ratios.values()]
    speed = {v: totals[v]["tokens"] / totals[v]["wall"] for v in VARIANTS}
    print(f"tokens/s agreement / without, per prompt (median of rounds): median {np.median(med):.3f} "
          f"({min(med):.3f}-{max(med):.3f}); overall {speed['agreement'] / speed['without']:.3f}")
    chooser = decoders["agreement"].budget_chooser
    print("learned corrections (1 / 2 / 3+ sources):", " / ".join(f"{f:.2f}" for f in chooser.agreement_factors()),
          "; tested nodes' expected sums:", " / ".join(f"{x:.0f}" for x in chooser.agreement[1]))
    print("outputs identical")
    if calibration is not None:
        print(calibration.report())


if __name__ == "__main__":
    main()
