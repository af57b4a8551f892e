"""`python -m rest_core bench`: REST against plain decoding and Hugging Face generate(), measured.

Every method runs on every prompt in one process with the same model and dtype,
interleaved prompt by prompt (the order rotates per prompt) so machine noise hits
all methods alike.  Each call is timed whole, prefill included.  Nothing is
estimated: forward passes, query sizes and forward times come from hooks on the
model, drafts and acceptances from the decoders' own counts.

Methods
  plain             our plain autoregressive loop
  hf_greedy         transformers generate(do_sample=False): the reference output
  hf_prompt_lookup  transformers generate(prompt_lookup_num_tokens=10)
  rest_static       REST with the static store only (the paper's method)
  rest_full         static + request + history stores; the history is in memory
                    and holds this run's earlier answers of rest_full (empty at first)

`--temperature > 0` runs plain, rest_static and rest_full with the same seed per
prompt and checks the distribution.  `--suite retrieval` times store lookups
against store size instead (see `run_retrieval`).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import sys
import time
import traceback
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from rest_core.bench.suites import SUITES, BenchPrompt, load_suite

GREEDY_METHODS = ("plain", "hf_greedy", "hf_prompt_lookup", "rest_static", "rest_full")
SAMPLING_METHODS = ("plain", "rest_static", "rest_full")
# opt-in: rest_static with every step recorded to SQLite, to measure the recorder's overhead
TRACED = "rest_static_traced"
SPECULATIVE = ("hf_prompt_lookup", "rest_static", "rest_full")
REST_METHODS = ("rest_static", "rest_full", TRACED)
PLAIN_TOLERANCE = 0.05  # our plain loop should be within 5% of generate() per token
SUMMARY_KEYS = ("prompts_ok", "prompts_failed", "new_tokens", "wall_s", "tokens_per_s", "mean_prompt_tokens_per_s",
                "ms_per_token", "speedup", "forward_passes", "mean_accepted", "acceptance_rate", "no_draft_share",
                "retrieve_ms_p50", "retrieve_ms_p99", "verify_cost_rel_model", "forward_ms_per_step",
                "verify_cost_rel_measured", "mean_budget", "identical", "compared")


# -- forward-call log ---------------------------------------------------------------------------------

class ForwardLog:
    """Hooks on the model: the query length and wall time (ms) of every forward call."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.calls: list[tuple[int, float]] = []
        self._q = 0
        self._t0 = 0.0
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        self._q = int(ids.shape[1]) if ids is not None else 0
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.calls.append((self._q, (time.perf_counter() - self._t0) * 1e3))

    def reset(self) -> None:
        self.calls = []

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def cut_at_eos(tokens: Sequence[int], eos: set[int]) -> list[int]:
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos:
            break
    return out


def same_output(a: Sequence[int], b: Sequence[int], eos: set[int]) -> bool:
    """Equal up to the shorter length, both cut at their first EOS."""
    a, b = cut_at_eos(a, eos), cut_at_eos(b, eos)
    m = min(len(a), len(b))
    return a[:m] == b[:m]


# -- running one method on one prompt ------------------------------------------------------------------

