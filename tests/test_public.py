"""Public mode: what an open server lets a visitor ask for, and the faults a visitor can meet.

The policy's detection and limits directly; the engine refusing models a public server does not
offer; the line of decodes; the trace store bounded, full, locked and unreadable during a decode
(the answer always completes, committed steps stay); bad input of every kind through the API.
"""
from __future__ import annotations

import sqlite3
import threading
from dataclasses import replace

import numpy as np
import pytest

from rest_core import app as sup
from rest_core.app import engine as engine_module
from rest_core.app import live as live_module
from rest_core.app.guard import Refused, UploadLedger
from rest_core.app.policy import Policy, markdown_safe, markdown_text, public_reason
from rest_core.app.turns import Busy, Turns
from rest_core.app.visitors import Visitors, client_address
from rest_core.decode import DecodeConfig, plain_generate
from rest_core.model import DEFAULT_MODEL, ModelLoadError
from rest_core.traces.recorder import TraceRecorder

from conftest import make_tiny_lm, no_chooser

pytestmark = pytest.mark.usefixtures("module_cache")

PROMPT_IDS = [5, 6, 7, 8, 9]
PROMPT = " ".join(f"t{t}" for t in PROMPT_IDS)
TINY = sup.Settings(model="tiny", mode="completion", static=sup.NO_STATIC, max_new_tokens=24, budget_mode="fixed",
                    budget=8)
PUBLIC = Policy(public=True, reason="test", models=(DEFAULT_MODEL, "tiny"), max_new_tokens=256)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_lm(max_positions=512)


def public_engine(tiny, recorder=None, trace_db=None, policy=PUBLIC, loads=None) -> sup.Engine:
    def factory(name):
        if loads is not None:
            loads.append(name)
        return tiny
    return sup.Engine(lm_factory=factory, store_factory=lambda tok: None, cost_factory=no_chooser,
                      recorder=recorder, trace_db=trace_db, policy=policy)


def turn(engine, settings=TINY, text=PROMPT, session=None):
    return list(sup.chat_turn(engine, session or sup.Session(id="visitor-a"), settings, text))


# ---------------------------------------------------------------- the policy

@pytest.mark.parametrize("env, public", [
    ({}, False),
    ({"GRADIO_SERVER_NAME": "127.0.0.1"}, False),
    ({"GRADIO_SERVER_NAME": "localhost"}, False),
    ({"GRADIO_SERVER_NAME": "0.0.0.0"}, True),
    ({"SPACE_ID": "someone/rest-lab"}, True),
    ({"REST_LAB_PUBLIC": "1"}, True),
    ({"SPACE_ID": "someone/rest-lab", "REST_LAB_PUBLIC": "0"}, False),
])
def test_public_mode_is_detected(env, public):
    assert bool(public_reason(env)) is public
    assert Policy.from_env(env).public is public


def test_limits_and_models_come_from_the_environment():
    policy = Policy.from_env({"SPACE_ID": "x/y", "REST_LAB_MODELS": " org/a , org/b,", "REST_LAB_MODEL": "org/c",
                              "REST_LAB_MAX_PROMPT_CHARS": "100", "REST_LAB_MAX_RUNS": "7",
                              "REST_LAB_MAX_TRACE_MB": "3", "REST_LAB_MAX_WAITING": "oops"})
    assert policy.models == (DEFAULT_MODEL, "org/c", "org/a", "org/b")
    assert policy.max_prompt_chars == 100 and policy.max_runs == 7 and policy.max_trace_bytes == 3 * 2**20
    assert policy.max_waiting == Policy().max_waiting, "a value that is not a number keeps the default"


def test_public_server_refuses_models_it_does_not_offer_without_loading_or_echoing(tiny, tmp_path):
    loads = []
    engine = public_engine(tiny, recorder=TraceRecorder(tmp_path / "t.sqlite"), loads=loads)
    for name in ("gpt2", "/etc", str(tmp_path), "../../models/x", "org/" + "x" * 200):
        with pytest.raises(ModelLoadError, match="offers these models only") as err:
            engine.model(name)
        assert name not in str(err.value)
        views = turn(engine, replace(TINY, model=name))
        assert "offers these models only" in views[-1].notice and name not in views[-1].notice
        assert name not in engine.status()
    assert loads == [], "nothing was loaded, downloaded or even looked up"
    assert engine.tokenizer_for("gpt2") is None, "replaying a run never fetches an unknown tokenizer"
    assert engine.model("tiny").lm is tiny and loads == ["tiny"]
    private = public_engine(tiny, recorder=TraceRecorder(tmp_path / "p.sqlite"), policy=Policy(), loads=loads)
    assert private.model("gpt2").lm is tiny, "a private server loads what it is asked for"


