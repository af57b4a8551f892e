"""A public server on loopback, through its API: bad input of every kind, upload floods, eight
visitors at once, and the server killed in the middle of a recorded decode.

The server runs the tiny random model (no built-in store), so each test stays well under a minute
on a busy two-core machine.  The figures the load and kill tests measure are printed (pytest -s).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from rest_core import app as sup
from rest_core.app.policy import Policy
from rest_core.model import DEFAULT_MODEL
from rest_core.traces.recorder import TraceRecorder

from conftest import free_port, make_tiny_lm, no_chooser, tool

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("module_cache")]

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "t5 t6 t7 t8 t9"
TINY = sup.Settings(model="tiny", mode="completion", static=sup.NO_STATIC, max_new_tokens=24, budget_mode="fixed",
                    budget=8)
POLICY = Policy(public=True, reason="test", models=(DEFAULT_MODEL, "tiny"), max_waiting=12, trusted_proxies=1)
USERS, LOAD_S = 8, 12.0  # the load test: visitors at once, and how long each keeps sending
CLIENT = "10.66.0.1"  # the one client that opens many sessions
many = tool("many_sessions")  # raw requests to the page's queue, as a browser (or a script) sends them
forwarded = many.forwarded


def settings_args(settings: sup.Settings) -> list:
    return [getattr(settings, f) for f in sup.Settings.__dataclass_fields__]


def finals(job) -> list:
    """Per output, the last value a streamed job sent that was not an 'unchanged' marker."""
    last = None
    for out in job:
        out = list(out)
        last = last or [None] * len(out)
        for i, value in enumerate(out):
            if not (isinstance(value, dict) and value.get("__type__") == "update" and "value" not in value):
                last[i] = value
    if last is None:
        job.result()  # raises what the server said
    return last


def rss_mb(pid: int | None = None) -> float:
    for line in Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from gradio_client import Client

    import app

    tiny = make_tiny_lm(max_positions=512)
    traces = tmp_path_factory.mktemp("served") / "traces.sqlite"
    loads = []  # the models loaded; tokenizers load alone

    def load(name):
        loads.append(name)
        return tiny
    demo = app.build_demo(lm_factory=load, store_factory=lambda tok: None, cost_factory=no_chooser,
                          tokenizer_factory=lambda name: tiny.tokenizer, trace_db=str(traces), preload=False,
                          defaults=TINY, policy=POLICY)
    demo.loads = loads
    _, url, _ = app.launch(demo, prevent_thread_lock=True, server_port=free_port(), quiet=True)
    yield demo, url, Client
    demo.close()


# ---------------------------------------------------------------- bad input through the API

def outcome(call) -> str:
    """What a bad request got: the page's own message, or the server's refusal (never a crash)."""
    try:
        return json.dumps(call(), default=str)
    except Exception as err:  # the request was refused before a handler ran
        return f"refused: {err}"


def test_every_handler_answers_bad_input_with_a_message(served, capsys):
    demo, url, Client = served
    client = Client(url, verbose=False)
    base = settings_args(TINY)
    names = list(sup.Settings.__dataclass_fields__)

    def chat(text=PROMPT, **changes):
        args = [changes.get(n, v) for n, v in zip(names, base)]
        return lambda: finals(client.submit(text, *args, api_name="/chat"))

    def race(text=PROMPT, **changes):
        args = [changes.get(n, v) for n, v in zip(names, base)]
        return lambda: finals(client.submit(text, *args, api_name="/race"))

    choices, bounds = "not in the list of choices", "maximum value"  # the page's controls refusing a value
    cases = {  # request -> what its answer (or the server's refusal) must say, one of
        "huge prompt": (chat("t5 " * 200_000), ("at most 4,000",)),
        "no prompt": (chat(None), ("prompt is empty",)),
        "unknown model": (chat(model="gpt2"), ("offers these models only", choices)),
        "server folder as model": (chat(model="/etc"), ("offers these models only", choices)),
        "relative path as model": (chat(model="../models/SmolLM2-135M-Instruct"), ("offers these models only",
                                                                                  choices)),
        "model not text": (chat(model=["tiny"]), ("model", choices)),
        "negative tokens": (chat(max_new_tokens=-5), ("max_new_tokens", "minimum value")),
        "too many tokens": (chat(max_new_tokens=100_000), ("max_new_tokens", bounds)),
        "tokens as text": (chat(max_new_tokens="many"), ("max_new_tokens", "Expected a `float`")),
        "a fraction of a token": (chat(max_new_tokens=2.5), ("max_new_tokens", "whole number")),
        "datastore as a path": (chat(static="/etc/passwd"), ("static", choices)),
        "n_min above n_max": (chat(n_min=8, n_max=2), ("n_min", "n\\\\_min")),  # Markdown's n\\_min, in JSON
        "seed as text": (chat(seed="abc"), ("seed", "Expected a `float`", "Expected a")),
        "race, unknown model": (race(model="org/model"), ("offers these models only", choices)),
        "race, huge prompt": (race("x" * 50_000), ("at most 4,000",)),
        "race, budget out of range": (race(budget=1000), ("budget", bounds)),
        "explore, huge context": (lambda: client.predict("t1 " * 10_000, 8, *base, api_name="/explore"),
                                  ("at most 4,000",)),
        "explore, unknown model": (lambda: client.predict(PROMPT, 8, *[("gpt2" if n == "model" else v)
                                                                        for n, v in zip(names, base)],
                                                          api_name="/explore"), ("offers these models only", choices)),
        "explore, budget out of range": (lambda: client.predict(PROMPT, 10**12, *base, api_name="/explore"),
                                         ("draft budget", bounds)),
        "step of a run not listed": (lambda: client.predict(1, 0, api_name="/step"), ("among your runs", choices)),
        "step with a huge run id": (lambda: client.predict(10**30, 0, api_name="/step"), ("among your runs", choices)),
        "step with a huge step": (lambda: client.predict(None, 10**30, api_name="/step"), ("[", bounds)),
        "build with no files and an unknown model": (lambda: client.predict([], "gpt2", api_name="/build_datastore"),
                                                     ("No files uploaded", choices)),
    }
    refused = []
    for name, (call, expected) in cases.items():
        answer = outcome(call)
        refused += [name] if answer.startswith("refused") else []
        assert "Traceback" not in answer and "Something went wrong" not in answer, (name, answer)
        assert any(e in answer for e in expected), (name, answer[:400])
    assert not demo.engine.recorder.list_runs(), "no bad request was recorded as a run"
    assert set(demo.engine.models) <= {"tiny"}, "nothing but the offered model was loaded"
    assert 'data-state="done"' in finals(client.submit(PROMPT, *base, api_name="/chat"))[4], "the server still answers"
    with capsys.disabled():
        print(f"\nbad inputs tried through the API: {len(cases)}; answered by the handler with a message: "
              f"{len(cases) - len(refused)}; refused with a message by the page's controls before a handler ran: "
              f"{len(refused)}")


def test_upload_floods_are_refused_before_they_are_stored(served, tmp_path):
    from gradio_client import handle_file

    demo, url, Client = served
    cache = Path(demo.GRADIO_CACHE)
    before = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) if cache.exists() else 0
    big = [("files", (f"f{k}.txt", b"x" * (2 * 2**20), "text/plain")) for k in range(12)]  # 24 MB in one request
    answer = httpx.post(f"{url.rstrip('/')}/gradio_api/upload", files=big, timeout=60)
    assert answer.status_code == 413 and "at most 20 MB" in answer.text
    after = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) if cache.exists() else 0
    assert after - before < 2**20, "nothing of the refused request was kept"
    many = []
    for k in range(201):
        path = tmp_path / f"n{k}.txt"
        path.write_text(f"note {k}\n")
        many.append(handle_file(str(path)))
    status, _, notice = Client(url, verbose=False).predict(many, "tiny", api_name="/build_datastore")
    assert "at most 200" in status


# ---------------------------------------------------------------- one client, many sessions

def slow_model(demo, seconds: float):
    """Every forward pass of the served model takes `seconds` longer (a slow machine: decodes overlap)."""
    return demo.engine.model("tiny").lm.model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))


def kind_of(answer) -> str:
    """What a decode through the raw API got: a turn (its answer finished), or refused, and by whom."""
    text = answer.text()
    if answer.outcome == "refused":
        return f"refused by the queue ({answer.status})"
    if "network address already has" in text:
        return "refused: the address holds its places"
    return "answered" if 'data-state=\\"done\\"' in text or 'data-state="done"' in text else f"other: {text[:200]}"


def test_thirty_decodes_from_one_client_hold_two_places_and_another_address_gets_one(served, capsys):
    demo, url, _ = served
    page = many.Page(url)
    long = many.default_values(page, "chat", prompt=PROMPT, **{"Max new tokens": 160})
    short = many.default_values(page, "chat", prompt=PROMPT, **{"Max new tokens": 8})
    hook = slow_model(demo, 0.02)
    demo.engine.turns.most_per_address = 0
    try:
        attack: list = []
        client = threading.Thread(target=lambda: attack.extend(many.many_sessions(
            page, "chat", long, 30, forwarded(f"1.2.3.4, {CLIENT}"), at_once=True)))  # a forged entry, then the proxy's
        client.start()
        time.sleep(1.0)
        honest = page.call("chat", short, headers=forwarded("203.0.113.9"))
        client.join()
    finally:
        hook.remove()
    kinds = Counter(kind_of(a) for a in attack)
    with capsys.disabled():
        print(f"\n30 decodes from one client's 30 sessions: {dict(kinds)}; the most places it held at once "
              f"{demo.engine.turns.most_per_address}; another address's decode: {kind_of(honest)} after "
              f"{honest.total_s:.1f} s")
    assert kinds["answered"] <= 2 and kinds["refused: the address holds its places"] >= 20
    assert set(kinds) <= {"answered", "refused: the address holds its places", "refused by the queue (503)"}
    assert demo.engine.turns.most_per_address <= POLICY.max_waiting_per_address
    assert kind_of(honest) == "answered", "a visitor at another address still got a place"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A public server with small bounds: a queue of 16, 4 decodes waiting, the state of 16 sessions, and a
    visitor's state kept 2 s after its latest request."""
    import app

    tiny = make_tiny_lm(max_positions=512)
    policy = replace(POLICY, queue_size=16, max_waiting=4, max_sessions=16, session_idle_s=2)
    demo = app.build_demo(lm_factory=lambda name: tiny, store_factory=lambda tok: None, cost_factory=no_chooser,
                          trace_db=str(tmp_path_factory.mktemp("small") / "t.sqlite"), preload=False, defaults=TINY,
                          policy=policy)
    _, url, _ = app.launch(demo, prevent_thread_lock=True, server_port=free_port(), quiet=True)
    yield demo, url, tiny
    demo.close()


