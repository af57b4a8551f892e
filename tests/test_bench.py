"""The benchmark end to end on the tiny random model: every method runs, every number is derived from the records."""
from __future__ import annotations

import json
import os
import subprocess
from collections import Counter

import numpy as np
import pytest
import torch

import rest_core.cost
import rest_core.cost_curve
from datastores import TokenDatastore, build_datastore, build_from_token_documents, iter_documents
from rest_core.bench import (
    GREEDY_METHODS,
    SAMPLING_METHODS,
    SUMMARY_KEYS,
    TRACED,
    BenchPrompt,
    MethodRunner,
    chat_prompts,
    chi_square,
    load_suite,
    report,
    rotated,
    run_benchmark,
    run_retrieval,
)
from rest_core.bench.runner import _compare
from rest_core.cli import _parser
from rest_core.compare import identical
from rest_core.decode import DecodeConfig, plain_generate
from rest_core.sampling import Sampling
from rest_core.traces.recorder import TraceRecorder

from conftest import ROOT, make_tiny_lm

PROMPTS = [(5, 6, 7, 5, 6, 7, 5, 6), (11, 12, 13, 14, 11, 12)]
# the methods a run without the general-text store runs by default
GREEDY = tuple(m for m in GREEDY_METHODS if m not in ("rest_answers", "rest_dense"))
SAMPLING = tuple(m for m in SAMPLING_METHODS if m not in ("rest_answers", "rest_dense"))
TINY_TOKENIZER = {"name": "tiny", "fingerprint": None, "vocab_size": 70_000}


class Chars:
    """A character tokenizer (ids = code point mod 97) with a trivial chat template; enough to build a store."""

    chat_template = "user: {text}"
    name_or_path = "chars"

    def __call__(self, text, add_special_tokens=False, **kw):
        if isinstance(text, str):
            return {"input_ids": [ord(c) % 97 for c in text]}
        return {"input_ids": [[ord(c) % 97 for c in t] for t in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self("user: " + messages[-1]["content"] + "\nassistant: ")["input_ids"]

    def get_vocab(self):
        return {f"c{i}": i for i in range(97)}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path / "cache"))  # the cost calibration of the tiny model


@pytest.fixture(autouse=True)
def _steady_curve(monkeypatch):
    """The tiny model's cost curve, stated instead of measured (a pass over q tokens costs 1 + 0.05 (q - 1) ms):
    its passes take about a millisecond, so a curve timed while the rest of the suite loads the machine could
    make every draft look too dear, and the tests of what the benchmark counts about drafts would find none
    (a full-suite run once found rest_static with no draft at all).  What these tests check is the
    benchmark's accounting, not this curve; tests/test_cost.py checks the measurement."""
    monkeypatch.setattr(rest_core.cost_curve, "measure_forward_curve",
                        lambda lm, prefix_len=256, repeats=5, grid=rest_core.cost_curve.GRID:
                        np.array([1.0 + 0.05 * (q - 1) for q in grid]))


@pytest.fixture(scope="module")
def lm():
    return make_tiny_lm()


@pytest.fixture(scope="module")
def store(lm, tmp_path_factory):
    """A static store holding the tiny model's own greedy continuations: rest_static gets accepted drafts."""
    docs = [list(p) + plain_generate(lm, p, DecodeConfig(max_new_tokens=12)).tokens for p in PROMPTS]
    return build_from_token_documents(tmp_path_factory.mktemp("store") / "s", docs, tokenizer_info=TINY_TOKENIZER)


def _prompts():
    return [BenchPrompt(f"p{i}", f"prompt {i}", p) for i, p in enumerate(PROMPTS)]


