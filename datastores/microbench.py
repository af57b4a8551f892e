"""Lookup latency of a store, measured the way the decoder calls it.

Two kinds of contexts: taken from inside the store (every lookup matches n_max tokens,
the worst case for gathering since frequent n-grams hit max_matches) and from held-out
text tokenized with the store's tokenizer (realistic: matches of every length, some
misses). The store's pages are touched first (`TokenDatastore.warm`, as a server
does once) and each context is looked up once after a short warm-up; the report gives
wall-clock and per-thread CPU percentiles in microseconds plus what the lookups found
(CPU time stays meaningful when other processes share the cores).
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from datastores.common import SEP, Store
from datastores.sources import iter_text_files

if TYPE_CHECKING:
    from datastores.static import TokenDatastore

__all__ = ["bench_store", "contexts_from_store", "contexts_from_texts", "format_report", "time_lookups"]


def contexts_from_store(store: TokenDatastore, count: int = 2000, context_len: int = 64,
                        seed: int = 0) -> list[np.ndarray]:
    """Random contexts ending inside the store's stream, cut at the previous separator."""
    rng = np.random.default_rng(seed)
    toks = store._tokens  # (N,) uint32
    out = []
    for end in rng.integers(1, store.n_tokens, size=count * 2):
        ctx = toks[max(0, end - context_len):end].astype(np.int64)
        seps = np.flatnonzero(ctx == SEP)
        if seps.size:
            ctx = ctx[seps[-1] + 1:]
        if ctx.size >= 2:
            out.append(ctx)
        if len(out) == count:
            break
    return out


def contexts_from_texts(tokenizer: Any, texts: Sequence[str], count: int = 2000, context_len: int = 64,
                        seed: int = 0) -> list[np.ndarray]:
    """Random contexts from tokenized held-out texts (each at least 2 tokens)."""
    rng = np.random.default_rng(seed)
    streams = [np.asarray(ids, dtype=np.int64)
               for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"] if len(ids) >= 2]
    if not streams:
        return []
    sizes = np.array([s.size for s in streams], dtype=np.float64)
    which = rng.choice(len(streams), size=count, p=sizes / sizes.sum())
    out = []
    for w in which:
        s = streams[w]
        end = int(rng.integers(2, s.size + 1))
        out.append(s[max(0, end - context_len):end])
    return out


def time_lookups(store: Store, contexts: Sequence[np.ndarray], n_max: int = 16, n_min: int = 2,
                 max_matches: int = 5000, continuation_len: int = 10, warmup: int = 50) -> dict:
    """Latency percentiles (microseconds) and hit statistics of store.lookup over contexts."""
    for ctx in contexts[:warmup]:
        store.lookup(ctx, n_max, n_min, max_matches, continuation_len)
    lat = np.empty(len(contexts))  # wall clock, microseconds
    cpu = np.empty(len(contexts))  # this thread's CPU time: robust when other work shares the cores
    matched = np.empty(len(contexts))
    rows = np.empty(len(contexts))
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for k, ctx in enumerate(contexts):
        c0, t0 = cpu_clock(), clock()
        r = store.lookup(ctx, n_max, n_min, max_matches, continuation_len)
        lat[k], cpu[k] = (clock() - t0) / 1e3, (cpu_clock() - c0) / 1e3
        matched[k], rows[k] = r.matched_len, r.continuations.shape[0]
    if not len(contexts):
        return {"n": 0}
    return {"n": len(contexts),
            "p50_us": float(np.percentile(lat, 50)), "p90_us": float(np.percentile(lat, 90)),
            "p99_us": float(np.percentile(lat, 99)), "max_us": float(lat.max()), "mean_us": float(lat.mean()),
            "cpu_p50_us": float(np.percentile(cpu, 50)), "cpu_p99_us": float(np.percentile(cpu, 99)),
            "hit_rate": float((matched > 0).mean()), "mean_matched_len": float(matched[matched > 0].mean())
            if (matched > 0).any() else 0.0, "mean_rows": float(rows.mean())}


def bench_store(store: TokenDatastore, tokenizer: Any = None, heldout_texts: Sequence[str] = (), count: int = 2000,
                context_len: int = 64, seed: int = 0, **lookup_kw: int) -> dict:
    """{"inside": stats, "heldout": stats (when texts and tokenizer are given)}."""
    report = {"store": str(getattr(store, "path", "")), "n_tokens": int(getattr(store, "n_tokens", 0)),
              "loadavg_1min": os.getloadavg()[0], "cpus": os.cpu_count(),
              "lookup": {"n_max": 16, "n_min": 2, "max_matches": 5000, "continuation_len": 10, **lookup_kw}}
    if hasattr(store, "warm"):
        store.warm()  # steady state: a server warms its mappings once at start
    report["inside"] = time_lookups(store, contexts_from_store(store, count, context_len, seed), **lookup_kw)
    if heldout_texts and tokenizer is not None:
        ctxs = contexts_from_texts(tokenizer, heldout_texts, count, context_len, seed)
        report["heldout"] = time_lookups(store, ctxs, **lookup_kw)
    return report


def read_heldout(paths: Sequence[str | Path], max_files: int = 400, max_bytes: int = 8 << 20) -> list[str]:
    """Texts of up to max_files files (folders walked for *.py) for held-out contexts."""
    texts, total = [], 0
    for p in paths:
        src = iter_text_files([p], suffixes=[".py"] if Path(p).is_dir() else None)
        for _doc_id, text in src:
            texts.append(text)
            total += len(text)
            if len(texts) >= max_files or total >= max_bytes:
                return texts
    return texts


def format_report(report: dict) -> str:
    lines = [f"store {report['store']}  ({report['n_tokens']:,} tokens)  lookup {report['lookup']}  "
             f"[load {report.get('loadavg_1min', 0):.1f} on {report.get('cpus')} cpus]"]
    for kind in ("inside", "heldout"):
        s = report.get(kind)
        if not s or not s.get("n"):
            continue
        lines.append(f"{kind:8s} n={s['n']}  p50 {s['p50_us']:.0f} us  p90 {s['p90_us']:.0f} us  "
                     f"p99 {s['p99_us']:.0f} us  max {s['max_us']:.0f} us  (cpu p50 {s['cpu_p50_us']:.0f} p99 "
                     f"{s['cpu_p99_us']:.0f} us)  | hit {s['hit_rate']:.0%}  "
                     f"matched_len {s['mean_matched_len']:.1f}  rows {s['mean_rows']:.0f}")
    return "\n".join(lines)