def test_the_queue_is_bounded(small, capsys):
    demo, url, tiny = small
    hook = tiny.model.register_forward_pre_hook(lambda module, args: time.sleep(0.02))
    try:
        page = many.Page(url)
        data = many.default_values(page, "chat", prompt=PROMPT, **{"Max new tokens": 40})
        answers: list = []
        threads = [threading.Thread(target=lambda k=k: answers.append(page.call("chat", data, headers=forwarded(
            f"198.51.100.{k}")))) for k in range(40)]  # 40 visitors at 40 addresses, together
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        hook.remove()
    kinds = Counter(kind_of(a) if a.outcome != "refused" else f"{a.status}: {a.message}" for a in answers)
    with capsys.disabled():
        print(f"\n40 decodes at once, queue of 16, 4 waiting in line: {dict(kinds)}")
    full = [a for a in answers if a.outcome == "refused"]
    assert full and all(a.status == 503 and "full" in a.message.lower() for a in full), "past 16 the queue refuses"
    assert kinds["answered"] >= 5


def test_the_server_keeps_few_sessions_and_forgets_idle_ones(small, tmp_path):
    from gradio_client import Client, handle_file

    demo, url, _ = small
    page = many.Page(url)
    data = many.default_values(page, "explore", Context=PROMPT)
    for k in range(24):  # 24 visitors at addresses of their own
        assert page.call("explore", data, headers=forwarded(f"192.0.2.{k}")).outcome == "done"
    assert demo.state_session_capacity == 16 and len(demo.state_holder.session_data) <= 16
    note = tmp_path / "notes.txt"
    note.write_text("t5 t6 t7 t8 t9 " * 50)
    client = Client(url, verbose=False, headers=forwarded("192.0.2.200"))
    status, _, _ = client.predict([handle_file(str(note))], "tiny", api_name="/build_datastore")
    folder = sup.sessions_root() / client.session_hash
    assert "Your datastore" in status and (folder / "store").is_dir()
    deadline = time.monotonic() + 30
    while folder.exists() and time.monotonic() < deadline:  # idle past its 2 s: its state and folder go
        time.sleep(0.5)
    assert not folder.exists()