class MethodRunner:
    """Runs any method on a prompt and returns one raw record (numbers only measured here)."""

    def __init__(self, lm, static_store, cfg, methods: Sequence[str], prompt_lookup_tokens: int = 10):
        from datastores import HistoryStore

        from rest_core.cost import CostModel
        from rest_core.decode import RestDecoder

        self.lm, self.cfg, self.methods = lm, cfg, tuple(methods)
        self.eos = lm.eos_token_ids
        self.prompt_lookup_tokens = prompt_lookup_tokens
        auto = cfg.draft_budget is None
        self.cost_model = CostModel.for_model(lm)  # the calibrated curve, for the relative verify cost
        self.decoders = {}
        if "rest_static" in methods:
            self.decoders["rest_static"] = RestDecoder(lm, static_store=static_store, history_store=None,
                                                       use_request_store=False,
                                                       budget_chooser=CostModel.for_model(lm) if auto else None)
        if TRACED in methods:
            import tempfile

            from rest_core.traces.recorder import TraceRecorder

            self.trace_dir = Path(tempfile.mkdtemp(prefix="rest-bench-trace-"))
            self.recorder = TraceRecorder(self.trace_dir / "trace.sqlite")
            self.decoders[TRACED] = RestDecoder(lm, static_store=static_store, history_store=None,
                                                use_request_store=False,
                                                budget_chooser=CostModel.for_model(lm) if auto else None)
        if "rest_full" in methods:
            self.history = HistoryStore(path=None, n_max=cfg.retrieve.n_max, n_min=cfg.retrieve.n_min)
            self.decoders["rest_full"] = RestDecoder(lm, static_store=static_store, history_store=self.history,
                                                     use_request_store=True,
                                                     budget_chooser=CostModel.for_model(lm) if auto else None)
        self.log = ForwardLog(lm.model, lm.device)

    def close(self) -> None:
        self.log.close()

    def _sync(self) -> None:
        if self.lm.device.type == "cuda":
            torch.cuda.synchronize(self.lm.device)

    def run(self, method: str, prompt: Sequence[int], cfg=None, update_history: bool = True) -> dict:
        cfg = cfg or self.cfg
        rec = {"method": method, "ok": False, "error": None}
        self.log.reset()
        try:
            if method.startswith("hf_"):
                rec.update(self._run_hf(method, prompt, cfg))
            else:
                rec.update(self._run_ours(method, prompt, cfg, update_history))
            rec["ok"] = True
        except Exception as err:  # noqa: BLE001 - a failing method is recorded, the run goes on
            rec["error"] = f"{type(err).__name__}: {err}"
            rec["traceback"] = traceback.format_exc(limit=4)
        finally:
            self.log.reset()
        return rec

    def _run_ours(self, method: str, prompt, cfg, update_history: bool) -> dict:
        from rest_core.decode import plain_generate

        t0 = time.perf_counter()
        if method == "plain":
            res = plain_generate(self.lm, prompt, cfg)
        elif method == TRACED:
            run_id = self.recorder.start_run(model=self.lm.name, tokenizer_name=self.lm.name, stores=["static"],
                                             settings={"bench": True}, prompt="", prompt_tokens=list(prompt))
            res = self.decoders[method].generate(prompt, cfg, hook=self.recorder.step_hook(run_id, self.lm.tokenizer))
            self.recorder.finish_run(run_id, output=res.text, new_tokens=res.new_tokens, steps=res.steps,
                                     wall_s=res.wall_s, mean_accepted=res.mean_accepted)
        else:
            res = self.decoders[method].generate(prompt, cfg, update_history=update_history)
        self._sync()
        wall = time.perf_counter() - t0
        calls = list(self.log.calls)
        steps = calls[len(calls) - res.steps:] if res.steps else []
        rec = self._common(res.tokens, wall, calls, steps, forward_passes=res.steps)
        rec.update(prefill_calls=len(calls) - res.steps, stop_reason=res.stop_reason, steps=res.steps,
                   accepted_drafts=res.accepted_drafts if method != "plain" else 0,
                   draft_tokens=res.draft_tokens if method != "plain" else 0,
                   no_draft_steps=res.no_draft_steps if method != "plain" else res.steps,
                   retrieve_ms=[round(x, 4) for x in res.retrieve_ms], budgets=list(res.budgets),
                   phase_ms={k: round(v, 3) for k, v in res.phase_ms.items()},
                   log_consistent=len(calls) == res.steps + (len(prompt) > 1))
        return rec

    def _run_hf(self, method: str, prompt, cfg) -> dict:
        from rest_core.decode import _check_prompt

        if not cfg.sampling.greedy:
            raise ValueError("The Hugging Face methods run greedy only in this benchmark.")
        room = _check_prompt(self.lm, prompt, cfg)  # the same room our loops get
        ids = torch.tensor([list(prompt)], device=self.lm.device)
        eos = sorted(self.eos)
        pad = getattr(self.lm.tokenizer, "pad_token_id", None)
        pad = pad if isinstance(pad, int) else (eos[0] if eos else 0)
        kw = dict(max_new_tokens=room, do_sample=False, eos_token_id=(eos or None) if cfg.stop_at_eos else None,
                  pad_token_id=pad)
        if method == "hf_prompt_lookup":
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        self._sync()
        wall = time.perf_counter() - t0
        new = [int(t) for t in out[0, len(prompt):].tolist()]
        if cfg.stop_at_eos:
            new = cut_at_eos(new, self.eos)
        calls = list(self.log.calls)
        # the first call runs the prompt (plus any first drafts) and yields the first token; later calls feed
        # the newest token plus the drafts to verify
        drafts = ([max(0, calls[0][0] - len(prompt))] if calls else []) + [q - 1 for q, _ in calls[1:]]
        rec = self._common(new, wall, calls, calls[1:], forward_passes=len(calls))
        rec.update(prefill_calls=0, steps=len(calls),
                   stop_reason="eos" if new and new[-1] in self.eos and cfg.stop_at_eos else "length",
                   accepted_drafts=max(0, len(new) - len(calls)), draft_tokens=int(sum(drafts)),
                   no_draft_steps=int(sum(d == 0 for d in drafts)), retrieve_ms=[], budgets=[], phase_ms={},
                   log_consistent=bool(calls))
        return rec

    def _common(self, tokens, wall, calls, step_calls, forward_passes) -> dict:
        n = len(tokens)
        return {"tokens": [int(t) for t in tokens], "new_tokens": n, "wall_s": wall,
                "tokens_per_s": n / wall if wall > 0 else 0.0, "forward_passes": int(forward_passes),
                "forward_calls": len(calls),
                "step_query_sizes": [int(q) for q, _ in step_calls],
                "step_forward_ms": [round(ms, 4) for _, ms in step_calls]}


# -- the benchmark ------------------------------------------------------------------------------------

def rotated(methods: Sequence[str], i: int) -> list[str]:
    k = i % len(methods)
    return list(methods[k:]) + list(methods[:k])


