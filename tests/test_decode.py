"""The decoder on a tiny random model: exact greedy, exact sampling, KV compaction, cuts, bad input."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chi2
from transformers import DynamicCache

import rest_core.verify as verify_mod
from datastores import HistoryStore, RecycleStore, assemble_stores
from rest_base.native_policy import PYTHON
from rest_core.commit import compact_cache
from rest_core.cost import GRID, CostModel
from rest_core.decode import DecodeConfig, PromptError, RestDecoder, plain_generate
from rest_core.retrieve import RetrieveSettings
from rest_core.sampling import Sampling, draw_token, next_token_probs

from conftest import make_tiny_lm, tool
from oracle import BruteForceStore

PROMPTS = [[5, 9, 69_999, 3], [65_536, 65_537, 12], [2], list(range(100, 140))]


def store_from_plain(lm, prompt, n, noise_seed=0):
    """A store holding the plain continuation (so drafts hit) among random noise (so some miss)."""
    plain = plain_generate(lm, prompt, DecodeConfig(max_new_tokens=n, stop_at_eos=False))
    rng = np.random.default_rng(noise_seed)
    noise = rng.integers(0, lm.model.config.vocab_size, size=200).tolist()
    text = noise[:100] + list(prompt) + plain.tokens + noise[100:]
    # a corrupted copy: right suffix, wrong continuation, to force rejected branches
    wrong = list(prompt[-2:]) + [(t + 1) % lm.model.config.vocab_size for t in plain.tokens[:6]]
    return plain, BruteForceStore(text + wrong)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_rest_equals_plain_greedy(tiny_lm, prompt):
    plain, store = store_from_plain(tiny_lm, prompt, 40)
    cfg = DecodeConfig(max_new_tokens=40, draft_budget=12, stop_at_eos=False)
    rest = RestDecoder(tiny_lm, stores=assemble_stores(static=store)).generate(prompt, cfg)
    assert rest.tokens == plain.tokens
    assert rest.steps < plain.steps  # drafts were really accepted
    # every step adds a bonus token, except a last step cut at max_new_tokens
    assert len(rest.tokens) - rest.steps <= rest.accepted_drafts <= len(rest.tokens) - rest.steps + 1


def test_greedy_with_only_wrong_drafts_still_exact(tiny_lm):
    prompt = PROMPTS[0]
    plain = plain_generate(tiny_lm, prompt, DecodeConfig(max_new_tokens=20, stop_at_eos=False))
    rng = np.random.default_rng(1)
    store = BruteForceStore(rng.integers(0, 50, size=3000).tolist() + prompt[-2:] + [1, 2, 3, 4])
    rest = RestDecoder(tiny_lm, stores=assemble_stores(static=store, request=False)).generate(
        prompt, DecodeConfig(max_new_tokens=20, draft_budget=8, stop_at_eos=False))
    assert rest.tokens == plain.tokens


def test_no_match_is_an_ordinary_one_token_step(tiny_lm):
    traces = []
    dec = RestDecoder(tiny_lm, stores=assemble_stores(static=BruteForceStore([1, 2, 3]), request=False))
    res = dec.generate([40, 41], DecodeConfig(max_new_tokens=3, draft_budget=8, stop_at_eos=False),
                       hook=traces.append)
    assert res.no_draft_steps == res.steps == 3
    assert all(len(t.tree_tokens) == 1 and t.mask.shape[-2] == 1 for t in traces)


def test_trace_reports_exactly_what_the_model_saw(tiny_lm):
    prompt = PROMPTS[1]
    plain, store = store_from_plain(tiny_lm, prompt, 24)
    traces = []
    res = RestDecoder(tiny_lm, stores=assemble_stores(static=store)).generate(
        prompt, DecodeConfig(max_new_tokens=24, draft_budget=10, stop_at_eos=False), hook=traces.append)
    assert [t for tr in traces for t in tr.new_tokens] == res.tokens == plain.tokens
    for tr in traces:
        q = len(tr.tree_tokens)
        assert tr.mask.shape == (1, 1, q, tr.prefix_len + q)
        assert tr.position_ids == [tr.prefix_len + d for d in tr.tree_depths]
        path_tokens = [tr.tree_tokens[n] for n in tr.accepted_nodes[1:]] + [tr.bonus_token]
        assert path_tokens[: len(tr.new_tokens)] == tr.new_tokens
        # greedy: each accepted node is the model's choice at its parent
        for parent, child in zip(tr.accepted_nodes, tr.accepted_nodes[1:]):
            assert tr.model_choices[parent] == tr.tree_tokens[child]
        assert tr.model_choices[tr.accepted_nodes[-1]] == tr.bonus_token
        assert set(tr.timings_ms) == {"retrieve", "tree", "forward", "verify", "commit"}
    assert sum(tr.draft_size > 0 for tr in traces) > 0


def test_kv_compaction_of_a_path_kept_whole_leaves_the_cache_as_it_is(tiny_lm):
    """A one-token step, or a chain accepted to its end: the cache already holds exactly the kept nodes, in
    order, so compaction moves and copies nothing (and a crop to fewer nodes still cuts)."""
    model = tiny_lm.model
    prefix = [7, 8, 9, 10, 11]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        tiny_lm.forward(input_ids=torch.tensor([prefix + [12, 13, 14]]), cache=cache)
        before = [(layer.keys, layer.values) for layer in cache.layers]
        compact_cache(cache, len(prefix), [0, 1, 2])
        assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, before))
        compact_cache(cache, len(prefix), [0, 1])
    assert cache.get_seq_length() == len(prefix) + 2
    for layer, (k, _) in zip(cache.layers, before):
        torch.testing.assert_close(layer.keys, k[:, :, :len(prefix) + 2])


def test_eos_and_max_new_tokens_cut_the_accepted_path(tiny_lm):
    prompt = PROMPTS[0]
    plain = plain_generate(tiny_lm, prompt, DecodeConfig(max_new_tokens=30, stop_at_eos=False))
    eos = plain.tokens[7]  # pretend the 8th token is EOS
    lm = make_tiny_lm(eos_token_id=eos)
    store = BruteForceStore(list(prompt) + plain.tokens)
    res = RestDecoder(lm, stores=assemble_stores(static=store)).generate(
        prompt, DecodeConfig(max_new_tokens=30, draft_budget=16))
    first = plain.tokens.index(eos)
    assert res.tokens == plain.tokens[: first + 1] and res.stop_reason == "eos"
    res = RestDecoder(tiny_lm, stores=assemble_stores(static=store)).generate(
        prompt, DecodeConfig(max_new_tokens=5, draft_budget=16, stop_at_eos=False))
    assert res.tokens == plain.tokens[:5] and res.stop_reason == "length"


def test_same_seed_gives_the_same_sample_as_plain_sampling(tiny_lm):
    sampling = Sampling(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = PROMPTS[0]
    plain = plain_generate(tiny_lm, prompt, DecodeConfig(max_new_tokens=30, sampling=sampling, stop_at_eos=False))
    store = BruteForceStore(list(prompt) + plain.tokens)
    rest = RestDecoder(tiny_lm, stores=assemble_stores(static=store)).generate(
        prompt, DecodeConfig(max_new_tokens=30, sampling=sampling, draft_budget=8, stop_at_eos=False))
    assert rest.tokens == plain.tokens
    assert rest.steps < plain.steps


# -- exact sampling: the distribution of REST samples equals plain sampling's -----------------------------

def _exact_sequence_probs(lm, prompt, sampling, length, vocab):
    probs = {}
    with torch.inference_mode():
        for seq in itertools.product(range(vocab), repeat=length):
            p = 1.0
            for i in range(length):
                logits = lm.model(input_ids=torch.tensor([list(prompt) + list(seq[:i])])).logits[0, -1]
                p *= float(next_token_probs(logits, sampling)[seq[i]])
                if p == 0.0:
                    break
            probs[seq] = p
    return probs


def _chi_square_p(observed: dict, expected_probs: dict, n: int) -> float:
    cells = sorted(expected_probs, key=lambda s: -expected_probs[s])
    stat, dof, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for seq in cells:  # pool cells with expected count < 5 into one
        e = expected_probs[seq] * n
        if e >= 5:
            stat += (observed.get(seq, 0) - e) ** 2 / e
            dof += 1
        else:
            pooled_obs += observed.get(seq, 0)
            pooled_exp += e
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        dof += 1
    return float(chi2.sf(stat, dof - 1))


def _sample_many(lm, prompt, sampling, store, runs, length, stores=None):
    counts = {}
    dec = RestDecoder(lm, stores=stores if stores is not None else assemble_stores(static=store, request=False))
    for seed in range(runs):
        cfg = DecodeConfig(max_new_tokens=length, draft_budget=6, stop_at_eos=False,
                           sampling=Sampling(sampling.temperature, sampling.top_k, sampling.top_p, seed),
                           retrieve=RetrieveSettings(n_max=4, n_min=1))
        seq = tuple(dec.generate(prompt, cfg).tokens)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


SMALL = dict(vocab_size=5, layers=1, eos_token_id=4)


def _spread_out_case():
    """A 5-token model with a spread-out distribution (every branch matters), a prompt, sampling
    settings, and the exact probability of every 3-token continuation."""
    lm = make_tiny_lm(seed=3, **SMALL)
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(0.25)
    prompt = [1, 2]
    sampling = Sampling(temperature=0.9, top_p=0.95)
    return lm, prompt, sampling, _exact_sequence_probs(lm, prompt, sampling, 3, 5)


@pytest.mark.slow
def test_rest_sampling_matches_plain_distribution():
    lm, prompt, sampling, expected = _spread_out_case()
    store = BruteForceStore([1, 2, 0, 1, 2, 1, 2, 3, 0, 0, 1, 2, 2, 2, 3, 2, 0, 1])  # branching drafts
    runs = 1500
    observed = _sample_many(lm, prompt, sampling, store, runs, 3)
    assert _chi_square_p(observed, expected, runs) > 1e-3


@pytest.mark.slow
def test_rest_sampling_with_the_models_own_drafts_matches_plain_distribution():
    lm, prompt, sampling, expected = _spread_out_case()
    recycled = RecycleStore(5, k=3)  # learns from every pass, so later runs draft branching trees from it
    runs = 1000
    observed = _sample_many(lm, prompt, sampling, None, runs, 3, stores=assemble_stores(request=False, model=recycled))
    assert recycled.known >= 3
    assert _chi_square_p(observed, expected, runs) > 1e-3


@pytest.mark.slow
def test_the_chi_square_check_catches_the_biased_reference_rule(monkeypatch):
    """Sampling each child independently and re-drawing fresh on rejection favours drafted tokens."""
    def biased(tree, logits, cfg, gen, choices=None):
        choices = logits.argmax(-1).tolist()
        path, node = [0], 0
        while True:
            probs = next_token_probs(logits[node], cfg)
            accepted = None
            for token, child in tree.children[node].items():  # accept each child with p(child), in turn
                if torch.rand((), generator=gen).item() < float(probs[token]):
                    accepted = child
                    break
            if accepted is None:
                return verify_mod.Verdict(path, draw_token(probs, gen), choices)  # fresh draw: the bias
            path.append(accepted)
            node = accepted

    lm, prompt, sampling, expected = _spread_out_case()
    store = BruteForceStore([1, 2, 0, 1, 2, 1, 2, 3, 0, 0, 1, 2, 2, 2, 3, 2, 0, 1])
    monkeypatch.setattr(verify_mod, "verify_sampling", biased)
    observed = _sample_many(lm, prompt, sampling, store, 800, 3)
    assert _chi_square_p(observed, expected, 800) < 1e-3


# -- bad input ---------------------------------------------------------------------------------------------

def test_empty_and_too_long_prompts_are_refused_clearly(tiny_lm):
    dec = RestDecoder(tiny_lm)
    with pytest.raises(PromptError, match="empty"):
        dec.generate([], DecodeConfig())
    with pytest.raises(PromptError, match="shorten"):
        dec.generate([3] * 600, DecodeConfig())
    with pytest.raises(PromptError, match="empty"):
        plain_generate(tiny_lm, [], DecodeConfig())
    with pytest.raises(PromptError, match="vocabulary"):
        dec.generate([1, 70_000], DecodeConfig())


@pytest.mark.parametrize("cfg,message", [
    (DecodeConfig(max_new_tokens=0), "max_new_tokens"),
    (DecodeConfig(sampling=Sampling(temperature=-1)), "temperature"),
    (DecodeConfig(sampling=Sampling(temperature=1, top_p=0)), "top_p"),
    (DecodeConfig(sampling=Sampling(temperature=1, top_k=-3)), "top_k"),
    (DecodeConfig(retrieve=RetrieveSettings(n_max=2, n_min=5)), "n_min"),
    (DecodeConfig(draft_budget=-1), "draft_budget"),
])
def test_wrong_settings_are_refused_clearly(tiny_lm, cfg, message):
    with pytest.raises(ValueError, match=message):
        RestDecoder(tiny_lm).generate([1, 2], cfg)


def test_generation_near_the_context_limit_stops_cleanly(tiny_lm):
    res = RestDecoder(tiny_lm).generate([3] * 508, DecodeConfig(max_new_tokens=50,
                                                                                          stop_at_eos=False))
    assert len(res.tokens) == 4 and res.stop_reason == "context"


# -- fixed on the way --------------------------------------------------------------------------------------

def test_unseeded_sampling_leaves_the_global_rng_alone(tiny_lm):
    cfg = DecodeConfig(max_new_tokens=4, sampling=Sampling(temperature=1.0))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    plain_generate(tiny_lm, [1, 2, 3], cfg)
    RestDecoder(tiny_lm, stores=assemble_stores()).generate([1, 2, 3], cfg)
    assert torch.equal(torch.rand(3), expected)


def test_history_store_follows_the_requested_suffix_lengths(tiny_lm):
    history = HistoryStore(n_max=16, n_min=2)  # indexed for n_min=2, as the command line opened it
    history.add([5, 6, 7, 8, 9])
    cfg = DecodeConfig(max_new_tokens=6, draft_budget=4, retrieve=RetrieveSettings(n_max=4, n_min=1))
    dec = RestDecoder(tiny_lm, stores=assemble_stores(history=history, request=False, n_max=4, n_min=1))
    res = dec.generate([1, 2, 5], cfg)  # a one-token suffix (5) must be looked up, not refused
    assert res.tokens == plain_generate(tiny_lm, [1, 2, 5], cfg).tokens
    assert history.lookup([5], n_max=4, n_min=1).matched_len == 1
    assert len(history) == 2  # the answer was kept (in memory: the decoder writes no files)


def test_a_fixed_budget_of_zero_is_recorded_as_zero():
    assert DecodeConfig(draft_budget=0).settings()["draft_budget"] == 0
    assert DecodeConfig(draft_budget=None).settings()["draft_budget"] == "auto"
    assert DecodeConfig(draft_budget=7).settings()["draft_budget"] == 7


def test_stores_learn_only_through_their_lifecycle(tiny_lm, tmp_path):
    history = HistoryStore(path=tmp_path / "h.npz")
    dec = RestDecoder(tiny_lm, stores=assemble_stores(history=history))
    dec.generate([1, 2, 3], DecodeConfig(max_new_tokens=5))
    assert len(history) == 1 and not (tmp_path / "h.npz").exists()  # kept in memory, saved by its owner
    dec.generate([1, 2, 3], DecodeConfig(max_new_tokens=5), update_history=False)
    assert len(history) == 1


def test_the_models_own_predictions_draft_and_greedy_stays_exact(tiny_lm):
    recycled = RecycleStore(tiny_lm.vocab_size)
    dec = RestDecoder(tiny_lm, stores=assemble_stores(request=False, model=recycled))
    cfg = DecodeConfig(max_new_tokens=40, draft_budget=8, stop_at_eos=False)
    traces = []
    for prompt in ([5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8]):
        res = dec.generate(prompt, cfg, hook=traces.append)
        assert res.tokens == plain_generate(tiny_lm, prompt, cfg).tokens
    assert recycled.known > 0 and recycled.known_pairs > 0
    row, paired = recycled.successors(7, 8)  # the first root, 8, came after 7: learned as a pair
    assert paired and row[0] == plain_generate(tiny_lm, [5, 6, 7, 8], cfg).tokens[0]
    assert 2 in {t.matched_len["model"] for t in traces}  # drafted after pairs it had seen
    assert {"model"} == {s for t in traces for s in t.tree_sources[1:]}
    assert res.accepted_by_source.get("model", 0) > 0  # the repeated prompt is drafted from what was learned
    assert res.drafted_by_source["model"] >= res.accepted_by_source["model"]


def test_the_step_overhead_script_splits_steps_with_and_without_a_draft(tiny_lm):
    """tools/step_overhead.py on the tiny model: every step is counted once, under the kind its tree was,
    and its phases are the decoder's own timings."""
    module = tool("step_overhead")
    dec = RestDecoder(tiny_lm, stores=assemble_stores(request=True, model=RecycleStore(tiny_lm.vocab_size)))
    cfg = DecodeConfig(max_new_tokens=24, draft_budget=4, stop_at_eos=False)
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8]]  # the second learns from the first: some steps draft, some not
    out = module.measure(dec, prompts, cfg)
    traces = []  # the same decodes again with fresh stores (which learn alike), their steps counted by hand
    fresh = RestDecoder(tiny_lm, stores=assemble_stores(request=True, model=RecycleStore(tiny_lm.vocab_size)))
    for ids in prompts:
        fresh.generate(list(ids), cfg, hook=traces.append)
    drafted = sum(len(t.tree_tokens) > 1 for t in traces)
    assert out["with draft"]["steps"] == drafted > 0 and out["no draft"]["steps"] == len(traces) - drafted > 0
    for kind in ("no draft", "with draft"):
        k = out[kind]
        assert 0 < k["median_ms"] and 0 < k["mean_ms"] and k["learning_ms"] == 0.0  # no cost model here
        # the phases besides the pass, plus the forward phase's time outside the model call (within that phase)
        assert 0 <= k["outside_call_ms"] < k["phases_ms"]["forward"]
        assert k["mean_ms"] == pytest.approx(sum(k["phases_ms"][p] for p in module.PHASES_AROUND)
                                             + k["outside_call_ms"])
    assert 0 < out["plain_around_ms"] < out["plain_ms_per_step"]
    assert dec.budget_chooser is None  # the decoder is handed back as it was
    assert "forward" not in vars(tiny_lm)  # and the model's calls are no longer timed