def test_settings_of_every_wrong_kind_are_refused_by_name(tiny, tmp_path):
    engine = public_engine(tiny, recorder=TraceRecorder(tmp_path / "t.sqlite"))
    bad = [("max_new_tokens", -1), ("max_new_tokens", 10**9), ("max_new_tokens", "abc"), ("max_new_tokens", 2.5),
           ("max_new_tokens", 300), ("temperature", float("nan")), ("top_p", 7), ("budget", 65), ("n_max", 0),
           ("n_min", None), ("continuation_len", [3]), ("seed", -5), ("seed", "x"), ("mode", "shell"),
           ("static", "/etc/passwd"), ("decoding", 3), ("budget_mode", None), ("request_store", "yes"),
           ("history_store", 2), ("model", 17)]
    for name, value in bad:
        views = turn(engine, replace(TINY, **{name: value}))
        assert views[-1].done and name in views[-1].notice and "Traceback" not in views[-1].notice, (name, value)
    text = "t5 " * 3000  # 9,000 characters
    assert "at most 4,000" in turn(engine, TINY, text)[-1].notice
    assert "must be text" in turn(engine, TINY, 12345)[-1].notice
    assert not list(engine.recorder.list_runs()), "nothing refused was recorded"
    assert Policy().check_settings(replace(TINY, max_new_tokens=500)).max_new_tokens == 500, "private: slider range"


def test_status_line_shows_no_visitor_text_and_stays_short(tiny, tmp_path):
    engine = public_engine(tiny, recorder=TraceRecorder(tmp_path / "t.sqlite"), policy=Policy())

    def failing(name):
        raise ModelLoadError(f"no {name}")
    engine.lm_factory = failing
    for k in range(10):
        with pytest.raises(ModelLoadError):
            engine.model(f"**bold{k}** <img src=x>")
    status = engine.status()
    assert status.count("could not be loaded") == engine_module.MAX_LOAD_ERRORS
    assert "<img" not in status and "&lt;img" in status and "**bold" not in status and "\\*\\*bold9" in status
    assert markdown_text("a_b*c") == "a\\_b\\*c"


def test_models_are_evicted_least_recently_used_before_a_load(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "MAX_MODELS", 2)
    seen_at_load = []
    engine = public_engine(tiny, recorder=TraceRecorder(tmp_path / "t.sqlite"), policy=Policy())
    engine.lm_factory = lambda name: seen_at_load.append(sorted(engine.models)) or tiny
    engine.model("a")
    engine.model("b")
    engine.model("a")  # a is now the most recently used
    engine.model("c")
    assert seen_at_load[-1] == ["a"], "b (least recently used) went before c loaded"
    assert list(engine.models) == ["a", "c"]


def test_a_failed_built_in_store_build_is_tried_again(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "STORE_RETRY_S", 0.0)
    calls = []

    def flaky(tokenizer):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("no space left")
        return None
    engine = public_engine(tiny, recorder=TraceRecorder(tmp_path / "t.sqlite"))
    engine.store_factory = flaky
    slot = engine.model("tiny")
    assert engine.start_static(slot).finished.wait(10) and slot.static.state == "failed"
    assert "tried again" in engine.status()
    assert engine.start_static(slot).finished.wait(10) and slot.static.state == "off" and len(calls) == 2


# ---------------------------------------------------------------- the line of decodes

