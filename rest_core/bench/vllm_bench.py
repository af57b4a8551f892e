"""vLLM with and without drafting, on the benchmark's suites, at several batch sizes.

    python -m rest_core bench --engine vllm --suite humaneval --limit 16

(which runs `python -m rest_core.bench.vllm_bench` in .venv-vllm).

Methods: `plain` (no drafting), `ngram` (vLLM's prompt lookup, k tokens, n-grams of 1-4), `suffix` (SuffixDecoding,
where arctic-inference is installed), `rest` (rest_core.vllm.RestProposer) and, asked for by name, `empty` (a custom
proposer that never drafts: vLLM's drafting path alone, the floor under REST when it drafts nothing), `rest_stores`
(REST without the model's predictions), `rest_dense` (REST with the dense store), `rest_rs` (REST with every step
sampled by vLLM's rejection sampler) and `plain_sync` (plain with vLLM's async scheduling off, as vLLM runs every
custom proposer: what of the floor that costs). Every method gets a fresh engine at every batch size and round (so
what suffix decoding and REST keep of past outputs holds only this run's), the methods side by side per batch size;
the suite's prompts run with that many requests in flight (a finished request is replaced at once, as a server's load
would be). Measured: aggregate tokens/s, each request's latency (submission to last token; p50 / p95), mean tokens per
step per request (the new tokens over the steps that gave each request tokens, read from the engine's outputs), and
whether every output equals plain vLLM's, token for token. The order of methods alternates between rounds;
`--rounds-at 16=3` gives one batch size more rounds than the others, and the report gives every cell's median over its
rounds with their range. With the default 16 prompts a batch-16 cell is one wave of about 13 s: nothing replaces a
finished request, so it ends with its slowest one; `--limit 40` keeps 16 requests in flight for most of the run
(sustained load; docs/bench/vllm-zen4-load.md). `--waves N` takes N samples a round side by side in time: one engine
per method, all up together, serve N waves of distinct prompts, the methods taking turns at every wave (on a host
where one wave moves by ±10-20% from the next, many paired samples a few seconds apart; docs/bench/vllm-zen5-cores.md
section 7).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from rest_base.files import read_json

ENGINE = {"enforce_eager": True, "dtype": "float32", "max_model_len": 2048, "disable_log_stats": False}
METHODS = ("plain", "ngram", "suffix", "rest", "empty", "rest_stores", "rest_dense", "rest_rs", "plain_sync")
PLAIN_METHODS = ("plain", "plain_sync")  # no drafting, so no draft length
DEFAULT_METHODS = METHODS[:4]  # the others are diagnoses: `empty`, `rest_stores` (REST without the model's
# predictions), `rest_dense` (REST with the dense store), `rest_rs` (REST with every step sampled by vLLM's rejection
# sampler, as vLLM has it) and `plain_sync` (plain without async scheduling, which
# vLLM turns off for a custom proposer)
# REST's proposer under each name, with the drafter's settings its engine starts with
REST_VARIANTS = {"rest": {}, "rest_stores": {"REST_LAB_PREDICTIONS": "none"},
                 "rest_dense": {"REST_LAB_DENSE": "default"}, "rest_rs": {"REST_LAB_PLAIN_SAMPLING": "0"}}
TURN_PAUSE_S = 1.0  # between two methods' turns in a wave run: the engine that ran goes idle first (Intel OpenMP
# keeps its workers spinning 200 ms after their last work by default, KMP_BLOCKTIME)
PROPOSE_LOG = Path(tempfile.gettempdir()) / "rest-lab-propose.json"  # one file per run, named after it


def method_spec(spec: str) -> tuple[str, int | None]:
    """A method as the command line names it: `rest`, or `rest@16` for that method with its own
    num_speculative_tokens (the others keep --k); SystemExit with the choices for anything else."""
    name, at, k = spec.partition("@")
    if name not in METHODS or (at and not (k.isdigit() and int(k) >= 1)) or (at and name in PLAIN_METHODS):
        raise SystemExit(f"unknown method {spec!r}: choose from {', '.join(METHODS)}, each drafting method "
                         f"optionally with its own draft length as METHOD@K (e.g. rest@16)")
    return name, int(k) if at else None


def speculative_config(method: str, k: int):
    if method in PLAIN_METHODS:
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if method in REST_VARIANTS:
        return {"method": "custom_class", "model": "rest_core.vllm.RestProposer", "num_speculative_tokens": k}
    if method == "empty":
        return {"method": "custom_class", "model": "rest_core.vllm.NoDraftProposer", "num_speculative_tokens": k}
    raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")


def starts_rest(methods) -> bool:
    """Whether these methods start REST's proposer, which plans with the step cost measured for the engine."""
    return any(method_spec(m)[0] in REST_VARIANTS for m in methods)