@pytest.mark.slow
def test_greedy_benchmark_end_to_end(lm, store, tmp_path):
    out = tmp_path / "out"
    res = run_benchmark(lm, _prompts(), DecodeConfig(max_new_tokens=8), None, store, out, suite="tiny",
                        command="python -m rest_core bench --suite tiny", png=False, progress=False)
    data = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert (out / "chart.html").stat().st_size > 1000
    summ = data["summary"]["methods"]
    assert list(summ) == list(GREEDY)
    for m in GREEDY:
        assert f"| {m} |" in md
        assert set(SUMMARY_KEYS) <= set(summ[m])
        assert summ[m]["prompts_ok"] == 2 and summ[m]["prompts_failed"] == 0
    assert "Machine:" in md and "python -m rest_core bench --suite tiny" in md
    # the page names the code it measured: this checkout's commit
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert f"Code: commit {head.stdout.strip()}" in md and data["machine"]["code"].startswith("commit ")
    assert data["machine"]["torch_threads"] >= 1 and data["machine"]["cpu"]
    # the CPU in the machine line: model name, vendor where the OS says it, the instruction set torch uses
    cap = torch.backends.cpu.get_cpu_capability()
    assert data["machine"]["cpu_capability"] == cap and f"torch uses {cap}" in md
    assert data["machine"]["cpu"] in md and (data["machine"]["cpu_vendor"] or "") in md
    if data["machine"]["cpu_family"]:  # a virtual machine's bare "AMD EPYC": family and model tell which one
        assert f"family/model {data['machine']['cpu_family']}" in md
    assert all(f in md for f in data["machine"]["cpu_features"])
    recs = data["records"]
    assert len(recs) == 2 * len(GREEDY) and all(r["ok"] for r in recs)
    # interleaved, the order rotating per prompt
    for i in range(2):
        order = [r["method"] for r in sorted((r for r in recs if r["prompt_index"] == i), key=lambda r: r["order"])]
        assert order == rotated(GREEDY, i)
    # the HF methods really ran: their forward calls were seen, their tokens are the greedy output
    for r in recs:
        assert r["new_tokens"] == len(r["tokens"]) > 0 and r["forward_passes"] >= 1 and r["log_consistent"]
    ref = {r["prompt"]: r["tokens"] for r in recs if r["method"] == "hf_greedy"}
    for m in GREEDY:
        mine = [r for r in recs if r["method"] == m]
        same = sum(identical(ref[r["prompt"]], r["tokens"], lm.eos_token_ids) for r in mine)
        assert summ[m]["identical"] == same and summ[m]["compared"] == 2
    assert summ["plain"]["identical"] == 2  # fp32: our plain loop is generate()'s greedy output
    assert summ["rest_static"]["identical"] == 2 and summ["rest_full"]["identical"] == 2
    assert summ["rest_model"]["identical"] == 2
    # per draft source: sums of the decoders' own counts, in the stores' merge order, in results.md too
    by_source = data["summary"]["by_source"]
    assert list(by_source) == ["rest_static", "rest_full", "rest_model"]
    assert list(by_source["rest_full"]) == ["static", "request", "history", "model"]
    for m, sources in by_source.items():
        mine = [r for r in recs if r["method"] == m]
        assert sum(c["drafted"] for c in sources.values()) == sum(r["draft_tokens"] for r in mine)
        assert sum(c["accepted"] for c in sources.values()) == sum(r["accepted_drafts"] for r in mine)
        for src in sources:
            assert f"| {m} | {src} |" in md
    # summary numbers recomputed from the per-prompt records
    tps = {m: sum(r["new_tokens"] for r in recs if r["method"] == m)
           / sum(r["wall_s"] for r in recs if r["method"] == m) for m in GREEDY}
    base = max(tps["plain"], tps["hf_greedy"])
    for m in GREEDY:
        mine = [r for r in recs if r["method"] == m]
        assert summ[m]["tokens_per_s"] == pytest.approx(tps[m])
        assert summ[m]["speedup"] == pytest.approx(tps[m] / base)
        assert summ[m]["mean_accepted"] == pytest.approx(sum(r["new_tokens"] for r in mine)
                                                        / sum(r["forward_passes"] for r in mine))
        fwd = [ms for r in mine for ms in r["step_forward_ms"]]
        assert summ[m]["forward_ms_per_step"] == pytest.approx(np.mean(fwd))
    assert summ["plain"]["mean_accepted"] == 1.0 and summ["hf_greedy"]["mean_accepted"] == 1.0
    assert summ["plain"]["acceptance_rate"] is None and summ["plain"]["verify_cost_rel_model"] == pytest.approx(1.0)
    rs = [r for r in recs if r["method"] == "rest_static"]
    assert summ["rest_static"]["acceptance_rate"] == pytest.approx(
        sum(r["accepted_drafts"] for r in rs) / sum(r["draft_tokens"] for r in rs))
    assert summ["rest_static"]["mean_accepted"] > 1.0  # the store holds these very continuations
    ret = [x for r in rs for x in r["retrieve_ms"]]
    assert summ["rest_static"]["retrieve_ms_p99"] == pytest.approx(np.percentile(ret, 99))
    assert summ["rest_static"]["mean_budget"] == pytest.approx(np.mean([b for r in rs for b in r["budgets"]]))
    # automatic budget: the query size of each step is the chosen budget plus the root
    assert all(r["step_query_sizes"] == [b + 1 for b in r["budgets"]] for r in rs)
    pl = [r for r in recs if r["method"] == "hf_prompt_lookup"]
    assert sum(r["draft_tokens"] for r in pl) > 0  # the repeated prompts give generate() something to look up
    assert res["checks"]["plain_vs_hf_ms_per_token_ratio"] > 0


