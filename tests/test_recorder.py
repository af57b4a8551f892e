"""TraceRecorder: round trip, exact masks, concurrent writers, interrupted runs.

Step traces are built here with the decoder's conventions (node 0 = root, nodes
sorted by depth, parents[i] < i, 4D float mask with the prefix fully visible);
`make_trace` is shared with test_figures.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rest_core.phases import PHASES
from rest_core.trace import Branch, StepTrace
from rest_core.traces.liveness import process_alive
from rest_core.traces.masks import decode_block, encode_block, full_mask
from rest_core.traces.recorder import TraceRecorder
from rest_core.traces.rows import MAX_BRANCHES_PER_SOURCE, _top_branches

SOURCES = ("static", "request", "history")  # the sources of synthetic traces (any name is stored)
ROOT = Path(__file__).resolve().parents[1]
VOCAB = ["the", " cat", " sat", " on", " mat", "\n", " <b>", "&", " dog", " ran", " far", "def", "(", ")", ":"]
V = 200  # token ids drawn in synthetic traces


class FakeTokenizer:
    """decode([id]) -> a word of VOCAB (ids beyond it: 'w<id>')."""

    def decode(self, ids):
        return "".join(VOCAB[i] if i < len(VOCAB) else f"w{i}" for i in ids)

    def convert_ids_to_tokens(self, i):
        return self.decode([i])


def tree_mask(parents: list[int], prefix_len: int, dtype=torch.float32) -> torch.Tensor:
    """The mask the decoder gives the model: (1, 1, q, prefix_len + q); 0 = may attend."""
    q = len(parents)
    allowed = torch.zeros(q, prefix_len + q, dtype=torch.bool)
    allowed[:, :prefix_len] = True
    for i in range(q):
        j = i
        while j >= 0:
            allowed[i, prefix_len + j] = True
            j = parents[j]
    mask = torch.full((q, prefix_len + q), torch.finfo(dtype).min, dtype=dtype)
    return mask.masked_fill(allowed, 0.0)[None, None]


def make_trace(rng: random.Random, *, step: int = 0, prefix_len: int = 12, n_nodes: int = 10,
               dtype=torch.float32, accept_p: float = 0.7) -> StepTrace:
    """A consistent REST step: a trie-shaped draft tree, greedy verification along it."""
    parents, depths, tokens = [-1], [0], [rng.randrange(V)]
    frontier = [0]
    while len(parents) < n_nodes:
        level = []
        for _ in range(rng.randint(1, max(1, n_nodes - len(parents)))):
            if len(parents) >= n_nodes:
                break
            p = rng.choice(frontier)
            used = {tokens[c] for c in range(len(parents)) if parents[c] == p}
            tok = rng.choice([t for t in range(V) if t not in used])  # siblings differ (a trie)
            parents.append(p), depths.append(depths[p] + 1), tokens.append(tok)
            level.append(len(parents) - 1)
        frontier = level
    n = len(parents)
    children = {i: [c for c in range(n) if parents[c] == i] for i in range(n)}
    choices = [rng.randrange(V) for _ in range(n)]
    path = [0]
    while True:  # the model agrees with some drafted child, or emits a bonus off-tree
        kids = children[path[-1]]
        if kids and rng.random() < accept_p:
            c = rng.choice(kids)
            choices[path[-1]] = tokens[c]
            path.append(c)
            continue
        kid_tokens = {tokens[c] for c in kids}
        choices[path[-1]] = rng.choice([t for t in range(V) if t not in kid_tokens])
        break
    bonus = choices[path[-1]]
    scores = [float(rng.randint(1, 40)) for _ in range(n)]
    scores[0] = sum(scores[1:]) or 1.0
    branches = [Branch(rng.choice(SOURCES), tuple(rng.randrange(V) for _ in range(rng.randint(1, 5))),
                       rng.randint(1, 9)) for _ in range(rng.randint(0, 6))]
    return StepTrace(
        step=step, prefix_len=prefix_len, query=[rng.randrange(V) for _ in range(4)],
        matched_len={s: rng.randint(0, 4) for s in SOURCES}, branches=branches,
        tree_tokens=tokens, tree_parents=parents, tree_depths=depths, tree_scores=scores,
        tree_sources=[""] + [rng.choice(SOURCES) for _ in range(n - 1)],
        position_ids=[prefix_len + d for d in depths], mask=tree_mask(parents, prefix_len, dtype),
        model_choices=choices, accepted_nodes=path, bonus_token=bonus,
        new_tokens=[tokens[i] for i in path[1:]] + [bonus],
        timings_ms={p: round(rng.uniform(0.1, 60.0), 3) for p in PHASES},
        **model_probs(tokens, parents, choices, path),
        **_cost_model_choice(rng, n),
    )


def _cost_model_choice(rng: random.Random, n: int) -> dict:
    """The cost model's fields of a step: none (a fixed budget) half the time, else its reasons and a chance per
    kept node (when it kept any)."""
    if rng.random() < 0.5:
        return {}
    chances = [round(rng.uniform(0, 0.99), 4) for _ in range(n - 1)]
    return {"budget_choice": {"candidates": n - 1 + rng.randint(0, 9), "kept": n - 1,
                              "expected_accepted": round(sum(chances), 4), "relative_cost": round(rng.uniform(1, 2), 4),
                              "request_factors": {s: round(rng.uniform(0.3, 2), 4) for s in SOURCES[:2]}},
            "node_chances": [None, *chances] if chances else []}


def model_probs(tokens: list[int], parents: list[int], choices: list[int], path: list[int]) -> dict:
    """Probability fields consistent with the choices: each node's choice is its likeliest next token
    (a generator of its own, so the step's other random fields do not depend on them)."""
    rng = random.Random(hash((len(tokens), tuple(tokens), tuple(choices))))
    top_tokens, top_probs = [], []
    for choice in choices:
        others = rng.sample([t for t in range(V) if t != choice], 4)
        probs = sorted((rng.random() for _ in range(5)), reverse=True)
        total = sum(probs) * rng.uniform(1.0, 2.0)
        top_tokens.append([choice] + others)
        top_probs.append([p / total for p in probs])
    draft = [None] + [rng.random() * top_probs[parents[i]][0] for i in range(1, len(tokens))]
    uniforms = {node: rng.random() for node in path} if rng.random() < 0.5 else {}
    return {"draft_probs": draft, "choice_probs": [p[0] for p in top_probs], "top_tokens": top_tokens,
            "top_probs": top_probs, "uniforms": uniforms}


def record_run(rec: TraceRecorder, traces: list[StepTrace], tokenizer=None, finish: bool = True, **comparison) -> int:
    run_id = rec.start_run(model="tiny", tokenizer_name="fake", stores=["static:demo"],
                           settings={"n_max": 16, "choices": 64}, prompt="the cat", prompt_tokens=2)
    hook = rec.step_hook(run_id, tokenizer or FakeTokenizer())
    for t in traces:
        hook(t)
    if finish:
        new = sum(len(t.new_tokens) for t in traces)
        rec.finish_run(run_id, output="out", new_tokens=new, steps=len(traces), wall_s=1.0,
                       mean_accepted=new / max(1, len(traces)), comparison=comparison or None)
    return run_id


def assert_same_trace(a: StepTrace, b: StepTrace) -> None:
    for name in StepTrace.__dataclass_fields__:
        if name == "mask":
            assert a.mask.dtype == b.mask.dtype and a.mask.shape == b.mask.shape
            assert torch.equal(a.mask, b.mask)
        else:
            assert getattr(a, name) == getattr(b, name), name


@pytest.fixture
def rec(tmp_path):
    r = TraceRecorder(tmp_path / "traces.sqlite")
    yield r
    r.close()


# ------------------------------------------------------------------ round trip

@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40), prefix=st.integers(0, 60),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_round_trip_is_identical(tmp_path_factory, seed, n, prefix, dtype):
    rng = random.Random(seed)
    traces = [make_trace(rng, step=k, prefix_len=prefix + k, n_nodes=n, dtype=dtype) for k in range(3)]
    rec = TraceRecorder(tmp_path_factory.mktemp("db") / "t.sqlite")
    run_id = record_run(rec, traces)
    for t in traces:
        back = rec.load_trace(run_id, t.step)
        assert_same_trace(t, back)
        step = rec.load_step(run_id, t.step, mask="numpy")
        assert step["mask"].shape == (len(t.tree_tokens), t.prefix_len + len(t.tree_tokens))
        assert np.array_equal(step["mask"], t.mask[0, 0].float().numpy())
    rec.close()


