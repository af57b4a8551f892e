"""How well the cost model ranks a step's candidate drafts, against other estimates of a node's chance, on the same
trees.

`record` decodes prompts with rest_full's stores and the cost model (as `tools/cut_ceiling.py` does) and keeps, per
step, the candidate tree the cost model was handed, what each source retrieved (per node: how many rows of each
source run through it, and each source's matched suffix length) and the answer's path through the tree.  `replay`
then runs an estimator of each node's chance of being accepted once its parent was over those steps in their order,
learning as the decoder would (only from the nodes it kept whose parent was accepted), ranks and cuts each tree with
the cost model's objective on the run's cost curve, and reports tokens per pass and speed on the curve.

The estimators: `cells` (the cost model's: per source, depth x support x ratio, corrected per request and per
number of agreeing sources; replayed here, it reproduces the decoder's choices from empty counts), and variants
that add one thing each, to see which information the ranking lacks.

    .venv/bin/python tools/rank_study.py record --suite chat --limit 16 --out /tmp/chat.pkl [--dense default]
    .venv/bin/python tools/rank_study.py replay /tmp/chat.pkl
"""
from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rest_core.cost import CANDIDATE_BUDGETS, MAX_CHANCE, CostModel


class _Recorder:
    """The decoder's cost model, with the last tree it was handed in a step kept (a step that searched a fallback
    store decided twice; the second tree is the one it kept)."""

    def __init__(self, chooser: CostModel):
        self._chooser = chooser
        self.last = None

    def decide(self, tree):
        self.last = tree
        return self._chooser.decide(tree)

    def __getattr__(self, name):
        return getattr(self._chooser, name)


def _children(tokens, parents) -> dict:
    out: dict = {}
    for node in range(1, len(tokens)):
        out.setdefault(int(parents[node]), {})[int(tokens[node])] = node
    return out


def _rows_per_source(tree, branches, names: list[str]) -> np.ndarray:
    """(n, S) how many retrieved rows of each source run through each node."""
    kids = _children(tree.tokens, tree.parents)
    out = np.zeros((len(tree.tokens), len(names)))
    for b in branches:
        s = names.index(b.source)
        node = 0
        for t in b.tokens:
            node = kids.get(node, {}).get(int(t), -1)
            if node < 0:
                break
            out[node, s] += b.count
    return out


def record(args) -> None:
    from rest_core.bench.methods import rest_full_stores
    from rest_core.bench.report import cpu_line
    from rest_core.bench.suites import BENCHMARK_CHAT_PROMPTS, load_suite
    from rest_core.decode import DecodeConfig, RestDecoder
    from rest_core.hidden import open_model_dense
    from rest_core.machine import cpu_info
    from rest_core.model import load_model
    from rest_core.tree import root_only

    lm = load_model()
    dense = open_model_dense(lm, args.dense)
    stores, kind = rest_full_stores(lm, args.suite, dense=dense)
    names = [s.source for s in stores]
    base = CostModel.for_model(lm, stores=stores, kind=kind)
    chooser = CostModel(times_ms=base.times_ms.copy(), labels=base.labels, kind=kind)  # counts from empty
    recorder = _Recorder(chooser)
    decoder = RestDecoder(lm, stores=stores, budget_chooser=recorder)
    suite = load_suite(args.suite, lm.tokenizer, limit=args.limit,
                       pick=BENCHMARK_CHAT_PROMPTS if args.suite == "chat" else None)
    steps, answers = [], []
    for index, prompt in enumerate(suite):
        chooser.begin_request()
        got = []

        def hook(trace, got=got):
            got.append((recorder.last, trace))

        out = decoder.generate(list(prompt.ids), DecodeConfig(max_new_tokens=args.max_new_tokens), hook=hook)
        answers.append(list(prompt.ids) + list(out.tokens))
        done = 0
        for tree, trace in got:
            answer = out.tokens[done:]
            if tree is None:
                tree = root_only(int((list(prompt.ids) + out.tokens[:done])[-1]))
            kids = _children(tree.tokens, tree.parents)
            path, node = [], 0
            for t in answer:
                node = kids.get(node, {}).get(int(t), -1)
                if node < 0:
                    break
                path.append(node)
            tree_arrays = {"tokens": tree.tokens, "parents": tree.parents, "depths": tree.depths,
                           "sources": list(tree.sources), "shares": tree.shares, "support": tree.support,
                           "agree": tree.agree, "rows": _rows_per_source(tree, trace.branches, names)}
            steps.append({"prompt": index, "at": len(prompt.ids) + done, "answer_next": int(answer[0]),
                          "tree": tree_arrays, "path": path,
                          "kept": trace.draft_size,
                          "accepted": len(trace.accepted_nodes) - 1,
                          "matched": {k: int(v) for k, v in trace.matched_len.items()}})
            done += len(trace.new_tokens)
            recorder.last = None
    ms = chooser.forward_ms(np.arange(1, 65))
    with open(args.out, "wb") as f:
        pickle.dump({"steps": steps, "answers": answers, "names": names, "forward_ms": ms, "cpu": cpu_line(cpu_info()),
                     "suite": args.suite, "dense": args.dense}, f)
    print(f"{len(steps)} steps -> {args.out}; recorded {sum(1 + s['accepted'] for s in steps) / len(steps):.3f} "
          "tokens per pass")