def test_rest_model_drafts_from_the_models_own_predictions_only(lm, tmp_path):
    out = tmp_path / "out"
    cfg = DecodeConfig(max_new_tokens=12, draft_budget=8)  # a fixed budget: drafting does not hang on timings
    res = run_benchmark(lm, _prompts(), cfg, ["plain", "rest_model"], None, out, png=False, progress=False)
    recs = [r for r in res["records"] if r["method"] == "rest_model"]
    assert len(recs) == 2 and all(r["ok"] and r["sources"] == ["model"] for r in recs)
    assert {s for r in recs for s in r["drafted_by_source"]} == {"model"}  # p1 repeats a token: drafts follow
    drafted = sum(r["drafted_by_source"]["model"] for r in recs if r["drafted_by_source"])
    accepted = sum(r["accepted_by_source"].get("model", 0) for r in recs)
    assert drafted == sum(r["draft_tokens"] for r in recs) > 0
    assert accepted == sum(r["accepted_drafts"] for r in recs)
    data = json.loads((out / "results.json").read_text())
    assert data["summary"]["by_source"] == {"rest_model": {"model": {
        "drafted": drafted, "accepted": accepted, "acceptance_rate": pytest.approx(accepted / drafted)}}}
    assert "| rest_model | model |" in (out / "results.md").read_text()
    assert "empty" in data["settings"]["model_drafts"]
    # the model's own drafts change nothing in the output: plain greedy, token for token
    summ = data["summary"]["methods"]["rest_model"]
    assert summ["identical"] == summ["compared"] == 2
    for r in recs:
        assert r["tokens"] == plain_generate(lm, PROMPTS[r["prompt_index"]], cfg).tokens


def test_rest_answers_drafts_from_the_general_text_store_only(lm, store, tmp_path):
    answers = TokenDatastore.open(store.path, name="answers-tiny", source="answers")
    out = tmp_path / "out"
    cfg = DecodeConfig(max_new_tokens=12)
    res = run_benchmark(lm, _prompts(), cfg, ["plain", "rest_answers", "rest_full"], store, out, png=False,
                        progress=False, answers_store=answers)
    recs = {m: [r for r in res["records"] if r["method"] == m] for m in ("rest_answers", "rest_full")}
    assert all(r["sources"] == ["answers"] for r in recs["rest_answers"])
    assert all(r["sources"][:3] == ["static", "answers", "request"] for r in recs["rest_full"])
    assert sum(r["accepted_by_source"].get("answers", 0) for r in recs["rest_answers"]) > 0
    for r in recs["rest_answers"]:
        assert r["tokens"] == plain_generate(lm, PROMPTS[r["prompt_index"]], cfg).tokens
    assert res["settings"]["answers_store"]["documents"] == store.n_docs
    assert "| rest_answers | answers |" in (out / "results.md").read_text()
    # without the store the method is refused by name, and left out of the default list
    with pytest.raises(ValueError, match="rest_answers needs the general-text store"):
        MethodRunner(lm, store, cfg, ["rest_answers"])
    res = run_benchmark(lm, _prompts()[:1], DecodeConfig(max_new_tokens=2), None, store, None, png=False,
                        progress=False)
    assert "rest_answers" not in res["settings"]["methods"]