def test_stored_block_and_rows(rec):
    t = make_trace(random.Random(3), prefix_len=7, n_nodes=12)
    run_id = record_run(rec, [t])
    s = rec.load_step(run_id, 0, mask="torch")
    assert torch.equal(s["mask"], t.mask) and s["mask"].dtype == t.mask.dtype
    assert np.array_equal(s["mask_block"], (t.mask[0, 0, :, 7:] == 0).numpy())
    assert [n["token_text"] for n in s["nodes"]] == [FakeTokenizer().decode([x]) for x in t.tree_tokens]
    assert [n["node"] for n in s["nodes"] if n["accepted"]] == t.accepted_nodes
    for n in s["nodes"][1:]:  # chosen = the model's choice at the parent is this token
        assert n["chosen"] == int(t.model_choices[n["parent"]] == n["token_id"])
    assert s["accepted_len"] == len(t.accepted_nodes) - 1 and s["draft_size"] == len(t.tree_tokens) - 1
    assert s["bonus_text"] == FakeTokenizer().decode([t.bonus_token])
    assert s["new_texts"] == [FakeTokenizer().decode([x]) for x in t.new_tokens]
    assert [b["text"] for b in s["branches"]] == [FakeTokenizer().decode(list(b.tokens)) for b in t.branches]
    assert rec.load_steps(run_id)[0]["t_forward_ms"] == t.timings_ms["forward"]


