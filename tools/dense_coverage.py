"""How much of what the text sources miss a dense store's nearest neighbours would draft, by layer, PCA size,
k and corpus -- measured before the dense source's defaults are chosen.

1. Decodes the suite with rest_full's stores and the cost model (scripts/cut_ceiling.py's recording), so every
   step's candidate tree and the model's next token are known: a step is *uncovered* when no candidate of any
   source is the model's next token.
2. Runs the model once over every prompt + answer and over every corpus document (a corpus document is read with
   the request before it, as the model read it, where the corpus has one), keeping the hidden state at each layer
   asked for (`--layers`, transformers' numbering: 30 is the final norm's output of the default model).
3. For each layer and PCA size (`--dims`, 0 = no PCA), exact inner-product search (centred, PCA, L2-normalised)
   of the state that predicted the newest context token among the corpus positions; a neighbour at corpus
   position p drafts the tokens after p + 1.  `filtered`: only neighbours whose next token is the newest context
   token (what the model's state at p predicted is what the context holds), the first k of the 64 nearest;
   `nearest`: the k nearest whatever their next token.

Reports per setting the share of uncovered steps whose next token some neighbour drafts, the share of all steps,
and the accepted-path bound with the dense drafts added (per step 1 + the longest answer prefix any candidate
of any source holds), beside the same bound without them.

    .venv/bin/python tools/dense_coverage.py --suite chat --limit 16
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cut_ceiling import record

from datastores.answer_prompts import answer_prompts
from datastores.answers import answer_documents, answers_store_path, read_kept_answers
from datastores.common import SEP
from datastores.sources import iter_python_sources, stdlib_root
from rest_core.bench.methods import rest_full_stores
from rest_core.bench.suites import BENCHMARK_CHAT_PROMPTS, chat_prompts, load_suite
from rest_core.cost import CostModel
from rest_core.decode import DecodeConfig, RestDecoder
from rest_core.machine import cpu_info, cpu_line
from rest_core.model import load_model

POOL = 64  # neighbours searched per step; `filtered` keeps the first k of them whose next token fits
REACH = 16  # answer tokens a continuation is compared with


@torch.inference_mode()
def states(lm, seq: Sequence[int], layers: Sequence[int]) -> dict[int, np.ndarray]:
    """Hidden states (len(seq), d) float16 at each layer asked for, one pass of the base model."""
    out = lm.model.model(input_ids=torch.tensor([list(seq)]), use_cache=False, output_hidden_states=True)
    return {layer: out.hidden_states[layer][0].numpy().astype(np.float16) for layer in layers}


def corpus_docs(lm, name: str, budget: int, answers: Optional[Path] = None) -> list[tuple[list[int], int]]:
    """(sequence, first kept position) per document: the states from `first` on are keys, each followed by the
    next token.  answers: the model's answers read after their requests; python: standard-library source."""
    tok = lm.tokenizer
    if name.startswith("answers"):
        records = read_kept_answers(answers or answers_store_path(lm.name, tok))
        return answer_documents(tok, records[::2] if name == "answers-half" else records)
    docs, total = [], 0
    for _, text in iter_python_sources([stdlib_root()]):
        ids = tok(text, add_special_tokens=False)["input_ids"][:1024]
        if len(ids) < 8:
            continue
        docs.append((ids, 0))
        total += len(ids)
        if total >= budget:
            break
    return docs


def build_corpus(lm, docs, layers, read=None):
    """Keys per layer (N, d) float16 and the token stream (positions line up with the keys; SEP after each doc).
    `read` (optional) maps a document's index to its states already computed."""
    keys = {layer: [] for layer in layers}
    stream = []
    for i, (seq, first) in enumerate(docs):
        found = read(i) if read is not None else states(lm, seq, layers)
        for layer in layers:
            keys[layer].append(found[layer][first:])
            keys[layer].append(np.zeros((1, found[layer].shape[1]), np.float16))  # the SEP position: never found
        stream.extend(seq[first:])
        stream.append(SEP)
    valid = np.array(stream) != SEP
    valid[:-1] &= np.array(stream[1:]) != SEP  # a key needs a next token
    return {layer: np.concatenate(k) for layer, k in keys.items()}, np.array(stream, dtype=np.int64), valid