def test_rest_dense_drafts_from_the_dense_store_only_and_rest_full_with_it_and_rest_text_without(lm, tmp_path):
    from datastores import build_dense_store
    from rest_core.hidden import layer_count, model_fingerprint, state_reader

    cfg = DecodeConfig(max_new_tokens=12)
    docs = [(list(p) + plain_generate(lm, p, cfg).tokens, len(p) - 1) for p in PROMPTS]
    layer = layer_count(lm.model)
    dense = build_dense_store(tmp_path / "dense", docs, state_reader(lm.model, layer), None,
                              {"name": lm.name, "fingerprint": model_fingerprint(lm.model)}, layer, 8, progress=False)
    out = tmp_path / "out"
    res = run_benchmark(lm, _prompts(), cfg, ["plain", "rest_dense", "rest_full", "rest_text"], None, out,
                        png=False, progress=False, dense_store=dense)
    recs = {m: [r for r in res["records"] if r["method"] == m] for m in ("rest_dense", "rest_full", "rest_text")}
    assert all(r["sources"] == ["dense"] for r in recs["rest_dense"])
    assert all(r["sources"][-1] == "dense" for r in recs["rest_full"])
    assert all(r["sources"] == f["sources"][:-1] for r, f in zip(recs["rest_text"], recs["rest_full"]))
    assert sum(r["accepted_by_source"].get("dense", 0) for r in recs["rest_dense"]) > 0
    for r in recs["rest_dense"] + recs["rest_full"] + recs["rest_text"]:
        assert r["tokens"] == plain_generate(lm, PROMPTS[r["prompt_index"]], cfg).tokens
    assert res["settings"]["dense_store"]["positions"] == len(dense)
    assert "| rest_dense | dense |" in (out / "results.md").read_text()
    with pytest.raises(ValueError, match="rest_dense needs the dense store"):
        MethodRunner(lm, None, cfg, ["rest_dense"])


def test_each_model_source_method_learns_its_own_table_from_empty(lm, store):
    runner = MethodRunner(lm, store, DecodeConfig(max_new_tokens=12), ["rest_full", "rest_model"])
    try:
        tables = dict(runner.model_drafts)
        assert set(tables) == {"rest_full", "rest_model"} and tables["rest_full"] is not tables["rest_model"]
        assert all(t.known == 0 for t in tables.values())
        assert runner.sources("rest_full") == ["static", "request", "history", "model"]
        assert runner.decoders["rest_model"].stores == [tables["rest_model"]]
        assert runner.run("rest_model", PROMPTS[1])["ok"]
        assert tables["rest_model"].known > 0 and tables["rest_full"].known == 0  # each learns from its own passes
        runner.reset_learned()
        fresh = runner.model_drafts
        assert all(fresh[m] is not tables[m] and fresh[m].known == 0 for m in fresh)
        assert runner.decoders["rest_model"].stores == [fresh["rest_model"]]
        assert runner.decoders["rest_full"].stores[-1] is fresh["rest_full"]
        assert runner.decoders["rest_full"].stores[2] is runner.history and len(runner.history) == 0
    finally:
        runner.close()


def _round_tps(recs: list[dict], method: str, k: int) -> float:
    """A method's tokens/s over round k: all its new tokens / all its wall time."""
    mine = [r for r in recs if r["method"] == method and r["round"] == k]
    return sum(r["new_tokens"] for r in mine) / sum(r["wall_s"] for r in mine)


