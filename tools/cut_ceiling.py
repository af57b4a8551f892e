"""How much of the candidate draft tree the cost model's cut keeps, and what other budget rules would reach.

Decodes prompts with rest_full's stores (the Python store, the general-text store in chat, the request
store, a history and the model's own predictions, the last two in memory and empty at first) and the
cost model, and records for every step the whole candidate tree the cost model was handed, its ranking
of the candidates, and the answer (REST's greedy output is the model's, so the answer is known): which
of the candidates lie on the path the model went on to take, and where the ranking put them.  On those
very trees it then replays budget rules against the cost curve the run ended with:

* the recorded choice, and the cost model's objective again with its chances scaled (its calibration);
* the same chances spent at an exchange rate instead: each step takes the budget with the most expected
  tokens - r * ms, for r a multiple of the one-token rate or the rate the chances themselves promise (the
  rule that maximizes a sum of tokens over a sum of times when the chances are right);
* fixed budgets (the top b of the same ranking);
* the budgets that give all steps together the most tokens per ms for someone who knew the answer (the
  same ranking: what a perfect estimate of *which* steps pay would reach) and the accepted path alone (a
  perfect ranking as well).

The replay ignores what other choices would have taught the cost model and the stores, so it bounds
what a budget rule can reach on these trees rather than predicting a run.  What no budget rule can reach
is reported first: how often the answer's next token is among no candidate at all, and how far into the
answer the candidates reach per step; `--show-misses N` prints N of the steps no candidate covered.
`--candidates` hands the cost model more of the merged tree than the decoder's 63 nodes, and
`--model-branching` / `--model-row-scale` let the model's own predictions (source "model") draft wider and
deeper, to see how much of that ceiling is the candidate count's and the model source's; `--dense default` adds
the dense store and reports how many of the steps the text sources miss it covers (searched as the decoder
searches it, only where the text sources' cut keeps nothing; with `--dense-every-step`, in every step).

    .venv/bin/python tools/cut_ceiling.py --suite humaneval --limit 16
    .venv/bin/python tools/cut_ceiling.py --suite chat --limit 16 --show-misses 30
    .venv/bin/python tools/cut_ceiling.py --suite chat --limit 16 --candidates 255
    .venv/bin/python tools/cut_ceiling.py --suite chat --limit 16 --dense default
    .venv/bin/python tools/cut_ceiling.py --suite chat --limit 16 --dense default --dense-every-step
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datastores.recycle import BRANCHING, ROW_SCALE, RecycleStore
from rest_core.bench.methods import rest_full_stores
from rest_core.bench.suites import BENCHMARK_CHAT_PROMPTS, load_suite
from rest_core.cost import CANDIDATE_BUDGETS, MAX_CHANCE, CostModel
from rest_core.decode import DecodeConfig, RestDecoder
from rest_core.hidden import open_model_dense
from rest_core.machine import cpu_info, cpu_line
from rest_core.model import load_model
from rest_core.tree import DraftTree


class _RecordingChooser:
    """The decoder's cost model, with every candidate tree it is handed and its ranking of them kept."""

    def __init__(self, chooser: CostModel):
        self._chooser = chooser
        self.seen: list[tuple[DraftTree, np.ndarray, np.ndarray]] = []  # (tree, ranked nodes, their chances)

    def decide(self, tree: DraftTree):
        if tree.draft_size == 0:
            self.seen.append((tree, np.zeros(0, int), np.zeros(0)))
            return self._chooser.decide(tree)
        order, chance = self._chooser.ranked(tree)
        self.seen.append((tree, order, chance))
        return self._chooser.cut(tree, order, chance)  # ranked once, as decide would

    def __getattr__(self, name):
        return getattr(self._chooser, name)


def answer_path(tree: DraftTree, answer: Sequence[int]) -> list[int]:
    """The tree's nodes (1-based) along the answer, from the root down, as far as the tree holds it."""
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(tree.tokens)):
        children.setdefault(int(tree.parents[node]), {}).setdefault(int(tree.tokens[node]), node)
    path, node = [], 0
    for token in answer:
        node = children.get(node, {}).get(int(token), -1)
        if node < 0:
            break
        path.append(node)
    return path