def engine_settings(dtype: str) -> dict:
    """The benchmark's engines (ENGINE, served in `dtype`) as the settings a step-cost table is measured for."""
    return {"dtype": dtype, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
            "max_model_len": ENGINE["max_model_len"], "enforce_eager": ENGINE["enforce_eager"]}


def counters(llm, names: tuple = ("vllm:spec_decode_num_accepted_tokens",)) -> dict[str, float]:
    """vLLM's counters of these names, summed over their labels.  They are the process's: with several engines in
    one process they count the engine made last."""
    found = {name: 0.0 for name in names}
    for metric in llm.get_metrics():
        if metric.name in found and hasattr(metric, "value"):
            found[metric.name] += float(metric.value)
    return found


def run_batch(llm, prompts, batch: int, max_new_tokens: int, steps: Optional[list] = None) -> dict:
    """All prompts with `batch` requests in flight; per prompt its tokens and latency, and the totals (`steps`:
    where given, each engine step's (ms, requests it finished) is appended to it, as tools/vllm_wave_trace.py
    reads them)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    waiting = list(range(len(prompts)))
    started, done = {}, {}
    produced: dict[str, int] = {}  # tokens each request has so far, as the engine's outputs said
    n_steps = request_steps = 0
    t0 = time.perf_counter()
    while waiting or len(done) < len(prompts):
        while waiting and len(started) - len(done) < batch:
            i = waiting.pop(0)
            started[i] = time.perf_counter()
            engine.add_request(str(i), {"prompt_token_ids": list(prompts[i].ids)}, params)
        n_steps += 1
        start = time.perf_counter()
        outs = engine.step()
        if steps is not None:
            steps.append(((time.perf_counter() - start) * 1e3, sum(out.finished for out in outs)))
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n > produced.get(out.request_id, 0):  # a step in which this request got tokens
                produced[out.request_id] = n
                request_steps += 1
            if out.finished:
                i = int(out.request_id)
                done[i] = (list(out.outputs[0].token_ids), time.perf_counter() - started[i])
    wall = time.perf_counter() - t0
    tokens = sum(len(done[i][0]) for i in done)
    latencies = sorted(done[i][1] for i in done)
    return {"batch": batch, "wall_s": wall, "new_tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_p50_s": statistics.median(latencies),
            "latency_p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
            # per request and step that gave it tokens: 1 + its drafts kept, read from the outputs (vLLM's counters
            # would say as much, for the engine made last in this process only: `counters`)
            "tokens_per_step": tokens / max(request_steps, 1), "request_steps": request_steps, "engine_steps": n_steps,
            "ms_per_engine_step": 1e3 * wall / max(n_steps, 1),
            "outputs": {prompts[i].id: done[i][0] for i in sorted(done)}}


def drafter_times(before, after) -> dict:
    """propose()'s own milliseconds per engine step (in all, and in the steps that looked up), the engine's between
    two calls, the collector's, how many steps taught the model's predictions, what the dense store drafted and
    the share of steps served for the batch's last requests, from a proposer's reports at the start and end of a
    run (the empty proposer reports its steps and collections only; nothing for the methods that write none)."""
    if not isinstance(after, dict) or not after.get("steps"):
        return {}
    before = before if isinstance(before, dict) else {}
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("steps", "drafting_steps", "propose_ms", "gc_ms",
                                                          "gc_full", "drafting_propose_ms", "engine_ms", "timed_steps",
                                                          "predicted_steps", "predicted_skipped", "dense_lookups",
                                                          "dense_drafted", "dense_accepted", "last_request_steps")}
    return {"propose_ms_per_step": d["propose_ms"] / max(d["steps"], 1),
            "propose_ms_per_lookup_step": d["drafting_propose_ms"] / max(d["drafting_steps"], 1),
            "lookup_share": d["drafting_steps"] / max(d["steps"], 1),
            # steps served for the requests the batch ends with (nothing waited to join it)
            "last_request_share": d["last_request_steps"] / max(d["steps"], 1),
            "engine_ms_per_step": d["engine_ms"] / max(d["timed_steps"], 1),
            "gc_ms_per_step": d["gc_ms"] / max(d["steps"], 1), "gc_full": d["gc_full"],
            # steps whose logits taught the model's predictions, and those whose rows did not match the drafts
            "predicted_share": d["predicted_steps"] / max(d["steps"], 1), "predicted_skipped": d["predicted_skipped"],
            # requests the dense store was searched for, and its drafts verified and kept
            "dense_lookups": d["dense_lookups"], "dense_drafted": d["dense_drafted"],
            "dense_accepted": d["dense_accepted"]}


def run_method(model: str, spec: str, k: int, suites: dict, batch: int, max_new_tokens: int,
               engine: dict = ENGINE) -> dict:
    """One method (`name` or `name@k`) at one batch size on a fresh engine: what a method caches across requests
    (suffix decoding's tree of past outputs, REST's history) holds only what this run served, never the answers
    of a run before."""
    llm, rec, report = start_method(model, spec, k, batch, engine)
    if llm is not None:
        rec["runs"] = serve_suites(llm, spec, report, suites, batch, max_new_tokens)
        stop_method(llm, report)
    return rec


def start_method(model: str, spec: str, k: int, batch: int, engine: dict = ENGINE) -> tuple[Any, dict, Path]:
    """A fresh, warmed-up engine for one method (`name` or `name@k`), what its start says (or the error that
    stopped it: no engine then) and the file its proposer reports to."""
    from vllm import LLM

    method, own_k = method_spec(spec)
    k = own_k or k
    t0 = time.perf_counter()
    report = PROPOSE_LOG.with_name(f"{PROPOSE_LOG.stem}-{os.getpid()}-{method}-{k}-{batch}.json")
    report.unlink(missing_ok=True)
    os.environ["REST_LAB_PROPOSE_LOG"] = str(report)  # REST's drafter reports its own time there
    settings = REST_VARIANTS.get(method, {})
    kept = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)  # the engine's processes read the drafter's settings when they start
    try:
        llm = LLM(model, speculative_config=speculative_config(method, k), **engine,
                  **({"async_scheduling": False} if method == "plain_sync" else {}))
    except Exception as err:  # a method that cannot start (suffix without arctic-inference) is reported, not fatal
        return None, {"error": f"{type(err).__name__}: {err}"}, report
    finally:
        for name, value in kept.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    # vLLM overlaps scheduling a step with running the last one (async scheduling) where it can: never for a
    # custom proposer, whose drafts need the step's tokens first, and (vLLM 0.32) not on CPU for plain either
    rec = {"startup_s": time.perf_counter() - t0, "k": k, "runs": {},
           "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)}
    warm_up(llm)
    return llm, rec, report


def warm_up(llm: Any) -> None:
    """One untimed request outside the suites: the engine (and its proposer) warms up before a timed run."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": list(range(1000, 1032))}], SamplingParams(temperature=0, max_tokens=16),
                 use_tqdm=False)