def test_repeats_run_interleaved_rounds_with_a_per_prompt_median_and_spread(lm, store, tmp_path):
    out = tmp_path / "out"
    methods = ["plain", "hf_greedy", "rest_full"]
    res = run_benchmark(lm, _prompts(), DecodeConfig(max_new_tokens=8), methods, store, out, png=False,
                        progress=False, repeats=2)
    recs = res["records"]
    assert len(recs) == 2 * 2 * len(methods) and {r["round"] for r in recs} == {0, 1}
    assert len(res["prompts"]) == 2 and res["settings"]["repeats"] == 2
    for k in range(2):  # every round: every prompt with every method, the order rotating per prompt
        for i in range(2):
            mine = sorted((r for r in recs if r["round"] == k and r["prompt_index"] == i), key=lambda r: r["order"])
            assert [r["method"] for r in mine] == rotated(methods, i)
    # the greedy identity check ran in every round
    assert all(r["identical"] is True for r in recs)
    summ = res["summary"]
    assert all(summ["methods"][m]["identical"] == summ["methods"][m]["compared"] == 4 for m in methods)
    # suite figures: the median over rounds of each round's figure; speedup over the baseline in the same round
    base = summ["baseline"]
    assert base in ("plain", "hf_greedy")
    for m in methods:
        ups = [_round_tps(recs, m, k) / _round_tps(recs, base, k) for k in range(2)]
        s = summ["methods"][m]
        assert s["tokens_per_s"] == pytest.approx(np.median([_round_tps(recs, m, k) for k in range(2)]))
        assert s["speedup"] == pytest.approx(np.median(ups))
        assert (s["speedup_min"], s["speedup_max"]) == (pytest.approx(min(ups)), pytest.approx(max(ups)))
    # per prompt: rest_full over the baseline in each round, median and spread
    pp = summ["per_prompt"]
    assert pp["method"] == "rest_full" and pp["baseline"] == base
    assert [e["prompt"] for e in pp["prompts"]] == ["p0", "p1"]
    for e in pp["prompts"]:
        tps = {(r["method"], r["round"]): r["tokens_per_s"] for r in recs if r["prompt"] == e["prompt"]}
        ratios = [tps["rest_full", k] / tps[base, k] for k in range(2)]
        assert e["ratios"] == pytest.approx(ratios) and e["median"] == pytest.approx(np.median(ratios))
        assert (e["min"], e["max"]) == (pytest.approx(min(ratios)), pytest.approx(max(ratios)))
    md = (out / "results.md").read_text()
    assert "2 rounds" in md and f"| prompt | rest_full / {base} tokens/s, median | min–max | rounds |" in md
    assert "| p0 |" in md and "| p1 |" in md
    with pytest.raises(ValueError, match="repeats"):
        run_benchmark(lm, _prompts(), DecodeConfig(max_new_tokens=4), ["plain"], None, None, png=False,
                      progress=False, repeats=0)


def test_a_failing_prompt_is_recorded_and_the_run_goes_on(lm, store, tmp_path):
    prompts = _prompts()[:1] + [BenchPrompt("bad", "bad", (3, 70_000))]  # an id outside the vocabulary
    res = run_benchmark(lm, prompts, DecodeConfig(max_new_tokens=4), ["plain", "hf_greedy", "rest_full"], store,
                        tmp_path, png=False, progress=False)
    summ = res["summary"]["methods"]
    assert all(summ[m]["prompts_ok"] == 1 and summ[m]["prompts_failed"] == 1 for m in summ)
    errors = res["checks"]["errors"]
    assert {e["method"] for e in errors} == {"plain", "hf_greedy", "rest_full"}
    assert all(e["prompt"] == "bad" and e["error"] for e in errors)
    assert "failed runs" in (tmp_path / "results.md").read_text()


def test_sampling_mode_reproduces_plain_and_runs_the_distribution_check(lm, store, tmp_path):
    cfg = DecodeConfig(max_new_tokens=6, sampling=Sampling(temperature=0.8, top_p=0.95, seed=3))
    res = run_benchmark(lm, _prompts(), cfg, None, store, tmp_path, chi2_prompts=1, chi2_seeds=12,
                        png=False, progress=False)
    summ = res["summary"]["methods"]
    assert list(summ) == list(SAMPLING) and res["summary"]["baseline"] == "plain"
    recs = res["records"]
    assert {r["seed"] for r in recs} == {3, 4}
    plain = {r["prompt"]: r["tokens"] for r in recs if r["method"] == "plain"}
    for m in SAMPLING:
        same = sum(r["tokens"] == plain[r["prompt"]] for r in recs if r["method"] == m)
        assert summ[m]["identical"] == same
    dc = res["distribution_check"]["prompts"][0]["methods"]
    assert set(dc) == set(SAMPLING) and all(v["runs"] == 12 for v in dc.values())
    with pytest.raises(ValueError, match="not available"):
        run_benchmark(lm, _prompts(), cfg, ["hf_greedy"], store, None, png=False, progress=False)


def test_chi_square_tells_a_fair_sampler_from_a_biased_one():
    probs = np.array([0.5, 0.3, 0.2])
    fair = Counter({0: 502, 1: 298, 2: 200})
    biased = Counter({0: 700, 1: 200, 2: 100})
    assert chi_square(fair, probs, 1000)["p_value"] > 0.5
    assert chi_square(biased, probs, 1000)["p_value"] < 1e-6


