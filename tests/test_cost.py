"""The draft budget follows the measured cost curve and the observed acceptance."""
from __future__ import annotations

import json

import numpy as np
import pytest

import rest_core.cost as cost
import rest_core.cost_curve as cost_curve
import rest_core.cost_stats as cost_stats
import rest_core.machine as machine
from datastores import assemble_stores
from rest_core.cost import GRID, CostModel
from rest_core.cost_curve import monotone_fit
from rest_core.decode import DecodeConfig, RestDecoder
from rest_core.tree import build_draft_tree

from oracle import OracleLookup


def curve(one_ms: float, slope_ms: float) -> np.ndarray:
    return np.array([one_ms + slope_ms * (q - 1) for q in GRID], dtype=float)


def chain_tree(shares_rows: int = 10, agree: int = 10):
    """A single chain drafted by `agree` of `shares_rows` continuations: share agree/rows at every depth."""
    rows = np.array([[11, 12, 13, 14, 15, 16, 17, 18]] * agree + [[21, 22, 23, 24, 25, 26, 27, 28]] *
                    (shares_rows - agree))
    return build_draft_tree(1, [OracleLookup("static", 4, shares_rows, rows)], budget=63)


def test_free_verification_drafts_everything_useful():
    model = CostModel(times_ms=curve(50.0, 0.0))
    tree = chain_tree(agree=10)
    assert model.choose(tree) == tree.draft_size


def test_expensive_verification_and_weak_drafts_mean_a_plain_step():
    model = CostModel(times_ms=curve(50.0, 10.0))
    rows = np.array([[10 + i, 30 + i, 50 + i] for i in range(10)])  # ten different guesses, 10% each
    tree = build_draft_tree(1, [OracleLookup("static", 2, 10, rows)], budget=63)
    assert model.choose(tree) == 0


def test_observed_acceptance_moves_the_choice():
    model = CostModel(times_ms=curve(50.0, 3.0))
    tree = chain_tree(shares_rows=10, agree=5)
    before = model.choose(tree)
    for _ in range(300):  # every drafted node was rejected
        model.observe(tree, [0], forward_ms=60.0)
    assert model.choose(tree) < before or before == 0
    assert model.choose(tree) == 0
    fresh = CostModel(times_ms=curve(50.0, 3.0))
    for _ in range(300):  # the whole chain was always accepted
        fresh.observe(tree, list(range(len(tree))), forward_ms=60.0)
    assert fresh.choose(tree) >= before


def test_step_timings_refresh_the_curve():
    model = CostModel(times_ms=curve(50.0, 1.0))
    tree = build_draft_tree(1, [], budget=0)  # q = 1
    for _ in range(9):
        model.observe(tree, [0], forward_ms=80.0)
    assert model.forward_ms(1) == 80.0


def test_cached_calibration_is_reused_only_while_it_still_holds(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path))
    calls = []

    def fake_measure(lm, prefix_len=96, repeats=3, grid=GRID):
        calls.append(grid)
        return np.array([fake_measure.one_ms + fake_measure.per_token * (q - 1) for q in grid], dtype=float)

    monkeypatch.setattr(cost_curve, "measure_forward_curve", fake_measure)
    fake_measure.one_ms, fake_measure.per_token = 50.0, 4.0  # 8 tokens: 78 ms, 1.56x
    first = CostModel.for_model(tiny_lm)
    assert calls == [GRID] and first.forward_ms(1) == 50.0
    cost_curve._CURVES.clear()  # a new process: only the file is left
    fake_measure.one_ms, fake_measure.per_token = 55.0, 4.6  # 10% slower all over: the same shape
    second = CostModel.for_model(tiny_lm)  # probe agrees: cached curve kept
    assert calls[-1] == cost_curve.PROBE and second.forward_ms(1) == 50.0 and second.forward_ms(8) == 78.0
    fake_measure.one_ms, fake_measure.per_token = 50.0, 2.0  # one token as before, 8 tokens 1.28x: another shape
    cost_curve._CURVES.clear()
    third = CostModel.for_model(tiny_lm)
    assert calls[-2:] == [cost_curve.PROBE, GRID] and third.relative_cost(8) == 64.0 / 50.0
    fake_measure.one_ms, fake_measure.per_token = 200.0, 8.0  # the machine got slower: measure again
    cost_curve._CURVES.clear()
    fourth = CostModel.for_model(tiny_lm)
    assert calls[-2:] == [cost_curve.PROBE, GRID] and fourth.forward_ms(1) == 200.0
    saved = json.loads(next((tmp_path / "cost").glob("*.json")).read_text())
    assert saved["times_ms"][0] == 200.0