def serve_suites(llm: Any, spec: str, report: Path, suites: dict, batch: int, max_new_tokens: int) -> dict:
    """Each suite's prompts through the engine with `batch` requests in flight: a run per suite, keyed
    'suite/batch'."""
    runs = {}
    for suite, prompts in suites.items():
        load = os.getloadavg()[0]  # other programs' work on the machine, before and after the run
        drafter = read_json(report)
        r = runs[f"{suite}/{batch}"] = run_batch(llm, prompts, batch, max_new_tokens)
        r["load_average"] = [load, os.getloadavg()[0]]
        r.update(drafter_times(drafter, read_json(report)))
        print(f"  {spec:7s} {suite:9s} batch {batch:2d}: {r['tokens_per_s']:7.1f} tokens/s, "
              f"{r['tokens_per_step']:.2f} tokens/step", flush=True)
    return runs


def stop_method(llm: Any, report: Path) -> None:
    llm.llm_engine.engine_core.shutdown()
    report.unlink(missing_ok=True)
    del llm
    gc.collect()


def sharing_engine(engine: dict, engines: int) -> dict:
    """The engine settings for `engines` engines up together: on a GPU each takes its share of the memory vLLM
    takes for one (gpu_memory_utilization, 0.9 unless given); a CPU engine's cache is VLLM_CPU_KVCACHE_SPACE."""
    import torch

    if engines < 2 or not torch.cuda.is_available():
        return engine
    return {**engine, "gpu_memory_utilization": round(engine.get("gpu_memory_utilization", 0.9) / engines, 3)}