def test_the_step_overhead_script_times_rest_cut_to_the_root_against_plain(tiny_lm):
    """--never-draft: the cost model decides every step, but every tree the model sees is the root alone, so the
    decode is plain decoding with REST's work around it; the chooser is handed back afterwards."""
    module = tool("step_overhead")
    seen = []

    class Watching(CostModel):
        def decide(self, tree):
            seen.append(tree.draft_size)
            return super().decide(tree)

    chooser = Watching(times_ms=np.array([50.0 + 0.01 * (q - 1) for q in GRID]))
    dec = RestDecoder(tiny_lm, stores=assemble_stores(request=True, model=RecycleStore(tiny_lm.vocab_size)),
                      budget_chooser=chooser)
    cfg = DecodeConfig(max_new_tokens=24, stop_at_eos=False)
    traces = []
    real_generate = dec.generate
    dec.generate = lambda ids, c: real_generate(ids, c, hook=traces.append)
    out = module.never_drafting(dec, [[5, 6, 7, 8], [5, 6, 7, 8]], cfg, rounds=2)
    assert len(traces) == 2 * 2 * 24 and all(len(t.tree_tokens) == 1 for t in traces)  # never a draft sent
    assert max(seen) > 0  # though the stores offered candidates, ranked by the cost model
    assert out["rest_ms_per_step"] > 0 and out["plain_ms_per_step"] > 0 and len(out["per_prompt"]) == 2
    assert dec.budget_chooser is chooser