def test_acceptance_is_learned_per_source_and_kept_between_runs(tmp_path):
    rows = np.array([[11, 12, 13]] * 6 + [[21, 22, 23]] * 4)
    static_tree = build_draft_tree(1, [OracleLookup("static", 3, 10, rows)], budget=63)
    request_tree = build_draft_tree(1, [OracleLookup("request", 3, 10, rows)], budget=63)
    model = CostModel(times_ms=curve(50.0, 4.0), stats_path=tmp_path / "acc.json")
    for _ in range(200):
        model.observe(static_tree, [0], forward_ms=60.0)  # static drafts never accepted
        model.observe(request_tree, [0, 1, 3, 5], forward_ms=60.0)  # request drafts: the 11-12-13 chain always
    assert model.choose(static_tree) == 0
    assert model.choose(request_tree) >= 3
    model.save_stats()
    again = CostModel(times_ms=model.times_ms.copy(), stats_path=tmp_path / "acc.json")  # the curve as refreshed
    again.load_stats()
    assert again.choose(static_tree) == 0 and again.choose(request_tree) == model.choose(request_tree)
    assert set(again.counts) == set(model.counts) == {"static", "request"}
    for source in model.counts:
        np.testing.assert_allclose(again.counts[source], model.counts[source])


def test_monotone_fit_averages_a_spike_instead_of_lifting_everything_after_it():
    fitted = monotone_fit(np.array([50.0, 90.0, 60.0, 62.0, 100.0]))
    assert np.all(np.diff(fitted) >= 0)
    assert fitted[0] == 50.0 and fitted[-1] == 100.0
    assert fitted[1] == fitted[2] == fitted[3] == (90.0 + 60.0 + 62.0) / 3
    np.testing.assert_array_equal(monotone_fit(np.array([1.0, 2.0, 3.0])), [1.0, 2.0, 3.0])


def test_curve_is_measured_once_per_process_and_stats_are_kept_per_store(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path))
    cost_curve._CURVES.clear()
    calls = []

    def fake_measure(lm, prefix_len=96, repeats=3, grid=GRID):
        calls.append(grid)
        return np.array([50.0 + q for q in grid], dtype=float)

    monkeypatch.setattr(cost_curve, "measure_forward_curve", fake_measure)
    static_only = [OracleLookup("static", 0, 0, None)]
    static_only[0].label = "static:/a"
    with_request = static_only + [OracleLookup("request", 0, 0, None)]
    with_request[1].label = "request"
    other_static = [OracleLookup("static", 0, 0, None)]
    other_static[0].label = "static:/b"
    a = CostModel.for_model(tiny_lm, static_only)
    b = CostModel.for_model(tiny_lm, with_request)
    assert calls == [GRID]  # one measurement for the whole process, no probe, no overwrite
    rows = np.array([[11, 12, 13]] * 4)
    b.observe(build_draft_tree(1, [OracleLookup("request", 3, 4, rows)], budget=8), [0, 1, 2, 3], forward_ms=60.0)
    b.observe(build_draft_tree(1, [OracleLookup("static", 3, 4, rows)], budget=8), [0], forward_ms=60.0)
    b.save_stats()
    a.save_stats()  # a learned nothing: what b learned stays
    saved = json.loads(b.stats_path.read_text())["stores"]
    assert set(saved) == {"request", "static:/a"}
    # a store brings what was learned about it into any set of stores; another store starts afresh
    c = CostModel.for_model(tiny_lm, static_only)
    assert set(c.counts) == {"static"} and c.counts["static"][0].sum() == 1  # only the first node was tested
    assert CostModel.for_model(tiny_lm, other_static).counts == {}
    assert calls == [GRID]
    cost_curve._CURVES.clear()


def test_a_node_counts_only_when_its_parent_was_accepted_and_chances_multiply_along_a_path():
    rows = np.array([[11, 12, 13, 14]] * 8)
    tree = build_draft_tree(1, [OracleLookup("request", 3, 8, rows)], budget=8)  # one chain, ratio 1 everywhere
    model = CostModel(times_ms=curve(50.0, 1.0))
    fresh = model.ranked(tree)[1]
    assert np.allclose(fresh, cost.PRIOR_SCALE ** np.arange(1, 5)), "the prior: the ratio scaled down, multiplied"
    for _ in range(50):  # the first two tokens always right, the third always wrong
        model.observe(tree, [0, 1, 2], forward_ms=55.0)
    c = model.counts["request"]
    assert c[0].sum() == 150 and c[1].sum() == 100, "the fourth node was never put to the test"
    order, chance = model.ranked(tree)
    assert list(order) == [1, 2, 3, 4] and chance[0] > 0.9 and chance[1] > 0.85 and chance[2] < 0.1
    assert chance[3] <= chance[2]
    assert model.choose(tree) == 2