def run_waves(model: str, methods: list[str], k: int, suites: dict, waves: int, limit: int, batch: int,
              max_new_tokens: int, engine: dict = ENGINE) -> list[dict]:
    """`waves` samples of every method at one batch size, side by side in time: one engine per method, all up
    together, serve the suites' prompts in waves of `limit` (wave w: prompts w * limit ..), the methods taking
    turns at each wave (the order reversed at every other wave) with a pause between turns so that the engine
    that just ran is idle.  A method's caches (REST's history, suffix decoding's tree) then hold the run's earlier
    waves' answers, other prompts' answers, as a serving engine's would.  Per wave: {method: its record}."""
    engine = sharing_engine(engine, len(methods))
    started = {m: start_method(model, m, k, batch, engine) for m in methods}
    out = []
    for w in range(waves):
        part = {suite: prompts[w * limit:(w + 1) * limit] for suite, prompts in suites.items()}
        out.append({})
        for m in (methods if w % 2 == 0 else methods[::-1]):
            llm, rec, report = started[m]
            out[-1][m] = {**rec, "runs": {}}
            if llm is not None:
                time.sleep(TURN_PAUSE_S)
                out[-1][m]["runs"] = serve_suites(llm, m, report, part, batch, max_new_tokens)
    for llm, _, report in started.values():
        if llm is not None:
            stop_method(llm, report)
    return out


def machine() -> dict:
    from rest_core.machine import cpu_info

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    except OSError:
        commit = ""
    import torch
    import vllm

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {**cpu_info(), "cores": os.cpu_count(), "python": platform.python_version(), "vllm": vllm.__version__,
            "torch": torch.__version__, "gpu": gpu, "commit": commit, "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "kv_cache_gb": None if gpu else os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            # cores vLLM's CPU backend keeps off the model (unset: one per worker) and how it binds its threads
            "reserved_cpus": None if gpu else os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
            "omp_bind": None if gpu else os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}


def suite_prompts(suite: str, tokenizer, limit: int, waves: int = 1) -> list:
    """The first `limit` prompts of a suite (`limit` for each of `waves` waves); the chat suite's start with the
    benchmark's chat prompts, its other prompts after them in the suite's order."""
    from rest_core.bench.suites import BENCHMARK_CHAT_PROMPTS, load_suite

    prompts = load_suite(suite, tokenizer)
    if suite == "chat":
        first = set(BENCHMARK_CHAT_PROMPTS)
        prompts = [p for p in prompts if p.id in first] + [p for p in prompts if p.id not in first]
    if not 1 <= limit <= len(prompts):
        raise SystemExit(f"--limit {limit}: the {suite} suite has {len(prompts)} prompts; choose 1 to {len(prompts)}")
    if waves < 1 or limit * waves > len(prompts):
        raise SystemExit(f"--waves {waves} of --limit {limit}: the {suite} suite has {len(prompts)} prompts, enough "
                         f"for {len(prompts) // limit} wave(s) of {limit}; lower --waves or --limit")
    return prompts[:limit * waves]