def run_benchmark(lm, prompts: Sequence[BenchPrompt], cfg, methods: Optional[Sequence[str]] = None,
                  static_store=None, out_dir=None, *, suite: str = "custom", datastore: str = "",
                  command: str = "", prompt_lookup_tokens: int = 10, chi2_prompts: int = 1, chi2_seeds: int = 200,
                  png: bool = True, progress: bool = True) -> dict:
    """Run every method on every prompt; write results.json/.md and the charts to out_dir; return the results."""
    from tqdm.auto import tqdm
    import transformers

    cfg.validate()
    greedy = cfg.sampling.greedy
    allowed = GREEDY_METHODS if greedy else SAMPLING_METHODS
    methods = tuple(methods or allowed)
    bad = [m for m in methods if m not in allowed + (TRACED,)]
    if bad:
        raise ValueError(f"Methods {bad} are not available {'in greedy mode' if greedy else 'when sampling'}: "
                         f"choose from {', '.join(allowed)}.")
    if not prompts:
        raise ValueError("The suite has no prompts.")
    base_seed = cfg.sampling.seed if cfg.sampling.seed is not None else 0
    results = {"settings": _settings(cfg, suite, methods, datastore, static_store, len(prompts), prompt_lookup_tokens,
                                     base_seed),
               "machine": machine_info(lm), "command": command, "warmup": [], "prompts": [], "records": [],
               "started_at": _dt.datetime.now().isoformat(timespec="seconds")}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate() warns about sampling flags unused in greedy mode
    runner = MethodRunner(lm, static_store, cfg, methods, prompt_lookup_tokens)
    results["settings"]["cost_model"] = {"grid": list(runner.cost_model.grid),
                                         "times_ms": [round(float(t), 4) for t in runner.cost_model.times_ms]}
    interrupted = False
    try:
        warm_cfg = replace(cfg, max_new_tokens=min(16, cfg.max_new_tokens),
                           sampling=replace(cfg.sampling, seed=base_seed))
        for m in methods:  # not timed, not added to the history
            rec = runner.run(m, prompts[0].ids, warm_cfg, update_history=False)
            results["warmup"].append({"method": m, "ok": rec["ok"], "error": rec["error"]})
        bar = tqdm(total=len(prompts) * len(methods), desc=f"bench {suite}", unit="run", disable=not progress)
        for i, p in enumerate(prompts):
            results["prompts"].append({"id": p.id, "prompt_tokens": len(p.ids), "grounded": p.grounded,
                                       "text": p.text})
            pcfg = cfg if greedy else replace(cfg, sampling=replace(cfg.sampling, seed=base_seed + i))
            by_method = {}
            for k, m in enumerate(rotated(methods, i)):
                bar.set_postfix_str(f"{p.id} {m}")
                rec = runner.run(m, p.ids, pcfg)
                rec.update(prompt=p.id, prompt_index=i, order=k, seed=None if greedy else base_seed + i)
                by_method[m] = rec
                results["records"].append(rec)
                bar.update(1)
            _compare(lm, p, by_method, greedy, runner.eos)
        bar.close()
        if not greedy and chi2_prompts > 0 and chi2_seeds > 0:
            results["distribution_check"] = first_token_check(runner, prompts[:chi2_prompts], cfg, chi2_seeds,
                                                              progress=progress)
        elif not greedy:
            results["distribution_check"] = {"skipped": "--chi2-seeds 0 or --chi2-prompts 0"}
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        runner.close()
        transformers.logging.set_verbosity(verbosity)
        results["interrupted"] = interrupted
        results["machine"]["loadavg_end"] = _loadavg()
        results["summary"] = summarize(results["records"], methods, greedy, results["settings"]["cost_model"])
        results["checks"] = checks(results["records"], results["summary"], greedy)
        if TRACED in methods:
            results["recording"] = recording_overhead(results["records"], runner)
        if out_dir is not None:
            write_outputs(results, Path(out_dir), png=png)
    return results


def _compare(lm, prompt: BenchPrompt, by_method: dict, greedy: bool, eos: set[int]) -> None:
    """Mark each record identical (or not) to the reference: hf_greedy when greedy (else plain), plain when sampling."""
    from rest_core.cli import first_difference

    ref_name = "hf_greedy" if greedy and by_method.get("hf_greedy", {}).get("ok") else "plain"
    ref = by_method.get(ref_name)
    for m, rec in by_method.items():
        rec["reference"] = ref_name
        if not rec["ok"] or ref is None or not ref["ok"]:
            rec["identical"] = None
            continue
        rec["identical"] = same_output(ref["tokens"], rec["tokens"], eos)
        if not rec["identical"]:
            a, b = cut_at_eos(ref["tokens"], eos), cut_at_eos(rec["tokens"], eos)
            if greedy:
                diff = first_difference(lm, list(prompt.ids), a, b)
                if "tokens" in diff:
                    diff["tokens"] = {"reference": diff["tokens"]["plain"], "this": diff["tokens"]["rest"]}
            else:
                diff = {"first_difference": next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}
            rec["difference"] = diff