def test_a_lone_match_is_trusted_less_than_many_agreeing_ones_once_learned():
    model = CostModel(times_ms=curve(50.0, 2.0))
    lone = build_draft_tree(1, [OracleLookup("static", 3, 1, np.array([[11, 12]]))], budget=8)
    many = build_draft_tree(1, [OracleLookup("static", 3, 20, np.array([[21, 22]] * 20))], budget=8)
    assert lone.support[1] == 1 and many.support[1] == 20
    for _ in range(100):
        model.observe(lone, [0], forward_ms=55.0)  # a single match: wrong
        model.observe(many, [0, 1, 2], forward_ms=55.0)  # twenty agreeing matches: right
    assert model.choose(lone) == 0 and model.choose(many) == 2


def test_unreadable_acceptance_stats_are_ignored(tmp_path):
    path = tmp_path / "acc.json"
    for text in ("{not json", '{"bins": "x", "stores": []}', json.dumps({
            "version": cost_stats.STATS_VERSION, "shape": list(cost.SHAPE), "bins": cost.BINS.tolist(),
            "stores": {"static": [[1, 2]]}})):
        path.write_text(text)
        model = CostModel(times_ms=curve(50.0, 4.0), stats_path=path)
        model.load_stats()
        assert model.counts == {}


def test_the_calibration_is_kept_per_machine(tiny_lm, monkeypatch):
    here = cost_curve.calibration_file(tiny_lm).path
    monkeypatch.setattr(machine.torch, "__version__", "0.0.0-other")
    assert cost_curve.calibration_file(tiny_lm).path != here  # another torch: measured again
    monkeypatch.undo()
    info = {"cpu": "Test CPU", "cpu_vendor": "NoSuchVendor", "cpu_family": "0/0", "cpu_features": [],
            "cpu_capability": "DEFAULT"}  # no real machine reports this one, so it is not the machine running the test
    monkeypatch.setattr(machine, "cpu_info", lambda: info)
    assert cost_curve.calibration_file(tiny_lm).path != here  # another CPU or instruction set: measured again
    info.update(cpu="AMD EPYC", cpu_vendor="AuthenticAMD", cpu_family="25/1", cpu_features=["avx2"],
                cpu_capability="AVX2")
    zen3 = cost_curve.calibration_file(tiny_lm).path
    info.update(cpu_family="26/2", cpu_features=["avx2", "avx512f", "avx512_bf16"], cpu_capability="AVX512")
    assert cost_curve.calibration_file(tiny_lm).path != zen3  # the same name, another generation: measured again
    info.update(cpu_capability="AVX2")
    assert cost_curve.calibration_file(tiny_lm).path != zen3  # the family and features alone tell it apart


def test_a_real_pass_caps_every_smaller_size_so_a_spoiled_calibration_recovers():
    """A burst of load during the one-token passes made every tree look free (a flat curve); real timings of
    big trees beside one-token steps restore the shape, and the budget falls back from its largest."""
    rows = np.array([[11, 12, 13, 14, 15, 16, 17, 18]] * 2 + [[21, 22, 23, 24, 25, 26, 27, 28]] * 8
                    + [[31 + i, 40, 41, 42, 43, 44, 45, 46] for i in range(10)])
    tree = build_draft_tree(1, [OracleLookup("static", 4, 20, rows)], budget=63)
    plain = build_draft_tree(1, [], budget=0)
    model = CostModel(times_ms=np.full(len(GRID), 342.0))
    q = len(tree)
    assert q in GRID and model.choose(tree) == tree.draft_size  # spoiled: everything costs the same
    for _ in range(5):
        model.observe(tree, [0], forward_ms=120.0)  # the real cost of that big pass, nothing accepted
    assert model.choose(tree) == tree.draft_size  # one size alone: a slower pass or a slower machine?
    for _ in range(cost_curve.MIN_REFERENCE + cost_curve.MIN_PASSES):  # one-token steps between them tell the two apart
        model.observe(plain, [0], forward_ms=40.0)
        model.observe(tree, [0], forward_ms=120.0)
    i = GRID.index(q)
    assert model.times_ms[i] == pytest.approx(120.0) and np.all(model.times_ms[:i] <= model.times_ms[i])
    assert model.forward_ms(1) == pytest.approx(40.0) and model.choose(tree) < tree.draft_size


