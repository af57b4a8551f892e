"""The benchmark run: every method on every prompt, measured, compared and summarized.

Every method runs on every prompt in one process with the same model and dtype,
interleaved prompt by prompt (the order rotates per prompt) so machine noise hits
all methods alike.  Each call is timed whole, prefill included.  The methods are
listed in `rest_core.bench.methods`; the numbers are derived in `rest_core.bench.stats`
from the per-prompt records only.

`--temperature > 0` runs plain, rest_static, rest_full and rest_model with the same
seed per prompt and checks the distribution of the first new token (chi-square).

`repeats` (`--repeats N`) runs the whole set N rounds: round r runs every prompt with
every method (the order rotating per prompt, as in one round).  Every round starts with
an empty history and empty model tables, so each round repeats the same run; outputs
are checked against the reference in every round.
"""
from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import transformers
from tqdm.auto import tqdm

from datastores import Store
from rest_core.bench.methods import (
    ANSWERS_METHOD,
    DEFAULT_KERNELS,
    DENSE_METHOD,
    GREEDY_METHODS,
    SAMPLING_METHODS,
    TEXT_METHOD,
    TRACED,
    MethodRunner,
    base_method,
)
from rest_core.bench.report import loadavg, machine_info, write_outputs
from rest_core.bench.stats import checks, first_token_check, recording_overhead, summarize
from rest_core.bench.suites import BenchPrompt
from rest_core.compare import cut_at_eos, first_difference, identical
from rest_core.decode import DecodeConfig
from rest_core.model import LoadedModel


def rotated(methods: Sequence[str], i: int) -> list[str]:
    """The method order for prompt i: shifted by one place per prompt."""
    k = i % len(methods)
    return list(methods[k:]) + list(methods[:k])


def _methods(cfg: DecodeConfig, methods: Sequence[str] | None, answers: bool = True,
             dense: bool = True) -> tuple[str, ...]:
    """The methods asked for (default: every one of the mode; rest_answers and rest_dense only where the run has
    their store)."""
    greedy = cfg.sampling.greedy
    allowed = GREEDY_METHODS if greedy else SAMPLING_METHODS
    missing = {m for m, have in ((ANSWERS_METHOD, answers), (DENSE_METHOD, dense)) if not have}
    methods = tuple(methods or (m for m in allowed if m not in missing))
    bad = [m for m in methods if base_method(m) not in allowed + (TRACED, TEXT_METHOD) or m.count("@") > 1
           or ("@" in m and not m.endswith(DEFAULT_KERNELS))]
    if bad:
        raise ValueError(f"Methods {bad} are not available {'in greedy mode' if greedy else 'when sampling'}: "
                         f"choose from {', '.join(allowed)}.")
    return methods


def run_benchmark(lm: LoadedModel, prompts: Sequence[BenchPrompt], cfg: DecodeConfig,
                  methods: Sequence[str] | None = None, static_store: Store | None = None,
                  out_dir: str | Path | None = None, *,
                  suite: str = "custom", datastore: str = "", command: str = "", prompt_lookup_tokens: int = 10,
                  chi2_prompts: int = 1, chi2_seeds: int = 200, png: bool = True, progress: bool = True,
                  repeats: int = 1, answers_store: Store | None = None, dense_store: Store | None = None) -> dict:
    """Run every method on every prompt (`repeats` rounds); write results.json/.md and the charts to out_dir;
    return the results."""
    cfg.validate()
    greedy = cfg.sampling.greedy
    methods = _methods(cfg, methods, answers=answers_store is not None, dense=dense_store is not None)
    if not prompts:
        raise ValueError("The suite has no prompts.")
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}.")
    base_seed = cfg.sampling.seed if cfg.sampling.seed is not None else 0
    results = {"settings": _settings(cfg, suite, methods, datastore, static_store, len(prompts), prompt_lookup_tokens,
                                     base_seed, repeats, answers_store, dense_store),
               "machine": machine_info(lm), "command": command, "warmup": [], "prompts": [], "records": [],
               "started_at": _dt.datetime.now().isoformat(timespec="seconds")}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate() warns about sampling flags unused in greedy mode
    runner = MethodRunner(lm, static_store, cfg, methods, prompt_lookup_tokens, answers_store=answers_store,
                          kind="chat" if suite == "chat" else "text", dense_store=dense_store)
    results["settings"]["cost_model"] = {"grid": list(runner.cost_model.grid),
                                         "times_ms": [round(float(t), 4) for t in runner.cost_model.times_ms]}
    interrupted = False
    try:
        _run_prompts(runner, prompts, cfg, base_seed, results, suite, progress, repeats)
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
        results["machine"]["loadavg_end"] = loadavg()
        results["summary"] = summarize(results["records"], methods, greedy, results["settings"]["cost_model"])
        results["checks"] = checks(results["records"], results["summary"], greedy)
        if TRACED in methods:
            results["recording"] = recording_overhead(results["records"], runner)
        if out_dir is not None:
            write_outputs(results, Path(out_dir), png=png)
    return results