def test_explore_and_building_a_store_take_their_turn_in_the_line(served, tmp_path):
    from gradio_client import handle_file

    demo, url, Client = served
    page = many.Page(url)
    long = many.default_values(page, "chat", prompt=PROMPT, **{"Max new tokens": 160})
    explore = many.default_values(page, "explore", Context=PROMPT)
    hook = slow_model(demo, 0.02)
    try:
        client = [threading.Thread(target=page.call, args=("chat", long, None, forwarded(CLIENT))) for _ in range(2)]
        for t in client:
            t.start()
        time.sleep(1.0)
        refused = page.call("explore", explore, headers=forwarded(CLIENT))
        other = page.call("explore", explore, headers=forwarded("203.0.113.9"))
        for t in client:
            t.join()
    finally:
        hook.remove()
    assert "network address already has 2" in refused.text(), "an explore counts against the address's places"
    assert other.outcome == "done" and "longest suffix" in other.text() and other.total_s > 0.5, \
        "another address's explore waited for its turn"
    demo.engine.models.clear()  # building a store loads the tokenizer alone, never the model
    loads = len(demo.loads)
    note = tmp_path / "notes.txt"
    note.write_text(" ".join(f"t{k % 300}" for k in range(2000)))
    status, _, notice = Client(url, verbose=False).predict([handle_file(str(note))], "tiny",
                                                          api_name="/build_datastore")
    assert "Your datastore: 2,000 tokens" in status and len(demo.loads) == loads and not demo.engine.models


