"""The vLLM benchmark's results as Markdown (rest_core.bench.vllm_bench writes results.json, this reads it)."""
from __future__ import annotations

import math
import random
import statistics


def _runs(result: dict, method: str, key: str) -> list[dict]:
    return [r[method]["runs"][key] for r in result["rounds"] if key in r.get(method, {}).get("runs", {})]


def _identical(result: dict, method: str, key: str) -> tuple[int, int]:
    """(outputs equal to plain vLLM's, outputs compared) over every round."""
    plain = [r["outputs"] for r in _runs(result, "plain", key)]
    same = total = 0
    for run in _runs(result, method, key):
        for pid, tokens in run["outputs"].items():
            total += 1
            seen = [p[pid] for p in plain if pid in p]  # plain's runs that served this prompt (its wave's)
            same += bool(seen) and all(p == tokens for p in seen)
    return same, total


def ratios(result: dict, method: str, key: str, base: str = "plain") -> list[float]:
    """tokens/s against `base`'s (plain vLLM's) in the same round, per round that ran both."""
    return [r[method]["runs"][key]["tokens_per_s"] / r[base]["runs"][key]["tokens_per_s"]
            for r in result["rounds"] if key in r.get(method, {}).get("runs", {})
            and key in r.get(base, {}).get("runs", {})]


def _spread(values: list[float], unit: str = "", more: str = "") -> str:
    """The median, and the range where there is more than one value: '1.02× (0.97-1.05)'; `more` goes inside
    the brackets after the range."""
    if not values:
        return "-"
    text = f"{statistics.median(values):.{2 if unit else 1}f}{unit}"
    if len(values) > 1:
        text += f" ({min(values):.{2 if unit else 1}f}-{max(values):.{2 if unit else 1}f}{more})"
    return text


INTERVAL_FROM = 5  # paired samples from which a cell's ratio to plain also gets its mean and 90% interval
RESAMPLES = 2000


def ratio_interval(ratios: list[float]) -> str:
    """The ratios' geometric mean and a 90% bootstrap interval of it (seeded: the same results give the same
    interval), where there are INTERVAL_FROM or more: '; mean 1.01×, 90% 0.98-1.04'."""
    if len(ratios) < INTERVAL_FROM or min(ratios) == max(ratios):  # plain against itself: nothing to add
        return ""
    logs = [math.log(r) for r in ratios]
    pick = random.Random(0)
    means = sorted(statistics.fmean(pick.choices(logs, k=len(logs))) for _ in range(RESAMPLES))
    low, high = means[int(0.05 * RESAMPLES)], means[int(0.95 * RESAMPLES) - 1]
    return f"; mean {math.exp(statistics.fmean(logs)):.2f}×, 90% {math.exp(low):.2f}-{math.exp(high):.2f}"


def _step_ms(runs: list[dict]) -> str:
    """A cell's milliseconds per engine step, and of them propose()'s own (REST's drafter reports it), medians
    over the rounds; '-' for runs from before the steps were counted."""
    steps = [r["ms_per_engine_step"] for r in runs if r.get("ms_per_engine_step")]
    if not steps:
        return "-"
    propose = [r["propose_ms_per_step"] for r in runs if r.get("propose_ms_per_step") is not None]
    inner = f" ({statistics.median(propose):.2f})" if propose else ""
    return f"{statistics.median(steps):.1f}{inner}"


def machine_line(m: dict) -> str:
    """The machine a run measured: its GPU where vLLM ran on one, its CPU always."""
    cpu = (f"{m['cpu']} (family/model {m['cpu_family']}, {', '.join(m['cpu_features'])}), {m['cores']} cores; "
           f"commit {m['commit']}; Python {m['python']}")
    if m.get("gpu"):
        return f"{m['gpu']} (torch {m.get('torch', '?')}) on {cpu}"
    cores = "".join(f"; {name}={m[key]}" for key, name in (("reserved_cpus", "VLLM_CPU_NUM_OF_RESERVED_CPU"),
                                                             ("omp_bind", "VLLM_CPU_OMP_THREADS_BIND"))
                    if m.get(key) is not None)
    return f"{cpu}; LD_PRELOAD={m['ld_preload'] or '-'}; VLLM_CPU_KVCACHE_SPACE={m['kv_cache_gb']} GB{cores}"


def _samples(result: dict) -> str:
    """How many samples a run took: rounds, or rounds of waves side by side (vllm_bench --waves)."""
    waves = result["settings"].get("waves", 1)
    if waves == 1:
        return f"{len(result['rounds'])} round(s)"
    return (f"{len(result['rounds'])} samples: {len(result['rounds']) // waves} round(s) x {waves} waves of "
            f"{result['settings']['limit']} distinct prompts, one engine per method up together, the methods taking "
            f"turns at every wave")


def vllm_markdown(result: dict) -> str:
    """One table per suite: per batch size and method, tokens/s (and against plain in the same round), latency,
    tokens per step, identical outputs."""
    m = result["machine"]
    s = result["settings"]
    methods = list(result["rounds"][0])
    lines = [f"# vLLM {m['vllm']}: plain, ngram, suffix and REST drafting", "",
             f"Machine: {machine_line(m)}.", "",
             f"Command: `{result['command']}`", "",
             f"Greedy, {s['max_new_tokens']} new tokens, k = {s['k']} drafts at most per request and step "
             f"(METHOD@K: K), "
             f"engine {s['engine']}; {_samples(result)}: medians over a cell's rounds, their range in "
             f"brackets; × plain is the ratio to plain vLLM in the same round; ms/step is the wall time per engine "
             f"step, propose()'s own share of it in brackets (REST's drafter reports it); with {INTERVAL_FROM} "
             f"samples or more, × plain also gives the geometric mean of the ratios and a 90% bootstrap interval "
             f"of it.", ""]
    loads = [x for r in result["rounds"] for rec in r.values() for run in rec.get("runs", {}).values()
             for x in run.get("load_average", ())]
    if loads:
        lines += [f"Load average (1 min) at the start and end of the runs: {min(loads):.2f} to {max(loads):.2f} "
                  f"({m['cores']} cores).", ""]
    for method in methods:
        err = result["rounds"][0][method].get("error")
        if err:
            lines += [f"**{method}** did not run: {err[:300]}", ""]
    keys = sorted({k for r in result["rounds"] for rec in r.values() for k in rec.get("runs", {})},
                  key=lambda k: (k.split("/")[0], int(k.split("/")[1])))
    for suite in dict.fromkeys(k.split("/")[0] for k in keys):
        lines += [f"## {suite}", "", "| batch | method | tokens/s | × plain | p50 latency s | p95 latency s | "
                  "tokens/step | ms/step (propose) | identical to plain |", "|---|---|---|---|---|---|---|---|---|"]
        for key in (k for k in keys if k.startswith(suite + "/")):
            for method in methods:
                runs = _runs(result, method, key)
                if not runs:
                    continue
                tps = [r["tokens_per_s"] for r in runs]
                cell = ratios(result, method, key)
                same, total = _identical(result, method, key)
                lines.append(f"| {key.split('/')[1]} | {method} | {_spread(tps)} | "
                             f"{_spread(cell, '×', ratio_interval(cell))} | "
                             f"{statistics.median(r['latency_p50_s'] for r in runs):.2f} | "
                             f"{statistics.median(r['latency_p95_s'] for r in runs):.2f} | "
                             f"{statistics.median(r['tokens_per_step'] for r in runs):.2f} | {_step_ms(runs)} | "
                             f"{same}/{total} |")
        lines.append("")
    return "\n".join(lines)