def _settings(cfg, suite, methods, datastore, static_store, n_prompts, prompt_lookup_tokens, base_seed) -> dict:
    s = cfg.sampling
    return {"suite": suite, "prompts": n_prompts, "methods": list(methods), "mode": "greedy" if s.greedy else "sampling",
            "max_new_tokens": cfg.max_new_tokens, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
            "seed_base": None if s.greedy else base_seed, "stop_at_eos": cfg.stop_at_eos,
            "n_max": cfg.retrieve.n_max, "n_min": cfg.retrieve.n_min, "max_matches": cfg.retrieve.max_matches,
            "continuation_len": cfg.retrieve.continuation_len, "draft_budget": cfg.draft_budget or "auto",
            "prompt_lookup_num_tokens": prompt_lookup_tokens, "datastore": datastore,
            "static_store": None if static_store is None else {"path": str(getattr(static_store, "path", "")),
                                                                "n_tokens": int(getattr(static_store, "n_tokens", 0))},
            "history": "in memory, empty at the start; rest_full adds each of its answers after the prompt",
            "warmup": "one prompt (the first), every method, max 16 tokens, not timed"}


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(lm) -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": usable, "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "device": str(lm.device), "dtype": str(lm.dtype).replace("torch.", ""), "model": lm.name,
            "model_source": lm.source, "loadavg_start": _loadavg()}
    if lm.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(lm.device)
    return info


# -- summary ------------------------------------------------------------------------------------------

def _ratio(a, b):
    return a / b if b else None


def summarize(records: list[dict], methods: Sequence[str], greedy: bool, cost_model: dict) -> dict:
    """Per-method numbers, computed from the per-prompt records only."""
    from rest_core.cost import CostModel

    cm = CostModel(grid=tuple(cost_model["grid"]), times_ms=np.array(cost_model["times_ms"], dtype=float))
    out = {}
    for m in methods:
        recs = [r for r in records if r["method"] == m]
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
        spec = m in SPECULATIVE
        out[m] = {
            "prompts_ok": len(ok), "prompts_failed": len(recs) - len(ok), "new_tokens": new, "wall_s": wall,
            "tokens_per_s": _ratio(new, wall),
            "mean_prompt_tokens_per_s": float(np.mean([r["tokens_per_s"] for r in ok])) if ok else None,
            "ms_per_token": _ratio(wall * 1e3, new),
            "speedup": None,
            "forward_passes": passes, "mean_accepted": _ratio(new, passes),
            "acceptance_rate": _ratio(sum(r["accepted_drafts"] for r in ok), drafted) if spec else None,
            "no_draft_share": _ratio(sum(r["no_draft_steps"] for r in ok), steps) if spec else None,
            "retrieve_ms_p50": float(np.percentile(ret, 50)) if ret else None,
            "retrieve_ms_p99": float(np.percentile(ret, 99)) if ret else None,
            "verify_cost_rel_model": float(np.mean([cm.relative_cost(q) for q in qs])) if qs else None,
            "forward_ms_per_step": float(np.mean(fwd)) if fwd else None,
            "verify_cost_rel_measured": None,
            "mean_budget": float(np.mean(budgets)) if budgets and m in REST_METHODS else None,
            "identical": sum(bool(r["identical"]) for r in compared), "compared": len(compared),
        }
    base_names = [m for m in (("plain", "hf_greedy") if greedy else ("plain",)) if out.get(m, {}).get("tokens_per_s")]
    baseline = max(base_names, key=lambda m: out[m]["tokens_per_s"]) if base_names else None
    plain_fwd = out.get("plain", {}).get("forward_ms_per_step")
    for m, s in out.items():
        if baseline and s["tokens_per_s"] is not None:
            s["speedup"] = s["tokens_per_s"] / out[baseline]["tokens_per_s"]
        if plain_fwd and s["forward_ms_per_step"] is not None:
            s["verify_cost_rel_measured"] = s["forward_ms_per_step"] / plain_fwd
    return {"baseline": baseline, "reference": "hf_greedy" if greedy and "hf_greedy" in methods else "plain",
            "methods": out}


def checks(records: list[dict], summary: dict, greedy: bool) -> dict:
    """Plain loop vs generate() per token (prompts where both ran), and outputs that differ."""
    out = {}
    by = {}
    for r in records:
        by.setdefault(r["prompt"], {})[r["method"]] = r
    both = [(d["plain"], d["hf_greedy"]) for d in by.values()
            if d.get("plain", {}).get("ok") and d.get("hf_greedy", {}).get("ok")]
    if greedy and both:
        ours = sum(a["wall_s"] for a, _ in both) / max(1, sum(a["new_tokens"] for a, _ in both))
        hf = sum(b["wall_s"] for _, b in both) / max(1, sum(b["new_tokens"] for _, b in both))
        ratio = ours / hf if hf else None
        out["plain_vs_hf_ms_per_token_ratio"] = ratio
        out["plain_within_5pct_of_hf"] = ratio is not None and abs(ratio - 1.0) <= PLAIN_TOLERANCE
        if ratio is not None and not out["plain_within_5pct_of_hf"]:
            out["plain_vs_hf_flag"] = (f"our plain loop takes {ratio:.3f}x the time per token of generate() "
                                       f"({'slower' if ratio > 1 else 'faster'} by more than 5%)")
    out["differences"] = [{"prompt": r["prompt"], "method": r["method"], "reference": r["reference"],
                           **r.get("difference", {})} for r in records if r.get("identical") is False]
    out["errors"] = [{"prompt": r["prompt"], "method": r["method"], "error": r["error"]}
                     for r in records if not r["ok"]]
    out["forward_log_inconsistent"] = [{"prompt": r["prompt"], "method": r["method"]} for r in records
                                       if r["ok"] and not r.get("log_consistent", True)]
    return out


