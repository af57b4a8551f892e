"""Figures show what they claim: checked on the figure data, from recorded steps."""
from __future__ import annotations

import asyncio
import csv
import html
import json
import random
from collections import Counter

import numpy as np
import pytest
import torch
from datasette.app import Datasette
from hypothesis import given, settings
from hypothesis import strategies as st
from test_recorder import VOCAB, FakeTokenizer, make_trace, record_run, tree_mask

from rest_core.phases import PHASES
from rest_core.trace import Branch, StepTrace
from rest_core.traces import figures, palette
from rest_core.traces.cli import main as traces_main
from rest_core.traces.datasette import metadata as trace_metadata
from rest_core.traces.palette import FALLBACK_COLOURS, tint
from rest_core.traces.recorder import TraceRecorder
from rest_core.traces.runs import RUN_COLUMNS, tokens_per_s

WORD = {w: i for i, w in enumerate(VOCAB)}


def known_step(prefix_len: int = 6) -> StepTrace:
    """root 'the' -> ' cat' -> {' sat', ' ran'}, root -> ' dog'; the model takes ' cat',
    then wants ' on': draft and model disagree at ' cat'."""
    tokens = [WORD[w] for w in ("the", " cat", " dog", " sat", " ran")]
    parents = [-1, 0, 0, 1, 1]
    depths = [0, 1, 1, 2, 2]
    choices = [WORD[" cat"], WORD[" on"], WORD[" far"], WORD[" mat"], WORD["\n"]]
    return StepTrace(
        step=0, prefix_len=prefix_len, query=[WORD["the"]], matched_len={"static": 1, "request": 0, "history": 0},
        branches=[Branch("static", (WORD[" cat"], WORD[" sat"]), 3)],
        tree_tokens=tokens, tree_parents=parents, tree_depths=depths, tree_scores=[9.0, 6.0, 3.0, 4.0, 2.0],
        tree_sources=["", "static", "request", "static", "history"],
        position_ids=[prefix_len + d for d in depths], mask=tree_mask(parents, prefix_len),
        model_choices=choices, accepted_nodes=[0, 1], bonus_token=WORD[" on"],
        new_tokens=[WORD[" cat"], WORD[" on"]], timings_ms={p: 1.0 + i for i, p in enumerate(PHASES)})


@pytest.fixture
def rec(tmp_path):
    r = TraceRecorder(tmp_path / "t.sqlite")
    yield r
    r.close()


def node_traces(fig):
    return [d for d in fig.data if d.mode == "markers+text" and d.customdata is not None]


def test_tree_labels_path_and_disagreement(rec):
    t = known_step()
    step = rec.load_step(record_run(rec, [t]), 0)
    fig = figures.draft_tree_figure(step)
    labels = {}
    for d in node_traces(fig):
        labels.update(zip(d.customdata, d.text))
    assert labels == {i: html.escape(figures.show_token(FakeTokenizer().decode([tok])))
                      for i, tok in enumerate(t.tree_tokens)}
    assert labels[1] == "␣cat"
    path = next(d for d in fig.data if d.name == "accepted path")
    assert list(path.customdata) == t.accepted_nodes
    outlined = {n for d in node_traces(fig) for n, w in zip(d.customdata, d.marker.line.width) if w == 4}
    assert outlined == set(t.accepted_nodes)
    note = fig.layout.annotations[0].text
    assert note == "draft: ␣sat, ␣ran, model: ␣on"
    assert not any("cost model" in h for d in node_traces(fig) for h in d.hovertext)  # no cost model chose here


def test_a_node_hover_tells_the_cost_models_estimate_when_it_chose(rec):
    t = known_step()
    t.node_chances = [None, 0.62, 0.2, 0.31, 0.05]
    fig = figures.draft_tree_figure(rec.load_step(record_run(rec, [t]), 0))
    hover = {n: h for d in node_traces(fig) for n, h in zip(d.customdata, d.hovertext)}
    assert "the cost model's estimate that it would be accepted: 0.62" in hover[1]
    assert "estimate that it would be accepted: 0.05" in hover[4] and "cost model" not in hover[0]
    bonus = next(d for d in fig.data if d.name.startswith("bonus"))
    assert list(bonus.text) == ["␣on"]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 50))