def test_block_encoding_round_trip():
    block = np.random.default_rng(0).random((9, 9)) > 0.5
    assert np.array_equal(decode_block(encode_block(block)), block)
    assert decode_block(encode_block(np.zeros((0, 0), bool))).shape == (0, 0)
    m = full_mask(block, 3, "float16")
    assert m.shape == (1, 1, 9, 12) and (m[0, 0, :, :3] == 0).all()


def test_mask_with_blocked_prefix_is_refused_and_not_recorded(rec):
    t = make_trace(random.Random(1), prefix_len=5, n_nodes=6)
    t.mask = t.mask.clone()
    t.mask[0, 0, 2, 1] = torch.finfo(t.mask.dtype).min
    run_id = rec.start_run(model="m", tokenizer_name="t", stores=[], settings={}, prompt="p", prompt_tokens=1)
    hook = rec.step_hook(run_id, FakeTokenizer())
    with pytest.raises(ValueError, match="prefix"):
        hook(t)
    assert rec.load_steps(run_id) == []
    assert rec.db.execute("SELECT count(*) FROM draft_nodes").fetchone()[0] == 0


@pytest.mark.parametrize("bad", ["shape", "value"])
def test_malformed_masks_are_refused(rec, bad):
    t = make_trace(random.Random(2), prefix_len=4, n_nodes=5)
    t.mask = t.mask[..., 1:] if bad == "shape" else t.mask.masked_fill(t.mask != 0, -1e4)
    hook = rec.step_hook(rec.start_run(model="m", tokenizer_name="t", stores=[], settings={}, prompt="",
                                       prompt_tokens=0))
    with pytest.raises(ValueError):
        hook(t)


