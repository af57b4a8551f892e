"""How well do the model's own earlier predictions foretell its next token, per token and per pair?

Decodes prompts greedily with the model alone, keeping its top 8 next tokens at every new
position, then replays each answer in order with successor tables that learn as the
model source's do (after every position, the model's top 8 there) but never lose a pair to a
hash collision, and reports:

* per rank r, how often the rank-r successor kept after the same two tokens was the next
  token (where that pair had been seen), and how often the one kept after the token alone was
  (where only the token had been seen) -- the figures datastores/recycle.py's PAIR_PRIOR and
  TOKEN_PRIOR come from;
* new tokens per step if every step drafted one chain of rank-0 successors (up to 8 deep), looked
  up per token only or per pair first: an upper view of what the pair table adds, verification free.

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

TOP = 8
CHAIN = 8


@torch.inference_mode()
def greedy_with_tops(lm, ids: list[int], max_new: int) -> tuple[list[int], list[list[int]]]:
    """The model's greedy answer and its top TOP tokens at every new position."""
    cache = prefill(lm, ids)
    last, tokens, tops = ids[-1], [], []
    for _ in range(max_new):
        logits = lm.forward(input_ids=torch.tensor([[last]], device=lm.device), cache=cache).logits[0, -1]
        top = logits.topk(TOP).indices.tolist()
        last = top[0]
        tokens.append(last)
        tops.append(top)
        if last in lm.eos_token_ids:
            break
    return tokens, tops


def replay(decodes: list[tuple[list[int], list[int], list[list[int]]]]) -> dict:
    """Rank hit rates per kind of lookup, and tokens per step of one rank-0 chain per step."""
    by_token: dict[int, list[int]] = {}
    by_pair: dict[tuple[int, int], list[int]] = {}
    hits = {"pair": np.zeros(TOP + 1), "token": np.zeros(TOP + 1)}
    for prompt, tokens, tops in decodes:
        ctx = list(prompt)
        for tok, top in zip(tokens, tops):
            pair = (ctx[-2], ctx[-1]) if len(ctx) > 1 else None
            row, kind = (by_pair[pair], "pair") if pair in by_pair else (by_token.get(ctx[-1]), "token")
            if row is not None:
                hits[kind][row.index(tok) if tok in row else TOP] += 1
            by_token[ctx[-1]] = top
            if pair is not None:
                by_pair[pair] = top
            ctx.append(tok)
    out = {kind: (h[:TOP] / max(h.sum(), 1)).round(3).tolist() + [int(h.sum())] for kind, h in hits.items()}
    out["chain tokens/step, per token"] = _chains(decodes, pairs=False)
    out["chain tokens/step, pair first"] = _chains(decodes, pairs=True)
    return out


def _chains(decodes, pairs: bool) -> float:
    by_token: dict[int, int] = {}
    by_pair: dict[tuple[int, int], int] = {}
    steps = new = 0
    for prompt, tokens, tops in decodes:
        ctx, i = list(prompt), 0
        while i < len(tokens):
            chain, accepted = list(ctx), 0
            while accepted < CHAIN and i + accepted < len(tokens):
                key = (chain[-2], chain[-1]) if len(chain) > 1 else None
                guess = by_pair[key] if pairs and key in by_pair else by_token.get(chain[-1])
                if guess != tokens[i + accepted]:
                    break
                chain.append(guess)
                accepted += 1
            take = min(accepted + 1, len(tokens) - i)
            for j in range(i, i + take):  # the step commits these: the model's choice after each is learned
                by_token[ctx[-1]] = tops[j][0]
                if len(ctx) > 1:
                    by_pair[(ctx[-2], ctx[-1])] = tops[j][0]
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
    for kind in ("pair", "token"):
        rates, seen = result[kind][:TOP], result[kind][TOP]
        print(f"rank hit rate after the same {kind} ({seen} positions): " + " ".join(f"{r:.3f}" for r in rates))
    for key in ("chain tokens/step, per token", "chain tokens/step, pair first"):
        print(f"{key}: {result[key]}")


if __name__ == "__main__":
    main()