def rounds_per_batch(batches: list[int], rounds: int, rounds_at: list[str]) -> dict[int, int]:
    """Rounds per batch size: `rounds`, or what a BATCH=N of `rounds_at` says for that batch size."""
    out = {b: rounds for b in batches}
    for item in rounds_at:
        batch, _, n = item.partition("=")
        if not (batch.isdigit() and n.isdigit() and int(n) >= 1 and int(batch) in out):
            raise SystemExit(f"--rounds-at {item!r}: write BATCH=N with BATCH one of --batches "
                             f"({' '.join(map(str, batches))}) and N at least 1")
        out[int(batch)] = int(n)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rest_core bench --engine vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="served model folder or hub id (default: REST Lab's default model)")
    ap.add_argument("--suite", nargs="+", default=["humaneval", "chat"], choices=("humaneval", "chat"))
    ap.add_argument("--limit", type=int, default=16,
                    help="prompts per suite (the chat suite's are the benchmark's 16 chat prompts; beyond them its "
                         "other prompts follow, up to 42): at batch 16 the default is one wave, which drains as "
                         "requests finish; a larger limit keeps the batch full (sustained load)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), metavar="METHOD[@K]",
                    help=f"{', '.join(METHODS)}; METHOD@K: that method with K drafts at most (e.g. ngram@16)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens of every drafting method")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--rounds-at", nargs="+", default=[], metavar="BATCH=N",
                    help="more rounds at these batch sizes (e.g. 16=3); the others get --rounds")
    ap.add_argument("--waves", type=int, default=1,
                    help="samples per round side by side in time: one engine per method, all up together, serve "
                         "WAVES waves of --limit distinct prompts each, the methods taking turns at every wave "
                         "(the report's cells then hold rounds x waves samples; the suite needs limit x waves "
                         "prompts)")
    ap.add_argument("--dtype", default=ENGINE["dtype"],
                    help="the served model's dtype (float32 as REST Lab's CPU decoder; bfloat16 is usual on a GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    engine = {**ENGINE, "dtype": args.dtype}
    for spec in args.methods:
        method_spec(spec)  # a wrong name stops the run before any engine starts
    if len(set(args.methods)) < len(args.methods):
        raise SystemExit(f"--methods names a method twice: {' '.join(args.methods)}")
    from rest_core.model import load_tokenizer, resolve_source

    _, model = resolve_source(args.model)
    tokenizer = load_tokenizer(args.model)
    suites = {s: suite_prompts(s, tokenizer, args.limit, args.waves) for s in args.suite}
    out = Path(args.out or Path("bench_out") / f"vllm-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": "python -m rest_core bench --engine vllm " + " ".join(argv or sys.argv[1:]),
              "machine": machine(), "settings": {**vars(args), "engine": engine}, "rounds": []}
    rounds = rounds_per_batch(args.batches, args.rounds, args.rounds_at)
    for r in range(max(rounds.values())):
        order = args.methods if r % 2 == 0 else args.methods[::-1]
        samples = [{m: {"runs": {}} for m in order} for _ in range(args.waves)]
        result["rounds"] += samples  # a round's waves, each a sample of every cell
        for batch in (b for b in args.batches if rounds[b] > r):  # the methods side by side at each batch size
            if args.waves == 1:
                waves = [{m: run_method(model, m, args.k, suites, batch, args.max_new_tokens, engine) for m in order}]
            else:
                waves = run_waves(model, order, args.k, suites, args.waves, args.limit, batch, args.max_new_tokens,
                                  engine)
            for sample, got in zip(samples, waves):
                for m, rec in got.items():
                    sample[m]["runs"].update(rec.pop("runs", {}))
                    sample[m].update(rec)
            (out / "results.json").write_text(json.dumps(result, indent=1))
    from rest_core.bench.vllm_report import vllm_markdown

    (out / "results.md").write_text(vllm_markdown(result))
    print((out / "results.md").read_text())
    print(f"results in {out}/")
    return 0


if __name__ == "__main__":
    from rest_core.serving.launch import set_vllm_defaults

    set_vllm_defaults()
    sys.exit(main())