def test_run_lifecycle_and_comparison(rec):
    rng = random.Random(5)
    run_id = record_run(rec, [make_trace(rng, step=k) for k in range(4)],
                        plain_wall_s=2.0, plain_tokens_per_s=5.0, speedup=2.0, identical=True)
    run = rec.get_run(run_id)
    assert run["status"] == "done" and run["steps"] == 4 and run["identical"] == 1 and run["speedup"] == 2.0
    assert run["settings"] == {"n_max": 16, "choices": 64} and run["stores"] == ["static:demo"]
    assert run["pid"] == os.getpid() and run["finished_at"] >= run["started_at"]
    other = record_run(rec, [make_trace(rng)], finish=False)
    assert rec.get_run(other)["status"] == "running" and rec.get_run(other)["steps"] == 1
    assert [r["id"] for r in rec.list_runs()] == [other, run_id]
    assert [r["id"] for r in rec.list_runs(status="done")] == [run_id]
    with pytest.raises(ValueError):
        rec.finish_run(other, output="", new_tokens=0, steps=0, wall_s=0, mean_accepted=0, status="ok")
    with pytest.raises(ValueError):
        rec.finish_run(other, output="", new_tokens=0, steps=0, wall_s=0, mean_accepted=0, comparison={"x": 1})
    rec.finish_run(other, output="", new_tokens=0, steps=1, wall_s=0.1, mean_accepted=0, status="failed",
                   error="boom")
    assert rec.get_run(other)["error"] == "boom"
    with pytest.raises(KeyError):
        rec.get_run(999)
    with pytest.raises(KeyError):
        rec.load_step(run_id, 99)


# ------------------------------------------------------------------ concurrency

def _write_runs(path: str, seed: int, n_runs: int, n_steps: int) -> None:
    rec = TraceRecorder(path, busy_timeout_s=60)
    rng = random.Random(seed)
    for _ in range(n_runs):
        record_run(rec, [make_trace(rng, step=k, n_nodes=8) for k in range(n_steps)])
    rec.close()


def _count(rec: TraceRecorder) -> tuple[int, int, int]:
    q = rec.db.execute
    return (q("SELECT count(*) FROM runs WHERE status = 'done'").fetchone()[0],
            q("SELECT count(*) FROM steps").fetchone()[0], q("SELECT count(*) FROM draft_nodes").fetchone()[0])


def test_threads_write_concurrently(rec):
    shared = rec  # one recorder shared by threads, and separate recorders, at once
    errors = []

    def work(seed, own):
        try:
            r = TraceRecorder(rec.path) if own else shared
            rng = random.Random(seed)
            for _ in range(2):
                record_run(r, [make_trace(rng, step=k, n_nodes=8) for k in range(15)])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s, s % 2 == 0)) for s in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert _count(rec) == (12, 12 * 15, 12 * 15 * 8)


