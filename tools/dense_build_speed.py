"""How fast the model reads a dense store's documents, one per pass against several in padded passes, and how far
the batched states are from the ones a pass over each document alone gives.

    python tools/dense_build_speed.py [--docs 64] [--batch-tokens 512 1024 2048 4096]

The documents are every n-th of the built-in general-text store's answers (as `datastore dense default` reads
them), so the sample spans their lengths; the layer is the built-in dense store's (`dense_layer`).
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from datastores.answers import answer_documents, answers_store_path, read_kept_answers
from rest_core.hidden import dense_layer, length_batches, sequence_states
from rest_core.model import load_model


def timed_states(model, docs, layer, batch_tokens):
    t0 = time.perf_counter()
    states = sequence_states(model, docs, layer, batch_tokens=batch_tokens)
    return states, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=64, help="documents in the sample (0: all of them)")
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    args = ap.parse_args(argv)
    lm = load_model()
    layer = dense_layer(lm.model)
    docs = [ids for ids, _ in answer_documents(lm.tokenizer, read_kept_answers(answers_store_path(lm.name,
                                                                                                  lm.tokenizer)))]
    if args.docs:
        docs = docs[::max(1, len(docs) // args.docs)][:args.docs]
    tokens = sum(len(d) for d in docs)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; {len(docs)} documents, {tokens:,} tokens, layer {layer}")
    alone, seconds = timed_states(lm.model, docs, layer, batch_tokens=1)  # 1: every document in a pass of its own
    print("| batch tokens | passes | seconds | tokens / s | × one per pass | largest difference (relative) |")
    print("|---|---|---|---|---|---|")
    print(f"| one document per pass | {len(docs)} | {seconds:.1f} | {tokens / seconds:,.0f} | 1.00 | – |")
    for batch_tokens in args.batch_tokens:
        passes = len(length_batches([len(d) for d in docs], batch_tokens))
        got, took = timed_states(lm.model, docs, layer, batch_tokens)
        worst = max(float(np.abs(g - a).max() / (np.abs(a).max() + 1e-12)) for g, a in zip(got, alone))
        print(f"| {batch_tokens} | {passes} | {took:.1f} | {tokens / took:,.0f} | {seconds / took:.2f} | "
              f"{worst:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