def test_the_line_is_first_come_first_served_one_place_per_visitor():
    turns = Turns(max_waiting=2, one_each=True)
    a, b, c = (turns.join(v) for v in "abc")
    with pytest.raises(Busy, match="already have a decode"):
        turns.join("a")
    with pytest.raises(Busy, match="server is busy"):
        turns.join("d")
    assert [t.ahead() for t in (a, b, c)] == [0, 1, 2]
    assert a.wait(0) and not b.wait(0.01)
    order = []

    def run(ticket):
        assert ticket.wait(10)
        order.append(ticket.owner)
        ticket.leave()
    threads = [threading.Thread(target=run, args=(t,)) for t in (c, b)]
    for t in threads:
        t.start()
    a.leave()
    for t in threads:
        t.join(10)
    assert order == ["b", "c"] and len(turns) == 0


def test_a_second_decode_of_the_same_visitor_is_refused_while_the_first_runs(tiny, tmp_path):
    engine = public_engine(tiny, recorder=TraceRecorder(tmp_path / "t.sqlite"))
    visitor = sup.Session(id="visitor-a")
    first = sup.chat_turn(engine, visitor, replace(TINY, max_new_tokens=200), PROMPT)
    next(first)
    second = turn(engine, TINY, PROMPT, visitor)
    assert "already have a decode" in second[-1].notice
    other = sup.chat_turn(engine, sup.Session(id="visitor-b"), TINY, PROMPT)
    waiting = next(other)
    assert "Waiting for your turn: 1 decode ahead" in waiting.chat[-1]["content"]
    first.close()  # Stop: the place in line is given up
    assert list(other)[-1].done and len(engine.turns) == 0


# ---------------------------------------------------------------- the trace store: bounded, full, locked, unreadable

def test_runs_are_pruned_per_visitor_in_all_and_by_size(tiny, tmp_path):
    policy = replace(PUBLIC, max_runs_per_visitor=3, max_runs=5)
    engine = public_engine(tiny, recorder=TraceRecorder(tmp_path / "t.sqlite"), policy=policy)
    a, b = sup.Session(id="visitor-a"), sup.Session(id="visitor-b")
    short = replace(TINY, max_new_tokens=4)
    ids_a = [turn(engine, short, PROMPT, a)[-1].run_id for _ in range(5)]
    ids_b = [turn(engine, short, PROMPT, b)[-1].run_id for _ in range(3)]
    rec = engine.recorder
    # a kept its newest 3; then b's third run took the oldest run of all (a's) to keep 5 in all
    assert [r["id"] for r in sup.visible_runs(rec, a)] == ids_a[-2:][::-1]
    assert [r["id"] for r in sup.visible_runs(rec, b)] == ids_b[::-1]
    assert len(rec.list_runs()) == 5
    assert all(rec.step_count(i) == 0 for i in ids_a[:3]) and rec.step_count(ids_a[-1]) > 0, \
        "a pruned run's steps went with it"
    listed = rec.list_runs(owner="visitor-a")
    assert "output" not in listed[0] and "prompt" in listed[0], "a listing reads no outputs"


def test_a_full_trace_store_never_stops_the_answer(tiny, tmp_path):
    rec = TraceRecorder(tmp_path / "t.sqlite", max_bytes=120 * 1024)
    engine = public_engine(tiny, recorder=rec, policy=Policy())
    views = turn(engine, replace(TINY, max_new_tokens=300, request_store=True), PROMPT)
    final = views[-1]
    assert final.done and "Recording stopped after" in final.notice and "full" in final.notice
    run = rec.get_run(final.run_id)
    assert run["status"] == "partial" and "Recording stopped" in run["error"]
    plain = plain_generate(tiny, PROMPT_IDS, DecodeConfig(max_new_tokens=300))
    kept = rec.step_count(final.run_id)
    assert 0 < kept < run["steps"], "some steps were stored, then the store was full"
    steps = rec.load_steps(final.run_id)
    assert [s["step"] for s in steps] == list(range(kept)), "every committed step intact"
    assert all(rec.load_step(final.run_id, k)["nodes"] for k in range(kept))
    assert run["output"] == tiny.decode(plain.tokens), "the answer went on to the end"
    assert final.chat[-1]["content"].count("rest-answer") == 2, "stored steps tinted, the rest as plain text"