def test_retrieval_mode_builds_prefixes_and_reads_meta(tmp_path):
    texts = [text for _, text, _ in chat_prompts()]
    base = build_datastore(tmp_path / "base", Chars(), iter_documents((str(i), t * 3) for i, t in enumerate(texts)),
                           progress=False)
    res = run_retrieval(base, [1000, 10 ** 9], Chars(), texts[:5], out_dir=tmp_path / "out", count=50, png=False,
                        progress=False, cache_root=tmp_path / "bench-stores")
    rows = res["stores"]
    assert [r["n_tokens"] for r in rows] == [1000, base.n_tokens]  # sizes over the store's own are dropped
    assert rows[0]["prefix_of_base"] and rows[0]["tokenize_tokens_per_s"] is None
    assert rows[1]["tokenize_tokens_per_s"] == base.meta["build"]["tokenize_tokens_per_s"]
    for r in rows:
        assert r["inside"]["n"] == 50 and r["inside"]["p99_us"] >= r["inside"]["p50_us"] > 0
        assert r["heldout"]["n"] == 50 and r["heldout"]["hit_rate"] > 0
        assert r["bytes_per_token"] > 0 and r["suffix_array_tokens_per_s"] > 0
    again = run_retrieval(base, [1000], count=10, out_dir=None, png=False, progress=False,
                          cache_root=tmp_path / "bench-stores")
    assert again["stores"][0]["built_at"] == rows[0]["built_at"]  # cached, not rebuilt
    assert "| 1,000 |" in (tmp_path / "out" / "results.md").read_text()


def test_suites_and_the_command_line():
    chat = chat_prompts()
    assert len(chat) >= 40 and len({pid for pid, _, _ in chat}) == len(chat)
    assert sum(g for _, _, g in chat) >= 15  # input-grounded prompts
    words = Chars()
    he = load_suite("humaneval", words)
    assert len(he) == 164 and he[0].id == "HumanEval/0" and list(he[0].ids) == words(he[0].text)["input_ids"]
    two = load_suite("chat", words, limit=2)
    assert len(two) == 2 and two[0].ids[:6] == tuple(words("user: ")["input_ids"])
    with pytest.raises(ValueError, match="Unknown suite"):
        load_suite("mtbench", words)
    picked = load_suite("chat", words, pick=["explain-*", "code-git-undo"], limit=3)
    assert [p.id for p in picked] == ["code-git-undo", "explain-recursion", "explain-http"]  # suite order
    with pytest.raises(ValueError, match="matches no prompt"):
        load_suite("chat", words, pick=["nothing-*"])
    args = _parser().parse_args(["bench", "--suite", "chat", "--limit", "2", "--max-new-tokens", "16",
                                 "--methods", "plain", "rest_full"])
    assert args.func.__name__ == "run_bench" and args.limit == 2 and args.methods == ["plain", "rest_full"]
    assert args.repeats == 1
    args = _parser().parse_args(["bench", "--suite", "humaneval", "--repeats", "3", "--methods", "rest_model"])
    assert args.repeats == 3 and args.methods == ["rest_model"]


def test_outputs_are_identical_only_when_equal_token_for_token_cut_at_eos():
    assert identical([1, 2, 0, 5], [1, 2, 0, 7], {0})  # after EOS nothing counts
    assert not identical([1, 2, 3], [1, 2], set())  # a shorter output is a different output
    assert not identical([1, 2, 3], [1, 3, 3], set())
    assert not identical([1, 0], [1, 2, 0], {0})  # one stopped where the other went on


def test_the_bench_counts_a_shorter_output_as_different(lm):
    """It used to compare up to the shorter output: a method that stopped early counted as identical."""
    prompt = BenchPrompt("p", "p", (5, 6, 7))
    by_method = {"plain": {"ok": True, "tokens": [1, 2, 3]}, "rest_full": {"ok": True, "tokens": [1, 2]},
                 "rest_static": {"ok": True, "tokens": [1, 2, 3, 0, 9]}}
    _compare(lm, prompt, by_method, greedy=False, eos={0})
    assert by_method["plain"]["identical"] and not by_method["rest_static"]["identical"]
    assert by_method["rest_full"]["identical"] is False
    assert by_method["rest_full"]["difference"] == {"first_difference": 2}  # where the shorter one ends