def record(decoder: RestDecoder, prompts: Sequence[Sequence[int]], cfg: DecodeConfig,
           answers: Optional[list] = None) -> list[dict]:
    """Per step: candidates, kept and accepted drafts, the ranks (0 = first) of the candidates on the answer's
    path, the chances the cost model ranked them by (best first), and where the step stood (`prompt`: its
    prompt's index, `at`: the context's length).  `answers` (when given) receives each prompt's answer ids."""
    chooser = decoder.budget_chooser
    if chooser is None:
        raise ValueError("the decoder needs a cost model (budget_chooser) whose cut is to be measured")
    recording = _RecordingChooser(chooser)
    decoder.budget_chooser = recording
    rows: list[dict] = []
    traces: list = []
    decided: list[tuple[DraftTree, np.ndarray, np.ndarray]] = []

    def step_done(trace) -> None:
        # the step's last decision: a step that searched a fallback store (the dense one) decided twice, on the
        # other stores' tree and then on the tree with the fallback's drafts, which it kept
        traces.append(trace)
        decided.append(recording.seen[-1])
        recording.seen.clear()

    try:
        for index, ids in enumerate(prompts):
            traces.clear()
            decided.clear()
            out = decoder.generate(list(ids), cfg, hook=step_done)
            if answers is not None:
                answers.append(list(out.tokens))
            done = 0
            for trace, (tree, order, chance) in zip(traces, decided, strict=True):
                rank = {int(n): i for i, n in enumerate(order)}
                path = answer_path(tree, out.tokens[done:])
                rows.append({"candidates": int(tree.draft_size), "kept": trace.draft_size,
                             "accepted": trace.accepted_drafts, "ranks": [rank[n] for n in path],
                             "chances": [float(c) for c in chance],
                             "before": (list(ids) + out.tokens[:done])[-6:], "next": out.tokens[done],
                             "prompt": index, "at": len(ids) + done,
                             "holders": sorted({b.source for b in trace.branches
                                                if b.tokens and b.tokens[0] == out.tokens[done]})})
                done += len(trace.new_tokens)
    finally:
        decoder.budget_chooser = chooser
    return rows


def accepted_within(row: dict, budget: int) -> int:
    """Drafts a step accepts when it keeps the top `budget` candidates: the answer's path as far as it ranks
    within them."""
    return next((j for j, r in enumerate(row["ranks"]) if r >= budget), len(row["ranks"]))


def replay(rows: Sequence[dict], forward_ms: Callable, rule: Callable[[dict], int]) -> tuple[float, float]:
    """(tokens per pass, speed over one-token passes on the cost curve) of a budget rule on the recorded trees:
    a step keeps the top `rule(row)` candidates of the recorded ranking."""
    tokens = ms = 0.0
    for row in rows:
        budget = min(rule(row), row["candidates"])
        tokens += 1 + accepted_within(row, budget)
        ms += forward_ms(budget + 1)
    return tokens / len(rows), tokens / ms * forward_ms(1)


def expected_tokens(row: dict, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The cost model's candidate budgets for a step and the tokens it expects of each (1 + the chances of
    the top b, scaled)."""
    chance = np.minimum(np.asarray(row["chances"]) * scale, MAX_CHANCE)
    budgets = CANDIDATE_BUDGETS[CANDIDATE_BUDGETS <= chance.size]
    return budgets, 1.0 + np.concatenate([[0.0], np.cumsum(chance)])[budgets]


def objective(forward_ms: Callable, scale: float = 1.0) -> Callable[[dict], int]:
    """The cost model's rule, (1 + expected accepted drafts of the top b) / t(b + 1), chances scaled."""
    def rule(row: dict) -> int:
        budgets, tokens = expected_tokens(row, scale)
        return int(budgets[int((tokens / forward_ms(budgets + 1)).argmax())])
    return rule


def at_rate(rows: Sequence[dict], forward_ms: Callable, multiple: Optional[float] = None) -> Callable[[dict], int]:
    """Each step takes the budget with the most expected tokens - r * ms.  r is `multiple` times the one-token
    rate, or (None) the best rate of all steps together by the chances themselves (Dinkelbach's iteration
    on expected tokens, as `knowing_the_answer` does on accepted ones)."""
    options = [(budgets, tokens, forward_ms(budgets + 1))  # per step: (budgets, expected tokens, ms)
               for budgets, tokens in map(expected_tokens, rows)]
    return _rule_at(rows, options, _best_rate(options) if multiple is None else multiple / forward_ms(1))


