"""Numbers from the benchmark's per-prompt records: the per-method summary, the checks,
the first-token distribution test (sampling) and the recorder's overhead.

With several rounds (`--repeats N`) the suite-level speed figures (tokens/s, ms/token,
speedup) are the median over rounds of each round's suite figure, with the spread (min
and max); every other figure pools the records of all rounds.  Per prompt, rest_full's
tokens/s over the baseline's is given per round, with its median and spread."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from tqdm.auto import tqdm

from rest_core.bench.methods import DEFAULT_KERNELS, REST_METHODS, SPECULATIVE, TRACED, MethodRunner, base_method
from rest_core.bench.suites import BenchPrompt
from rest_core.cost import CostModel
from rest_core.decode import DecodeConfig
from rest_core.sampling import next_token_probs

PLAIN_TOLERANCE = 0.05  # our plain loop should be within 5% of generate() per token
SUMMARY_KEYS = ("prompts_ok", "prompts_failed", "new_tokens", "wall_s", "tokens_per_s", "mean_prompt_tokens_per_s",
                "ms_per_token", "speedup", "forward_passes", "mean_accepted", "acceptance_rate", "no_draft_share",
                "retrieve_ms_p50", "retrieve_ms_p99", "verify_cost_rel_model", "forward_ms_per_step",
                "verify_cost_rel_measured", "mean_budget", "identical", "compared", "speedup_min", "speedup_max")
PER_PROMPT_METHOD = "rest_full"  # the per-prompt table: this method against the baseline


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median(xs: Sequence[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return float(np.median(got)) if got else None


def _method_summary(m: str, recs: list[dict], cm: CostModel) -> dict:
    """One method's numbers from its records (the speed figures and measured cost are filled in by `summarize`)."""
    ok = [r for r in recs if r["ok"]]
    new = sum(r["new_tokens"] for r in ok)
    wall = sum(r["wall_s"] for r in ok)
    passes = sum(r["forward_passes"] for r in ok)
    drafted = sum(r["draft_tokens"] for r in ok)
    steps = sum(r["steps"] for r in ok)
    qs = [q for r in ok for q in r["step_query_sizes"]]
    fwd = [ms for r in ok for ms in r["step_forward_ms"]]
    ret = [x for r in ok for x in r["retrieve_ms"]]
    budgets = [b for r in ok for b in r["budgets"]]
    compared = [r for r in ok if r.get("identical") is not None]
    spec = base_method(m) in SPECULATIVE
    return {
        "prompts_ok": len(ok), "prompts_failed": len(recs) - len(ok), "new_tokens": new, "wall_s": wall,
        "tokens_per_s": None,
        "mean_prompt_tokens_per_s": float(np.mean([r["tokens_per_s"] for r in ok])) if ok else None,
        "ms_per_token": None, "speedup": None,
        "forward_passes": passes, "mean_accepted": _ratio(new, passes),
        "acceptance_rate": _ratio(sum(r["accepted_drafts"] for r in ok), drafted) if spec else None,
        "no_draft_share": _ratio(sum(r["no_draft_steps"] for r in ok), steps) if spec else None,
        "retrieve_ms_p50": float(np.percentile(ret, 50)) if ret else None,
        "retrieve_ms_p99": float(np.percentile(ret, 99)) if ret else None,
        "verify_cost_rel_model": float(np.mean([cm.relative_cost(q) for q in qs])) if qs else None,
        "forward_ms_per_step": float(np.mean(fwd)) if fwd else None,
        "verify_cost_rel_measured": None,
        "mean_budget": float(np.mean(budgets)) if budgets and base_method(m) in REST_METHODS else None,
        "identical": sum(bool(r["identical"]) for r in compared), "compared": len(compared),
    }


def _round_speed(records: list[dict], methods: Sequence[str]) -> list[dict]:
    """Each round's suite figures per method: tokens/s and ms/token (all its tokens, all its wall time)."""
    rounds = []
    for k in sorted({r.get("round", 0) for r in records}):
        ok = [r for r in records if r.get("round", 0) == k and r["ok"]]
        new = {m: sum(r["new_tokens"] for r in ok if r["method"] == m) for m in methods}
        wall = {m: sum(r["wall_s"] for r in ok if r["method"] == m) for m in methods}
        rounds.append({"round": k, "tokens_per_s": {m: _ratio(new[m], wall[m]) for m in methods},
                       "ms_per_token": {m: _ratio(wall[m] * 1e3, new[m]) for m in methods}})
    return rounds