# -- sampling: the first-token distribution -----------------------------------------------------------

def chi_square(counts: Counter, probs: np.ndarray, runs: int, min_expected: float = 5.0) -> dict:
    """Goodness of fit of observed token counts to probs; tokens with small expected counts share one bin."""
    expected = probs * runs
    keep = np.flatnonzero(expected >= min_expected)
    keep_set = set(int(k) for k in keep)
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


def first_token_check(runner: MethodRunner, prompts: Sequence[BenchPrompt], cfg, seeds: int,
                      progress: bool = True) -> dict:
    """First-token frequencies over many seeds against the exact sampling distribution (chi-square)."""
    from tqdm.auto import tqdm

    from rest_core.sampling import next_token_probs

    lm = runner.lm
    one = replace(cfg, max_new_tokens=1)
    report = {"seeds": seeds, "what": "first new token over seeds 0..S-1 (max_new_tokens=1), against the model's "
              "exact distribution after temperature/top-k/top-p; rest_full's history is not updated", "prompts": []}
    for p in prompts:
        with torch.inference_mode():
            logits = lm.model(input_ids=torch.tensor([list(p.ids)], device=lm.device)).logits[0, -1]
        probs = next_token_probs(logits, cfg.sampling).double().cpu().numpy()
        entry = {"prompt": p.id, "methods": {}}
        for m in runner.methods:
            counts, drafted, errors = Counter(), 0, 0
            for s in tqdm(range(seeds), desc=f"chi2 {p.id} {m}", leave=False, disable=not progress):
                rec = runner.run(m, p.ids, replace(one, sampling=replace(one.sampling, seed=s)), update_history=False)
                if not rec["ok"] or not rec["tokens"]:
                    errors += 1
                    continue
                counts[rec["tokens"][0]] += 1
                drafted += rec["draft_tokens"] > 0
            runs = sum(counts.values())
            result = chi_square(counts, probs, runs) if runs else {"p_value": None, "note": "no successful run"}
            result.update(runs=runs, errors=errors, share_with_drafts=drafted / runs if runs else None,
                          top_tokens=[[int(t), c, round(float(probs[t]) * runs, 2)] for t, c in counts.most_common(5)])
            entry["methods"][m] = result
        report["prompts"].append(entry)
    return report


def recording_overhead(records: list[dict], runner) -> dict:
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


# -- output -------------------------------------------------------------------------------------------