def test_processes_write_concurrently(rec):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_runs, args=(str(rec.path), s, 2, 20)) for s in range(4)]
    for p in procs:
        p.start()
    _write_runs(str(rec.path), 99, 2, 20)  # the parent writes too, through its own handle
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert _count(rec) == (10, 10 * 20, 10 * 20 * 8)
    assert rec.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_killed_writer_run_is_marked_interrupted(tmp_path):
    db = tmp_path / "t.sqlite"
    script = textwrap.dedent(f"""
        import random, sys, time
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        from test_recorder import make_trace, record_run
        from rest_core.traces.recorder import TraceRecorder
        rec = TraceRecorder({str(db)!r})
        record_run(rec, [make_trace(random.Random(0), step=k) for k in range(3)], finish=False)
        print("recorded", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "recorded"
        assert TraceRecorder(db).list_runs()[0]["status"] == "running"  # writer alive: left alone
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    rec = TraceRecorder(db)
    run = rec.list_runs()[0]
    assert run["status"] == "interrupted" and "ended" in run["error"]
    assert len(rec.load_steps(run["id"])) == 3  # every committed step survives the kill
    rec.close()


def test_running_run_of_a_reused_pid_is_interrupted(rec):
    run_id = rec.start_run(model="m", tokenizer_name="t", stores=[], settings={}, prompt="", prompt_tokens=0)
    assert process_alive(os.getpid(), rec.get_run(run_id)["proc_start"])
    rec.db.execute("UPDATE runs SET proc_start = 'not-this-process' WHERE id = ?", [run_id])
    assert rec.mark_interrupted() == [run_id]
    assert rec.get_run(run_id)["status"] == "interrupted"


# ------------------------------------------------------------------ large steps

def test_large_steps_are_recorded_whole_through_the_hook(rec):
    """Steps as large as a decode makes them (a 64-node tree over a 1,000-token prefix, 200 ten-token branches)
    go through the live hook whole: every node and mask cell comes back, and the branches kept.  What recording
    costs per step is measured by the benchmark (`rest_static_traced` against `rest_static`,
    docs/bench/recording.md), not timed here."""
    rng = random.Random(7)
    traces = [make_trace(rng, step=k, prefix_len=1000 + k, n_nodes=64) for k in range(30)]
    for t in traces:
        t.branches = [Branch("static", tuple(rng.randrange(V) for _ in range(10)), 3) for _ in range(200)]
    run_id = rec.start_run(model="m", tokenizer_name="t", stores=[], settings={}, prompt="", prompt_tokens=0)
    hook = rec.step_hook(run_id, FakeTokenizer())
    for t in traces:
        hook(t)
    assert rec.step_count(run_id) == 30
    for t in (traces[0], traces[17], traces[-1]):
        s = rec.load_step(run_id, t.step, mask="numpy")
        recorded = {FakeTokenizer().decode(list(b.tokens)) for b in t.branches}
        # of 200 equally frequent branches of one source, the most frequent MAX_BRANCHES_PER_SOURCE are kept
        assert len(s["branches"]) == MAX_BRANCHES_PER_SOURCE and {b["text"] for b in s["branches"]} <= recorded
        assert len(s["nodes"]) == 64 and np.array_equal(s["mask"], t.mask[0, 0].float().numpy())


def test_prompt_ids_default_path_and_finish_keeping_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path / "cache"))
    rec = TraceRecorder()
    assert rec.path == tmp_path / "cache" / "traces.sqlite"
    run_id = rec.start_run(model="m", tokenizer_name="t", stores=[], settings={}, prompt="p", prompt_tokens=[5, 6, 7])
    hook = rec.step_hook(run_id)  # no tokenizer: texts are '<id>'
    traces = [make_trace(random.Random(8), step=k) for k in range(2)]
    for t in traces:
        hook(t)
    rec.finish_run(run_id, status="stopped", error="stopped by the user")  # counts left to the hook
    run = rec.get_run(run_id)
    assert (run["prompt_tokens"], run["prompt_ids"]) == (3, [5, 6, 7])
    assert (run["status"], run["steps"], run["new_tokens"]) == ("stopped", 2, sum(len(t.new_tokens) for t in traces))
    assert rec.load_step(run_id, 0)["bonus_text"] == f"<{traces[0].bonus_token}>"
    rec.close()


def test_only_the_most_frequent_continuations_per_source_are_stored(tmp_path):
    many = [Branch("static", (i, i + 1), count=1 + (i % 7)) for i in range(200)]
    few = [Branch("request", (5, 6, 7), count=3), Branch("request", (5, 9), count=1)]
    kept = _top_branches(many + few, MAX_BRANCHES_PER_SOURCE)
    static = [b for b in kept if b.source == "static"]
    assert len(static) == MAX_BRANCHES_PER_SOURCE
    assert min(b.count for b in static) >= max(b.count for b in many if b not in static)
    assert [b for b in kept if b.source == "request"] == few
    assert kept == [b for b in many + few if b in kept]  # the trace's order is kept


# ------------------------------------------------------------------ open-ended sources, partial reads

def with_sources(t: StepTrace, names: tuple[str, ...], rng: random.Random) -> StepTrace:
    """The same step with its nodes, branches and matches spread over `names`."""
    t.tree_sources = [""] + [rng.choice(names) for _ in t.tree_sources[1:]]
    t.branches = [Branch(name, (1 + k, 2 + k), 1 + k) for k, name in enumerate(names)]
    t.matched_len = {name: k for k, name in enumerate(names)}
    return t


def test_any_source_name_round_trips(rec):
    names = ("static", "request", "history", "model", "notes", "my uploads ✓")
    rng = random.Random(21)
    traces = [with_sources(make_trace(rng, step=k, n_nodes=12, accept_p=0.9), names, rng) for k in range(3)]
    run_id = record_run(rec, traces)
    for t in traces:
        assert_same_trace(t, rec.load_trace(run_id, t.step))
        step = rec.load_step(run_id, t.step)
        assert [b["source"] for b in step["branches"]] == list(names)
        assert step["accepted_sources"] == [t.tree_sources[n] for n in t.accepted_nodes[1:]]
    assert {n["source"] for t in traces for n in rec.load_step(run_id, t.step)["nodes"][1:]} == {
        s for t in traces for s in t.tree_sources[1:]}


def test_load_steps_since_step_and_step_count(rec):
    rng = random.Random(22)
    traces = [make_trace(rng, step=k, n_nodes=6) for k in range(5)]
    run_id = record_run(rec, traces)
    assert rec.step_count(run_id) == 5 and rec.step_count(run_id + 1) == 0
    assert [s["step"] for s in rec.load_steps(run_id)] == [0, 1, 2, 3, 4]
    assert [s["step"] for s in rec.load_steps(run_id, since_step=3)] == [3, 4]
    assert rec.load_steps(run_id, since_step=3) == rec.load_steps(run_id)[3:]
    assert rec.load_steps(run_id, since_step=5) == []
    other = record_run(rec, [make_trace(rng, step=0)])
    assert rec.step_count(other) == 1 and [s["run_id"] for s in rec.load_steps(other)] == [other]


def test_a_failed_commit_rolls_back_and_the_recorder_goes_on(rec):
    """A COMMIT can fail (here: a deferred foreign key); the transaction must not stay open."""
    with pytest.raises(sqlite3.IntegrityError):
        with rec._transaction() as conn:
            conn.execute("PRAGMA defer_foreign_keys = ON")
            conn.execute("INSERT INTO steps (run_id, step, prefix_len, tree_mask, mask_dtype) "
                         "VALUES (12345, 0, 0, '[]', 'float32')")
    assert not conn.in_transaction
    assert rec.db.execute("SELECT count(*) FROM steps").fetchone()[0] == 0
    run_id = record_run(rec, [make_trace(random.Random(23))])  # the next write works
    assert rec.step_count(run_id) == 1


def test_a_store_written_before_the_budget_choice_column_gains_it_and_keeps_its_steps(tmp_path):
    path = tmp_path / "old.sqlite"
    rec = TraceRecorder(path)
    t = make_trace(random.Random(5), n_nodes=4)
    t.budget_choice, t.node_chances = None, []
    old_run = record_run(rec, [t])
    rec.close()
    with sqlite3.connect(path) as conn:  # the tables as they were before the columns existed
        conn.execute("ALTER TABLE steps DROP COLUMN budget_choice")
        conn.execute("ALTER TABLE draft_nodes DROP COLUMN chance")
    rec = TraceRecorder(path)
    assert rec.load_step(old_run, 0)["budget_choice"] is None
    assert rec.load_trace(old_run, 0).node_chances == [] and rec.load_step(old_run, 0)["nodes"][1]["chance"] is None
    t2 = make_trace(random.Random(6), n_nodes=5)
    t2.budget_choice = {"candidates": 9, "kept": 4, "expected_accepted": 1.5, "relative_cost": 1.2,
                        "request_factors": {"static": 0.7}}
    t2.node_chances = [None, 0.8, 0.5, 0.3, 0.05]
    new_run = record_run(rec, [t2])
    assert rec.load_step(new_run, 0)["budget_choice"] == t2.budget_choice
    assert rec.load_trace(new_run, 0).budget_choice == t2.budget_choice
    assert [n["chance"] for n in rec.load_step(new_run, 0)["nodes"]] == t2.node_chances
    rec.close()