def test_the_cut_ceiling_script_replays_the_recorded_choice_exactly(tiny_lm):
    """tools/cut_ceiling.py on the tiny model: every step's candidate tree is recorded with the cost model's
    ranking; replaying the budgets the cost model kept gives back the drafts the decoder accepted, and a
    rule that knows the answer does at least as well as the recorded choice."""
    module = tool("cut_ceiling")

    class NearlyFree(CostModel):  # trees cost almost nothing more than one token, whatever the tiny model takes
        def _refresh_curve(self, q, forward_ms):
            pass

    chooser = NearlyFree(times_ms=np.array([50.0 + 0.01 * (q - 1) for q in GRID]))
    dec = RestDecoder(tiny_lm, stores=assemble_stores(request=True, model=RecycleStore(tiny_lm.vocab_size)),
                      budget_chooser=chooser)
    cfg = DecodeConfig(max_new_tokens=24, stop_at_eos=False)
    rows = module.record(dec, [[5, 6, 7, 8], [5, 6, 7, 8, 5, 6, 7, 8]], cfg)
    assert dec.budget_chooser is chooser  # handed back as it was
    assert any(r["kept"] > 0 for r in rows) and any(r["candidates"] > 0 for r in rows)
    for r in rows:
        assert len(r["chances"]) == r["candidates"] and r["kept"] <= r["candidates"]
        assert r["accepted"] <= len(r["ranks"])  # what was accepted lies on the answer's path
    recorded = module.replay(rows, chooser.forward_ms, lambda r: r["kept"])
    assert recorded[0] == pytest.approx(np.mean([1 + r["accepted"] for r in rows]))
    assert recorded[0] > 1.0
    knowing = module.replay(rows, chooser.forward_ms, module.knowing_the_answer(rows, chooser.forward_ms))
    assert knowing[1] >= recorded[1] - 1e-9
    lines = module.report(rows, chooser.forward_ms)
    uncovered = np.mean([not r["ranks"] for r in rows])  # the answer's next token among no candidate
    assert 0 < uncovered < 1  # both kinds of step occur here, so the share below is not a constant
    assert lines[1].startswith(f"the answer's next token among no candidate: {uncovered:.1%} of steps")
    assert lines[2].startswith(f"answer tokens the candidates hold per step: 0: {uncovered:.1%}, ")
    holders = sorted({s for r in rows for s in r["holders"]})  # the sources that retrieved some step's next token
    assert lines[4].startswith("the answer's next token as the first token of a source's continuations: ")
    assert all(f"{s} " in lines[4] for s in holders) and holders
    assert lines[5].startswith("recorded choice") and len(lines) == 22
    assert all(len(r["before"]) <= 6 and isinstance(r["next"], int) for r in rows)
    assert sum(line.startswith("expected tokens - r * ms") for line in lines) == 4