def _speed(out: dict, rounds: list[dict], greedy: bool) -> str | None:
    """Fill tokens/s, ms/token and speedup (medians over rounds, speedup spread); return the baseline."""
    for m, s in out.items():
        s["tokens_per_s"] = _median([r["tokens_per_s"][m] for r in rounds])
        s["ms_per_token"] = _median([r["ms_per_token"][m] for r in rounds])
    bases = ("plain", "hf_greedy") if greedy else ("plain",)  # with either kernels: the fastest is the baseline
    base_names = [m for m in out if base_method(m) in bases and out[m].get("tokens_per_s")]
    baseline = max(base_names, key=lambda m: out[m]["tokens_per_s"]) if base_names else None
    for r in rounds:  # speedup in a round: over the baseline's tokens/s in that same round
        r["speedup"] = {m: _ratio(t, r["tokens_per_s"].get(baseline)) for m, t in r["tokens_per_s"].items()}
    for m, s in out.items():
        ups = [r["speedup"][m] for r in rounds if r["speedup"][m] is not None]
        s["speedup"] = _median(ups)
        s["speedup_min"], s["speedup_max"] = min(ups, default=None), max(ups, default=None)
    return baseline


def summarize(records: list[dict], methods: Sequence[str], greedy: bool, cost_model: dict) -> dict:
    """Per-method numbers, computed from the per-prompt records only (see the module docstring for rounds)."""
    cm = CostModel(grid=tuple(cost_model["grid"]), times_ms=np.array(cost_model["times_ms"], dtype=float))
    out = {m: _method_summary(m, [r for r in records if r["method"] == m], cm) for m in methods}
    rounds = _round_speed(records, methods)
    baseline = _speed(out, rounds, greedy)
    plain_fwd = out.get("plain", {}).get("forward_ms_per_step")
    for s in out.values():
        if plain_fwd and s["forward_ms_per_step"] is not None:
            s["verify_cost_rel_measured"] = s["forward_ms_per_step"] / plain_fwd
    return {"baseline": baseline, "reference": reference_method(methods, greedy),
            "methods": out, "rounds": rounds, "by_source": source_summary(records, methods),
            "per_prompt": per_prompt_ratios(records, PER_PROMPT_METHOD, baseline),
            "per_prompt_default_kernels": per_prompt_ratios(records, PER_PROMPT_METHOD + DEFAULT_KERNELS, baseline)}


def reference_method(methods: Sequence[str], greedy: bool) -> str:
    """Whose output the others must equal: generate() with transformers' own kernels where it ran (greedy),
    else generate() with the tuned kernels, else (sampling) our plain loop."""
    for m in (("hf_greedy" + DEFAULT_KERNELS, "hf_greedy") if greedy else ()):
        if m in methods:
            return m
    return "plain"


def source_summary(records: list[dict], methods: Sequence[str]) -> dict:
    """Per REST method and draft source: draft nodes sent to the model, committed draft tokens and their
    ratio, summed over every prompt and round the method completed.  Sources in the stores' merge order."""
    out = {}
    for m in (m for m in methods if base_method(m) in REST_METHODS):
        ok = [r for r in records if r["method"] == m and r["ok"]]
        names = list(dict.fromkeys(s for r in ok for s in r.get("sources", ())))
        names += sorted({s for r in ok for s in r.get("drafted_by_source", {})} - set(names))
        drafted = {s: sum(r.get("drafted_by_source", {}).get(s, 0) for r in ok) for s in names}
        accepted = {s: sum(r.get("accepted_by_source", {}).get(s, 0) for r in ok) for s in names}
        out[m] = {s: {"drafted": drafted[s], "accepted": accepted[s],
                      "acceptance_rate": _ratio(accepted[s], drafted[s])} for s in names}
    return out


