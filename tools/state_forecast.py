"""How often a linear forecast of the model's next state would hold the token after the last committed one.

The draft's first token follows the step's root, the token the model committed last; the state the model computed
there comes only with the next pass.  What the decoder has is the state one position earlier (the one that chose
the root) and the root's token.  This fits, in closed form (ridge regression) over the general-text answers, a map
from (that state, the root's embedding) to the final normalised state at the root, reads the model's own output
layer on it, and counts how often the answer's next token is its first or among its first 8.  Given a
`tools/rank_study.py` recording, it also counts that on the steps the recorded candidate trees did not cover.

    .venv/bin/python tools/state_forecast.py --steps /tmp/chat.pkl
"""
from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def final_states(model, docs: list[list[int]]) -> list[np.ndarray]:
    """(len, d) the final normalised state (what the output layer reads) at every position of each document."""
    kept = {}
    hook = model.model.norm.register_forward_hook(lambda module, args, out: kept.__setitem__("rows", out.detach()))
    try:
        out = []
        for doc in docs:
            model.model(input_ids=torch.tensor([doc]), use_cache=False)
            out.append(kept["rows"][0].float().numpy())
    finally:
        hook.remove()
    return out


def features(states: np.ndarray, doc: np.ndarray, embed: np.ndarray) -> np.ndarray:
    """(len - 2, 2d + 1) per position c - 1 >= 1: the state at c - 2, the embedding of token c - 1, a constant."""
    return np.concatenate([states[:-2], embed[doc[1:-1]], np.ones((len(doc) - 2, 1), np.float32)], axis=1)


def main() -> None:
    from datastores.answers import answer_documents, read_kept_answers
    from datastores.builtin import answers_store_path
    from rest_core.bench.report import cpu_line
    from rest_core.machine import cpu_info
    from rest_core.model import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", required=True, help="a tools/rank_study.py recording (its answers are the test set)")
    ap.add_argument("--ridge", type=float, default=1.0)
    ap.add_argument("--save", default=None, metavar="FILE",
                    help="keep each recorded step's forecast (its first 8 tokens and their probabilities) for "
                         "`tools/rank_study.py replay --forecast FILE`")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    lm = load_model()
    model = lm.model
    with open(args.steps, "rb") as f:
        data = pickle.load(f)
    docs = [d for d, _ in answer_documents(lm.tokenizer, read_kept_answers(answers_store_path(lm.name, lm.tokenizer)))]
    started = time.perf_counter()
    train = final_states(model, docs)
    embed = model.get_input_embeddings().weight.detach().float().numpy()
    out_w = model.lm_head.weight.detach().float().numpy()
    x = np.concatenate([features(s, np.array(d), embed) for s, d in zip(train, docs) if len(d) > 2])
    y = np.concatenate([s[1:-1] for s, d in zip(train, docs) if len(d) > 2])
    fit = np.linalg.solve(x.T @ x + args.ridge * np.eye(x.shape[1]), x.T @ y)
    print(cpu_line(cpu_info()))
    print(f"fitted on {len(docs)} answers, {x.shape[0]:,} positions, in {time.perf_counter() - started:.0f} s")
    answers = data["answers"]
    tests = final_states(model, answers)
    top: dict[tuple[int, int], tuple[int, bool, bool]] = {}  # (prompt, context length) -> (next, first, in 8)
    kept: dict[tuple[int, int], tuple[list[int], list[float]]] = {}  # ... -> the first 8 tokens, their probabilities
    for index, (doc, states) in enumerate(zip(answers, tests)):
        doc = np.array(doc)
        logits = features(states, doc, embed) @ fit @ out_w.T  # row c - 2 forecasts token c
        best = np.argpartition(-logits, 8, axis=1)[:, :8]
        first = best[np.arange(len(best)), np.argmax(np.take_along_axis(logits, best, 1), axis=1)]
        shifted = logits - logits.max(axis=1, keepdims=True)
        probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
        for c in range(2, len(doc)):
            top[(index, c)] = (int(doc[c]), bool(first[c - 2] == doc[c]), bool((best[c - 2] == doc[c]).any()))
            order = best[c - 2][np.argsort(-probs[c - 2, best[c - 2]])]
            kept[(index, c)] = (order.tolist(), probs[c - 2, order].tolist())
    steps = [s for s in data["steps"] if (s["prompt"], s["at"]) in top]
    for label, chosen in (("every step", steps), ("steps no candidate covered", [s for s in steps if not s["path"]]),
                          ("steps the candidates covered", [s for s in steps if s["path"]])):
        if chosen:
            got = np.array([top[(s["prompt"], s["at"])][1:] for s in chosen])
            print(f"{label}: {len(chosen)}; the forecast's first token {got[:, 0].mean():.1%}, "
                  f"among its first 8 {got[:, 1].mean():.1%}")
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump(kept, f)
    uncovered = np.mean([not s["path"] for s in steps])
    rescued = np.mean([not s["path"] and top[(s["prompt"], s["at"])][2] for s in steps])
    print(f"uncovered {uncovered:.1%} of steps; with the forecast's first 8 beside the candidates "
          f"{uncovered - rescued:.1%}")


if __name__ == "__main__":
    main()