def test_a_burst_of_load_on_big_trees_does_not_stay_on_the_curve():
    """Big passes slowed while one-token steps kept their speed (a burst of load that hit the big trees): every
    size from them up looks dear, so the budget drops. Once the big size runs at its real cost again, the
    budget comes back; and a size no step runs any more returns to its calibrated cost after STALE_STEPS
    steps, so the budget can grow again and measure it anew."""
    model = CostModel(times_ms=curve(50.0, 1.0))
    calibrated = model.times_ms.copy()
    big = chain_tree()  # 8 drafts: a pass over 9 tokens, between grid sizes 8 and 12
    small = build_draft_tree(1, [OracleLookup("static", 4, 10, np.array([[11, 12]] * 10))], budget=63)
    plain = build_draft_tree(1, [], budget=0)

    def big_and_plain(big_ms: float, rounds: int) -> None:  # one-token steps between the big ones
        for _ in range(rounds):
            model.observe(plain, [0], forward_ms=50.0)
            model.observe(big, list(range(9)), forward_ms=big_ms)

    big_and_plain(58.0, 30)  # learned: the chain is always accepted whole, at the curve's cost
    assert model.choose(big) == 8
    big_and_plain(400.0, cost_curve.MIN_PASSES)  # a burst of load on the big passes
    assert model.relative_cost(64) >= 7.0 and model.choose(big) < 8  # dear from 8 tokens up
    big_and_plain(58.0, cost_curve.MIN_PASSES)  # the big tree at its real cost again
    assert model.choose(big) == 8
    assert np.allclose(model.times_ms[GRID.index(16):], calibrated[GRID.index(16):], rtol=0.02)  # never run

    big_and_plain(400.0, cost_curve.MIN_PASSES)  # another burst; then only small trees run
    assert model.choose(big) < 8
    steps = 0
    while model.choose(big) < 8 and steps <= cost_curve.STALE_STEPS:
        model.observe(small, [0, 1], forward_ms=51.0)
        steps += 1
    assert steps == cost_curve.STALE_STEPS  # the burst's sizes went stale STALE_STEPS steps after their last pass
    shape = model.times_ms / model.times_ms[0]
    assert np.allclose(shape[GRID.index(8):], (calibrated / calibrated[0])[GRID.index(8):], rtol=0.02)
    assert model.forward_ms(3) == pytest.approx(51.0)  # what does run keeps its measured time


def test_a_machine_that_slows_down_slows_every_size_with_it():
    """The machine runs at half its calibrated speed for a while (another program on the same cores). Only
    one-token passes and 9-token trees run; a 32-token tree, never run, must not look cheap next to them:
    it slows down with the machine, so its cost relative to a one-token pass stays the calibrated one."""
    model = CostModel(times_ms=np.array([20.0 + 0.5 * (q - 1) for q in GRID]))
    cal_32 = model.relative_cost(32)
    big = chain_tree()  # 9 tokens: 24 ms calibrated
    plain = build_draft_tree(1, [], budget=0)
    for _ in range(20):
        model.observe(plain, [0], forward_ms=40.0)
        model.observe(big, [0], forward_ms=48.0)
    assert model.forward_ms(1) == pytest.approx(40.0)
    assert model.relative_cost(9) == pytest.approx(1.2, rel=0.02)
    assert model.relative_cost(32) == pytest.approx(cal_32, rel=0.05)  # calibrated 1.78x, not 35.5 / 40 ms
    assert np.all(np.diff(model.times_ms) >= 0)


def test_the_curve_is_measured_in_interleaved_rounds_keeping_each_sizes_fastest_pass(tiny_lm, monkeypatch):
    seen = []
    real = tiny_lm.forward
    monkeypatch.setattr(tiny_lm, "forward", lambda cache, **kw: seen.append(kw["input_ids"].shape[1])
                        or real(cache, **kw))
    times = cost_curve.measure_forward_curve(tiny_lm, prefix_len=8, repeats=2, grid=(1, 2, 4))
    assert seen == [8] + [1, 2, 4] * 3  # the prefix, then a warm-up round and two timed rounds over every size
    assert times.shape == (3,) and np.all(np.diff(times) >= 0) and times[0] > 0


def test_draft_depth_follows_how_often_a_pattern_was_continued_that_way():
    """A branch many continuations agree on, and that the model keeps following, is drafted deep (past the old
    10-token cut); a branch one match offers, that the model seldom follows, is cut short."""
    model = CostModel(times_ms=curve(50.0, 0.5))
    deep = np.arange(100, 120)
    agreed = build_draft_tree(1, [OracleLookup("request", 6, 12, np.array([deep] * 12))], budget=63)
    lone = build_draft_tree(1, [OracleLookup("request", 2, 1, np.array([deep + 100]))], budget=63)
    assert agreed.draft_size == lone.draft_size == 20
    for _ in range(60):
        model.observe(agreed, list(range(21)), forward_ms=60.0)  # the whole branch accepted (at the curve's cost)
        model.observe(lone, [0, 1], forward_ms=60.0)  # the first token only
    assert model.choose(agreed) >= 16
    assert model.choose(lone) <= 2