def _f(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def markdown(results: dict) -> str:
    st, mc, summ = results["settings"], results["machine"], results["summary"]
    greedy = st["mode"] == "greedy"
    lines = [f"# REST Lab benchmark: {st['suite']} ({st['mode']}, {st['prompts']} prompts, "
             f"max {st['max_new_tokens']} new tokens)", ""]
    lines.append(f"Machine: {mc['cpu']}, {mc['cores']} cores ({mc['usable_cores']} usable), torch threads "
                 f"{mc['torch_threads']}, device {mc['device']}{' (' + mc['gpu'] + ')' if mc.get('gpu') else ''}, "
                 f"{mc['dtype']}; torch {mc['torch']}, transformers {mc['transformers']}; model {mc['model']}; "
                 f"load average {mc.get('loadavg_start')} at start, {mc.get('loadavg_end')} at end.")
    lines.append("")
    lines.append(f"Command: `{results.get('command') or '(library call)'}`")
    lines.append("")
    ref = summ["reference"]
    head = ["method", "tokens/s", "speedup", "ms/token", "accepted/pass", "acceptance", "no-draft steps",
            "retrieve p50/p99 ms", "verify cost (model)", "fwd ms/step", "fwd cost (measured)", "mean budget",
            f"same as {ref}", "failed"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for m, s in summ["methods"].items():
        ret = "–" if s["retrieve_ms_p50"] is None else f"{s['retrieve_ms_p50']:.2f} / {s['retrieve_ms_p99']:.2f}"
        row = [m, _f(s["tokens_per_s"]), _f(s["speedup"], ".2f") + ("×" if s["speedup"] is not None else ""),
               _f(s["ms_per_token"], ".1f"), _f(s["mean_accepted"]), _f(s["acceptance_rate"], ".1%"),
               _f(s["no_draft_share"], ".1%"), ret, _f(s["verify_cost_rel_model"]),
               _f(s["forward_ms_per_step"], ".1f"), _f(s["verify_cost_rel_measured"]), _f(s["mean_budget"], ".1f"),
               f"{s['identical']}/{s['compared']}", str(s["prompts_failed"])]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    notes = [f"Speedup is over the faster of the baselines ({summ['baseline']}); tokens/s = all new tokens / all "
             "wall time (prefill included) over the prompts a method completed.",
             "Accepted/pass = new tokens per forward pass (ours: prefill not counted; generate(): its first call "
             "runs the prompt and yields the first token)."
             + (" HF prompt-lookup drafts are read from the query sizes of its forward calls." if greedy else ""),
             "Verify cost (model) = mean calibrated cost of the step's query size relative to a one-token pass; "
             "measured = mean forward ms per step / plain's forward ms per step.",
             "rest_full's history store is in memory and starts empty: it holds this run's earlier rest_full "
             "answers only.",
             "Methods ran interleaved prompt by prompt, the order rotating per prompt, after one untimed warm-up."]
    ch = results.get("checks", {})
    if "plain_vs_hf_ms_per_token_ratio" in ch and ch["plain_vs_hf_ms_per_token_ratio"] is not None:
        notes.append(f"Plain loop vs generate(): {ch['plain_vs_hf_ms_per_token_ratio']:.3f}× the time per token "
                     + ("(within 5%)." if ch["plain_within_5pct_of_hf"] else f"— FLAG: {ch['plain_vs_hf_flag']}."))
    if ch.get("differences"):
        for d in ch["differences"]:
            gap = f", logit gap {d['logit_gap']:.4g}" if d.get("logit_gap") is not None else ""
            notes.append(f"{d['method']} differs from {d['reference']} on {d['prompt']} at token "
                         f"{d.get('first_difference')}{gap}.")
    if ch.get("errors"):
        notes.append(f"{len(ch['errors'])} failed runs (see results.json), e.g. {ch['errors'][0]['method']} on "
                     f"{ch['errors'][0]['prompt']}: {ch['errors'][0]['error'][:200]}")
    dc = results.get("distribution_check")
    if not greedy and dc:
        if "skipped" in dc:
            notes.append(f"First-token chi-square check skipped ({dc['skipped']}).")
        for entry in dc.get("prompts", []):
            parts = []
            for m, r in entry["methods"].items():
                pv = r.get("p_value")
                parts.append(f"{m} p={pv:.3g} ({r.get('bins')} bins, drafts at the root in "
                             f"{_f(r.get('share_with_drafts'), '.0%')} of runs)" if pv is not None
                             else f"{m}: {r.get('note', 'n/a')}")
            notes.append(f"First-token chi-square over {dc['seeds']} seeds on {entry['prompt']}: " + "; ".join(parts)
                         + ".")
    rc = results.get("recording")
    if rc and rc.get("overhead_per_step") is not None:
        notes.append(f"Recording every step to SQLite: {rc['overhead_per_step']:+.1%} wall time per step "
                     f"({rc['per_method'][TRACED]['ms_per_step']:.1f} vs {rc['per_method']['rest_static']['ms_per_step']:.1f} ms), "
                     f"{rc['db_bytes_per_1000_steps'] / 1e6:.2f} MB of database per 1,000 steps.")
    if results.get("interrupted"):
        notes.append("INTERRUPTED: partial results.")
    if results.get("png_note"):
        notes.append(results["png_note"])
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def chart(results: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    summ = results["summary"]["methods"]
    names = list(summ)
    tps = [summ[m]["tokens_per_s"] or 0 for m in names]
    acc = [summ[m]["mean_accepted"] or 0 for m in names]
    labels = [f"{summ[m]['speedup']:.2f}×" if summ[m]["speedup"] is not None else "" for m in names]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens/s (speedup over the faster baseline)",
                                                        "mean new tokens per forward pass"))
    fig.add_trace(go.Bar(x=names, y=tps, text=labels, textposition="outside", marker_color="#4c78a8",
                         name="tokens/s"), row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=acc, text=[f"{a:.2f}" for a in acc], textposition="outside",
                         marker_color="#f58518", name="accepted/pass"), row=1, col=2)
    st, mc = results["settings"], results["machine"]
    fig.update_layout(title=f"REST Lab bench: {st['suite']}, {st['mode']}, {st['prompts']} prompts, "
                            f"{mc['model']} on {mc['device']} ({mc['cpu']})",
                      showlegend=False, height=480, width=1150, margin=dict(t=90))
    fig.update_yaxes(rangemode="tozero")
    return fig


def write_png(fig, path: Path) -> Optional[str]:
    """Write a PNG with kaleido (Chromium at /usr/bin/chromium when present); a note when it cannot."""
    if not os.environ.get("BROWSER_PATH") and Path("/usr/bin/chromium").exists():
        os.environ["BROWSER_PATH"] = "/usr/bin/chromium"
    try:
        fig.write_image(str(path), width=1150, height=480)
        return None
    except Exception as err:  # noqa: BLE001 - the PNG is optional
        return f"chart.png skipped: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def write_outputs(results: dict, out: Path, png: bool = True, fig=None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fig = fig if fig is not None else chart(results)
    fig.write_html(str(out / "chart.html"), include_plotlyjs=True)
    results["png_note"] = (write_png(fig, out / "chart.png") if png else "chart.png not written (--no-png)")
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False), encoding="utf-8")
    (out / "results.md").write_text(markdown(results), encoding="utf-8")


# -- retrieval micro-benchmark ------------------------------------------------------------------------