def test_pruning_makes_room_again_on_a_public_server(tiny, tmp_path):
    policy = replace(PUBLIC, max_trace_bytes=100 * 1024, max_new_tokens=512)
    engine = public_engine(tiny, trace_db=tmp_path / "t.sqlite", policy=policy)
    long = replace(TINY, max_new_tokens=400, request_store=True)
    first = turn(engine, long)[-1]
    assert engine.recorder.get_run(first.run_id)["status"] == "partial"
    second = turn(engine, replace(TINY, max_new_tokens=8))[-1]
    assert not second.notice and engine.recorder.get_run(second.run_id)["status"] == "done"
    assert engine.recorder.path.stat().st_size <= policy.max_trace_bytes + 64 * 1024


def test_a_locked_trace_store_leaves_the_answer_unrecorded_with_a_message(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "TRACE_BUSY_S", 0.3)
    path = tmp_path / "t.sqlite"
    engine = public_engine(tiny, trace_db=path, policy=Policy())
    assert turn(engine)[-1].run_id is not None
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another program holds the write lock
    try:
        final = turn(engine)[-1]
        assert final.done and "locked by another program" in final.notice and final.run_id is None
        assert "rest-answer" in final.chat[-1]["content"]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert turn(engine)[-1].run_id is not None, "recording resumes once the lock is gone"


def test_an_unreadable_trace_store_is_kept_aside_and_a_fresh_one_started(tiny, tmp_path):
    path = tmp_path / "traces.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    engine = public_engine(tiny, trace_db=path, policy=Policy())
    final = turn(engine)[-1]
    assert final.done and final.run_id is not None and not final.notice
    kept = list(tmp_path.glob("traces.unreadable-*.sqlite"))
    assert len(kept) == 1 and kept[0].read_bytes().startswith(b"this is not a database")
    assert "trace store was unreadable" in engine.status()


def test_messages_show_home_paths_from_the_home_folder_only():
    from pathlib import Path

    text = sup.message_of(FileNotFoundError(f"no file {Path.home() / 'secret' / 'x.txt'}"))
    assert str(Path.home()) not in text and "~/secret/x.txt" in text


# ---------------------------------------------------------------- who a visitor is, and what one address may hold

@pytest.mark.parametrize("peer, forwarded, hops, expected", [
    ("10.16.3.80", [], 0, "10.16.3.80"),  # no proxy: the connection's address
    ("10.16.3.80", ["203.0.113.7"], 1, "203.0.113.7"),  # one proxy (a Space): the entry it appended
    ("10.16.3.80", ["1.2.3.4, 203.0.113.7"], 1, "203.0.113.7"),  # a forged entry on the left is ignored
    ("10.16.3.80", ["1.2.3.4", "203.0.113.7:5555"], 1, "203.0.113.7"),  # header lines together, a port dropped
    ("10.16.3.80", ["1.2.3.4, 203.0.113.7, 10.0.0.2"], 2, "203.0.113.7"),  # two proxies
    ("10.16.3.80", [], 1, "10.16.3.80"),  # fewer entries than proxies: counted by the proxy itself
    ("10.16.3.80", ["2001:db8:1:2:aaaa::1"], 1, "2001:db8:1:2::/64"),  # IPv6: its /64 network
    ("::ffff:192.0.2.1", [], 0, "192.0.2.1"),
    (None, [], 0, "unknown"),
])
def test_a_client_is_known_by_the_address_its_trusted_proxy_forwarded(peer, forwarded, hops, expected):
    assert client_address(peer, forwarded, hops) == expected
    assert Policy.from_env({"SPACE_ID": "x/y"}).trusted_proxies == 1
    assert Policy.from_env({"SPACE_ID": "x/y", "REST_LAB_TRUSTED_PROXIES": "2"}).trusted_proxies == 2
    assert Policy.from_env({}).trusted_proxies == 0


def test_the_line_holds_a_few_places_per_address_whatever_the_sessions():
    turns = Turns(max_waiting=12, one_each=True, per_address=2)
    held = [turns.join(f"session-{k}", "10.66.0.1") for k in range(2)]
    for k in range(2, 30):  # 28 more sessions of the same client
        with pytest.raises(Busy, match="network address already has 2"):
            turns.join(f"session-{k}", "10.66.0.1")
    honest = turns.join("visitor", "203.0.113.7")
    assert honest.ahead() == 2 and len(turns) == 3
    held[0].leave()
    assert turns.join("session-29", "10.66.0.1").ahead() == 2, "a place freed is a place again"


