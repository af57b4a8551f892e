""""What if" on a recorded step, the example run that ships with the page, and the tour over it.

A recorded step run again with the run's own settings must give back the recorded draft tree and
accepted path exactly (greedy, seeded sampling, fixed and automatic budgets); other settings must
change the tree the way they say.  The tiny random model and a store built from its own continuation
(plus a variant that parts from it) keep every test to seconds.
"""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from datastores import build_from_token_documents
from rest_core import app as sup
from rest_core.app.policy import Policy
from rest_core.app.replay import EXAMPLE_RUN_ID, example_run, run_choices, step_panel
from rest_core.app.tour import STOPS, card_html, tour_step
from rest_core.app.whatif import FIXED, WhatIf, own_settings
from rest_core.app.whatif_view import what_if_views
from rest_core.decode import DecodeConfig, plain_generate
from rest_core.traces.exported import ExportedRun, ExportError
from rest_core.traces.recorder import TraceRecorder

from conftest import make_tiny_lm, no_chooser, private_cache

pytestmark = pytest.mark.usefixtures("module_cache")

PROMPT_IDS = [5, 6, 7, 8, 9]
PROMPT = " ".join(f"t{t}" for t in PROMPT_IDS)
RUN = sup.Settings(model="tiny", mode="completion", static=sup.BUILT_IN, max_new_tokens=24, budget_mode="fixed",
                   budget=8, model_drafts=False, history_store=False, continuation_len=10)
NODE_FIELDS = ("node", "parent", "depth", "token_id", "source", "score", "model_choice", "accepted")


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_lm(max_positions=256)


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    """The model's own continuation of PROMPT, and more frequent variants that part from it after a few
    tokens: draft trees whose best-supported branches the model rejects."""
    plain = plain_generate(tiny, PROMPT_IDS, DecodeConfig(max_new_tokens=40, stop_at_eos=False)).tokens
    noise = np.random.default_rng(1).integers(1, 60_000, size=400).tolist()
    variants = [PROMPT_IDS + plain[:cut] + noise[cut * 7:cut * 7 + 12] for cut in (2, 6, 11, 15)]
    docs = [PROMPT_IDS + plain, *variants, *variants, *[plain[cut - 3:cut] + noise[100 + cut:120 + cut]
                                                       for cut in (4, 8, 12)]]
    return build_from_token_documents(tmp_path_factory.mktemp("store") / "tiny-store", docs)


@pytest.fixture
def engine(tiny, store, tmp_path):
    engine = sup.Engine(lm_factory=lambda name: tiny, store_factory=lambda tok: store,
                        cost_factory=no_chooser, recorder=TraceRecorder(tmp_path / "traces.sqlite"))
    assert engine.start_static(engine.model("tiny")).finished.wait(30)
    return engine


@pytest.fixture
def session(tmp_path, monkeypatch):
    monkeypatch.setenv("REST_LAB_CACHE", private_cache(tmp_path / "cache"))
    return sup.Session(id="visitor-a")


def record(engine, session, settings=RUN) -> int:
    views = list(sup.chat_turn(engine, session, settings, PROMPT))
    assert views[-1].run_id is not None and not views[-1].notice, views[-1].notice
    return views[-1].run_id


def again(engine, session, run_id, k, wi):
    views = list(what_if_views(engine, session, run_id, k, wi))
    assert views[-1].done
    return views[-1]


def nodes(step) -> list[tuple]:
    return [tuple(round(n[f], 9) if isinstance(n[f], float) else n[f] for f in NODE_FIELDS) for n in step["nodes"]]


@pytest.mark.parametrize("settings", [RUN, replace(RUN, budget_mode="auto"),
                                      replace(RUN, decoding="sampling", temperature=1.3, top_p=0.95, seed=7)],
                         ids=["greedy-fixed", "greedy-auto", "sampled-seeded"])