def prefix_store(base, n_tokens: int, cache_root: Optional[Path] = None):
    """A store holding the first n_tokens of base's stream (whole documents, the last cut), built once and cached."""
    from datastores import DatastoreError, TokenDatastore, build_from_token_documents, cache_dir
    from datastores.common import SEP
    from datastores.static import TOKENS_NAME

    stamp = str(base.meta["files"][TOKENS_NAME]["sample_sha256"])[:10]
    path = (cache_root or cache_dir() / "bench-stores") / f"{base.path.name}-{stamp}-{n_tokens}"
    try:
        return TokenDatastore.open(path)
    except DatastoreError:
        pass
    toks = base._tokens[:n_tokens]  # (n,) uint32 view of the memory map
    cuts = np.flatnonzero(toks == SEP)

    def documents():
        start = 0
        for c in [*cuts.tolist(), int(toks.size)]:
            if c > start:
                yield np.asarray(toks[start:c], dtype=np.int64)
            start = c + 1

    return build_from_token_documents(path, documents(), tokenizer_info=dict(base.meta["tokenizer"]),
                                      max_tokens=n_tokens, overwrite=True)


def run_retrieval(base, sizes: Sequence[int], tokenizer=None, heldout_texts: Sequence[str] = (), out_dir=None, *,
                  count: int = 2000, lookup: Optional[dict] = None, command: str = "", png: bool = True,
                  progress: bool = True, cache_root: Optional[Path] = None) -> dict:
    """Lookup latency p50/p99 against store size, build throughput and bytes per token (from meta.json)."""
    from tqdm.auto import tqdm

    from datastores.microbench import bench_store

    lookup = dict(lookup or {})
    sizes = sorted({int(s) for s in sizes if 0 < int(s) < base.n_tokens}) + [base.n_tokens]
    rows = []
    for n in tqdm(sizes, desc="retrieval", unit="store", disable=not progress):
        store = base if n == base.n_tokens else prefix_store(base, n, cache_root)
        rep = bench_store(store, tokenizer, heldout_texts, count=count, **lookup)
        b = store.meta["build"]
        pretokenized = store.meta["tokenizer"].get("name") == "pre-tokenized" or any(
            s.get("kind") == "token-documents" for s in store.meta.get("sources", []))
        rows.append({"store": str(store.path), "n_tokens": store.n_tokens, "prefix_of_base": store is not base,
                     "inside": rep.get("inside"), "heldout": rep.get("heldout"), "lookup": rep["lookup"],
                     "tokenize_tokens_per_s": None if pretokenized else b.get("tokenize_tokens_per_s"),
                     "suffix_array_tokens_per_s": b.get("suffix_array_tokens_per_s"),
                     "suffix_array_s": b.get("suffix_array_s"), "bytes_per_token": b.get("bytes_per_token"),
                     "total_bytes": b.get("total_bytes"), "built_at": store.meta.get("built_at")})
    results = {"settings": {"suite": "retrieval", "sizes": sizes, "contexts": count, "lookup": rows[0]["lookup"],
                            "heldout_texts": len(heldout_texts), "base_store": str(base.path)},
               "machine": machine_info_cpu(), "command": command, "stores": rows}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        fig = retrieval_chart(results)
        fig.write_html(str(out / "chart.html"), include_plotlyjs=True)
        results["png_note"] = write_png(fig, out / "chart.png") if png else "chart.png not written (--no-png)"
        (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
        (out / "results.md").write_text(retrieval_markdown(results), encoding="utf-8")
    return results


def machine_info_cpu() -> dict:
    class _Dev:  # machine_info without a model: the CPU, as the lookups run there
        name, source = "-", "-"
        device, dtype = torch.device("cpu"), "-"

    info = machine_info(_Dev)
    for k in ("device", "dtype", "model", "model_source"):
        info.pop(k, None)
    return info


def retrieval_markdown(results: dict) -> str:
    mc = results["machine"]
    lines = ["# REST Lab benchmark: retrieval", "",
             f"Machine: {mc['cpu']}, {mc['cores']} cores; load average {mc.get('loadavg_start')}.", "",
             f"Command: `{results.get('command') or '(library call)'}`", "",
             f"Lookup settings: {results['settings']['lookup']}; {results['settings']['contexts']} contexts per kind.",
             "", "| store tokens | inside p50 / p99 µs | held-out p50 / p99 µs | held-out hit rate | "
                 "tokenize tokens/s | suffix array tokens/s | bytes/token |", "|---|---|---|---|---|---|---|"]
    for r in results["stores"]:
        ins, ho = r.get("inside") or {}, r.get("heldout") or {}
        lines.append(f"| {r['n_tokens']:,} | {_f(ins.get('p50_us'), '.0f')} / {_f(ins.get('p99_us'), '.0f')} | "
                     f"{_f(ho.get('p50_us'), '.0f')} / {_f(ho.get('p99_us'), '.0f')} | {_f(ho.get('hit_rate'), '.0%')} | "
                     f"{_f(r['tokenize_tokens_per_s'], ',.0f')} | {_f(r['suffix_array_tokens_per_s'], ',.0f')} | "
                     f"{_f(r['bytes_per_token'])} |")
    lines += ["", "- Inside: contexts taken from the store's own stream (every lookup matches n_max tokens); "
              "held-out: contexts from the benchmark prompts, tokenized.",
              "- Smaller stores are prefixes of the largest (its first N tokens, built once and cached); their "
              "tokenization throughput is not meaningful (they are built from token ids) and is left blank.",
              "- Throughput and bytes per token are read from each store's meta.json (bytes on disk, memory-mapped)."]
    if results.get("png_note"):
        lines.append(f"- {results['png_note']}")
    return "\n".join(lines) + "\n"


def retrieval_chart(results: dict):
    import plotly.graph_objects as go

    fig = go.Figure()
    rows = results["stores"]
    x = [r["n_tokens"] for r in rows]
    for kind, dash in (("inside", "solid"), ("heldout", "dot")):
        for pct in ("p50_us", "p99_us"):
            y = [(r.get(kind) or {}).get(pct) for r in rows]
            if any(v is not None for v in y):
                fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=f"{kind} {pct[:3]}",
                                         line=dict(dash=dash)))
    fig.update_layout(title="Store lookup latency against store size", xaxis_title="store tokens",
                      yaxis_title="µs per lookup", xaxis_type="log", height=480, width=900)
    return fig