def test_tree_layout_is_tidy(seed, n):
    t = make_trace(random.Random(seed), n_nodes=n)
    y = figures.tree_layout(t.tree_parents)
    children = {i: [c for c in range(n) if t.tree_parents[c] == i] for i in range(n)}
    leaves = sorted(y[i] for i in range(n) if not children[i])
    assert leaves == list(range(len(leaves)))  # one row per leaf
    for i, kids in children.items():
        if kids:
            assert min(y[c] for c in kids) <= y[i] <= max(y[c] for c in kids)
    for d in set(t.tree_depths):  # no two nodes of one depth overlap
        ys = [y[i] for i in range(n) if t.tree_depths[i] == d]
        assert len(set(ys)) == len(ys)


def test_tree_figure_of_a_leaf_and_of_an_empty_draft(rec):
    rng = random.Random(0)
    empty = make_trace(rng, n_nodes=1)
    run_id = record_run(rec, [empty])
    fig = figures.draft_tree_figure(rec.load_step(run_id, 0))
    assert fig.layout.annotations[0].text.startswith("no draft this step, model: ")
    assert list(next(d for d in fig.data if d.name == "accepted path").customdata) == [0]
    t = known_step()
    t.model_choices[1], t.model_choices[3], t.accepted_nodes = WORD[" sat"], WORD[" on"], [0, 1, 3]
    t.bonus_token, t.new_tokens = WORD[" on"], [WORD[" cat"], WORD[" sat"], WORD[" on"]]
    fig = figures.draft_tree_figure(rec.load_step(record_run(rec, [t]), 0))
    assert fig.layout.annotations[0].text == "draft ends here (leaf), model: ␣on"


def test_mask_heatmap_cells_are_the_stored_mask(rec):
    t = make_trace(random.Random(11), prefix_len=9, n_nodes=14)
    step = rec.load_step(record_run(rec, [t]), 0)
    fig = figures.mask_heatmap(step)
    tree = next(d for d in fig.data if d.name == "tree mask")
    expected = (t.mask[0, 0, :, 9:] == 0).int().tolist()
    assert [list(r) for r in tree.z] == expected
    assert list(tree.x) == list(tree.y) == [f"{i} {html.escape(figures.show_token(FakeTokenizer().decode([x])))}"
                                            for i, x in enumerate(t.tree_tokens)]
    prefix = next(d for d in fig.data if d.name == "prefix")
    assert [list(r) for r in prefix.z] == [[1]] * 14 and "9 tokens" in prefix.x[0]
    assert "ancestors" in fig.layout.annotations[0].text


def test_mask_heatmap_flags_a_mask_that_is_not_the_tree(rec):
    t = make_trace(random.Random(12), prefix_len=3, n_nodes=6)
    t.mask = t.mask.clone()
    t.mask[0, 0, 5, 3 + 0] = torch.finfo(t.mask.dtype).min  # node 5 can no longer see the root
    step = rec.load_step(record_run(rec, [t]), 0)
    assert not step["mask_block"][5, 0]
    assert figures.mask_heatmap(step).layout.annotations[0].text.startswith("⚠ 1 cells differ")


def test_acceptance_histogram_counts(rec):
    rng = random.Random(2)
    traces = [make_trace(rng, step=k, n_nodes=rng.randint(1, 20)) for k in range(25)]
    steps = rec.load_steps(record_run(rec, traces))
    bar = figures.acceptance_histogram(steps).data[0]
    counts = Counter(len(t.accepted_nodes) - 1 for t in traces)
    assert list(bar.x) == list(range(max(counts) + 1))
    assert list(bar.y) == [counts.get(k, 0) for k in bar.x]


def test_speed_figure(rec):
    rng = random.Random(3)
    traces = [make_trace(rng, step=k, n_nodes=12) for k in range(10)]
    run_id = record_run(rec, traces, plain_wall_s=4.0, plain_tokens_per_s=5.0, speedup=1.5, identical=True)
    steps, run = rec.load_steps(run_id), rec.get_run(run_id)
    fig = figures.speed_figure(steps, run)
    rest = next(d for d in fig.data if d.name == "REST")
    assert list(rest.x) == list(range(1, 11))
    assert list(rest.y) == list(np.cumsum([len(t.new_tokens) for t in traces]))
    drafted = next(d for d in fig.data if d.name == "accepted draft tokens")
    bonus = next(d for d in fig.data if d.name.startswith("token from the model"))
    assert list(drafted.y) == [len(t.accepted_nodes) - 1 for t in traces] and list(bonus.y) == [1] * 10
    rate = next(d for d in fig.data if d.name == "tokens per second")
    assert list(rate.y) == [5.0, run["new_tokens"] / run["wall_s"]]
    assert "1.50×, identical output" in fig.layout.annotations[2].text
    # the narrow third panel: its title on two lines, and room above the taller bar for its label
    assert fig.layout.annotations[2].text.startswith("tokens per second<br>(")
    assert fig.layout.yaxis3.range[1] >= 1.2 * max(rate.y) - 1e-9
    plain_only = figures.speed_figure(steps, {**run, "plain_tokens_per_s": None})
    assert not any(d.name == "tokens per second" for d in plain_only.data)