def test_the_cut_ceiling_script_records_the_tree_a_fallback_step_kept(tiny_lm):
    """A step that asks a fallback store (the dense one) decides twice -- on the other stores' tree, then on the
    tree with the fallback's drafts -- and the recording keeps the second, one row per step."""
    from datastores import Lookup, StoreBase

    module = tool("cut_ceiling")

    class Fallback(StoreBase):  # drafts [7, 8] whatever the context, like the dense store
        source = "dense"
        fallback = True
        asked = 0

        def lookup(self, context, n_max=16, n_min=2, max_matches=512, continuation_len=4):
            Fallback.asked += 1
            return Lookup(self.source, 32, 32, np.array([[7, 8] + [-1] * (continuation_len - 2)] * 4),
                          by_suffix=False)

    chooser = CostModel(times_ms=np.array([50.0 + 0.01 * (q - 1) for q in GRID]))
    dec = RestDecoder(tiny_lm, stores=[*assemble_stores(request=True), Fallback()], budget_chooser=chooser)
    cfg = DecodeConfig(max_new_tokens=12, stop_at_eos=False)
    traces = []
    rows = module.record(dec, [[5, 6, 9, 4]], cfg)
    dec.generate([5, 6, 9, 4], cfg, hook=traces.append)
    assert Fallback.asked > 0 and len(rows) == len(traces)
    assert all(r["candidates"] >= 2 for r in rows)  # every step kept a tree with drafts: its own or the fallback's