# -- estimators ----------------------------------------------------------------------------------------------------

class Cells:
    """The cost model's estimate, learned from empty counts: a CostModel fed DraftTrees."""

    def __init__(self, agreement: bool = True):
        self.model = CostModel(times_ms=np.ones(16), use_agreement=agreement)

    def start(self, prompt: int) -> None:
        self.model.begin_request()

    def chances(self, step) -> np.ndarray:
        return self.model.conditional(step["_tree"])

    def learn(self, step, kept: np.ndarray, accepted: list[int]) -> None:
        from rest_core.tree import keep_nodes
        cut = keep_nodes(step["_tree"], kept)
        index = {int(n): i + 1 for i, n in enumerate(np.sort(kept))}
        self.model.observe(cut, [index[n] for n in accepted], None)


class Siblings(Cells):
    """The cells' estimate with each node's siblings' chances scaled together so they sum to at most `mass`: only
    one child of a node can be the model's next token."""

    def __init__(self, mass: float = 0.95):
        super().__init__()
        self.mass = mass

    def chances(self, step) -> np.ndarray:
        cond = super().chances(step).copy()
        parents = step["tree"]["parents"][1:]
        total = np.bincount(parents, weights=cond, minlength=parents.size + 1)
        scale = np.where(total > self.mass, self.mass / np.maximum(total, 1e-12), 1.0)
        return cond * scale[parents]


class Knowing:
    """Someone who knows the answer: a node on the answer's path is certain, any other hopeless."""

    def start(self, prompt: int) -> None:
        pass

    def chances(self, step) -> np.ndarray:
        n = len(step["tree"]["tokens"]) - 1
        cond = np.zeros(n)
        cond[np.array(step["path"], dtype=int) - 1] = MAX_CHANCE
        return cond

    def learn(self, step, kept, accepted) -> None:
        pass


def with_forecast(steps: list[dict], forecast: dict, rows: int = 16) -> list[dict]:
    """The steps with a forecast's first tokens among the candidates, as a source "forecast" would draft them: one
    depth-1 node per token (where a candidate already starts with it, that node counts one source more), its share
    the forecast's probability, `rows` rows per unit of it."""
    out = []
    for step in steps:
        got = forecast.get((step["prompt"], step["at"]))
        t = step["tree"]
        if got is None:
            out.append(step)
            continue
        tokens, parents, depths = list(t["tokens"]), list(t["parents"]), list(t["depths"])
        sources, shares, support = list(t["sources"]), list(t["shares"]), list(t["support"])
        agree = list(t["agree"]) if t["agree"] is not None else [1] * len(tokens)
        first = {int(tokens[n]): n for n in range(1, len(tokens)) if parents[n] == 0}
        path = list(step["path"])
        names_rows = t["rows"]
        extra = 0
        for token, p in zip(*got):
            if token in first:
                agree[first[token]] += 1
                continue
            tokens.append(token)
            parents.append(0)
            depths.append(1)
            sources.append("forecast")
            shares.append(p)
            support.append(max(1.0, round(p * rows)))
            agree.append(1)
            extra += 1
            if not path and step["answer_next"] == token:
                path = [len(tokens) - 1]
        tree = {"tokens": np.array(tokens), "parents": np.array(parents), "depths": np.array(depths),
                "sources": sources, "shares": np.array(shares, dtype=float), "support": np.array(support, dtype=float),
                "agree": np.array(agree), "rows": np.vstack([names_rows, np.zeros((extra, names_rows.shape[1]))])}
        out.append({**step, "tree": tree, "path": path})
    return out