def test_acceptance_is_kept_per_kind_of_text(tiny_lm, tmp_path, monkeypatch):
    """What a store's drafts earned on one kind of prompt (code completion) does not set how much it drafts on
    another (chat): the counts are saved and read back per kind; a caller that does not tell keeps its own."""
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path))
    cost_curve._CURVES.clear()
    monkeypatch.setattr(cost_curve, "measure_forward_curve",
                        lambda lm, prefix_len=96, repeats=3, grid=GRID: np.array([50.0 + q for q in grid], dtype=float))
    stores = [OracleLookup("static", 0, 0, None)]
    stores[0].label = "static:/a"
    rows = np.array([[11, 12, 13]] * 4)
    tree = build_draft_tree(1, [OracleLookup("static", 3, 4, rows)], budget=8)
    text = CostModel.for_model(tiny_lm, stores, kind="text")
    for _ in range(40):  # on code, the whole branch is accepted every time
        text.observe(tree, [0, 1, 2, 3], forward_ms=60.0)
    text.save_stats()
    saved = json.loads(text.stats_path.read_text())["stores"]
    assert set(saved) == {"static:/a [text]"}
    chat = CostModel.for_model(tiny_lm, stores, kind="chat")
    assert chat.counts == {}  # a chat starts from the prior, not from what code taught
    assert (chat.ranked(tree)[1] < CostModel.for_model(tiny_lm, stores, kind="text").ranked(tree)[1]).all()
    for _ in range(5):
        chat.observe(tree, [0], forward_ms=60.0)
    chat.save_stats()
    again = CostModel.for_model(tiny_lm, stores, kind="text")
    assert again.counts["static"][1].sum() == text.counts["static"][1].sum()  # the chat's misses left it alone
    assert CostModel.for_model(tiny_lm, stores, kind="chat").counts["static"][1].sum() == 0
    assert CostModel.for_model(tiny_lm, stores).counts == {}  # untold: neither kind's
    assert set(json.loads(text.stats_path.read_text())["stores"]) == {"static:/a [text]", "static:/a [chat]"}
    cost_curve._CURVES.clear()


def test_real_passes_off_the_grid_refresh_the_sizes_around_them():
    """Budgets of 8, 10, 12 drafts make passes of 9, 11, 13 tokens, which are not grid sizes: their real cost
    still reaches the curve (both neighbouring sizes, scaled by the curve's shape), so a calibration that
    made large trees look cheap is corrected by the steps that run them."""
    model = CostModel(times_ms=curve(50.0, 1.0))  # q = 9 predicted at 58 ms: 1.16x a one-token pass
    rows = np.array([[11, 12, 13, 14, 15, 16, 17, 18, 19]] * 10)
    tree = build_draft_tree(1, [OracleLookup("static", 4, 10, rows)], budget=8)
    plain = build_draft_tree(1, [], budget=0)
    q = len(tree)
    assert q == 9 and q not in GRID
    before = model.relative_cost(q)
    for _ in range(4):
        model.observe(tree, [0], forward_ms=87.0)
    assert model.relative_cost(q) == pytest.approx(before)  # one size alone: slower pass or slower machine?
    for _ in range(cost_curve.MIN_REFERENCE + cost_curve.MIN_PASSES):  # one-token passes between them tell
        model.observe(plain, [0], forward_ms=50.0)
        model.observe(tree, [0], forward_ms=87.0)
    assert model.relative_cost(q) == pytest.approx(87.0 / 50.0, rel=0.03)  # what the real passes cost
    lo, hi = GRID.index(8), GRID.index(12)
    assert model.times_ms[lo] > 57.0 + 20 and model.times_ms[hi] > 61.0 + 20
    assert model.forward_ms(1) == pytest.approx(50.0) and np.all(np.diff(model.times_ms) >= 0)
    last = model.times_ms[-1]
    for _ in range(5):  # passes beyond the grid change nothing
        model.observe(build_draft_tree(1, [OracleLookup("static", 4, 10, np.arange(80)[None] + 100)], budget=80),
                      [0], forward_ms=1000.0)
    assert model.times_ms[-1] == last


def test_a_request_whose_drafts_keep_missing_drafts_less_until_the_next_request():
    rows = np.array([[11, 12, 13]] * 8 + [[21, 22, 23]] * 2)
    static_tree = build_draft_tree(1, [OracleLookup("static", 3, 10, rows)], budget=63)
    request_tree = build_draft_tree(1, [OracleLookup("request", 3, 10, rows)], budget=63)
    model = CostModel(times_ms=curve(50.0, 1.0))
    model.begin_request()
    factors = []
    for _ in range(6):  # this request: every static draft missed
        model.observe(static_tree, [0], forward_ms=52.0)
        factors.append(model.request_factor("static"))
    assert all(b < a for a, b in zip([1.0, *factors], factors)) and factors[-1] < 0.75
    assert model.request_factor("request") == 1.0
    within = model.conditional(static_tree)
    model.begin_request()  # the next request starts from the cells alone (which did learn the misses)
    assert model.request_factor("static") == 1.0
    cells_only = model.conditional(static_tree)
    assert (within < cells_only).all()
    # the request's correction is static's alone (the correction per number of sources, learned from every
    # source's nodes, is another matter: off here)
    model.use_agreement = False
    assert np.allclose(model.conditional(request_tree), CostModel(times_ms=curve(50.0, 1.0)).conditional(request_tree))