def made_up_curve(q):
    """A cost curve for the replay tests: 1 token 1 ms, 3 tokens 2.5 ms, 9 tokens 6.9 ms, any other size 100 ms."""
    q = np.asarray(q)
    cost = np.select([q == 1, q == 3, q == 9], [1.0, 2.5, 6.9], 100.0)
    return cost if cost.ndim else float(cost)


def test_chances_spent_at_an_exchange_rate_draft_while_the_margin_beats_it():
    """On `made_up_curve`, 2 drafts with chances 0.9, 0.9 give 2.8 expected tokens in 2.5 ms (the
    step's best ratio, 1.12 per ms); 8 drafts give 7.42 in 6.9 ms (1.075), so the objective keeps 2.  At an
    exchange rate of one token per ms the 6 more drafts are worth their 4.4 ms (4.62 tokens); at two per ms
    not even a plain step's token is, and the rate a lone step's chances promise is its own best ratio."""
    module = tool("cut_ceiling")
    rows = [{"candidates": 8, "chances": [0.9, 0.9] + [0.77] * 6}]
    assert module.objective(made_up_curve)(rows[0]) == 2
    assert module.at_rate(rows, made_up_curve, 1.0)(rows[0]) == 8
    assert module.at_rate(rows, made_up_curve, 2.0)(rows[0]) == 0
    assert module.at_rate(rows, made_up_curve)(rows[0]) == 2