def per_prompt_ratios(records: list[dict], method: str, baseline: str | None) -> dict | None:
    """Per prompt: `method`'s tokens/s over the baseline's on that prompt in each round (None where either
    failed), with the median and the min and max over rounds.  None without both methods."""
    present = {r["method"] for r in records}
    if baseline is None or method not in present or baseline not in present:
        return None
    by: dict[str, dict[int, dict]] = {}
    for r in records:
        if r["method"] in (method, baseline):
            by.setdefault(r["prompt"], {}).setdefault(r.get("round", 0), {})[r["method"]] = r
    prompts = []
    for pid, rounds in by.items():
        ratios = []
        for k in sorted(rounds):
            a, b = rounds[k].get(method), rounds[k].get(baseline)
            both = a is not None and b is not None and a["ok"] and b["ok"]
            ratios.append(_ratio(a["tokens_per_s"], b["tokens_per_s"]) if both else None)
        got = [x for x in ratios if x is not None]
        prompts.append({"prompt": pid, "ratios": ratios, "median": _median(got), "min": min(got, default=None),
                        "max": max(got, default=None)})
    return {"method": method, "baseline": baseline, "prompts": prompts}


def _plain_vs_hf(by_prompt, plain: str, hf: str) -> dict:
    """Our plain loop's time per token over generate()'s, on the prompts and rounds where both ran."""
    both = [(d[plain], d[hf]) for d in by_prompt if d.get(plain, {}).get("ok") and d.get(hf, {}).get("ok")]
    if not both:
        return {}
    ours = sum(a["wall_s"] for a, _ in both) / max(1, sum(a["new_tokens"] for a, _ in both))
    ref = sum(b["wall_s"] for _, b in both) / max(1, sum(b["new_tokens"] for _, b in both))
    ratio = ours / ref if ref else None
    out = {"plain_vs_hf_ms_per_token_ratio": ratio,
           "plain_within_5pct_of_hf": ratio is not None and abs(ratio - 1.0) <= PLAIN_TOLERANCE}
    if ratio is not None and not out["plain_within_5pct_of_hf"]:
        out["plain_vs_hf_flag"] = (f"our plain loop takes {ratio:.3f}x the time per token of generate() "
                                   f"({'slower' if ratio > 1 else 'faster'} by more than 5%)")
    return out


def checks(records: list[dict], summary: dict, greedy: bool) -> dict:
    """Plain loop vs generate() per token (prompts where both ran), and outputs that differ."""
    out = {}
    by = {}
    for r in records:
        by.setdefault((r.get("round", 0), r["prompt"]), {})[r["method"]] = r
    if greedy:
        out.update(_plain_vs_hf(by.values(), "plain", "hf_greedy"))
        if any("plain" + DEFAULT_KERNELS in d for d in by.values()):  # the default-kernel pair, beside it
            out["default_kernels"] = _plain_vs_hf(by.values(), "plain" + DEFAULT_KERNELS, "hf_greedy" + DEFAULT_KERNELS)
    out["differences"] = [{"prompt": r["prompt"], "round": r.get("round", 0), "method": r["method"],
                           "reference": r["reference"], **r.get("difference", {})}
                          for r in records if r.get("identical") is False]
    out["errors"] = [{"prompt": r["prompt"], "round": r.get("round", 0), "method": r["method"], "error": r["error"]}
                     for r in records if not r["ok"]]
    out["forward_log_inconsistent"] = [{"prompt": r["prompt"], "method": r["method"]} for r in records
                                       if r["ok"] and not r.get("log_consistent", True)]
    return out


# -- sampling: the first-token distribution -----------------------------------------------------------