# -- command line -------------------------------------------------------------------------------------

def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    from rest_core.cli import add_decode_arguments

    p = subparsers.add_parser("bench", help="benchmark REST against plain decoding and HF generate()",
                              description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("benchmark")
    g.add_argument("--suite", default=None, choices=[*SUITES, "retrieval"],
                   help="humaneval (164 completion prompts), chat (instruction prompts, chat template) or retrieval")
    g.add_argument("--retrieval", action="store_true", help="the store lookup micro-benchmark (= --suite retrieval)")
    g.add_argument("--limit", type=int, default=None, help="first N prompts only")
    g.add_argument("--methods", nargs="+", default=None, choices=GREEDY_METHODS + (TRACED,),
                   help="default: all (greedy) or plain rest_static rest_full (sampling)")
    g.add_argument("--out", default=None, help="output folder (default bench_out/<suite>-<timestamp>)")
    g.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens for generate()")
    g.add_argument("--chi2-prompts", type=int, default=1, help="prompts for the first-token chi-square (sampling)")
    g.add_argument("--chi2-seeds", type=int, default=200, help="seeds per prompt and method; 0 skips the check")
    g.add_argument("--no-png", action="store_true", help="do not write chart.png")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--sizes", default="1000000,10000000",
                   help="retrieval: store sizes in tokens, comma-separated (the full store is always added)")
    g.add_argument("--contexts", type=int, default=2000, help="retrieval: lookups per context kind and store")
    add_decode_arguments(p)
    p.set_defaults(func=run_bench)
    return p


def _command_line() -> str:
    return "python -m rest_core " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def run_bench(args) -> int:
    suite = "retrieval" if args.retrieval else args.suite
    if suite is None:
        raise ValueError("Choose a suite: --suite humaneval, chat or retrieval.")
    out = Path(args.out or Path("bench_out") / f"{suite}-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    if suite == "retrieval":
        return _run_retrieval_cli(args, out)
    from rest_core.cli import decode_config
    from rest_core.model import load_model
    from datastores.builtin import open_static_store

    if args.history != "none" or args.no_request_store:
        print("note: --history and --no-request-store are ignored by bench: each method fixes its stores",
              file=sys.stderr)
    cfg = decode_config(args)
    cfg.validate()
    lm = load_model(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    prompts = load_suite(suite, lm.tokenizer, args.limit)
    static = open_static_store(args.datastore, lm.tokenizer)
    results = run_benchmark(lm, prompts, cfg, args.methods, static, out, suite=suite, datastore=args.datastore,
                            command=_command_line(), prompt_lookup_tokens=args.prompt_lookup_tokens,
                            chi2_prompts=args.chi2_prompts, chi2_seeds=args.chi2_seeds, png=not args.no_png,
                            progress=not args.no_progress)
    print(markdown(results))
    print(f"results in {out}/ (results.json, results.md, chart.html"
          f"{', chart.png' if (out / 'chart.png').exists() else ''})")
    return 0


def _run_retrieval_cli(args, out: Path) -> int:
    from rest_core.bench.suites import chat_prompts, humaneval_prompts
    from rest_core.model import load_tokenizer
    from datastores.builtin import open_static_store

    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    base = open_static_store(args.datastore, tokenizer)
    if base is None:
        raise ValueError("The retrieval benchmark needs a store: drop --datastore none.")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes must be whole numbers separated by commas, got {args.sizes!r}.") from None
    texts = [t for _, t, _ in humaneval_prompts()] + [t for _, t, _ in chat_prompts()]
    results = run_retrieval(base, sizes, tokenizer, texts, out, count=args.contexts,
                            lookup={"n_max": args.n_max, "n_min": args.n_min, "max_matches": args.max_matches,
                                    "continuation_len": args.continuation_len},
                            command=_command_line(), png=not args.no_png, progress=not args.no_progress)
    print(retrieval_markdown(results))
    print(f"results in {out}/")
    return 0