def test_knowing_the_answer_finds_the_best_rate_of_all_steps_together():
    """Two steps on `made_up_curve`.
    The first step's answer starts at its third-ranked candidate: 8 drafts give 7 tokens in 6.9 ms, a rate
    above a plain step's; the second's 2 drafts give 3 tokens in 2.5 ms.  Each step's own best rate drafts
    both (10 tokens in 9.4 ms); the best rate of the two together keeps the first step plain (4 in 3.5)."""
    module = tool("cut_ceiling")
    rows = [{"candidates": 8, "ranks": [2, 3, 4, 5, 6, 7], "kept": 8, "accepted": 6, "chances": [0.5] * 8},
            {"candidates": 2, "ranks": [0, 1], "kept": 2, "accepted": 2, "chances": [0.5] * 2}]
    each_alone = module.replay(rows, made_up_curve, lambda r: r["kept"])
    assert each_alone == (10 / 2, 10 / 9.4)
    knowing = module.knowing_the_answer(rows, made_up_curve)
    assert knowing(rows[0]) == 0 and knowing(rows[1]) == 2
    best = module.replay(rows, made_up_curve, knowing)
    assert best == (4 / 2, 4 / 3.5) and best[1] > each_alone[1]
    for first in module.CANDIDATE_BUDGETS[module.CANDIDATE_BUDGETS <= 8]:  # no other pair of budgets does better
        for second in (0, 1, 2):
            picks = {0: int(first), 1: second}
            other = module.replay(rows, made_up_curve, lambda r, picks=picks: picks[rows.index(r)])
            assert other[1] <= best[1]