def test_an_uploaded_store_is_refused_past_its_token_cap(served, tmp_path, monkeypatch):
    from gradio_client import handle_file

    demo, url, Client = served
    monkeypatch.setattr(demo.engine, "policy", replace(POLICY, max_upload_tokens=1000))
    note = tmp_path / "notes.txt"
    note.write_text(" ".join(f"t{k % 300}" for k in range(5000)))
    status, _, notice = Client(url, verbose=False).predict([handle_file(str(note))], "tiny",
                                                          api_name="/build_datastore")
    assert "more than 1,000 tokens" in status and "more than 1,000 tokens" in str(notice)


def cache_bytes(demo) -> int:
    cache = Path(demo.GRADIO_CACHE)
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) if cache.exists() else 0


def upload(url: str, address: str, files: list) -> httpx.Response:
    return httpx.post(f"{url.rstrip('/')}/gradio_api/upload", files=files, headers=forwarded(address), timeout=120)


def test_six_uploads_sent_together_never_pass_the_total(served, monkeypatch, capsys):
    demo, url, _ = served
    ledger = demo.page.uploads_ledger
    ledger.measure()
    used = ledger.used()[0]
    assert used < 2**20, "the upload folders are nearly empty"
    monkeypatch.setattr(ledger, "policy", replace(POLICY, max_upload_total_bytes=used + 40 * 2**20))
    before = cache_bytes(demo)
    answers: list = [None] * 6
    go = threading.Barrier(6)

    def send(k):
        body = os.urandom(15 * 2**20)  # contents of their own: the upload route keeps one copy of equal files
        go.wait()
        answers[k] = upload(url, f"198.51.100.{k + 1}", [("files", (f"big{k}.txt", body, "text/plain"))])
    threads = [threading.Thread(target=send, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = cache_bytes(demo) - before
    codes = Counter(a.status_code for a in answers)
    with capsys.disabled():
        print(f"\n6 x 15 MB uploads sent together under a 40 MB total: answers {dict(codes)}; "
              f"{stored / 2**20:.1f} MB stored")
    assert stored <= 40 * 2**20 and codes[200] == 2 and codes[507] == 4
    assert all("space for uploaded files is full" in a.text for a in answers if a.status_code == 507)


def test_one_address_uploads_at_most_its_allowance_and_files(served, monkeypatch):
    demo, url, _ = served
    sent = [upload(url, CLIENT, [("files", (f"{k}.txt", os.urandom(15 * 2**20), "text/plain"))]) for k in range(3)]
    other = upload(url, "203.0.113.9", [("files", ("c.txt", os.urandom(15 * 2**20), "text/plain"))])
    assert [a.status_code for a in sent] == [200, 200, 429] and other.status_code == 200
    assert "your network address has uploaded 30 MB" in sent[2].text and "at most 40 MB" in sent[2].text
    before = cache_bytes(demo)
    many_files = [("files", (f"n{k}.txt", f"note {k} {os.urandom(8).hex()}".encode(), "text/plain"))
                  for k in range(POLICY.max_upload_files + 1)]
    answer = upload(url, "203.0.113.10", many_files)
    assert answer.status_code == 413 and f"at most {POLICY.max_upload_files} are accepted" in answer.text
    assert cache_bytes(demo) - before < 1024, "the refused request's files were removed"


def test_a_slow_walk_of_the_upload_folders_never_stalls_the_page(served, monkeypatch):
    from rest_core.app import guard

    demo, url, _ = served
    walk = guard.folder_usage

    def slow(roots):  # a disk holding very many files
        time.sleep(3.0)
        return walk(roots)
    monkeypatch.setattr(guard, "folder_usage", slow)
    demo.page.uploads_ledger.measured_at = 0.0  # stale: the next upload walks again
    sent = threading.Thread(target=upload, args=(url, "203.0.113.11", [("files", ("s.txt", b"t5 t6", "text/plain"))]))
    sent.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    assert httpx.get(url, timeout=60).status_code == 200
    waited = time.monotonic() - t0
    sent.join()
    assert waited < 2.0, f"the page waited {waited:.1f} s behind the walk"


def test_a_web_address_is_never_downloaded_as_a_file(served, monkeypatch):
    from gradio import processing_utils

    demo, url, _ = served
    fetched = []

    async def download(address, cache_dir):  # what Gradio would do with it: fetch it into its cache
        fetched.append(address)
        raise OSError("no network here")
    monkeypatch.setattr(processing_utils, "async_ssrf_protected_download", download)
    page = many.Page(url)
    remote = {"path": "https://example.com/huge.txt", "orig_name": "huge.txt", "meta": {"_type": "gradio.FileData"}}
    answer = page.call("build_datastore", [[remote], None, "tiny"], headers=forwarded("203.0.113.12"))
    assert answer.outcome == "error" and "web address is not accepted as a file" in answer.text()
    assert fetched == [], "nothing was downloaded"


def test_a_node_of_another_step_gets_a_message(served):
    """The node picker offers the nodes of the step it showed last; the sampling check is asked about a step of
    another run, with fewer nodes."""
    demo, url, Client = served
    client = Client(url, verbose=False, headers=forwarded("203.0.113.13"))
    for prompt in ("t5 t6 t7 t8 t9", "t5 t6 t7 t5 t6 t7 t5 t6 t7 t5 t6"):  # the second drafts from its own prompt
        finals(client.submit(prompt, *settings_args(replace(TINY, max_new_tokens=8)), api_name="/chat"))
    plain, repeated = [row[0] for row in client.predict(api_name="/runs")["data"][:2]][::-1]
    few, more = (len(client.predict(run, 0, api_name="/step")[3]["data"]) for run in (plain, repeated))
    assert more > few, (few, more)  # the picker now offers the repeated run's nodes
    answer = many.Page(url).call("sampling_check", [plain, 0, more - 1, None], session=client.session_hash,
                                 headers=forwarded("203.0.113.13"))
    assert answer.outcome == "done", answer.text()  # the check kept its figure...
    assert any(f"Node {more - 1} is not in step 0: its nodes are 0–{few - 1}" in t for t in answer.toasts), \
        answer.toasts  # ...and said why


def test_visitor_text_shown_on_the_page_is_never_markup(served):
    demo, url, _ = served
    page = many.Page(url)
    link = "[win](http://evil.example/x) **now**"  # the tiny tokenizer refuses it, quoting it back
    answer = page.call("explore", many.default_values(page, "explore", Context=link),
                       headers=forwarded("203.0.113.14"))
    summary = str(answer.data[0])
    assert "win\\](http\\://evil.example" in summary, "shown as it is, its markup escaped"
    assert "](http://" not in summary


# ---------------------------------------------------------------- eight visitors at once

def visitor(url: str, Client, k: int, until: float, log: list) -> None:
    """One visitor (at an address of its own): chats, races and step views in turn until `until`, and at least one
    of each however slow the machine is (so "served more than once" does not depend on its speed); each request's
    outcome and wait."""
    client = Client(url, verbose=False, headers=forwarded(f"198.51.100.{k + 1}"))
    settings = replace(TINY, max_new_tokens=16 + 4 * k)
    n = 0
    while time.monotonic() < until or n < 3:
        kind = ("chat", "race", "step")[n % 3]
        t0 = time.monotonic()
        try:
            if kind == "step":
                runs = client.predict(api_name="/runs")["data"]
                out = client.predict(runs[0][0], 0, api_name="/step") if runs else ["no run yet"]
                ok = str(out[0]).startswith("**Step 0.**") or out == ["no run yet"]
                log.append((k, kind, "answered" if ok else f"wrong: {str(out[0])[:200]}", time.monotonic() - t0))
            else:
                last = finals(client.submit(PROMPT, *settings_args(settings), api_name=f"/{kind}"))
                done = 'data-state="done"' in str(last[4]) if kind == "chat" else "faster" in str(last[2]) or \
                    "slower" in str(last[2])
                notice = str(last[5] if kind == "chat" else last[4])
                state = "answered" if done else ("refused" if "busy" in notice else f"wrong: {notice[:200]}")
                log.append((k, kind, state, time.monotonic() - t0))
        except Exception as err:  # counted as an error: the test fails on any
            log.append((k, kind, f"error: {type(err).__name__}: {err}", time.monotonic() - t0))
        n += 1


def test_eight_visitors_at_once_are_all_served_fairly(served, capsys):
    demo, url, Client = served
    rss0 = rss_mb()
    log: list = []
    until = time.monotonic() + LOAD_S
    threads = [threading.Thread(target=visitor, args=(url, Client, k, until, log)) for k in range(USERS)]
    page_waits = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # the page itself loads while decodes queue
        t0 = time.monotonic()
        assert httpx.get(url, timeout=60).status_code == 200
        page_waits.append(time.monotonic() - t0)
        time.sleep(0.5)
    for t in threads:
        t.join()
    states = Counter(state.split(":")[0] for _, _, state, _ in log)
    per_user = Counter(k for k, _, state, _ in log if state == "answered")
    decode_waits = [w for _, kind, _, w in log if kind != "step"]
    rss1 = rss_mb()
    with capsys.disabled():
        kinds = dict(Counter(kind for _, kind, _, _ in log))
        print(f"\nload: {USERS} visitors x {LOAD_S:.0f} s: {len(log)} requests ({kinds}); "
              f"outcomes {dict(states)}; answered per visitor {sorted(per_user.values())}; longest chat/race "
              f"{max(decode_waits):.1f} s; longest wait for a turn {demo.engine.turns.longest_wait_s:.1f} s; "
              f"longest page load {max(page_waits):.2f} s; memory {rss0:.0f} -> {rss1:.0f} MB")
    assert not [entry for entry in log if entry[2].startswith(("error", "wrong"))], log
    assert len(per_user) == USERS and min(per_user.values()) >= 2, "every visitor was served, more than once"
    assert demo.engine.turns.longest_wait_s < 60 and max(page_waits) < 10
    assert rss1 - rss0 < 400, "memory stays bounded"
    assert len(demo.engine.turns) == 0


# ---------------------------------------------------------------- killed in the middle of a decode

SERVER = """
import sys, time
sys.path[:0] = [{root!r}, {tests!r}]
import app
from conftest import make_tiny_lm
from rest_core.app.policy import Policy
tiny = make_tiny_lm(max_positions=1024)
tiny.model.register_forward_pre_hook(lambda module, args: time.sleep(0.05))  # a slow machine: time to kill
demo = app.build_demo(lm_factory=lambda name: tiny, store_factory=lambda tok: None, preload=False,
                      cost_factory=lambda lm, stores, kind: None, trace_db={db!r},
                      policy=Policy(public=True, models=("tiny",)))
app.launch(demo, prevent_thread_lock=True, server_port={port}, quiet=True)
print("ready", flush=True)
time.sleep(600)
"""


def test_killed_in_a_recorded_decode_the_restarted_page_works(tmp_path, capsys):
    from gradio_client import Client

    import app

    db, port = tmp_path / "traces.sqlite", free_port()
    script = SERVER.format(root=str(ROOT), tests=str(ROOT / "tests"), db=str(db), port=port)
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "REST_LAB_CACHE": str(tmp_path / "cache")})
    try:
        lines = iter(server.stdout.readline, "")
        assert any(line.strip() == "ready" for line in lines), "the server started"
        url = f"http://127.0.0.1:{port}/"
        Client(url, verbose=False).submit(PROMPT, *settings_args(replace(TINY, max_new_tokens=256)), api_name="/chat")
        reader = TraceRecorder(db)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any((r["steps"] or 0) >= 5 for r in reader.list_runs()):
            time.sleep(0.1)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(30)
    finally:
        server.kill()
    run = reader.list_runs()[0]
    committed = reader.step_count(run["id"])
    assert committed >= 5 and run["status"] == "running"
    reopened = TraceRecorder(db)  # what the restarted page opens
    run = reopened.get_run(run["id"])
    assert run["status"] == "interrupted"
    assert [s["step"] for s in reopened.load_steps(run["id"])] == list(range(committed)), "every step intact"
    assert all(reopened.load_step(run["id"], k)["nodes"] for k in range(committed))
    tiny = make_tiny_lm(max_positions=512)
    demo = app.build_demo(lm_factory=lambda name: tiny, store_factory=lambda tok: None, preload=False,
                          cost_factory=no_chooser, trace_db=str(db), policy=POLICY)
    _, url, _ = app.launch(demo, prevent_thread_lock=True, server_port=free_port(), quiet=True)
    try:
        assert httpx.get(url, timeout=60).status_code == 200
        last = finals(Client(url, verbose=False).submit(PROMPT, *settings_args(TINY), api_name="/chat"))
        assert 'data-state="done"' in last[4]
    finally:
        demo.close()
    with capsys.disabled():
        print(f"\nkill -9 during a decode: {committed} committed steps intact, run marked {run['status']}, "
              "the restarted page answers")
