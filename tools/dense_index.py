"""The dense store's search index against the exact search, side by side in one process, on the states decoding
asks with.

Decodes the suite's prompts greedily (plain loop), reads each prompt + answer once more at the store's layer and
keeps, per answer token, the state that predicted it -- the state the decoder hands the store after each step.
Each state, reduced as the store reduces it, is searched for the store's `keep` nearest positions by the store's
own index (`datastores.dense.search_index`: an inverted file above `EXACT_UP_TO` positions) and by an exact flat
search over the same keys, one query at a time on one faiss thread, as a step searches.  Reports the median and
p99 time of each, the share of the exact nearest the index found (recall), and the time of the store's whole
`neighbours` call (reduce, search, map to stream positions) with each index.

    .venv/bin/python tools/dense_index.py --suite chat --limit 4
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datastores.dense import reduce_states
from rest_core.bench.suites import load_suite
from rest_core.decode import DecodeConfig, plain_generate
from rest_core.hidden import open_model_dense, sequence_states
from rest_core.machine import cpu_info, cpu_line
from rest_core.model import load_model


def decode_states(lm, store, prompts, max_new_tokens: int) -> np.ndarray:
    """(n, d) the states that predicted each answer token of the prompts' greedy answers, at the store's layer."""
    out = []
    for ids in prompts:
        answer = plain_generate(lm, ids, DecodeConfig(max_new_tokens=max_new_tokens)).tokens
        seq = list(ids) + answer
        states = sequence_states(lm.model, [seq], store.state_layer, lm.device)[0]  # (len, d)
        out.append(states[len(ids) - 1:len(seq) - 1])  # position i predicted token i + 1
    return np.concatenate(out)


def _timed(fn, queries) -> tuple[list, np.ndarray]:
    """fn(query) per query, one at a time: the answers and each call's milliseconds."""
    got, ms = [], []
    for q in queries:
        t0 = time.perf_counter()
        got.append(fn(q))
        ms.append((time.perf_counter() - t0) * 1e3)
    return got, np.array(ms)


def measure(store, states: np.ndarray) -> dict:
    """The store's index against an exact flat search over its keys for these (n, d) states: median / p99 ms of
    a search and of `neighbours`, and the recall of the exact `keep` nearest."""
    import faiss

    keys = np.fromfile(store.path / "keys.f16", dtype="<f2").astype(np.float32).reshape(store.tokens.size, -1)
    exact = faiss.IndexFlatIP(keys.shape[1])
    exact.add(np.ascontiguousarray(keys[store.positions]))
    queries = reduce_states(states, store.mean, store.axes)[:, None, :]  # (n, 1, dim): one search each
    k = store.keep
    was = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        (want, exact_ms), (got, index_ms) = (_timed(lambda q, ix=ix: ix.search(q, k)[1][0], queries)
                                             for ix in (exact, store.index))
    finally:
        faiss.omp_set_num_threads(was)
    recall = float(np.mean([len(set(a.tolist()) & set(b.tolist())) / max(len(b), 1) for a, b in zip(got, want)]))
    own = store.index
    _, own_ms = _timed(lambda s: store.neighbours(s, -1), states)
    store.index = exact
    try:
        _, flat_ms = _timed(lambda s: store.neighbours(s, -1), states)
    finally:
        store.index = own

    def p(ms: np.ndarray) -> tuple[float, float]:
        return round(float(np.median(ms)), 4), round(float(np.percentile(ms, 99)), 4)

    return {"index": type(own).__name__, "lists": int(getattr(own, "nlist", 0)),
            "probes": int(getattr(own, "nprobe", 0)), "positions": int(store.positions.size),
            "queries": int(states.shape[0]), "keep": k, "recall": recall,
            "exact_ms": p(exact_ms), "index_ms": p(index_ms), "neighbours_exact_ms": p(flat_ms),
            "neighbours_index_ms": p(own_ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=("chat", "humaneval"), default="chat")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    lm = load_model()
    store = open_model_dense(lm, "default", build=False)
    prompts = [p.ids for p in load_suite(args.suite, lm.tokenizer, limit=args.limit)]
    states = decode_states(lm, store, prompts, args.max_new_tokens)
    print(cpu_line(cpu_info()))
    for key, value in measure(store, states).items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