def test_recording_overhead_is_measured_against_the_same_method_untraced(lm, store, tmp_path):
    res = run_benchmark(lm, _prompts(), DecodeConfig(max_new_tokens=8), ["rest_static", TRACED], store,
                        tmp_path / "out", png=False, progress=False)
    rc = res["recording"]
    traced = [r for r in res["records"] if r["method"] == TRACED]
    assert rc["per_method"][TRACED]["steps"] == sum(r["steps"] for r in traced) > 0
    assert rc["db_bytes"] > 0 and rc["db_bytes_per_1000_steps"] == pytest.approx(1000 * rc["db_bytes"] / rc["db_steps"])
    base = rc["per_method"]["rest_static"]
    assert rc["overhead_per_step"] == pytest.approx(rc["per_method"][TRACED]["ms_per_step"] / base["ms_per_step"] - 1)
    # the traced runs decode the same tokens, and every step landed in the database
    rec = TraceRecorder(rc["db_path"])
    stored = [len(rec.load_steps(r["id"])) for r in rec.list_runs()]
    assert sum(stored) == rc["db_steps"]
    assert len(stored) == len(traced) + 1  # plus the untimed warm-up
    assert sum(stored) > sum(r["steps"] for r in traced)
    assert "Recording every step" in (tmp_path / "out" / "results.md").read_text()


def test_one_bench_run_measures_the_forward_curve_once(lm, store, monkeypatch):
    """Each REST method's cost model used to re-measure the curve and overwrite the one calibration file."""
    measured, saved = [], []
    measure, save = rest_core.cost_curve.measure_forward_curve, rest_core.cost.CostModel.save_stats
    monkeypatch.setattr(rest_core.cost_curve, "measure_forward_curve",
                        lambda *a, **kw: measured.append(1) or measure(*a, **kw))
    monkeypatch.setattr(rest_core.cost.CostModel, "save_stats", lambda self: saved.append(self) or save(self))
    res = run_benchmark(lm, _prompts(), DecodeConfig(max_new_tokens=6), ["plain", "rest_static", "rest_full"], store,
                        None, png=False, progress=False)
    assert all(r["ok"] for r in res["records"])
    assert len(measured) == 1
    # the bench owns the choosers: each REST decode (warm-up included) keeps its own chooser's counts
    assert len(saved) == 2 * (1 + len(PROMPTS)) and len({id(c) for c in saved}) == 2
    assert len({c.stats_path for c in saved}) == 1  # acceptance is kept per model, store by store
    kept = json.loads(saved[0].stats_path.read_text())["stores"]
    # per store, and per kind of prompt (this suite's prompts are plain text)
    assert f"{store.label} [text]" in kept
    assert set(kept) <= {f"{label} [text]" for label in (store.label, "request", "history", "model")}


class _Figure:
    """Records the BROWSER_PATH kaleido would see while the PNG is written."""

    def __init__(self, fail: bool = False):
        self.fail, self.seen = fail, []

    def write_image(self, path, width, height):
        self.seen.append(os.environ.get("BROWSER_PATH"))
        if self.fail:
            raise RuntimeError("no browser")


def test_the_png_export_names_the_browser_for_itself_only(tmp_path, monkeypatch):
    """BROWSER_PATH used to be set for the whole process and left behind."""
    chromium = tmp_path / "chromium"
    chromium.write_text("")
    monkeypatch.setattr(report, "CHROMIUM", chromium)
    monkeypatch.delenv("BROWSER_PATH", raising=False)
    fig, broken = _Figure(), _Figure(fail=True)
    assert report.write_png(fig, tmp_path / "a.png") is None
    assert fig.seen == [str(chromium)] and "BROWSER_PATH" not in os.environ
    assert "no browser" in report.write_png(broken, tmp_path / "b.png")
    assert broken.seen == [str(chromium)] and "BROWSER_PATH" not in os.environ
    monkeypatch.setenv("BROWSER_PATH", "/opt/my-chrome")  # the user's own choice is used and left alone
    assert report.write_png(fig, tmp_path / "c.png") is None
    assert fig.seen[-1] == "/opt/my-chrome" and os.environ["BROWSER_PATH"] == "/opt/my-chrome"
