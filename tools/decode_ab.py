"""What the decoder's cache and attention kernel buy, side by side in one process.

Decodes the same prompt at several context lengths with plain decoding and with REST (the built-in store, the
cost model) in three set-ups, taking turns with the order rotating every round:

* "this decoder": the growing key/value cache (`rest_core.kv_cache`: entries written in place) and the
  attention kernel chosen on this machine per row count (`rest_core.attention`);
* "SDPA": the same cache, torch's SDPA attention for every pass;
* "before": transformers' concatenating `DynamicCache` and SDPA, as the decoder ran before either.

Reports ms per new token (prefill left out) per context length, method and set-up, each set-up's time over
"before" (median over rounds, min-max of the per-round ratios), and checks that all give the same tokens.
The prompt is the first N tokens of this repository's README (its content does not matter for the timing;
greedy, no end-of-sequence stop, so every decode runs the same number of steps).

Before the decodes, single passes over q tokens (a chain of draft nodes under its tree mask) after a prefix,
each set-up with its own cache: ms per set-up, each over "before", and this decoder's q-token pass over its
one-token pass of the same round (the pass-cost ratio the budget choice weighs; paired per round, so a slow
minute on the shared machine moves both).

    .venv/bin/python tools/decode_ab.py
    .venv/bin/python tools/decode_ab.py --context 64 1024 2048 --new-tokens 64 --rounds 3
    .venv/bin/python tools/decode_ab.py --context 64 --new-tokens 8 --rounds 1 --pass-rounds 40
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rest_core.decode as decode_mod
from datastores import open_default_store
from rest_core.cost import CostModel
from rest_core.decode import DecodeConfig, RestDecoder, plain_generate
from rest_core.kv_cache import new_cache
from rest_core.machine import cpu_info, cpu_line
from rest_core.model import load_model

SETUPS = {"this decoder": (new_cache, True), "SDPA": (new_cache, False),
          "before": (lambda model: DynamicCache(config=model.config), False)}  # (cache, native attention)


def prompt_of(tokenizer, length: int) -> list[int]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def run(lm, decoder: RestDecoder, method: str, setup: str, prompt: list[int], cfg: DecodeConfig):
    cache, native_attention = SETUPS[setup]
    decode_mod.new_cache = cache  # what the decoder's prefill builds
    if lm.attention is not None:
        lm.attention.enabled = native_attention
    try:
        res = decoder.generate(list(prompt), cfg) if method == "rest" else plain_generate(lm, list(prompt), cfg)
    finally:
        decode_mod.new_cache = new_cache
        if lm.attention is not None:
            lm.attention.enabled = True
    return (res.wall_s - res.prefill_s) / len(res.tokens) * 1e3, res.tokens


@torch.inference_mode()
def passes(lm, prefix_len: int, sizes: list[int], rounds: int) -> dict[str, dict[int, list[float]]]:
    """ms of one forward pass over q tokens after a prefix, per set-up and q: each set-up keeps its own cache
    (the prefix run once into each), every pass is cropped off again; per round every set-up runs every q, the
    set-ups' order rotating."""
    gen = torch.Generator().manual_seed(prefix_len)
    prefix = torch.randint(0, lm.vocab_size, (1, prefix_len), generator=gen)
    caches = {}
    for name, (make, _) in SETUPS.items():
        caches[name] = make(lm.model)
        lm.forward(input_ids=prefix, cache=caches[name], logits_to_keep=1)
    names = list(SETUPS)
    out: dict[str, dict[int, list[float]]] = {n: {q: [] for q in sizes} for n in names}
    for r in range(rounds + 1):  # the first round warms up
        for name in names[r % len(names):] + names[:r % len(names)]:
            if lm.attention is not None:
                lm.attention.enabled = SETUPS[name][1]
            for q in sizes:
                ids = torch.randint(0, lm.vocab_size, (1, q), generator=gen)
                pos = torch.arange(prefix_len, prefix_len + q)[None]
                mask = None
                if q > 1:  # a chain of q draft nodes: each sees the prefix and the nodes before it
                    mask = torch.zeros((1, 1, q, prefix_len + q))
                    mask[0, 0, :, prefix_len:] = torch.triu(torch.full((q, q), float("-inf")), 1)
                t0 = time.perf_counter()
                lm.forward(input_ids=ids, position_ids=pos, attention_mask=mask, cache=caches[name])
                ms = (time.perf_counter() - t0) * 1e3
                caches[name].crop(-q)
                if r:
                    out[name][q].append(ms)
    if lm.attention is not None:
        lm.attention.enabled = True
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, nargs="+", default=[64, 512, 1024, 2048])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", nargs="+", choices=("plain", "rest"), default=["plain", "rest"])
    ap.add_argument("--prefix", type=int, nargs="+", default=[256, 1024], help="prefix lengths of the timed passes")
    ap.add_argument("--q", type=int, nargs="+", default=[1, 8, 16], help="tokens per timed pass")
    ap.add_argument("--pass-rounds", type=int, default=15)
    args = ap.parse_args()
    lm = load_model()
    store = open_default_store(lm.tokenizer, progress=False)
    decoder = RestDecoder(lm, stores=[store], budget_chooser=CostModel.for_model(lm, stores=[store]))
    cfg = DecodeConfig(max_new_tokens=args.new_tokens, stop_at_eos=False)
    print(f"{cpu_line(cpu_info())}, torch threads {torch.get_num_threads()}; {args.new_tokens} new tokens, "
          f"{args.rounds} rounds, median ms per new token")
    print(f"Attention: {lm.attention.describe() if lm.attention else 'torch SDPA (no native kernel here)'}")
    run(lm, decoder, "plain", "before", prompt_of(lm.tokenizer, 32), DecodeConfig(max_new_tokens=8))  # warm-up
    names = list(SETUPS)
    print(f"\nOne forward pass over q tokens after a prefix, ms (median of {args.pass_rounds} rounds), and over "
          f"'before' (median of the per-round ratios, p25-p75)\n")
    print("| prefix | q | " + " | ".join(names) + " | " + " | ".join(f"{n} / before" for n in names[:-1])
          + " | this decoder: × its one-token pass |")
    print("|---|---|" + "---|" * (2 * len(names)))
    for prefix_len in args.prefix:
        timed = passes(lm, prefix_len, args.q, args.pass_rounds)
        for q in args.q:
            cells = []
            for n in names[:-1]:
                per = np.array(timed[n][q]) / np.array(timed["before"][q])
                cells.append(f"{np.median(per):.3f} ({np.percentile(per, 25):.3f}-{np.percentile(per, 75):.3f})")
            own = "–"
            if 1 in timed[names[0]] and q != 1:  # paired: over the same round's one-token pass
                per = np.array(timed[names[0]][q]) / np.array(timed[names[0]][1])
                own = f"{np.median(per):.3f} ({np.percentile(per, 25):.3f}-{np.percentile(per, 75):.3f})"
            print(f"| {prefix_len} | {q} | " + " | ".join(f"{np.median(timed[n][q]):.1f}" for n in names) + " | "
                  + " | ".join(cells) + f" | {own} |", flush=True)
    print(f"\nWhole decodes: ms per new token (median of {args.rounds} rounds), and over 'before' (median, min-max "
          f"of the per-round ratios)\n")
    print("| context | method | " + " | ".join(names) + " | " + " | ".join(f"{n} / before" for n in names[:-1]) + " |")
    print("|---|---|" + "---|" * (2 * len(names) - 1))
    for length in args.context:
        prompt = prompt_of(lm.tokenizer, length)
        for method in args.methods:
            times: dict[str, list[float]] = {n: [] for n in names}
            tokens = {}
            for r in range(args.rounds):
                for setup in names[r % len(names):] + names[:r % len(names)]:
                    ms, toks = run(lm, decoder, method, setup, prompt, cfg)
                    times[setup].append(ms)
                    if tokens.setdefault(setup, toks) != toks:
                        raise AssertionError(f"{method} at {length} tokens decoded differently in round {r + 1}")
            if any(t != tokens["before"] for t in tokens.values()):
                raise AssertionError(f"{method} at {length} tokens: the set-ups decoded different tokens")
            med = {n: statistics.median(times[n]) for n in names}
            ratios = []
            for n in names[:-1]:
                per_round = [a / b for a, b in zip(times[n], times["before"])]
                ratios.append(f"{med[n] / med['before']:.3f} ({min(per_round):.3f}-{max(per_round):.3f})")
            print(f"| {length} | {method} | " + " | ".join(f"{med[n]:.1f}" for n in names) + " | "
                  + " | ".join(ratios) + " |", flush=True)
    print("Same tokens in every set-up, at every context and with both methods.")


if __name__ == "__main__":
    main()