def test_the_runs_own_settings_give_back_every_recorded_step(engine, session, settings):
    run_id = record(engine, session, settings)
    run = engine.recorder.get_run(run_id)
    wi = own_settings(run)
    assert wi.sources == ("static", "request") and (wi.n_max, wi.n_min, wi.continuation_len) == (16, 2, 10)
    rejected = 0
    for k in range(engine.recorder.step_count(run_id)):
        recorded = engine.recorder.load_step(run_id, k)
        view = again(engine, session, run_id, k, wi)
        assert view.step is not None, view.summary
        assert nodes(view.step) == nodes(recorded), f"step {k}: the same tree, the same accepted path"
        assert view.step["new_tokens"] == recorded["new_tokens"] and view.step["bonus_token"] == recorded[
            "bonus_token"]
        assert "✓ The what-if commits" in view.summary
        rejected += recorded["draft_size"] > recorded["accepted_len"]
        if settings.decoding == "sampling":
            assert "seed 7" in view.summary
            got = [n["uniform"] for n in view.step["nodes"]]
            assert got == [n["uniform"] for n in recorded["nodes"]], "the same uniform numbers at the same nodes"
    assert rejected, "some recorded step drafted tokens the model rejected (the check is not trivial)"


def test_a_larger_budget_and_other_stores_change_the_tree_as_they_should(engine, session):
    run_id = record(engine, session)
    k = 1
    recorded = engine.recorder.load_step(run_id, k)
    wi = own_settings(engine.recorder.get_run(run_id))

    bigger = again(engine, session, run_id, k, replace(wi, budget_mode=FIXED, budget=32)).step
    assert recorded["draft_size"] == 8 < bigger["draft_size"] <= 32
    paths = {tuple(p) for p in _paths(bigger)}
    assert all(tuple(p) in paths for p in _paths(recorded)), "the 8 best nodes stay in a larger tree"
    assert bigger["accepted_len"] >= recorded["accepted_len"]
    committed = bigger["new_tokens"]
    assert committed[:len(recorded["new_tokens"])] == recorded["new_tokens"], "the same tokens, perhaps more"

    request_only = again(engine, session, run_id, k, replace(wi, sources=("request",))).step
    assert {n["source"] for n in request_only["nodes"][1:]} <= {"request"}
    assert set(request_only["matched_len"]) == {"request"}
    none = again(engine, session, run_id, k, replace(wi, sources=()))
    assert none.step["draft_size"] == 0 and "drafted tokens</th><td>8</td><td>0</td>" in none.summary

    short = again(engine, session, run_id, k, replace(wi, continuation_len=2)).step
    assert max(n["depth"] for n in short["nodes"]) <= 2


def _paths(step) -> list[list[int]]:
    by_node = {}
    for n in step["nodes"]:
        by_node[n["node"]] = [] if n["parent"] < 0 else by_node[n["parent"]] + [n["token_id"]]
    return list(by_node.values())


def test_replayed_sources_and_unseeded_sampling_are_said_on_the_panel(engine, session):
    run_id = record(engine, session, replace(RUN, model_drafts=True, decoding="sampling", temperature=1.0, seed=None))
    wi = own_settings(engine.recorder.get_run(run_id))
    assert "model" in wi.sources
    view = again(engine, session, run_id, 0, wi)
    assert "replayed from the trace" in view.summary and "without a seed" in view.summary
    assert view.recorded is not None and view.what_if is not None and "accepted path" in view.what_if_path


def test_what_if_refuses_clearly_what_it_cannot_do(engine, session, tiny, tmp_path):
    run_id = record(engine, session)
    other = sup.Session(id="visitor-b")
    assert "no run" in again(engine, other, run_id, 0, WhatIf()).summary, "another visitor's run stays private"
    assert "n_min" in again(engine, session, run_id, 0, WhatIf(n_min=9, n_max=4)).summary
    assert "budget" in again(engine, session, run_id, 0, WhatIf(budget_mode="lots")).summary
    # a run recorded without its prompt's tokens (the command line, given a count only)
    bare = engine.recorder.start_run(model="tiny", tokenizer_name="tiny", stores=["request"], settings={},
                                     prompt=PROMPT, prompt_tokens=len(PROMPT_IDS))
    engine.recorder.step_hook(bare)(engine.recorder.load_trace(run_id, 0))
    assert "without its prompt's tokens" in again(engine, session, bare, 0, WhatIf()).summary
    # public mode: the run's model must be one the server offers
    public = sup.Engine(lm_factory=lambda name: tiny, store_factory=lambda tok: None,
                        cost_factory=no_chooser, recorder=engine.recorder,
                        policy=Policy(public=True, reason="test", models=("SmolLM2-135M-Instruct",)))
    refused = again(public, session, run_id, 0, WhatIf())
    assert "offers these models only" in refused.summary and refused.step is None