def test_a_request_whose_drafts_land_more_than_their_cells_say_drafts_more_never_above_certainty():
    rows = np.array([[11, 12, 13, 14]] * 3 + [[21, 22, 23, 24]] * 7)  # the drafts the rows agree on least...
    tree = build_draft_tree(1, [OracleLookup("request", 3, 10, rows)], budget=63)
    minority = [n for n in range(1, len(tree)) if tree.tokens[n] in (11, 12, 13, 14)]
    model = CostModel(times_ms=curve(50.0, 6.0))
    model.begin_request()
    first = model.choose(tree)
    for _ in range(8):  # ...are what the model says, step after step
        model.observe(tree, [0, *minority], forward_ms=60.0)
    assert model.request_factor("request") > 1.25
    within, drafted = model.conditional(tree), model.choose(tree)
    assert within.max() <= cost.MAX_CHANCE
    model.begin_request()
    cells_only = model.conditional(tree)
    assert (within >= cells_only).all() and (within > cells_only).any()
    assert drafted >= model.choose(tree) and drafted > first


def test_the_decoder_starts_every_request_with_a_fresh_correction(tiny_lm):
    class Counting(CostModel):
        begun = 0
        events: list = []

        def begin_request(self) -> None:
            Counting.begun += 1
            super().begin_request()
            Counting.events.append("begin")

        def decide(self, tree):
            Counting.events.append("decide with a leftover" if self._request.get("request") == (0.0, 50.0)
                                   else "decide")
            return super().decide(tree)

    chooser = Counting(times_ms=np.linspace(10.0, 40.0, len(GRID)))
    chooser._request["request"] = (0.0, 50.0)  # what a previous request left
    dec = RestDecoder(tiny_lm, stores=assemble_stores(), budget_chooser=chooser)
    first = dec.generate([5, 6, 7, 5, 6, 7, 5, 6], DecodeConfig(max_new_tokens=4))
    dec.generate([5, 6, 7], DecodeConfig(max_new_tokens=4))
    assert Counting.begun == 2
    assert chooser.request_factor("request") != 4.0 / 54.0
    # each request starts its correction before its first step decides: nothing left over reaches a step
    assert Counting.events[0] == "begin" and Counting.events[1 + first.steps] == "begin"
    assert "decide with a leftover" not in Counting.events and Counting.events.count("decide") >= first.steps
    fixed = RestDecoder(tiny_lm, stores=assemble_stores(), budget_chooser=chooser)
    fixed.generate([5, 6, 7], DecodeConfig(max_new_tokens=4, draft_budget=2))  # a fixed budget asks no chooser
    assert Counting.begun == 2


def test_the_decoder_reports_why_the_cost_model_kept_what_it_kept(tiny_lm):
    chooser = CostModel(times_ms=np.linspace(10.0, 40.0, len(GRID)))
    request = np.array([5, 6, 7, 8, 9] * 6)  # a repetitive prompt: the request store drafts
    steps = []
    dec = RestDecoder(tiny_lm, stores=assemble_stores(), budget_chooser=chooser)
    dec.generate(list(request), DecodeConfig(max_new_tokens=12), hook=steps.append)
    chosen = [s for s in steps if s.budget_choice is not None]
    assert chosen, "the request store drafted at some step"
    for s in chosen:
        why = s.budget_choice
        assert why["kept"] == len(s.tree_tokens) - 1 <= why["candidates"]
        assert why["relative_cost"] >= 1.0 and why["expected_accepted"] >= 0.0
        assert set(why["request_factors"]) <= {"request"} and "chances" not in why
        assert 0 <= why["agreed"] <= why["candidates"] and len(why["agreement_factors"]) == cost.AGREE_LEVELS
        if why["kept"] == 0:
            assert s.node_chances == []
            continue
        # each kept node's chance, the root none; a child never more likely than its parent; they sum to the
        # expected accepted drafts
        chances = s.node_chances
        assert len(chances) == len(s.tree_tokens) and chances[0] is None
        assert all(0.0 <= c <= 0.99 for c in chances[1:])
        assert all(chances[i] <= chances[p] + 1e-4 for i, p in enumerate(s.tree_parents) if p > 0)
        assert sum(chances[1:]) == pytest.approx(why["expected_accepted"], abs=1e-4 * len(chances))
    assert any(s.budget_choice["kept"] > 0 for s in chosen), "some step kept drafts: their chances were checked"
    nothing = [s for s in steps if s.budget_choice is None]
    assert all(len(s.tree_tokens) == 1 for s in nothing)
    fixed = []
    dec.generate(list(request), DecodeConfig(max_new_tokens=6, draft_budget=3), hook=fixed.append)
    assert all(s.budget_choice is None for s in fixed), "a fixed budget: no cost model chose"