def reduce(keys: np.ndarray, queries: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Centre on the corpus mean, project on the top `dim` principal axes (0: none), L2-normalise."""
    keys, queries = keys.astype(np.float32), queries.astype(np.float32)
    mean = keys.mean(axis=0)
    keys, queries = keys - mean, queries - mean
    if dim:
        cov = keys.T @ keys / len(keys)
        _, vecs = np.linalg.eigh(cov)
        axes = vecs[:, ::-1][:, :dim]  # (d, dim) largest first
        keys, queries = keys @ axes, queries @ axes
    keys /= np.maximum(np.linalg.norm(keys, axis=1, keepdims=True), 1e-12)
    queries /= np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-12)
    return keys, queries


def reach(stream: np.ndarray, p: int, answer: Sequence[int]) -> int:
    """How many of the answer's tokens the continuation after corpus position p + 1 holds."""
    n = 0
    for t in answer[:REACH]:
        at = p + 2 + n
        if at >= len(stream) or stream[at] != t:
            break
        n += 1
    return n


def evaluate(rows, seqs, keys, queries, stream, valid, ks):
    """Per k and strategy: (share of uncovered steps covered, share of all steps covered, per-step dense reach)."""
    sims = queries @ keys.T  # (steps, N)
    sims[:, ~valid] = -np.inf
    part = np.argpartition(-sims, POOL, axis=1)[:, :POOL]  # (steps, POOL) the nearest, unordered
    top = np.take_along_axis(part, np.argsort(-np.take_along_axis(sims, part, axis=1), axis=1), axis=1)
    out = {}
    for strategy in ("filtered", "nearest"):
        for k in ks:
            reaches = []
            for row, near in zip(rows, top):
                seq = seqs[row["prompt"]]
                newest, answer = seq[row["at"] - 1], seq[row["at"]:]
                if strategy == "filtered":
                    near = near[stream[near + 1] == newest]
                reaches.append(max((reach(stream, int(p), answer) for p in near[:k]), default=0))
            out[(strategy, k)] = np.array(reaches)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=("chat", "humaneval"), default="chat")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 15, 22, 29, 30])
    ap.add_argument("--dims", type=int, nargs="+", default=[32, 64, 128, 0])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--corpora", nargs="+", default=["answers", "answers-half", "python"])
    ap.add_argument("--answers", type=Path, default=None, metavar="STORE",
                    help="the general-text store folder (rest_full's, and the answers corpus; default: the built-in)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    lm = load_model()
    stores, kind = rest_full_stores(lm, args.suite, answers=args.answers)
    base = CostModel.for_model(lm, stores=stores, kind=kind)
    chooser = CostModel(times_ms=base.times_ms.copy(), labels=base.labels, kind=kind)
    suite = load_suite(args.suite, lm.tokenizer, limit=args.limit,
                       pick=BENCHMARK_CHAT_PROMPTS if args.suite == "chat" else None)
    answers: list = []
    rows = record(RestDecoder(lm, stores=stores, budget_chooser=chooser), [p.ids for p in suite],
                  DecodeConfig(max_new_tokens=args.max_new_tokens), answers)
    rows = [r for r in rows if r["at"] >= 2]
    seqs = [list(p.ids) + a for p, a in zip(suite, answers)]
    print(cpu_line(cpu_info()))
    overlap(lm, suite)
    text_reach = np.array([len(r["ranks"]) for r in rows])
    uncovered = text_reach == 0
    print(f"{len(rows)} steps; uncovered by the text sources: {uncovered.mean():.1%}; accepted-path bound "
          f"{np.mean(1 + text_reach):.3f} tokens per pass")
    suite_states = [states(lm, s, args.layers) for s in seqs]
    full: list = []  # the answers corpus's states per document, reused for its half
    for corpus in args.corpora:
        t0 = time.perf_counter()
        docs = corpus_docs(lm, corpus, 90_000, args.answers)
        read = None
        if corpus == "answers":
            full = [states(lm, seq, args.layers) for seq, _ in docs]
            read = full.__getitem__
        elif corpus == "answers-half" and full:
            read = full[::2].__getitem__  # the half is every other answer
        keys, stream, valid = build_corpus(lm, docs, args.layers, read)
        print(f"\ncorpus {corpus}: {int(valid.sum()):,} positions, states in {time.perf_counter() - t0:.0f} s")
        print("| layer | PCA | strategy | k | uncovered steps covered | all steps covered | bound with dense |")
        print("|---|---|---|---|---|---|---|")
        for layer in args.layers:
            raw_q = np.stack([suite_states[r["prompt"]][layer][r["at"] - 2] for r in rows])
            for dim in args.dims:
                k_red, q_red = reduce(keys[layer], raw_q, dim)
                found = evaluate(rows, seqs, k_red, q_red, stream, valid, args.ks)
                for (strategy, k), dense in found.items():
                    both = np.maximum(text_reach, dense)
                    print(f"| {layer} | {dim or 'none'} | {strategy} | {k} | {np.mean(dense[uncovered] > 0):.1%} | "
                          f"{np.mean(dense > 0):.1%} | {np.mean(1 + both):.3f} |", flush=True)


def overlap(lm, suite) -> None:
    """Whether any benchmark prompt is among the corpus's requests, exactly or by a shared run of 8 tokens."""
    corpus = answer_prompts()
    exact = [p.id for p in suite if p.text in corpus]
    grams = set()
    for text in corpus:
        ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        grams.update(tuple(ids[i:i + 8]) for i in range(len(ids) - 7))
    shared = []
    for p in suite:
        ids = lm.tokenizer(p.text, add_special_tokens=False)["input_ids"]
        if any(tuple(ids[i:i + 8]) in grams for i in range(len(ids) - 7)):
            shared.append(p.id)
    others = [pid for pid, _, _ in chat_prompts() if pid not in {p.id for p in suite}]
    print(f"benchmark prompts among the corpus's {len(corpus)} requests: {exact or 'none'}; sharing a run of 8 "
          f"tokens with one: {shared or 'none'} ({len(others)} other chat-suite prompts not measured here)")


if __name__ == "__main__":
    main()