def test_phase_breakdown_uses_recorded_timings(rec):
    rng = random.Random(4)
    traces = [make_trace(rng, step=k) for k in range(6)]
    fig = figures.phase_breakdown(rec.load_steps(record_run(rec, traces)))
    for phase in PHASES:
        bar = next(d for d in fig.data if d.name == phase)
        assert list(bar.y) == [t.timings_ms[phase] for t in traces]
    mean = next(d for d in fig.data if d.name == "mean")
    assert list(mean.x) == pytest.approx([np.mean([t.timings_ms[p] for t in traces]) for p in PHASES])


def test_origin_text_html(rec):
    t0 = known_step()
    t1 = make_trace(random.Random(5), step=1, n_nodes=3)
    t1.new_tokens, t1.bonus_token, t1.accepted_nodes = [WORD[" <b>"]], WORD[" <b>"], [0]  # nothing accepted
    t1.model_choices[0] = WORD[" <b>"]
    steps = rec.load_steps(record_run(rec, [t0, t1]))
    assert figures.token_origins(steps) == [(0, "static", " cat"), (0, "bonus", " on"), (1, "bonus", " <b>")]
    page = figures.origin_text_html(steps, prompt="the")
    assert '<span class="tok static"' in page and page.count('class="tok bonus"') == 2
    assert "&lt;b&gt;" in page and " <b>" not in page  # token text is escaped
    assert "from the model (bonus token): 2 (67%)" in page and "static store: 1 (33%)" in page


def test_an_accepted_recycled_draft_is_tinted_as_the_model_source_not_as_a_bonus(rec):
    t = known_step()
    t.tree_sources = ["", "model", "request", "model", "history"]  # ' cat' drafted from the model's own predictions
    run_id = record_run(rec, [t])
    steps = rec.load_steps(run_id)
    assert steps[0]["accepted_sources"] == ["model"]
    assert figures.token_origins(steps) == [(0, "model", " cat"), (0, "bonus", " on")]
    drafted, bonus = figures.ORIGIN_STYLES["model"], figures.ORIGIN_STYLES["bonus"]
    assert drafted[1] == "accepted draft, model's own prediction (recycled)"
    assert drafted[0] != bonus[0] and drafted[0] == tint(figures.source_color("model"), 0.5)
    spans = figures.origin_spans(steps)
    assert f'<span class="tok model" style="background:{drafted[0]};' in spans
    assert f'<span class="tok bonus" style="background:{bonus[0]};' in spans
    assert f'title="step 0: {html.escape(drafted[1])}"' in spans
    # the model source's own colour: fixed, colour-blind safe, unlike every other source's and the bonus token's
    others = [figures.source_color(s) for s in ("static", "request", "history", "")] + [palette.BONUS]
    assert figures.source_color("model") == palette.YELLOW and palette.YELLOW not in others
    assert palette.YELLOW not in FALLBACK_COLOURS
    page = figures.origin_text_html(steps)
    assert "accepted draft, model&#x27;s own prediction (recycled): 1 (50%)" in page
    assert "from the model (bonus token): 1 (50%)" in page
    fig = figures.draft_tree_figure(rec.load_step(run_id, 0))
    model_nodes = next(d for d in node_traces(fig) if d.name == "drafted by model")
    assert model_nodes.marker.color == palette.YELLOW and list(model_nodes.customdata) == [1, 3]
    assert all("model's own earlier prediction" in h for h in model_nodes.hovertext)
    star = next(d for d in fig.data if d.name.startswith("bonus"))
    assert star.marker.color == palette.BONUS


def test_figures_of_a_run_without_steps():
    for fig in (figures.speed_figure([], {}), figures.acceptance_histogram([]), figures.phase_breakdown([])):
        assert fig.layout.title.text
    assert "rest-origin" in figures.origin_text_html([])


