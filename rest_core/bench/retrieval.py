"""`bench --suite retrieval`: store lookup latency against store size, build throughput, bytes per token.

Smaller stores are prefixes of the base store (its first N tokens, whole documents, built
once from token ids and cached); the lookups themselves are timed by
`datastores.microbench.bench_store`.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from tqdm.auto import tqdm

from datastores import SEP, DatastoreError, TokenDatastore, build_from_token_documents
from datastores.microbench import bench_store
from datastores.store_format import TOKENS_NAME
from rest_base.files import cache_dir
from rest_core.bench.report import fmt, machine_info_cpu, write_png
from rest_core.machine import cpu_line


def prefix_store(base: TokenDatastore, n_tokens: int, cache_root: Path | None = None) -> TokenDatastore:
    """A store holding the first n_tokens of base's stream (whole documents, the last cut), built once and cached."""
    stamp = str(base.meta["files"][TOKENS_NAME]["sample_sha256"])[:10]
    path = (cache_root or cache_dir() / "bench-stores") / f"{base.path.name}-{stamp}-{n_tokens}"
    try:
        return TokenDatastore.open(path)
    except DatastoreError:
        pass
    toks = base._tokens[:n_tokens]  # (n,) uint32 view of the memory map
    cuts = np.flatnonzero(toks == SEP)

    def documents() -> Iterator[np.ndarray]:
        start = 0
        for c in [*cuts.tolist(), int(toks.size)]:
            if c > start:
                yield np.asarray(toks[start:c], dtype=np.int64)
            start = c + 1

    return build_from_token_documents(path, documents(), tokenizer_info=dict(base.meta["tokenizer"]),
                                      max_tokens=n_tokens, overwrite=True)


def _store_row(store: TokenDatastore, base: TokenDatastore, rep: dict) -> dict:
    b = store.meta["build"]
    pretokenized = store.meta["tokenizer"].get("name") == "pre-tokenized" or any(
        s.get("kind") == "token-documents" for s in store.meta.get("sources", []))
    return {"store": str(store.path), "n_tokens": store.n_tokens, "prefix_of_base": store is not base,
            "inside": rep.get("inside"), "heldout": rep.get("heldout"), "lookup": rep["lookup"],
            "tokenize_tokens_per_s": None if pretokenized else b.get("tokenize_tokens_per_s"),
            "suffix_array_tokens_per_s": b.get("suffix_array_tokens_per_s"),
            "suffix_array_s": b.get("suffix_array_s"), "bytes_per_token": b.get("bytes_per_token"),
            "total_bytes": b.get("total_bytes"), "built_at": store.meta.get("built_at")}


def run_retrieval(base: TokenDatastore, sizes: Sequence[int], tokenizer: Any = None,
                  heldout_texts: Sequence[str] = (), out_dir: str | Path | None = None, *, count: int = 2000,
                  lookup: dict | None = None, command: str = "", png: bool = True, progress: bool = True,
                  cache_root: Path | None = None) -> dict:
    """Lookup latency p50/p99 against store size, build throughput and bytes per token (from meta.json)."""
    lookup = dict(lookup or {})
    sizes = sorted({int(s) for s in sizes if 0 < int(s) < base.n_tokens}) + [base.n_tokens]
    rows = []
    for n in tqdm(sizes, desc="retrieval", unit="store", disable=not progress):
        store = base if n == base.n_tokens else prefix_store(base, n, cache_root)
        rows.append(_store_row(store, base, bench_store(store, tokenizer, heldout_texts, count=count, **lookup)))
    results = {"settings": {"suite": "retrieval", "sizes": sizes, "contexts": count, "lookup": rows[0]["lookup"],
                            "heldout_texts": len(heldout_texts), "base_store": str(base.path)},
               "machine": machine_info_cpu(), "command": command, "stores": rows}
    if out_dir is not None:
        write_retrieval_outputs(results, Path(out_dir), png=png)
    return results


def write_retrieval_outputs(results: dict, out: Path, png: bool = True) -> None:
    """results.json, results.md, chart.html and (unless png=False) chart.png in out."""
    out.mkdir(parents=True, exist_ok=True)
    fig = retrieval_chart(results)
    fig.write_html(str(out / "chart.html"), include_plotlyjs=True)
    results["png_note"] = write_png(fig, out / "chart.png") if png else "chart.png not written (--no-png)"
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    (out / "results.md").write_text(retrieval_markdown(results), encoding="utf-8")


def retrieval_markdown(results: dict) -> str:
    mc = results["machine"]
    lines = ["# REST Lab benchmark: retrieval", "",
             f"Machine: {cpu_line(mc)}, {mc['cores']} cores; load average {mc.get('loadavg_start')}.", "",
             f"Code: {mc.get('code', 'not recorded')}; run on {mc.get('date', 'an unrecorded date')}.", "",
             f"Command: `{results.get('command') or '(library call)'}`", "",
             f"Lookup settings: {results['settings']['lookup']}; {results['settings']['contexts']} contexts per kind.",
             "", ("| store tokens | inside p50 / p99 µs | held-out p50 / p99 µs | held-out hit rate | "
                  "tokenize tokens/s | suffix array tokens/s | bytes/token |"), "|---|---|---|---|---|---|---|"]
    for r in results["stores"]:
        ins, ho = r.get("inside") or {}, r.get("heldout") or {}
        cells = [f"{r['n_tokens']:,}", f"{fmt(ins.get('p50_us'), '.0f')} / {fmt(ins.get('p99_us'), '.0f')}",
                 f"{fmt(ho.get('p50_us'), '.0f')} / {fmt(ho.get('p99_us'), '.0f')}", fmt(ho.get("hit_rate"), ".0%"),
                 fmt(r["tokenize_tokens_per_s"], ",.0f"), fmt(r["suffix_array_tokens_per_s"], ",.0f"),
                 fmt(r["bytes_per_token"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", ("- Inside: contexts taken from the store's own stream (every lookup matches n_max tokens); "
               "held-out: contexts from the benchmark prompts, tokenized."),
              ("- Smaller stores are prefixes of the largest (its first N tokens, built once and cached); their "
               "tokenization throughput is not meaningful (they are built from token ids) and is left blank."),
              "- Throughput and bytes per token are read from each store's meta.json (bytes on disk, memory-mapped)."]
    if results.get("png_note"):
        lines.append(f"- {results['png_note']}")
    return "\n".join(lines) + "\n"


def retrieval_chart(results: dict) -> go.Figure:
    fig = go.Figure()
    rows = results["stores"]
    x = [r["n_tokens"] for r in rows]
    for kind, dash in (("inside", "solid"), ("heldout", "dot")):
        for pct in ("p50_us", "p99_us"):
            y = [(r.get(kind) or {}).get(pct) for r in rows]
            if any(v is not None for v in y):
                fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=f"{kind} {pct[:3]}",
                                         line={"dash": dash}))
    fig.update_layout(title="Store lookup latency against store size", xaxis_title="store tokens",
                      yaxis_title="µs per lookup", xaxis_type="log", height=480, width=900)
    return fig
