"""Tokens per pass and time at fixed draft budgets, beside the cost model's own choice, in live decodes.

Decodes a suite with rest_full's stores (the Python store, the general-text store in chat, the request store,
a history and the model's own predictions, the last two in memory and empty at first: fresh stores for every
setting) once per setting:

* "auto": the cost model chooses each step's budget (what the decoder does);
* "ranked B": the top B candidates of the cost model's own ranking every step (its chances, a fixed budget);
* "score B": the top B candidates by the tree's mixture scores (`DecodeConfig.draft_budget`, no cost model cut).

Every setting starts from the same saved acceptance counts and none saves them.  It reports tokens per pass,
passes, seconds and the committed drafts per source: how many tokens per pass a budget buys, and what it costs
on this machine in the same run (the settings run one after the other, so the seconds move with the machine).

    .venv/bin/python tools/budget_sweep.py --settings auto ranked:8 ranked:16 ranked:32
    .venv/bin/python tools/budget_sweep.py --suite humaneval --limit 16 --settings auto score:16
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rest_core.bench.methods import rest_full_stores
from rest_core.bench.suites import BENCHMARK_CHAT_PROMPTS, load_suite
from rest_core.cost import CostModel
from rest_core.decode import DecodeConfig, RestDecoder
from rest_core.machine import cpu_info, cpu_line
from rest_core.model import load_model
from rest_core.tree import keep_nodes


class _RankedBudget:
    """The cost model, keeping the top `budget` of its ranking every step instead of the budget it would choose."""

    def __init__(self, chooser: CostModel, budget: int):
        self._chooser, self.budget = chooser, budget

    def decide(self, tree):
        if tree.draft_size == 0:
            return tree, None
        order, _ = self._chooser.ranked(tree)
        return keep_nodes(tree, order[:self.budget]), None

    def __getattr__(self, name):
        return getattr(self._chooser, name)


def parse_setting(text: str) -> tuple[str, int]:
    """'auto', 'ranked:B' or 'score:B' -> (kind, B)."""
    kind, _, value = text.partition(":")
    if kind == "auto" and not value:
        return kind, 0
    if kind in ("ranked", "score") and value.isdigit() and 1 <= int(value) <= 63:
        return kind, int(value)
    raise argparse.ArgumentTypeError(f"{text!r}: use auto, ranked:B or score:B with B in 1..63")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=("chat", "humaneval"), default="chat")
    ap.add_argument("--limit", type=int, default=16, help="prompts of humaneval (chat: the benchmark's 16)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--settings", type=parse_setting, nargs="+",
                    default=[parse_setting(s) for s in ("auto", "ranked:8", "ranked:16", "ranked:32")])
    args = ap.parse_args()
    lm = load_model()
    if args.suite == "chat":
        prompts = [p.ids for p in load_suite("chat", lm.tokenizer, pick=list(BENCHMARK_CHAT_PROMPTS))]
    else:
        prompts = [p.ids for p in load_suite(args.suite, lm.tokenizer, limit=args.limit)]
    print(f"{cpu_line(cpu_info())}; {len(prompts)} prompts, {args.max_new_tokens} new tokens", flush=True)
    for kind, budget in args.settings:
        stores, text_kind = rest_full_stores(lm, args.suite)
        chooser = CostModel.for_model(lm, stores=stores, kind=text_kind)
        decider = _RankedBudget(chooser, budget) if kind == "ranked" else chooser
        decoder = RestDecoder(lm, stores=stores, budget_chooser=decider)
        cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, draft_budget=budget if kind == "score" else None)
        tokens = passes = 0
        committed: dict[str, int] = {}
        start = time.perf_counter()
        for ids in prompts:
            res = decoder.generate(list(ids), cfg)
            tokens += len(res.tokens)
            passes += res.steps
            for source, count in res.accepted_by_source.items():
                committed[source] = committed.get(source, 0) + count
        seconds = time.perf_counter() - start
        label = "auto (the cost model's budget)" if kind == "auto" else f"{kind} {budget}"
        drafts = ", ".join(f"{s} {c}" for s, c in sorted(committed.items(), key=lambda kv: -kv[1]))
        print(f"{label}: {tokens / passes:.3f} tokens per pass ({passes} passes), {seconds:.0f} s, "
              f"{tokens / seconds:.1f} tokens/s; committed drafts: {drafts}", flush=True)


if __name__ == "__main__":
    main()