def _tree_of(t):
    from rest_core.tree import DraftTree
    return DraftTree(np.asarray(t["tokens"]), np.asarray(t["parents"]), np.asarray(t["depths"]),
                     np.zeros(len(t["tokens"])), list(t["sources"]), np.asarray(t["shares"]),
                     np.asarray(t["support"]), None if t["agree"] is None else np.asarray(t["agree"]))


class Stacked:
    """The cells' estimate as one feature of an online logistic regression with more features of the node (`feats`
    names them: "mask" which sources hold it, "matched" its dominant source's matched length, "share" each
    source's share of its rows, "depth")."""

    def __init__(self, names: list[str], feats: Sequence[str], lr: float = 0.05, l2: float = 1e-4):
        self.cells = Cells()
        self.names, self.feats, self.lr, self.l2 = names, set(feats), lr, l2
        self.w = None

    def start(self, prompt: int) -> None:
        self.cells.start(prompt)

    def _x(self, step, base: np.ndarray) -> np.ndarray:
        t = step["tree"]
        n = len(t["tokens"]) - 1
        p = np.clip(base, 1e-4, 1 - 1e-4)
        cols = [np.ones(n), np.log(p / (1 - p))]
        rows = t["rows"][1:]  # (n, S)
        src = np.array([self.names.index(s) for s in t["sources"][1:]])
        if "mask" in self.feats:
            held = (rows > 0).astype(float)
            cols += [held[:, s] for s in range(len(self.names))]
            # the dominant source crossed with each other holder
            for s in range(len(self.names)):
                cols.append(held[:, s] * (src != s))
        if "matched" in self.feats:
            m = np.array([step["matched"].get(self.names[s], 0) for s in src], dtype=float)
            for s in range(len(self.names)):
                cols.append(np.log1p(m) * (src == s))
        if "share" in self.feats:
            full = t["rows"].copy()
            full[0] = _root_rows(t)[0]
            prow = full[t["parents"][1:]]  # (n, S) each source's rows through the parent
            ratio = np.where(prow > 0, rows / np.maximum(prow, 1e-9), 0.0)
            cols += [ratio[:, s] for s in range(len(self.names))]
        if "depth" in self.feats:
            d = np.minimum(t["depths"][1:], 6)
            cols += [(d == k).astype(float) for k in range(2, 7)]
        return np.stack(cols, axis=1)

    def chances(self, step) -> np.ndarray:
        base = self.cells.chances(step)
        x = self._x(step, base)
        if self.w is None:
            self.w = np.zeros(x.shape[1])
            self.w[1] = 1.0  # start as the cells' estimate
        step["_x"] = x
        return np.minimum(1 / (1 + np.exp(-(x @ self.w))), MAX_CHANCE)

    def learn(self, step, kept: np.ndarray, accepted: list[int]) -> None:
        self.cells.learn(step, kept, accepted)
        t = step["tree"]
        taken = set(accepted) | {0}
        tested = [n for n in kept if int(t["parents"][n]) in taken]
        if not tested:
            return
        x = step["_x"][np.array(tested) - 1]
        y = np.array([1.0 if n in taken else 0.0 for n in tested])
        p = 1 / (1 + np.exp(-(x @ self.w)))
        self.w -= self.lr * ((p - y) @ x / max(len(tested), 1) * min(len(tested), 8) + self.l2 * self.w)


def _root_rows(t) -> np.ndarray:
    """(1, S) each source's rows at the root (the rows through its depth-1 nodes)."""
    first = t["depths"] == 1
    return t["rows"][first].sum(axis=0, keepdims=True)


