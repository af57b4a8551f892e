"""How good the vLLM drafter's chain choice is: per lookup, how many of the next tokens the chain it chose
matches, how many the tree's best path would, and what other rules for walking the tree would have matched.

The served drafter (the default stores, acceptance as learned so far) is replayed over a suite's greedy outputs
one request at a time, as `tools/propose_cost.py` replays it (engine steps simulated: PLAIN ms + PER_DRAFT ms a
draft token).  At every lookup the draft tree and the cost model's chances are kept; the chain is walked from the
root by each rule (at every depth the child with the highest key):

    chance   the cost model's chance of acceptance (what the drafter does)
    score    the tree's mixed weight of the sources' continuations through the node
    shares   the share of its source's continuations through the node
    agree    the number of sources with continuations through it, then the chance
    below    the chance plus the best chances summed down the node's subtree (most expected tokens)

and where the chosen chain parts from the best path, the two children's sources and support are counted.

    .venv/bin/python tools/chain_choice.py --suite humaneval --k 8
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def walk(tree, key, limit: int) -> list[int]:
    node, nodes = 0, []
    while len(nodes) < limit and tree.children[node]:
        node = max(tree.children[node].values(), key=lambda c: (key(c), -c))
        nodes.append(node)
    return nodes


def matched(tree, nodes: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(nodes) and n < len(truth) and int(tree.tokens[nodes[n]]) == truth[n]:
        n += 1
    return n


def best_path(tree, truth: list[int]) -> list[int]:
    node, nodes = 0, []
    while len(nodes) < len(truth) and truth[len(nodes)] in tree.children[node]:
        node = tree.children[node][truth[len(nodes)]]
        nodes.append(node)
    return nodes


def rules(tree, chance: np.ndarray) -> dict:
    below: dict[int, float] = {}

    def expected(c: int) -> float:
        if c not in below:
            below[c] = chance[c] + max((expected(g) for g in tree.children[c].values()), default=0.0)
        return below[c]

    agree = tree.agree if tree.agree is not None else np.ones(len(tree))
    return {"chance": lambda c: chance[c], "score": lambda c: tree.scores[c], "shares": lambda c: tree.shares[c],
            "agree": lambda c: (agree[c], chance[c]), "below": expected}


def compare(drafter, pairs, k: int, engine_ms: tuple[float, float], clock) -> dict:
    """Replay `pairs` (prompt ids, greedy output ids) one request at a time through `drafter` (its clock `clock`,
    a propose_cost.EngineClock); per lookup the next tokens each rule's chain matches, and where the drafter's
    chain parts from the best path."""
    import rest_core.serving.drafter as drafter_module

    seen = []
    chosen_by = drafter_module.best_chain

    def keep(tree, chooser, limit):  # the drafter's own choice, and the tree with its chances for the rules
        order, chance = chooser.ranked(tree)
        by_node = np.zeros(len(tree))
        by_node[order] = chance
        seen.append((tree, by_node))
        return chosen_by(tree, chooser, limit)

    plain, per_draft = engine_ms
    totals: collections.Counter = collections.Counter()
    parts: collections.Counter = collections.Counter()
    lookups = frequent = 0
    drafter_module.best_chain = keep
    try:
        for prompt, output in pairs:
            seq, done, new = list(prompt) + output[:1], 1, output[:1]
            while done < len(output):
                seen.clear()
                out = drafter.step(["r"], [new], [len(seq)], np.array([seq], dtype=np.int64))[0]
                clock.engine_s += (plain + per_draft * len(out)) / 1e3
                truth = output[done:done + k]
                if seen:
                    tree, chance = seen[-1]
                    lookups += 1
                    best = best_path(tree, truth)
                    totals["best path"] += len(best)
                    walked = {}
                    for name, key in rules(tree, chance).items():
                        walked[name] = walk(tree, key, k)
                        totals[name] += matched(tree, walked[name], truth)
                    depth = matched(tree, walked["chance"], truth)
                    if len(best) > depth:
                        c, b = walked["chance"][depth], best[depth]
                        parts[(tree.sources[c], tree.sources[b], depth)] += 1
                        frequent += int(tree.support[c] > tree.support[b])
                accepted = 0
                while accepted < len(out) and done + accepted < len(output) \
                        and out[accepted] == output[done + accepted]:
                    accepted += 1
                new = output[done:done + accepted + 1]
                seq += new
                done += len(new)
    finally:
        drafter_module.best_chain = chosen_by
    return {"lookups": lookups, "matched": dict(totals), "parts": parts, "more_support": frequent}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="humaneval", choices=("chat", "humaneval"))
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--step-cost", required=True, help="a step-cost file `rest-lab calibrate-vllm` wrote")
    ap.add_argument("--engine-ms", type=float, nargs=2, default=(53.9, 0.8), metavar=("PLAIN", "PER_DRAFT"))
    args = ap.parse_args(argv)
    os.environ["REST_LAB_STEP_COST"] = str(Path(args.step_cost).expanduser())
    import propose_cost

    from rest_core.machine import cpu_info, cpu_line
    from rest_core.model import converted_default_dir, load_tokenizer
    from rest_core.serving.config import open_drafter

    path = Path(f"bench_out/greedy-{args.suite}-{args.limit}-{args.max_new_tokens}.json")
    pairs = propose_cost.greedy_outputs(args.suite, args.limit, args.max_new_tokens, path)
    drafter = open_drafter(str(converted_default_dir()), load_tokenizer(None), args.k, 2048, "")
    drafter.warm_up()
    clock = propose_cost.EngineClock()
    drafter.clock = clock
    got = compare(drafter, pairs, args.k, tuple(args.engine_ms), clock)
    lookups = max(got["lookups"], 1)
    print(cpu_line(cpu_info()))
    print(f"{args.suite}, {len(pairs)} prompts, k = {args.k}: {got['lookups']} lookups; next tokens matched per "
          f"lookup:")
    for name, total in got["matched"].items():
        print(f"  {name:9s} {total / lookups:.3f}")
    parted = sum(got["parts"].values())
    print(f"the chosen chain parts from the best path in {parted} lookups (chosen source, right source, depth):")
    for (c, b, d), n in got["parts"].most_common(10):
        print(f"  {c:8s} {b:8s} depth {d}: {n}")
    print(f"  the chosen child had more support than the right one in {got['more_support']} of them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
