"""Where a batch's time goes in vLLM, step by step: each method on a fresh engine (the benchmark's settings) serves
one suite with `--batch` requests in flight, every engine step timed from the client; REST's proposer also writes
down each propose() call (the engine's time since the call before, its own time, the requests in the step, the
drafts it gave, whether it looked the stores up, and the drafts verified and kept since the call before).

    .venv-vllm/bin/python tools/vllm_wave_trace.py MODEL --suite chat --batch 16 --methods plain rest plain rest
    (run it with the environment `rest_core.serving.launch.vllm_env` gives, as tools/vllm_draft_cost.py)

Per method it prints the wall, the engine steps, the first step (it reads the prompts), the median decoding step, at
which steps the first and the last request finished (the benchmark's own serving loop, `run_batch`) and the wave's time
in three phases (the prompts, every request decoding, the tail from the first request's end); for REST also the time in
propose() in steps that looked the stores up and in steps that did not, the engine's step fitted as a fixed time plus a
time per request and per draft verified, and every step that drafted (with `--all-steps`, every step). With 16 prompts
at batch 16 that is the benchmark's one-wave cell, with `--limit 40` its sustained one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rest_core.serving.engine import remaining_tokens, running_request_ids
from rest_core.vllm import RestProposer

TRACE_ENV = "REST_LAB_WAVE_TRACE"


class TracedRest(RestProposer):
    """REST's proposer, writing a line per propose() call to the file REST_LAB_WAVE_TRACE names: [start (s), its
    own ms, requests, drafts given, looked up, drafts kept so far, drafts verified so far, served for the
    requests the batch ends with (nothing waited to join it), drafts past what their requests' tokens left could
    use (a request with r left keeps r - 1 at most), served for them without drafting as their kind's batch ends
    lately saved less than they spent (serving.live.WaveEnds)]."""

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self._trace = open(os.environ[TRACE_ENV], "a", buffering=1)

    def propose(self, sampled_token_ids, *args, **kwargs):
        start = time.perf_counter()
        stats = self.drafter.stats
        looked, last, off = stats["drafting_steps"], stats["last_request_steps"], stats["wave_end_off_steps"]
        out = super().propose(sampled_token_ids, *args, **kwargs)
        ms = (time.perf_counter() - start) * 1e3
        left = remaining_tokens(self.runner, running_request_ids(self.runner, len(out)))
        past = 0 if left is None else sum(max(0, len(drafts) - max(0, r - 1)) for drafts, r in zip(out, left))
        self._trace.write(json.dumps([start, ms, len(sampled_token_ids), sum(map(len, out)),
                                      stats["drafting_steps"] > looked, stats["accepted"], stats["drafted"],
                                      stats["last_request_steps"] > last, past,
                                      stats["wave_end_off_steps"] > off]) + "\n")
        return out


def steps_of(records: list[list], before: Optional[list] = None) -> list[dict]:
    """The trace's calls as steps: the engine's ms since the call before ended (None for the first), propose()'s
    ms, the requests, the drafts given, whether it looked up, and the drafts the engine verified and kept in the
    step that ran before the call (the ones the call before gave); `before`: the call before the first (the
    warm-up's last), whose totals the first step's counts are taken from."""
    out, end, kept, verified = [], None, 0, 0
    if before is not None:
        kept, verified = before[5], before[6]
    for start, ms, batch, given, looked, kept_all, verified_all, *more in records:  # older traces: fewer fields
        out.append({"engine_ms": None if end is None else (start - end) * 1e3, "propose_ms": ms, "batch": batch,
                    "drafts": given, "looked": bool(looked), "verified": verified_all - verified,
                    "kept": kept_all - kept, "last": bool(more and more[0]), "past": more[1] if len(more) > 1 else 0,
                    "off": len(more) > 2 and bool(more[2])})
        end, kept, verified = start + ms / 1e3, kept_all, verified_all
    return out


def propose_summary(steps: list[dict]) -> dict:
    """propose()'s mean ms in steps that looked the stores up and in steps that did not, the drafts given,
    verified and kept in all, the steps served for the requests the batch ends with, and the drafts given past what
    their requests' tokens left could use."""
    looked = [s["propose_ms"] for s in steps if s["looked"]]
    quiet = [s["propose_ms"] for s in steps if not s["looked"]]
    return {"looked_steps": len(looked), "looked_ms": statistics.fmean(looked) if looked else 0.0,
            "quiet_steps": len(quiet), "quiet_ms": statistics.fmean(quiet) if quiet else 0.0,
            "drafts": sum(s["drafts"] for s in steps), "verified": sum(s["verified"] for s in steps),
            "kept": sum(s["kept"] for s in steps), "last_steps": sum(s.get("last", False) for s in steps),
            "past": sum(s.get("past", 0) for s in steps), "off_steps": sum(s.get("off", False) for s in steps)}


def phases(timeline: list[tuple[float, int]]) -> dict:
    """A wave's client-side step times in three phases: the prompts (the first three calls, where vLLM reads
    them), every request decoding (up to the step before the first one finished) and the tail (from that step
    on, the batch shrinking): per phase its steps and seconds."""
    ms = [step_ms for step_ms, _ in timeline]
    done = next((i for i, (_, finished) in enumerate(timeline) if finished), len(ms))
    cut = max(done, 3)
    parts = {"prompts": ms[:3], "all decoding": ms[3:cut], "tail": ms[cut:]}
    return {name: (len(part), sum(part) / 1e3) for name, part in parts.items()}


def fit_steps(steps: list[dict]) -> Optional[tuple[float, float, float]]:
    """Least squares over REST's decoding steps (the first three left out): a step's engine ms as
    fixed + per_request x requests + per_draft x drafts verified in it; None with too few steps to tell."""
    rows = [(s["batch"], s["verified"], s["engine_ms"]) for s in steps[3:] if s["engine_ms"] is not None]
    if len(rows) < 8 or len({r[0] for r in rows}) < 2 or len({r[1] for r in rows}) < 2:
        return None
    data = np.array(rows, dtype=float)
    design = np.c_[np.ones(len(data)), data[:, 0], data[:, 1]]
    coef, *_ = np.linalg.lstsq(design, data[:, 2], rcond=None)
    return float(coef[0]), float(coef[1]), float(coef[2])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the served model folder (REST Lab's converted copy for the default model)")
    ap.add_argument("--suite", default="chat", choices=("chat", "humaneval"))
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["plain", "rest"], choices=("plain", "empty", "rest"),
                    help="one fresh engine each, in this order")
    ap.add_argument("--all-steps", action="store_true", help="print every step of REST's trace")
    args = ap.parse_args(argv)

    from vllm import LLM

    from rest_core.bench.vllm_bench import ENGINE, run_batch, speculative_config, suite_prompts, warm_up
    from rest_core.machine import cpu_info, cpu_line
    from rest_core.model import load_tokenizer

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH"))
                                               if p)  # the engine's process imports TracedRest from here
    prompts = suite_prompts(args.suite, load_tokenizer(args.model), args.limit)
    print(cpu_line(cpu_info()))
    for method in args.methods:
        trace = Path(os.environ.get("TMPDIR", "/tmp")) / f"wave-trace-{os.getpid()}-{time.time_ns()}.jsonl"
        os.environ[TRACE_ENV] = str(trace)
        spec = speculative_config(method, 8)
        if method == "rest":
            spec = {**spec, "model": "vllm_wave_trace.TracedRest"}
        llm = LLM(args.model, speculative_config=spec, **ENGINE)
        warm_up(llm)  # as the benchmark
        skip = len(trace.read_text().splitlines()) if trace.exists() else 0
        timeline: list = []
        got = run_batch(llm, prompts, args.batch, args.max_new_tokens, steps=timeline)
        llm.llm_engine.engine_core.shutdown()
        ms = [step_ms for step_ms, _ in timeline]
        done_at = [i + 1 for i, (_, finished) in enumerate(timeline) if finished]
        print(f"{method}: {got['wall_s']:.3f} s, {len(ms)} steps, first step {sum(ms[:3]):.0f} ms (the first "
              f"three calls), decoding step median {statistics.median(ms[3:]):.1f} ms; first request done at step "
              f"{done_at[0]}, last at step {done_at[-1]}", flush=True)
        print("  " + "; ".join(f"{name}: {n} steps, {sec:.3f} s" + (f" ({1e3 * sec / n:.1f} ms each)" if n else "")
                               for name, (n, sec) in phases(timeline).items()))
        if method == "rest" and trace.exists():
            records = [json.loads(line) for line in trace.read_text().splitlines()]
            steps = steps_of(records[skip:], records[skip - 1] if skip else None)
            s = propose_summary(steps)
            print(f"  propose(): {s['looked_steps']} steps looked up ({s['looked_ms']:.2f} ms each), "
                  f"{s['quiet_steps']} did not ({s['quiet_ms']:.2f} ms); {s['drafts']} drafts given, "
                  f"{s['verified']} verified, {s['kept']} kept ({s['past']} past what their requests' tokens left "
                  f"could use); {s['last_steps']} steps served for the requests the batch ends with, "
                  f"{s['off_steps']} of them without drafting (their kind's batch ends lately saved less than they "
                  f"spent)")
            fit = fit_steps(steps)
            if fit is not None:
                print(f"  a decoding step of the engine: {fit[0]:.1f} ms + {fit[1]:.2f} ms a request + {fit[2]:.2f} ms "
                      f"a draft verified (least squares over its steps)")
            for i, st in enumerate(steps):
                if args.all_steps or st["drafts"] or st["looked"] or st["verified"]:
                    engine = f"{st['engine_ms']:6.1f}" if st["engine_ms"] is not None else "     -"
                    print(f"  step {i:4d}: {st['batch']:2d} requests, engine {engine} ms, propose "
                          f"{st['propose_ms']:5.2f} ms, drafts {st['drafts']:2d}, verified {st['verified']:2d}, "
                          f"kept {st['kept']:2d}{', looked up' if st['looked'] else ''}"
                          f"{', for the last requests' if st['last'] else ''}")
            trace.unlink()
    return 0


if __name__ == "__main__":
    from rest_core.serving.launch import set_vllm_defaults

    set_vllm_defaults()  # as the benchmark's engines: a bounded cache, every core for the model
    sys.exit(main())