def _rule_at(rows: Sequence[dict], options: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
             rate: float) -> Callable[[dict], int]:
    """The rule that gives each of these steps the budget (of its options: budgets, tokens, ms) with the most
    tokens - rate * ms."""
    chosen = {id(row): int(budgets[int((tokens - rate * ms).argmax())])
              for row, (budgets, tokens, ms) in zip(rows, options)}
    return lambda row: chosen[id(row)]


def _best_rate(options: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> float:
    """The best rate sum(tokens) / sum(ms) over one option per step (Dinkelbach's iteration: at a rate r each
    step takes the option with the most tokens - r * ms, which gives a better rate unless r was the best)."""
    rate = len(options) / sum(float(ms[0]) for _, _, ms in options)  # start from plain steps
    while True:
        picks = [int((tokens - rate * ms).argmax()) for _, tokens, ms in options]
        better = sum(tokens[i] for (_, tokens, _), i in zip(options, picks)) \
            / sum(ms[i] for (_, _, ms), i in zip(options, picks))
        if better <= rate * (1 + 1e-12):
            return rate
        rate = better


def knowing_the_answer(rows: Sequence[dict], forward_ms: Callable) -> Callable[[dict], int]:
    """The budgets (of the cost model's candidate sizes) that give these steps together the most tokens per
    ms, for someone who knew which candidates the model would accept.  The best rate of a sum of tokens over a
    sum of times is found by Dinkelbach's iteration (`_best_rate`)."""
    options = []  # per step: (budgets, tokens, ms)
    for row in rows:
        budgets = CANDIDATE_BUDGETS[CANDIDATE_BUDGETS <= row["candidates"]]
        tokens = np.array([1.0 + accepted_within(row, int(b)) for b in budgets])
        options.append((budgets, tokens, forward_ms(budgets + 1)))
    return _rule_at(rows, options, _best_rate(options))


def coverage(rows: Sequence[dict]) -> list[str]:
    """How far into the answer each step's candidates reach, whatever is kept of them."""
    reach = np.array([len(r["ranks"]) for r in rows])
    empty = np.array([r["candidates"] == 0 for r in rows])
    shares = ", ".join(f"{n}: {np.mean(reach == n):.1%}" for n in range(4)) + f", 4 or more: {np.mean(reach >= 4):.1%}"
    first = np.array([r["ranks"][0] for r in rows if r["ranks"]])
    ranked = ", ".join(f"top {b}: {np.mean(first < b):.0%}" for b in (1, 2, 4, 8)) if first.size else "-"
    return [f"the answer's next token among no candidate: {np.mean(reach == 0):.1%} of steps "
            f"({np.mean(empty):.1%} with no candidates at all)",
            f"answer tokens the candidates hold per step: {shares}",
            f"where they hold the next one, the cost model ranked it within its {ranked}"]


def by_source(rows: Sequence[dict]) -> list[str]:
    """Per draft source, the share of steps whose next token it retrieved (the first token of one of its
    continuations, before the tree is cut to its candidates), and for the dense source the share of the steps
    no other source's continuations covered that it covers."""
    names = sorted({s for r in rows for s in r.get("holders", ())})
    if not names:
        return []
    lines = ["the answer's next token as the first token of a source's continuations: "
             + ", ".join(f"{s} {np.mean([s in r['holders'] for r in rows]):.1%}" for s in names)]
    if "dense" in names:
        text_miss = [r for r in rows if not set(r["holders"]) - {"dense"}]
        covered = np.mean(["dense" in r["holders"] for r in text_miss]) if text_miss else 0.0
        lines.append(f"steps no text source's continuations cover: {len(text_miss) / len(rows):.1%}; the dense "
                     f"source covers {covered:.1%} of them; uncovered with it: "
                     f"{np.mean([not r['holders'] for r in rows]):.1%}")
    return lines


def report(rows: Sequence[dict], forward_ms: Callable) -> list[str]:
    lines = [f"{len(rows)} steps, candidates per step {np.mean([r['candidates'] for r in rows]):.1f}, kept "
             f"{np.mean([r['kept'] for r in rows]):.2f}; cost curve x one token at 2/4/8/16: "
             + " / ".join(f"{forward_ms(q) / forward_ms(1):.2f}" for q in (2, 4, 8, 16))]
    lines += coverage(rows)
    lines += by_source(rows)
    recorded = replay(rows, forward_ms, lambda r: r["kept"])
    lines.append(f"recorded choice: {recorded[0]:.3f} tokens per pass, {recorded[1]:.3f}x on the curve")
    def line(label: str, found: tuple[float, float]) -> str:
        return f"{label}: {found[0]:.3f} tokens per pass, {found[1]:.3f}x"

    for scale in (0.5, 1.0, 1.5, 2.0):
        lines.append(line(f"objective, chances x {scale:.1f}", replay(rows, forward_ms, objective(forward_ms, scale))))
    for multiple in (1.0, 1.5, 2.0, None):
        label = "the rate the chances promise" if multiple is None else f"{multiple:.1f} x the one-token rate"
        found = replay(rows, forward_ms, at_rate(rows, forward_ms, multiple))
        lines.append(line(f"expected tokens - r * ms, r = {label}", found))
    for b in (2, 4, 8, 16, 24, 32):
        lines.append(line(f"fixed budget {b}", replay(rows, forward_ms, lambda r, b=b: b)))
    knowing = knowing_the_answer(rows, forward_ms)
    lines.append(line("the best budgets, knowing the answer", replay(rows, forward_ms, knowing)))
    path_tokens = [1 + len(r["ranks"]) for r in rows]
    path_speed = sum(path_tokens) / sum(forward_ms(n) for n in path_tokens) * forward_ms(1)
    lines.append(line("the accepted path alone", (float(np.mean(path_tokens)), path_speed)))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=("chat", "humaneval"), default="chat")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--model-branching", type=lambda s: tuple(int(b) for b in s.split(",")), default=BRANCHING,
                    help="children per node at each depth of the model source's drafts, comma-separated "
                         f"(default {','.join(map(str, BRANCHING))})")
    ap.add_argument("--model-row-scale", type=int, default=ROW_SCALE,
                    help=f"the model source's rows per unit of chance (default {ROW_SCALE}; paths below 1/(2x) "
                         "of chance are not drafted)")
    ap.add_argument("--candidates", type=int, default=CostModel.max_budget, metavar="N",
                    help=f"nodes of the candidate tree each step hands the cost model (default {CostModel.max_budget}, "
                         "the decoder's; the cost model keeps at most its largest budget of them)")
    ap.add_argument("--dense", default="none", metavar="SPEC",
                    help="add a dense store to rest_full's stores: 'default' (the built-in one, built when missing), "
                         "a store folder, or 'none' (default)")
    ap.add_argument("--dense-every-step", action="store_true",
                    help="search the dense store in every step, not only where the text sources' cut keeps nothing "
                         "(as the decoder does): how many steps its candidates could cover, not how many it drafts")
    ap.add_argument("--show-misses", type=int, default=0, metavar="N",
                    help="print N steps (drawn at random, seed 0) whose next token was among no candidate")
    args = ap.parse_args()
    lm = load_model()
    model = RecycleStore(lm.vocab_size, branching=args.model_branching, row_scale=args.model_row_scale)
    dense = open_model_dense(lm, args.dense)
    if dense is not None and args.dense_every_step:
        dense.fallback = False  # a main store: looked up with the others in every step
    stores, kind = rest_full_stores(lm, args.suite, model=model, dense=dense)
    base = CostModel.for_model(lm, stores=stores, kind=kind)
    chooser = CostModel(times_ms=base.times_ms.copy(), labels=base.labels, kind=kind,  # counts from empty
                        max_budget=args.candidates)
    decoder = RestDecoder(lm, stores=stores, budget_chooser=chooser)
    suite = load_suite(args.suite, lm.tokenizer, limit=args.limit,
                       pick=BENCHMARK_CHAT_PROMPTS if args.suite == "chat" else None)
    rows = record(decoder, [p.ids for p in suite], DecodeConfig(max_new_tokens=args.max_new_tokens))
    print(cpu_line(cpu_info()))
    print(f"model source: branching {','.join(map(str, model.branching))}, row scale {model.row_scale}")
    print("\n".join(report(rows, chooser.forward_ms)))
    misses = [r for r in rows if not r["ranks"]]
    picked = np.random.default_rng(0).permutation(len(misses))[:args.show_misses]
    for i in sorted(picked):
        row = misses[i]
        print(f"  {lm.decode(row['before'])!r} -> {lm.decode([row['next']])!r} ({row['candidates']} candidates)")


if __name__ == "__main__":
    main()