def test_the_native_side_by_side_script_puts_every_store_on_its_python_path(tiny_lm, tmp_path):
    """tools/native_ab.py's "python" variant: every store answers through its Python path (no native call made,
    the request store hashed again) and the cost model ranks with numpy; a decode on those paths drafts and
    decodes exactly what the native paths do (the same stores' contents, a cost curve that does not move)."""
    from datastores import build_from_token_documents

    module = tool("native_ab")
    prompt = PROMPTS[0]
    plain, brute = store_from_plain(tiny_lm, prompt, 30)
    results = {}
    for variant in module.VARIANTS:
        static = build_from_token_documents(tmp_path / variant, [brute.tokens], tokenizer_info={"name": "tiny"})
        history, model = HistoryStore(path=None), RecycleStore(tiny_lm.vocab_size)
        stores = assemble_stores(static=static, request=True, history=history, model=model)
        chooser = CostModel(times_ms=np.array([10.0 + 0.1 * (q - 1) for q in GRID]))  # cheap trees: drafts
        chooser._refresh_curve = lambda q, ms: None  # the same budgets on both paths, whatever the passes took
        if variant == "python":
            module.python_paths(stores, chooser)
            assert static.native == model.native == chooser.native == PYTHON
            request = next(s for s in stores if s.source == "request")
            assert request._scan is None and request._index.hashed and history._index.scan is None
        dec = RestDecoder(tiny_lm, stores=stores, budget_chooser=chooser)
        cfg = DecodeConfig(max_new_tokens=30, stop_at_eos=False)
        runs = [dec.generate(prompt, cfg) for _ in range(2)]  # the second drafts from the history too
        results[variant] = [(r.tokens, r.steps, r.accepted_drafts) for r in runs]
        assert all(r.tokens == plain.tokens for r in runs) and runs[1].accepted_drafts > 0
    assert results["native"] == results["python"]