def _rank(parents: np.ndarray, depths: np.ndarray, cond: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = cond.size
    prod = cond.astype(float).copy()
    for i, p in enumerate(parents[1:].tolist()):
        if p > 0:
            prod[i] *= prod[p - 1]
    order = np.lexsort((np.arange(n), depths[1:], -prod))
    return order + 1, prod[order]


def replay(steps: list[dict], est, ms: np.ndarray) -> dict:
    """Tokens per pass and speed on the curve of one estimator over the recorded steps, in order."""
    forward = lambda q: np.interp(q, np.arange(1, ms.size + 1), ms)
    tokens = total_ms = 0.0
    first = held = 0
    prompt = None
    for step in steps:
        if step["prompt"] != prompt:
            prompt = step["prompt"]
            est.start(prompt)
        t = step["tree"]
        if t is None or len(t["tokens"]) == 1:
            tokens += 1
            total_ms += forward(1)
            continue
        step["_tree"] = step.get("_tree") or _tree_of(t)
        cond = est.chances(step)
        order, chance = _rank(t["parents"], t["depths"], cond)
        budgets = CANDIDATE_BUDGETS[CANDIDATE_BUDGETS <= chance.size]
        gain = np.concatenate([[0.0], np.cumsum(chance)])
        b = int(budgets[int(((1 + gain[budgets]) / forward(budgets + 1)).argmax())])
        kept = order[:b]
        keptset = set(kept.tolist())
        accepted = []
        for node in step["path"]:
            if node not in keptset:
                break
            accepted.append(node)
        if step["path"]:
            held += 1
            first += int(order[0] == step["path"][0])
        tokens += 1 + len(accepted)
        total_ms += forward(b + 1)
        est.learn(step, kept, accepted)
    return {"tokens_per_pass": tokens / len(steps), "speed": tokens / total_ms * forward(1),
            "first": first / max(held, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--suite", choices=("chat", "humaneval"), default="chat")
    r.add_argument("--limit", type=int, default=16)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--dense", default="none")
    r.add_argument("--out", required=True)
    p = sub.add_parser("replay")
    p.add_argument("file")
    p.add_argument("--warm", action="store_true", help="learn over the steps once before the measured pass")
    p.add_argument("--forecast", default=None, metavar="FILE",
                   help="add a `tools/state_forecast.py --save` forecast's first 8 tokens to every step's candidates")
    args = ap.parse_args()
    if args.cmd == "record":
        record(args)
        return
    with open(args.file, "rb") as f:
        data = pickle.load(f)
    steps, names, ms = data["steps"], data["names"], np.asarray(data["forward_ms"])
    print(data["cpu"])
    if args.forecast:
        with open(args.forecast, "rb") as f:
            steps = with_forecast(steps, pickle.load(f))
        print("with the forecast's first 8 tokens among the candidates; uncovered "
              f"{np.mean([not s['path'] for s in steps]):.1%}")
    print(f"{len(steps)} steps; recorded {sum(1 + s['accepted'] for s in steps) / len(steps):.3f} tokens per pass")
    variants = {
        "cells": lambda: Cells(),
        "cells, siblings <= 0.95": lambda: Siblings(0.95),
        "knowing the answer": lambda: Knowing(),
    } if args.forecast else {
        "cells": lambda: Cells(),
        "cells, no agreement": lambda: Cells(agreement=False),
        "stacked": lambda: Stacked(names, ()),
        "stacked + mask": lambda: Stacked(names, ("mask",)),
        "stacked + matched": lambda: Stacked(names, ("matched",)),
        "stacked + share": lambda: Stacked(names, ("share",)),
        "stacked + depth": lambda: Stacked(names, ("depth",)),
        "stacked + all": lambda: Stacked(names, ("mask", "matched", "share", "depth")),
        "cells, siblings <= 0.95": lambda: Siblings(0.95),
        "cells, siblings <= 0.8": lambda: Siblings(0.8),
        "knowing the answer": lambda: Knowing(),
    }
    for label, make in variants.items():
        est = make()
        if args.warm:
            replay(steps, est, ms)
        got = replay(steps, est, ms)
        print(f"{label:24s} {got['tokens_per_pass']:.3f} tokens/pass  {got['speed']:.3f}x on the curve  "
              f"first {got['first']:.0%}")


if __name__ == "__main__":
    main()