def test_an_address_holds_at_most_its_sessions_and_idle_ones_go():
    visitors = Visitors(per_address=3, idle_s=3600)
    gone = [visitors.admit("10.66.0.1", f"s{k}") for k in range(5)]
    assert gone == [[], [], [], ["s0"], ["s1"]] and visitors.held("10.66.0.1") == 3
    assert visitors.admit("10.66.0.1", "s2") == [], "a session used again is the most recent"
    assert visitors.admit("10.66.0.1", "s5") == ["s3"]
    assert visitors.admit("203.0.113.7", "mine") == [] and visitors.held("203.0.113.7") == 1
    visitors.idle_s, visitors._swept = 0.0, -1e9  # everything idle now: the next request sweeps them all
    assert set(visitors.admit("203.0.113.7", "mine")) == {"s2", "s4", "s5"}


def test_uploads_sent_together_reserve_the_room_atomically(tmp_path):
    policy = replace(PUBLIC, max_upload_total_bytes=40 * 2**20, max_upload_address_bytes=40 * 2**20)
    ledger = UploadLedger(policy, lambda: [tmp_path])
    ledger.measure()
    outcomes, barrier = [], threading.Barrier(6)

    def upload(k):
        barrier.wait()
        try:
            r = ledger.reserve(f"10.0.0.{k}", 15 * 2**20)
            outcomes.append(("stored", r))
        except Refused as refusal:
            outcomes.append((refusal.status, str(refusal)))
    threads = [threading.Thread(target=upload, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = [r for kind, r in outcomes if kind == "stored"]
    assert len(stored) == 2 and sorted(kind for kind, _ in outcomes if kind != "stored") == [507] * 4
    assert all("space for uploaded files is full" in text for kind, text in outcomes if kind == 507)
    for r in stored:
        ledger.settle(r, 15 * 2**20, 1)
    assert ledger.used() == (30 * 2**20, 2), "what was stored counts until a walk sees it"
    with pytest.raises(Refused) as refused:
        ledger.reserve("10.0.0.1", 15 * 2**20)
    assert refused.value.status == 507
    mine = ledger.reserve("10.0.0.9", 5 * 2**20)
    ledger.release(mine)  # a request that failed stores nothing: its room comes back
    assert ledger.used() == (30 * 2**20, 2)


def test_an_address_uploads_at_most_its_allowance_and_files(tmp_path):
    policy = replace(PUBLIC, max_upload_address_bytes=20 * 2**20, max_upload_files=3, max_upload_address_files=4)
    ledger = UploadLedger(policy, lambda: [tmp_path])
    ledger.measure()
    first = ledger.reserve("10.66.0.1", 15 * 2**20)
    with pytest.raises(Refused, match="your network address has uploaded 15 MB") as refused:
        ledger.reserve("10.66.0.1", 15 * 2**20)
    assert refused.value.status == 429
    ledger.settle(first, 1000, 3)
    with pytest.raises(Refused, match="4 files in one request; at most 3") as refused:
        ledger.settle(ledger.reserve("10.66.0.2", 1000), 1000, 4)
    assert refused.value.status == 413
    with pytest.raises(Refused, match="too many files") as refused:
        ledger.settle(ledger.reserve("10.66.0.1", 1000), 1000, 2)
    assert refused.value.status == 429 and ledger.used()[1] == 3, "refused files are not counted"
    (tmp_path / "a").write_bytes(b"x" * 10)
    ledger.measure()
    assert ledger.used() == (10, 1), "a walk replaces what was counted with what is on disk"


def test_runs_are_pruned_per_address_whatever_the_sessions(tiny, tmp_path):
    policy = replace(PUBLIC, max_runs_per_visitor=30, max_runs_per_address=3)
    engine = public_engine(tiny, recorder=TraceRecorder(tmp_path / "t.sqlite"), policy=policy)
    short = replace(TINY, max_new_tokens=4)
    mine = turn(engine, short, PROMPT, sup.Session(id="honest", address="203.0.113.7"))[-1].run_id
    many = [turn(engine, short, PROMPT, sup.Session(id=f"s{k}", address="10.66.0.1"))[-1].run_id for k in range(6)]
    kept = {r["id"] for r in engine.recorder.list_runs()}
    assert kept == {mine, *many[-3:]}, "the client's 6 sessions keep 3 runs; the other visitor's run stays"
    tags = {r["settings"].get("app_address") for r in engine.recorder.list_runs()}
    assert len(tags) == 2 and not any("10.66" in t or "203.0" in t for t in tags), "no address is stored"


def test_chat_history_is_capped_in_tokens_and_the_page_says_so(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(live_module, "CHAT_TURNS_SHOWN", 5)
    chatty = replace(tiny, tokenizer=tiny.tokenizer.chat())
    policy = replace(PUBLIC, max_chat_tokens=64)
    engine = sup.Engine(lm_factory=lambda name: chatty, store_factory=lambda tok: None, cost_factory=no_chooser,
                        recorder=TraceRecorder(tmp_path / "t.sqlite"), policy=policy)
    visitor, chat = sup.Session(id="visitor-a"), replace(TINY, mode="chat", max_new_tokens=8)
    notices = []
    for k in range(8):
        final = turn(engine, chat, " ".join(f"t{10 + k}" for _ in range(12)), visitor)[-1]
        notices.append(final.notice or "")
        assert engine.recorder.get_run(final.run_id)["prompt_tokens"] <= 64
    assert not notices[0] and any("newest 64 tokens" in n and "oldest turn" in n for n in notices[2:])
    assert len(visitor.history) <= 2 * 3, "the dropped turns are not kept either"
    assert len(visitor.chat) == 2 * 5, "the page shows the newest turns"


def test_visitor_tables_are_shared_until_they_learn_and_few_keep_their_own(tiny, tmp_path):
    engine = public_engine(tiny, recorder=TraceRecorder(tmp_path / "t.sqlite"),
                           policy=replace(PUBLIC, max_session_tables=2))
    slot = engine.model("tiny")
    explorers = [sup.Session(id=f"e{k}") for k in range(20)]
    for visitor in explorers:
        sup.explore(engine, visitor, replace(TINY, model_drafts=True), PROMPT, 8)
    base = explorers[0].recycle_store(slot)
    assert all(np.shares_memory(v.recycle_store(slot).table, base.table) for v in explorers), \
        "looking up copies no table"
    learners = [sup.Session(id=f"d{k}") for k in range(3)]
    for visitor in learners:
        turn(engine, replace(TINY, model_drafts=True, max_new_tokens=6), PROMPT, visitor)
    owns = [not v.recycle_store(slot).shared for v in learners]
    assert owns == [False, True, True], "past the limit the least recent learner goes back to the shared table"


def test_visitor_and_model_text_is_never_markup():
    link = "[win](http://evil.example) www.evil.example <img src=x> **bold** __init__"
    shown = markdown_safe(link)
    assert "[win]" not in shown and "<img" not in shown and "**" not in shown and "__" not in shown
    assert "http\\://" in shown and "www\\." in shown
    step = {"step": 0, "query_text": link, "matched_len": {}, "branches": [], "draft_size": 0, "nodes": [
        {"node": 0, "token_text": link, "accepted": True}], "bonus_text": link, "new_tokens": [1]}
    text = sup.explain_step(step, {"settings": {}})
    assert text.startswith("**Step 0.**") and "[win]" not in text and "<img" not in text and "**bold" not in text
    session = sup.Session(id="visitor-a", upload_files=["_a__b_.txt", "__init__.py"], upload_model="tiny")
    summary = sup.upload_summary(session, type("Store", (), {"n_tokens": 5})())
    assert "\\_\\_init\\_\\_.py" in summary


def test_an_uploaded_store_past_its_token_cap_is_refused(tiny, tmp_path):
    visitor = sup.Session(id="visitor-a")
    docs = [("a.txt", " ".join(f"t{k % 500}" for k in range(3000)))]
    with pytest.raises(sup.UploadError, match="more than 1,000 tokens"):
        sup.build_upload_store(visitor, docs, tiny.tokenizer, "tiny", max_tokens=1000, progress=False)
    assert not (visitor.store_dir / "meta.json").exists(), "nothing was published"
    store = sup.build_upload_store(visitor, docs, tiny.tokenizer, "tiny", max_tokens=5000, progress=False)
    assert store.n_tokens == 3000