def _run_prompts(runner: MethodRunner, prompts: Sequence[BenchPrompt], cfg: DecodeConfig, base_seed: int,
                 results: dict, suite: str, progress: bool, repeats: int = 1) -> None:
    """One untimed warm-up, then `repeats` rounds of every method on every prompt, interleaved."""
    warm_cfg = replace(cfg, max_new_tokens=min(16, cfg.max_new_tokens), sampling=replace(cfg.sampling, seed=base_seed))
    for m in runner.methods:  # not timed, not added to the history
        rec = runner.run(m, prompts[0].ids, warm_cfg, update_history=False)
        results["warmup"].append({"method": m, "ok": rec["ok"], "error": rec["error"]})
    bar = tqdm(total=repeats * len(prompts) * len(runner.methods), desc=f"bench {suite}", unit="run",
               disable=not progress)
    for r in range(repeats):
        runner.reset_learned()  # every round (the first too: the warm-up taught the model tables) starts empty
        _run_round(runner, prompts, cfg, base_seed, results, r, bar)
    bar.close()


def _run_round(runner: MethodRunner, prompts: Sequence[BenchPrompt], cfg: DecodeConfig, base_seed: int,
               results: dict, r: int, bar: tqdm) -> None:
    """Round r: every method on every prompt, the order rotating per prompt; records go into results."""
    greedy = cfg.sampling.greedy
    for i, p in enumerate(prompts):
        if r == 0:
            results["prompts"].append({"id": p.id, "prompt_tokens": len(p.ids), "grounded": p.grounded,
                                       "text": p.text})
        pcfg = cfg if greedy else replace(cfg, sampling=replace(cfg.sampling, seed=base_seed + i))
        by_method = {}
        for k, m in enumerate(rotated(runner.methods, i)):
            bar.set_postfix_str(f"round {r + 1} {p.id} {m}")
            rec = runner.run(m, p.ids, pcfg)
            rec.update(round=r, prompt=p.id, prompt_index=i, order=k, seed=None if greedy else base_seed + i)
            by_method[m] = rec
            results["records"].append(rec)
            bar.update(1)
        _compare(runner.lm, p, by_method, greedy, runner.eos)


def _compare(lm: LoadedModel, prompt: BenchPrompt, by_method: dict, greedy: bool, eos: set[int]) -> None:
    """Mark each record identical (or not) to the reference: hf_greedy when greedy (else plain), plain when sampling."""
    ref_name = next((m for m in (("hf_greedy" + DEFAULT_KERNELS, "hf_greedy") if greedy else ())
                     if by_method.get(m, {}).get("ok")), "plain")
    ref = by_method.get(ref_name)
    for rec in by_method.values():
        rec["reference"] = ref_name
        if not rec["ok"] or ref is None or not ref["ok"]:
            rec["identical"] = None
            continue
        rec["identical"] = identical(ref["tokens"], rec["tokens"], eos)
        if rec["identical"]:
            continue
        a, b = cut_at_eos(ref["tokens"], eos), cut_at_eos(rec["tokens"], eos)
        if greedy:
            diff = first_difference(lm, list(prompt.ids), a, b)
            if "tokens" in diff:
                diff["tokens"] = {"reference": diff["tokens"]["plain"], "this": diff["tokens"]["rest"]}
        else:  # where they part, or where the shorter one ends
            diff = {"first_difference": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}
        rec["difference"] = diff


def _settings(cfg: DecodeConfig, suite: str, methods: Sequence[str], datastore: str, static_store: Store | None,
              n_prompts: int, prompt_lookup_tokens: int, base_seed: int, repeats: int = 1,
              answers_store: Store | None = None, dense_store: Store | None = None) -> dict:
    s = cfg.sampling
    return {"suite": suite, "prompts": n_prompts, "methods": list(methods),
            "mode": "greedy" if s.greedy else "sampling", "max_new_tokens": cfg.max_new_tokens,
            "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
            "seed_base": None if s.greedy else base_seed, "stop_at_eos": cfg.stop_at_eos,
            "n_max": cfg.retrieve.n_max, "n_min": cfg.retrieve.n_min, "max_matches": cfg.retrieve.max_matches,
            "continuation_len": cfg.retrieve.continuation_len, "draft_budget": cfg.draft_budget or "auto",
            "prompt_lookup_num_tokens": prompt_lookup_tokens, "datastore": datastore,
            "static_store": None if static_store is None else {"path": str(getattr(static_store, "path", "")),
                                                                "n_tokens": int(getattr(static_store, "n_tokens", 0))},
            "answers_store": None if answers_store is None else {
                "path": str(getattr(answers_store, "path", "")), "n_tokens": int(getattr(answers_store, "n_tokens", 0)),
                "documents": int(getattr(answers_store, "n_docs", 0))},
            "dense_store": None if dense_store is None else {
                "path": str(getattr(dense_store, "path", "")), "positions": len(dense_store),
                "layer": getattr(dense_store, "state_layer", None), "dim": getattr(dense_store, "meta", {}).get("dim")},
            "repeats": repeats,
            "rounds": ("round r runs every prompt with every method, the order rotating per prompt; tokens/s, "
                       "ms/token and speedup are medians over rounds of each round's suite figure (speedup: over "
                       "the baseline's tokens/s in the same round), with min-max; other figures pool all rounds"),
            "history": ("in memory, empty at the start of every round; rest_full adds each of its answers after "
                        "the prompt"),
            "model_drafts": ("in memory, one table per method (rest_full, rest_model), empty at the start of every "
                             "round; each learns from every forward pass of its own method over the round's prompts"),
            "warmup": "one prompt (the first), every method, max 16 tokens, not timed"}
