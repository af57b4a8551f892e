"""Several vLLM benchmark runs' samples of a cell pooled: each method's ratios to plain vLLM (sample by sample, as
the runs paired them) over every results.json given, with their median, range, geometric mean and its 90%
bootstrap interval (rest_core.bench.vllm_report's reading of one run, over all of them).

    .venv/bin/python tools/vllm_pool.py bench_out/RUN1/results.json bench_out/RUN2/results.json --cell chat/16
    .venv/bin/python tools/vllm_pool.py bench_out/RUN*/results.json --cell humaneval/16 --waves-from 1
    .venv/bin/python tools/vllm_pool.py bench_out/RUN*/results.json --cell chat/16 --against empty

`--waves-from 1` leaves out each round's first wave (runs with --waves), `--first-wave` keeps it alone: the first
wave of a fresh engine is the benchmark's one-wave cell as a run without --waves takes it. `--against empty` reads
each method against the never-drafting proposer in the same samples (runs that had it) instead of plain.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rest_core.bench.vllm_report import ratio_interval, ratios


def samples(result: dict, method: str, cell: str, waves_from: int = 0, first_wave: bool = False,
            base: str = "plain") -> list[float]:
    """The run's ratios of `method` to `base` in `cell`, sample by sample (with --waves: the waves a round
    kept)."""
    waves = result["settings"].get("waves", 1)
    kept = [sample for i, sample in enumerate(result["rounds"])
            if i % waves >= waves_from and not (first_wave and i % waves)]
    return ratios({**result, "rounds": kept}, method, cell, base)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json files the vLLM benchmark wrote")
    ap.add_argument("--cell", required=True, help="SUITE/BATCH, e.g. chat/16")
    ap.add_argument("--waves-from", type=int, default=0, help="leave out each round's waves before this one")
    ap.add_argument("--first-wave", action="store_true", help="each round's first wave alone")
    ap.add_argument("--against", default="plain", help="the method the others are read against (default: plain; "
                    "`empty`: the never-drafting proposer, the floor under any custom proposer)")
    args = ap.parse_args(argv)
    results = [json.loads(Path(p).read_text()) for p in args.results]
    methods = dict.fromkeys(m for r in results for s in r["rounds"] for m in s if m != args.against)
    for method in methods:
        ratios = [x for r in results
                  for x in samples(r, method, args.cell, args.waves_from, args.first_wave, args.against)]
        if not ratios:
            continue
        print(f"{method} x {args.against} in {args.cell}: {len(ratios)} samples from {len(results)} run(s), median "
              f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}){ratio_interval(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