def test_cli_list_show_export(rec, tmp_path, capsys):
    rng = random.Random(6)
    run_id = record_run(rec, [make_trace(rng, step=k, n_nodes=8) for k in range(4)], speedup=1.2,
                        plain_tokens_per_s=3.0)
    db = str(rec.path)
    assert traces_main(["traces", "list", "--db", db]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["id", "started", "(UTC)"] and "done" in out
    assert traces_main(["traces", "show", str(run_id), "--db", db]) == 0
    out = capsys.readouterr().out
    assert "mean_accepted" in out and len([ln for ln in out.splitlines() if ln.strip()[:1].isdigit()]) >= 4
    page_path = tmp_path / "run.html"
    assert traces_main(["traces", "export", str(run_id), "--html", str(page_path), "--max-trees", "2",
                        "--db", db]) == 0
    page = page_path.read_text()
    assert page.count("* plotly.js v") == 1  # the library, inlined once
    assert page.count("Plotly.newPlot(") == 3 + 2 * 2  # speed, histogram, phases + tree and mask of 2 steps
    assert "first 2 of 4 steps" in page and "rest-origin" in page
    assert traces_main(["traces", "show", "999", "--db", db]) == 1
    assert traces_main(["traces", "export", str(run_id), "--db", db]) == 2  # no output named


def test_export_to_json_and_csv(rec, tmp_path):
    rng = random.Random(7)
    traces = [make_trace(rng, step=k, n_nodes=6) for k in range(3)]
    run_id = record_run(rec, traces)
    js, cs = tmp_path / "run.json", tmp_path / "steps.csv"
    assert traces_main(["traces", "export", str(run_id), "--json", str(js), "--csv", str(cs), "--db",
                        str(rec.path)]) == 0
    data = json.loads(js.read_text())
    assert data["run"]["id"] == run_id and [s["step"] for s in data["steps"]] == [0, 1, 2]
    for stored, t in zip(data["steps"], traces):
        q = len(t.tree_tokens)
        block = t.mask[0, 0, :, t.prefix_len:] == 0  # (q, q) may attend
        assert stored["tree_mask"] == ["".join("1" if v else "0" for v in row) for row in block.tolist()]
        assert [n["token_id"] for n in stored["nodes"]] == t.tree_tokens and len(stored["tree_mask"]) == q
    rows = list(csv.DictReader(cs.open()))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert json.loads(rows[1]["new_tokens"]) == traces[1].new_tokens and float(rows[2]["t_forward_ms"]) > 0


def test_a_step_cut_at_eos_counts_only_committed_tokens(rec):
    t = known_step()
    t.model_choices[1], t.accepted_nodes = WORD[" sat"], [0, 1, 3]  # two drafts accepted ...
    t.bonus_token = t.model_choices[3]
    t.new_tokens = [WORD[" cat"]]  # ... but a length cut commits only the first
    steps = rec.load_steps(record_run(rec, [t]))
    assert figures.token_origins(steps) == [(0, "static", " cat")]
    fig = figures.speed_figure(steps)
    assert [list(d.y) for d in fig.data if d.type == "bar"] == [[1], [0]]


# ------------------------------------------------------------------ any source name, the run table

def four_source_step() -> StepTrace:
    """known_step with its drafts from a fourth source ('model') and an unknown one ('notes')."""
    t = known_step()
    t.tree_sources = ["", "notes", "model", "notes", "history"]
    t.matched_len = {"static": 1, "request": 0, "history": 0, "model": 2, "notes": 1}
    t.branches = [Branch("notes", (WORD[" cat"], WORD[" sat"]), 2), Branch("model", (WORD[" dog"],), 1)]
    return t


def test_a_fourth_and_an_unknown_source_round_trip_and_get_colours(rec, tmp_path, capsys):
    t = four_source_step()
    run_id = record_run(rec, [t])
    step = rec.load_step(run_id, 0)
    assert [n["source"] for n in step["nodes"]] == t.tree_sources
    assert step["accepted_sources"] == ["notes"] and step["matched_len"] == t.matched_len
    assert [b["source"] for b in step["branches"]] == ["notes", "model"]

    known = {"static": "#0072B2", "request": "#E69F00", "history": "#009E73"}  # unchanged colours
    assert {s: figures.source_color(s) for s in known} == known
    assert figures.source_color("model") not in known.values()
    notes = figures.source_color("notes")
    assert notes in FALLBACK_COLOURS and notes == figures.source_color("notes")
    assert all(figures.source_color(f"upload {k}") in FALLBACK_COLOURS for k in range(20))

    fig = figures.draft_tree_figure(step)
    colours = {d.name: d.marker.color for d in node_traces(fig)}
    assert colours == {"root (last committed token)": figures.source_color(""),
                       "drafted by history": known["history"], "drafted by model": figures.source_color("model"),
                       "drafted by notes": notes}
    assert [d.name for d in node_traces(fig)][:2] == ["root (last committed token)", "drafted by history"]

    steps = rec.load_steps(run_id)
    spans = figures.origin_spans(steps)
    assert f'<span class="tok notes" style="background:{tint(notes, 0.35)};' in spans
    assert 'title="step 0: accepted draft, notes"' in spans
    assert "accepted draft, notes: 1 (50%)" in figures.origin_text_html(steps)

    assert traces_main(["traces", "show", str(run_id), "--db", str(rec.path)]) == 0
    header = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:2] == ["step", "prefix"])
    assert [h for h in ("static", "request", "history", "model", "notes") if f"match {h}" in header] == [
        "static", "request", "history", "model", "notes"]


