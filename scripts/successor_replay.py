"""How well do the model's own earlier predictions foretell its next token, per token, pair and triple?

Decodes prompts greedily with the model alone, keeping its top 8 next tokens at every new
position, then replays each answer in order with successor tables that learn as the
model source's do (after every position, the model's top 8 there) but never lose a key to a
hash collision, and reports:

* per rank r, how often the rank-r successor kept after the same two tokens was the next
  token (where that pair had been seen), and how often the one kept after the token alone was
  (where only the token had been seen) -- the figures datastores/recycle.py's PAIR_PRIOR and
  TOKEN_PRIOR come from;
* the same with a table of triples tried first: after the same three tokens, and after the same
  two where the three had not been seen (what a third table would add; measured and left out,
  docs/bench/model-source-pairs.md);
* new tokens per step if every step drafted one chain of rank-0 successors (up to 8 deep), looked
  up after keys of up to one, two or three tokens: an upper view of what each longer key adds,
  verification free.

    .venv/bin/python scripts/successor_replay.py --prompts answers --limit 40   # the priors' own data
    .venv/bin/python scripts/successor_replay.py --prompts chat
    .venv/bin/python scripts/successor_replay.py --prompts humaneval --limit 16

`answers` are the general-text store's requests (datastores/answer_prompts.py, shuffled with seed 0),
the other two are the benchmark's suites.  The tables persist across prompts, as in a benchmark round.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datastores.answer_prompts import answer_prompts
from rest_core.bench.suites import load_suite
from rest_core.decode import prefill
from rest_core.model import encode_prompt, load_model
from rest_core.sampling import greedy_choices, top_successors

TOP = 8
CHAIN = 8


@torch.inference_mode()
def greedy_with_tops(lm, ids: list[int], max_new: int) -> tuple[list[int], list[list[int]]]:
    """The model's greedy answer and its top TOP tokens at every new position."""
    cache = prefill(lm, ids)
    last, tokens, tops = ids[-1], [], []
    for _ in range(max_new):
        logits = lm.forward(input_ids=torch.tensor([[last]], device=lm.device), cache=cache).logits[0, -1:]
        top = top_successors(logits, TOP)[0].tolist()  # what the model source would learn here
        last = greedy_choices(logits)[0]  # what plain greedy decoding emits
        tokens.append(last)
        tops.append(top)
        if last in lm.eos_token_ids:
            break
    return tokens, tops


class KeyedTables:
    """What was recorded after the newest n tokens, for every n up to `longest` (dicts: no key is ever lost)."""

    def __init__(self, longest: int):
        self.by_len: list[dict[tuple[int, ...], object]] = [{} for _ in range(longest)]  # [n - 1]: keys of n

    def find(self, ctx: list[int]) -> tuple[object, int]:
        """What was recorded after the longest key seen, and that key's length (None, 0 when none was)."""
        for n in range(len(self.by_len), 0, -1):
            if len(ctx) >= n and (found := self.by_len[n - 1].get(tuple(ctx[-n:]))) is not None:
                return found, n
        return None, 0

    def learn(self, ctx: list[int], value: object) -> None:
        for n in range(1, min(len(self.by_len), len(ctx)) + 1):
            self.by_len[n - 1][tuple(ctx[-n:])] = value


# per replay: the longest key, and what each key length's hits are reported as
REPLAYS = ((2, {2: "pair", 1: "token"}),  # as the model source looks up: the pair when seen, else the token
           (3, {3: "triple", 2: "pair, no triple"}))  # with a table of triples tried first


def replay(decodes: list[tuple[list[int], list[int], list[list[int]]]]) -> dict:
    """Rank hit rates per kind of lookup, and tokens per step of one rank-0 chain per step."""
    out = {}
    for longest, names in REPLAYS:
        tables = KeyedTables(longest)
        hits = {n: np.zeros(TOP + 1) for n in names}
        for prompt, tokens, tops in decodes:
            ctx = list(prompt)
            for tok, top in zip(tokens, tops):
                row, n = tables.find(ctx)
                if n in hits:
                    hits[n][row.index(tok) if tok in row else TOP] += 1
                tables.learn(ctx, top)
                ctx.append(tok)
        for n, name in names.items():
            out[name] = (hits[n][:TOP] / max(hits[n].sum(), 1)).round(3).tolist() + [int(hits[n].sum())]
    for longest in (1, 2, 3):
        out[f"chain tokens/step, keys up to {longest}"] = _chains(decodes, longest)
    return out


def _chains(decodes, longest: int) -> float:
    """New tokens per step when each step drafts one chain of rank-0 successors, each looked up after the
    longest key (up to `longest` tokens) seen."""
    tables = KeyedTables(longest)
    steps = new = 0
    for prompt, tokens, tops in decodes:
        ctx, i = list(prompt), 0
        while i < len(tokens):
            chain, accepted = list(ctx), 0
            while accepted < CHAIN and i + accepted < len(tokens):
                guess, _ = tables.find(chain)
                if guess != tokens[i + accepted]:
                    break
                chain.append(guess)
                accepted += 1
            take = min(accepted + 1, len(tokens) - i)
            for j in range(i, i + take):  # the step commits these: the model's choice after each is learned
                tables.learn(ctx, tops[j][0])
                ctx.append(tokens[j])
            i += take
            steps += 1
            new += take
    return round(new / max(steps, 1), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", choices=("answers", "chat", "humaneval"), default="answers")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    lm = load_model(args.model)
    if args.prompts == "answers":
        texts = answer_prompts()
        random.Random(0).shuffle(texts)
        prompts = [encode_prompt(lm.tokenizer, t, chat=True) for t in texts[:args.limit]]
    else:
        prompts = [list(p.ids) for p in load_suite(args.prompts, lm.tokenizer, limit=args.limit)]
    decodes = []
    for n, ids in enumerate(prompts, 1):
        decodes.append((ids, *greedy_with_tops(lm, ids, args.max_new_tokens)))
        print(f"\rdecoded {n}/{len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    result = replay(decodes)
    for kind in ("pair", "token", "triple", "pair, no triple"):
        rates, seen = result[kind][:TOP], result[kind][TOP]
        print(f"rank hit rate after the same {kind} ({seen} positions): " + " ".join(f"{r:.3f}" for r in rates))
    for key in (k for k in result if k.startswith("chain")):
        print(f"{key}: {result[key]}")


if __name__ == "__main__":
    main()