def test_a_few_nodes_learn_in_python_numbers_exactly_as_the_array_path(monkeypatch):
    """Trees of up to FEW_NODES drafts are counted node by node in Python: on 300 random trees of several
    sources, random accepted paths and random earlier counts (some cells at the fading limit), the counts come
    out bit for bit as the array path's and the request's sums within rounding."""
    rng = np.random.default_rng(7)
    for trial in range(300):
        lookups = []
        for source in rng.choice(["static", "request", "model", "answers"], size=rng.integers(1, 4), replace=False):
            k = int(rng.integers(1, 12))
            rows = rng.integers(10, 14, size=(k, int(rng.integers(1, 6))))
            lookups.append(OracleLookup(str(source), int(rng.integers(1, 5)), k, rows))
        tree = build_draft_tree(1, lookups, budget=int(rng.integers(1, cost.FEW_NODES + 1)),
                                base_weights={"model": 0.5})
        if len(tree) < 2:
            continue
        path, node = [0], 0
        while True:  # walk down while a coin says the model agreed
            kids = [i for i in range(1, len(tree)) if tree.parents[i] == node]
            if not kids or rng.random() < 0.3:
                break
            node = int(rng.choice(kids))
            path.append(node)
        models = []
        for _ in range(2):
            m = CostModel(times_ms=curve(50.0, 1.0))
            r = np.random.default_rng(trial)
            for name in ("static", "request", "model", "answers"):
                c = m._counts(name)
                c[...] = np.round(r.random(cost.SHAPE) * 30, 3)
                c[0] += np.where(r.random(cost.SHAPE[1:]) < 0.1, cost_stats.MAX_COUNT - 0.5, 0.0)
                c[1] = np.minimum(c[1], c[0])
            m._request = {"request": (1.5, 2.25)}
            models.append(m)
        few, array = models
        few.observe(tree, path, forward_ms=50.0)
        monkeypatch.setattr(cost, "FEW_NODES", 0)
        array.observe(tree, path, forward_ms=50.0)
        monkeypatch.setattr(cost, "FEW_NODES", 16)
        assert few.counts.keys() == array.counts.keys()
        for name in few.counts:
            assert np.array_equal(few.counts[name], array.counts[name]), (trial, name)
        assert few._request.keys() == array._request.keys()
        for name, (acc, pred) in few._request.items():
            assert acc == array._request[name][0] and pred == pytest.approx(array._request[name][1], rel=1e-12)
        assert np.allclose(few.agreement, array.agreement, rtol=1e-12, atol=0), trial


def _two_source_trees():
    """The same chain drafted by one source (static) and by two (static and request), the cells alike."""
    rows = np.array([[11, 12, 13]] * 6 + [[21, 22, 23]] * 4)
    one = build_draft_tree(1, [OracleLookup("static", 3, 10, rows)], budget=63)
    two = build_draft_tree(1, [OracleLookup("static", 3, 10, rows), OracleLookup("request", 3, 1, rows[:1])],
                           budget=63)
    return one, two


def test_nodes_several_sources_drafted_are_trusted_as_they_turned_out():
    one, two = _two_source_trees()
    assert one.agree.tolist() == [0, 1, 1, 1, 1, 1, 1] and two.agree.tolist() == [0, 2, 1, 2, 1, 2, 1]
    model = CostModel(times_ms=curve(50.0, 2.0))
    for source in ("static", "request"):  # every cell long learned at one in two: this test moves them little
        counts = model._counts(source)
        counts[0], counts[1] = 4000.0, 2000.0
    before = model.conditional(two)
    for _ in range(30):  # what two sources drafted is always right, what static alone drafted never
        model.begin_request()
        model.observe(two, [0, 1, 3, 5], forward_ms=55.0)
        model.observe(one, [0], forward_ms=55.0)
    low, high = model.agreement_factors()[:2]
    assert high > 1.5 and low < 0.5
    model.begin_request()
    chance = model.conditional(two)
    by_cells, _ = model._from_cells(two)
    agreed = two.agree[1:] == 2
    assert np.allclose(chance[agreed], np.minimum(by_cells[agreed] * high, cost.MAX_CHANCE))
    assert np.allclose(chance[~agreed], by_cells[~agreed] * low)
    assert (chance[agreed] > before[agreed]).all()
    model.use_agreement = False  # the side-by-side switch: the cells (and the request's correction) alone
    assert np.allclose(model.conditional(two), np.minimum(by_cells, cost.MAX_CHANCE))
    unknown = build_draft_tree(1, [OracleLookup("static", 3, 10, np.array([[11, 12, 13]] * 10))], budget=63)
    unknown.agree = None  # a tree built without the counts: every node one source's
    model.use_agreement = True
    assert np.allclose(model.conditional(unknown), np.minimum(model._from_cells(unknown)[0] * low, cost.MAX_CHANCE))