def test_only_undisturbed_steps_teach_the_cost_curve(tiny_lm):
    """A step the decoder's `undisturbed` denies (something else of this process took the cores meanwhile, as the
    page's live figures do) still teaches acceptance, but its forward time does not teach the cost curve."""
    class Recording(CostModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.timed = []

        def observe(self, tree, accepted_nodes, forward_ms):
            self.timed.append(forward_ms)
            super().observe(tree, accepted_nodes, forward_ms)

    cfg = DecodeConfig(max_new_tokens=16, stop_at_eos=False)
    steps = {}
    for name, undisturbed in (("quiet", None), ("busy", lambda since: False), ("alternate", None)):
        chooser = Recording(times_ms=np.array([50.0 + 2.0 * (q - 1) for q in GRID]))
        if name == "alternate":
            calls = itertools.count()
            undisturbed = lambda since, calls=calls: next(calls) % 2 == 0
        before = chooser.times_ms.copy()
        RestDecoder(tiny_lm, stores=assemble_stores(request=True), budget_chooser=chooser,
                    undisturbed=undisturbed).generate([5, 6, 7, 8, 5, 6, 7, 8], cfg)
        steps[name] = chooser.timed
        if name == "busy":
            assert np.array_equal(chooser.times_ms, before)  # no step taught the curve
    assert steps["quiet"] and all(ms is not None and ms > 0 for ms in steps["quiet"])
    assert steps["busy"] and all(ms is None for ms in steps["busy"])
    alternate = steps["alternate"]
    assert [ms is None for ms in alternate] == [i % 2 == 1 for i in range(len(alternate))]