def test_what_if_waits_for_its_turn_in_the_line_of_decodes(engine, session):
    run_id = record(engine, session)
    ahead = engine.turns.join("someone-else")
    views = what_if_views(engine, session, run_id, 0, WhatIf())
    assert "Waiting for your turn: 1 decode ahead" in next(views).summary
    ahead.leave()
    assert list(views)[-1].step is not None


# ---------------------------------------------------------------- the example run and the tour

def test_the_example_run_replays_without_the_model_for_every_visitor(tmp_path):
    example = example_run()
    assert example is not None and example.run_id == EXAMPLE_RUN_ID
    run = example.get_run(EXAMPLE_RUN_ID)
    assert run["prompt_ids"] and "host" not in run and "pid" not in run
    steps = example.load_steps(EXAMPLE_RUN_ID)
    assert len(steps) == example.step_count(EXAMPLE_RUN_ID) >= 5
    assert sum(len(s["new_tokens"]) for s in steps) == run["new_tokens"]

    def no_model(name):
        raise AssertionError("replaying the example must not load a model")

    for policy in (Policy(), Policy(public=True, reason="test", models=("SmolLM2-135M-Instruct",))):
        engine = sup.Engine(lm_factory=no_model, store_factory=lambda tok: None,
                            recorder=TraceRecorder(tmp_path / f"{policy.public}.sqlite"), policy=policy)
        for visitor in ("a", "b"):
            session = sup.Session(id=visitor)
            assert (run_choices(engine.recorder, session)[-1][1]) == EXAMPLE_RUN_ID
            k = tour_step(steps)
            shown = step_panel(engine, session, EXAMPLE_RUN_ID, k)
            assert shown["explanation"].startswith(f"**Step {k}.**") and shown["tree"] is not None
            assert "⟨" not in shown["suffix"], "the context's tokens read as text with no tokenizer"
            assert shown["mask"] is not None and shown["node_probs"] is not None


def test_an_exported_run_reads_back_as_the_trace_store_gives_it(engine, session, tmp_path):
    from rest_core.traces.cli import run_json

    run_id = record(engine, session)
    data = json.loads(json.dumps(run_json(engine.recorder, engine.recorder.get_run(run_id))))
    exported = ExportedRun(data)
    for k in range(engine.recorder.step_count(run_id)):
        a, b = engine.recorder.load_step(run_id, k, mask="numpy"), exported.load_step(run_id, k, mask="numpy")
        assert (a.pop("mask") == b.pop("mask")).all() and (a.pop("mask_block") == b.pop("mask_block")).all()
        assert a == b
    assert exported.load_steps(run_id) == engine.recorder.load_steps(run_id)
    with pytest.raises(ExportError, match="not a run export"):
        ExportedRun({"steps": []})
    data["steps"][1]["tree_mask"] = ["01", "1"]
    with pytest.raises(ExportError, match="step 1"):
        ExportedRun(data)
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(ExportError, match="bad.json"):
        ExportedRun.from_file(tmp_path / "bad.json")


def test_every_tour_stop_names_a_part_of_the_page_and_the_steps_numbers(tiny, tmp_path):
    import app

    demo = app.build_demo(lm_factory=lambda name: tiny, store_factory=lambda tok: None,
                          cost_factory=no_chooser, trace_db=str(tmp_path / "t.sqlite"), preload=False)
    ids = {b.elem_id for b in demo.blocks.values()}
    example = example_run()
    step = example.load_step(EXAMPLE_RUN_ID, tour_step(example.load_steps(EXAMPLE_RUN_ID)))
    assert 5 <= len(STOPS) <= 7
    for i, stop in enumerate(STOPS):
        assert stop.target in ids, f"stop {i + 1} highlights #{stop.target}, which the page has"
        card = card_html(i, step)
        assert f'data-target="{stop.target}"' in card and f"{i + 1} / {len(STOPS)}" in card and "{" not in card
    verify = card_html(4, step)
    assert f"{step['accepted_len']} drafted tokens" in verify and f"{len(step['new_tokens'])} tokens for one" in verify