def chi_square(counts: Counter, probs: np.ndarray, runs: int, min_expected: float = 5.0) -> dict:
    """Goodness of fit of observed token counts to probs; tokens with small expected counts share one bin."""
    expected = probs * runs
    keep = np.flatnonzero(expected >= min_expected)
    keep_set = {int(k) for k in keep}
    obs = [counts.get(int(k), 0) for k in keep]
    exp = [float(expected[k]) for k in keep]
    rest_obs = sum(c for t, c in counts.items() if t not in keep_set)
    rest_exp = float(runs - sum(exp))
    if rest_exp > 1e-9 or rest_obs:
        obs.append(rest_obs)
        exp.append(max(rest_exp, 1e-9))
    if len(obs) < 2:
        note = ("too few runs for a test: no token is expected 5 times" if not keep.size
                else "the distribution is too concentrated for a test")
        return {"statistic": None, "dof": 0, "p_value": None, "bins": len(obs), "note": note}
    stat = float(sum((o - e) ** 2 / e for o, e in zip(obs, exp)))
    dof = len(obs) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return {"statistic": stat, "dof": dof, "p_value": p, "bins": len(obs)}


def _first_tokens(runner: MethodRunner, method: str, prompt: BenchPrompt, one: DecodeConfig, seeds: int,
                  probs: np.ndarray, progress: bool) -> dict:
    """The first new token of `method` over seeds 0..seeds-1, tested against probs."""
    counts, drafted, errors = Counter(), 0, 0
    for s in tqdm(range(seeds), desc=f"chi2 {prompt.id} {method}", leave=False, disable=not progress):
        rec = runner.run(method, prompt.ids, replace(one, sampling=replace(one.sampling, seed=s)),
                         update_history=False)
        if not rec["ok"] or not rec["tokens"]:
            errors += 1
            continue
        counts[rec["tokens"][0]] += 1
        drafted += rec["draft_tokens"] > 0
    runs = sum(counts.values())
    result = chi_square(counts, probs, runs) if runs else {"p_value": None, "note": "no successful run"}
    result.update(runs=runs, errors=errors, share_with_drafts=drafted / runs if runs else None,
                  top_tokens=[[int(t), c, round(float(probs[t]) * runs, 2)] for t, c in counts.most_common(5)])
    return result


def first_token_check(runner: MethodRunner, prompts: Sequence[BenchPrompt], cfg: DecodeConfig, seeds: int,
                      progress: bool = True) -> dict:
    """First-token frequencies over many seeds against the exact sampling distribution (chi-square)."""
    lm = runner.lm
    one = replace(cfg, max_new_tokens=1)
    report = {"seeds": seeds, "what": "first new token over seeds 0..S-1 (max_new_tokens=1), against the model's "
              "exact distribution after temperature/top-k/top-p; rest_full's history is not updated (the model "
              "tables learn from these passes too)", "prompts": []}
    for p in prompts:
        with torch.inference_mode():
            logits = lm.model(input_ids=torch.tensor([list(p.ids)], device=lm.device)).logits[0, -1]  # (V,)
        probs = next_token_probs(logits, cfg.sampling).double().cpu().numpy()
        report["prompts"].append({"prompt": p.id, "methods": {
            m: _first_tokens(runner, m, p, one, seeds, probs, progress) for m in runner.methods}})
    return report


def recording_overhead(records: list[dict], runner: MethodRunner) -> dict:
    """Wall time per step with and without the SQLite recorder (same stores, interleaved runs)."""
    per = {}
    for m in ("rest_static", TRACED):
        done = [r for r in records if r["method"] == m and r["ok"]]
        steps = sum(r["steps"] for r in done)
        per[m] = {"steps": steps, "wall_s": sum(r["wall_s"] for r in done),
                  "ms_per_step": 1e3 * sum(r["wall_s"] for r in done) / steps if steps else None,
                  "ms_per_token": 1e3 * sum(r["wall_s"] for r in done) / max(1, sum(r["new_tokens"] for r in done))}
    db = runner.trace_dir / "trace.sqlite"
    size = sum(f.stat().st_size for f in runner.trace_dir.iterdir() if f.name.startswith("trace.sqlite"))
    base, traced = per["rest_static"]["ms_per_step"], per[TRACED]["ms_per_step"]
    db_steps = sum(r["steps"] or 0 for r in runner.recorder.list_runs())  # the untimed warm-up is stored too
    return {"per_method": per, "overhead_per_step": (traced / base - 1) if base and traced else None,
            "db_path": str(db), "db_bytes": size, "db_steps": db_steps,
            "db_bytes_per_1000_steps": 1000 * size / db_steps if db_steps else None}