def test_the_agreement_correction_is_kept_per_kind_between_runs(tmp_path):
    one, two = _two_source_trees()
    path = tmp_path / "acc.json"
    chat = CostModel(times_ms=curve(50.0, 2.0), stats_path=path, kind="chat")
    for _ in range(30):
        chat.observe(two, [0, 1, 3, 5], forward_ms=55.0)
    chat.save_stats()
    text = CostModel(times_ms=curve(50.0, 2.0), stats_path=path, kind="text")
    text.observe(one, [0], forward_ms=55.0)
    text.save_stats()  # the chat sums stay
    again = CostModel(times_ms=curve(50.0, 2.0), stats_path=path, kind="chat")
    again.load_stats()
    np.testing.assert_allclose(again.agreement, chat.agreement)
    other = CostModel(times_ms=curve(50.0, 2.0), stats_path=path, kind="text")
    other.load_stats()
    np.testing.assert_allclose(other.agreement, text.agreement)
    data = json.loads(path.read_text())
    data["agreement"]["chat"] = [[1.0, "x"], [2.0]]  # unreadable: that kind starts afresh, the rest stays
    path.write_text(json.dumps(data))
    broken = CostModel(times_ms=curve(50.0, 2.0), stats_path=path, kind="chat")
    broken.load_stats()
    assert not broken.agreement.any() and set(broken.counts) == {"static", "request"}


def test_the_native_ranking_gives_the_numpy_paths_order_and_bit_equal_chances(monkeypatch):
    """`rank_tree.cpp` ranks a candidate tree in one call: on 300 random trees of up to four sources (random
    budgets up to 63, random counts, request corrections, agreement sums, the correction on and off, trees with
    and without source counts, random cost curves) its order and chances equal the numpy path's exactly, and the
    draft size it picks is `_best_budget`'s; dropping a correction, or breaking a tie another way, fails it."""
    from rest_core import native
    if native.rank_tree_library() is None:
        pytest.skip("no C++ compiler here: the numpy path is the only one")
    rng = np.random.default_rng(11)
    names = ["static", "request", "model", "answers"]
    native_calls = 0
    real = native.rank_tree

    def counted(*args, **kwargs):
        nonlocal native_calls
        got = real(*args, **kwargs)
        native_calls += got is not None
        return got

    monkeypatch.setattr(native, "rank_tree", counted)
    budgets = set()
    for trial in range(300):
        lookups = []
        for source in rng.choice(names, size=rng.integers(1, 5), replace=False):
            k = int(rng.integers(1, 40))
            rows = rng.integers(10, 13, size=(k, int(rng.integers(1, 8))))
            lookups.append(OracleLookup(str(source), int(rng.integers(1, 5)), k, rows))
        tree = build_draft_tree(1, lookups, budget=int(rng.integers(1, 64)), base_weights={"model": 0.5})
        if tree.draft_size == 0:
            continue
        if trial % 5 == 0:
            tree.agree = None  # a tree built by hand: every node one source's
        m = CostModel(times_ms=np.cumsum(rng.random(len(GRID)) * 8.0) + 30.0)  # a random increasing curve
        m.use_agreement = trial % 3 != 0
        for name in names:
            c = m._counts(name)
            c[...] = np.round(rng.random(cost.SHAPE) * 30, 3)
            c[1] = np.minimum(c[1], c[0])
        if trial % 2:
            m._request = {str(n): (float(rng.random() * 5), float(rng.random() * 5)) for n in names[:3]}
        m.agreement = np.round(rng.random((2, cost.AGREE_LEVELS)) * 50, 2)
        order, chance = m.ranked(tree)
        cut, why = m.decide(tree)
        with monkeypatch.context() as off:
            off.setattr(native, "rank_tree", lambda *a, **k: None)
            want_order, want_chance = m.ranked(tree)
            want_cut, want_why = m.decide(tree)
        assert np.array_equal(order, want_order), trial
        assert np.array_equal(chance, want_chance), trial
        assert why == want_why, trial  # the same budget, expectations and chances
        assert np.array_equal(cut.tokens, want_cut.tokens) and np.array_equal(cut.parents, want_cut.parents)
        budgets.add(why["kept"])
    assert native_calls > 400
    assert len(budgets) > 5  # many sizes chosen, not one