def test_origin_spans_stay_on_one_line_and_hide_tokens():
    steps = [{"step": 0, "new_tokens": [1, 2, 3], "new_texts": ["def f():\n", "    return", " 1<2"], "accepted_len": 2,
              "accepted_sources": ["static", "request"]},
             {"step": 1, "new_tokens": [4, 5], "new_texts": [" x", "<|im_end|>"], "accepted_len": 0,
              "accepted_sources": []}]
    out = figures.origin_spans(steps, hide=frozenset({"<|im_end|>"}))
    assert "\n" not in out and out.count("&#10;") == 1 and "1&lt;2" in out and out.count("<span") == 4
    assert out.count("border-left") == 2  # the first token of each step
    assert "im_end" not in out and 'title="step 1: from the model (bonus token)"' in out


def test_run_columns(rec):
    run_id = record_run(rec, [make_trace(random.Random(9), step=k) for k in range(4)], speedup=1.234,
                        identical=False)
    run = rec.get_run(run_id)
    assert [h for h, _ in RUN_COLUMNS] == ["id", "started (UTC)", "status", "model", "prompt", "new tokens", "steps",
                                           "tokens/pass", "tokens/s", "speedup", "identical"]
    row = dict((h, get(run)) for h, get in RUN_COLUMNS)
    assert row["id"] == run_id and row["status"] == "done" and row["prompt"] == "the cat"
    assert row["tokens/pass"] == round(run["new_tokens"] / 4, 2) and row["speedup"] == 1.23
    assert row["tokens/s"] == round(tokens_per_s(run), 1) and row["identical"] == "no"
    assert tokens_per_s({**run, "wall_s": None}) is None


def test_datasette_opens_the_traces_with_descriptions_and_canned_queries(rec):
    rng = random.Random(8)
    traces = [make_trace(rng, step=k, n_nodes=6) for k in range(3)]
    run_id = record_run(rec, traces)
    name = rec.path.stem
    ds = Datasette([str(rec.path)], metadata=trace_metadata(name))

    async def get(path):
        return await ds.client.get(path)

    by_source = asyncio.run(get(f"/{name}/acceptance_by_source.json?_shape=array"))
    assert by_source.status_code == 200
    drafted = Counter(s for t in traces for s in t.tree_sources[1:])
    assert {r["source"]: r["drafted"] for r in by_source.json()} == dict(drafted)
    calibration = asyncio.run(get(f"/{name}/chance_calibration.json?_shape=array")).json()
    with_chances = [c for t in traces for c in t.node_chances[1:]]
    assert with_chances, "some recorded step carries the cost model's chances"
    assert sum(r["drafted"] for r in calibration) == len(with_chances)
    accepted = [n in t.accepted_nodes for t in traces if t.node_chances for n in range(1, len(t.tree_tokens))]
    assert sum(r["accepted"] * r["drafted"] for r in calibration) == pytest.approx(sum(accepted))
    phases = asyncio.run(get(f"/{name}/phase_ms.json?_shape=array&run_id={run_id}")).json()
    assert set(phases[0]) == set(PHASES) and phases[0]["forward"] > 0
    page = asyncio.run(get(f"/{name}/steps")).text
    assert "One row per REST step" in page and "may attend" in page


def test_serve_names_a_missing_trace_file(tmp_path, capsys):
    assert traces_main(["traces", "serve", "--db", str(tmp_path / "none.sqlite")]) == 2
    assert "no trace file" in capsys.readouterr().err
