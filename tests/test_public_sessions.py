"""One client as many visitors, against a public server on loopback in a process of its own (its memory
measured alone): 200 new sessions calling the datastore explorer with every store on, and eight honest
visitors served while one client opens 200 sessions.

The server runs the tiny random model, whose vocabulary (70,000 ids) is larger than the default model's
(49,152), so each visitor's table of the model's own predictions is as large as on a real server (4.7 MB:
70,000 x 8 successors and 65,536 pair slots); it starts from a full persisted table, as a server that
command-line runs taught does.  The static and general-text stores are small (they are shared by every
visitor, so their size does not change what one more session costs).  The figures are printed (pytest -s).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from test_public_server import CLIENT, LOAD_S, USERS, visitor

from conftest import free_port, tool

pytestmark = [pytest.mark.usefixtures("module_cache"), pytest.mark.server]  # a public-mode server on loopback

ROOT = Path(__file__).resolve().parents[1]
many = tool("many_sessions")
forwarded = many.forwarded
CONTEXT = "t5 t6 t7 t8 t9 t10 t11"
MEMORY_MB = 50  # what 200 new sessions of one client may add to the server's memory, in all
# the load test's decodes add more: each visitor who decodes learns on a table of their own (4.7 MB here; at most
# max_session_tables = 16 of them), and the decodes' caches and recorded runs
LOAD_MB = 16 * 4.7 + 100

SERVER = """
import json, os, resource, sys
sys.path[:0] = [{root!r}, {tests!r}]
import numpy as np
import app
from conftest import make_tiny_lm, no_chooser
from datastores import RecycleStore, TokenDatastore, build_datastore, default_recycle_path
from datastores.answers import SOURCE
from rest_core import app as sup
from rest_core.app.policy import Policy
from tools.many_sessions import rss_mb

tiny = make_tiny_lm(max_positions=1024)
rng = np.random.default_rng(0)
words = lambda n: " ".join(f"t{{k}}" for k in rng.integers(5, 3000, n))
static = build_datastore({work!r} + "/static", tiny.tokenizer, [("a", words(200_000))], progress=False)
built = build_datastore({work!r} + "/answers", tiny.tokenizer, [("b", words(100_000))], progress=False)
answers = TokenDatastore.open(built.path, tokenizer=tiny.tokenizer, name="answers", source=SOURCE)
table = RecycleStore(tiny.vocab_size)  # what command-line runs taught: every token and many pairs known
ids = np.arange(tiny.vocab_size)
table.observe(ids, rng.integers(5, 3000, (ids.size, 8)), previous=rng.integers(5, 3000, ids.size))
table.save(default_recycle_path(tiny.name, tiny.tokenizer))
defaults = sup.Settings(model="tiny", mode="completion", static=sup.BUILT_IN, answers=sup.ANSWERS_ALWAYS,
                        request_store=True, history_store=True, model_drafts=True, max_new_tokens=24,
                        budget_mode="fixed", budget=8)
policy = Policy(public=True, reason="test", models=("tiny",), trusted_proxies=1)
demo = app.build_demo(lm_factory=lambda name: tiny, store_factory=lambda tok: static, cost_factory=no_chooser,
                      answers_factory=lambda slot, pause, st: answers, trace_db={work!r} + "/traces.sqlite",
                      preload=False, defaults=defaults, policy=policy)
app.launch(demo, prevent_thread_lock=True, server_port={port}, quiet=True)
print("ready", flush=True)
for line in sys.stdin:  # "stats": what the server holds now
    turns, holder = demo.engine.turns, demo.state_holder
    held = dict((a, len(s)) for a, s in demo.page.visitors._by_address.items())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({{"rss_mb": rss_mb(os.getpid()), "sessions": len(holder.session_data), "held": held,
                      "cpu_s": usage.ru_utime + usage.ru_stime,
                      "forgotten": demo.page.visitors.forgotten, "most_per_address": turns.most_per_address,
                      "longest_wait_s": turns.longest_wait_s, "served": turns.served,
                      "runs": len(demo.engine.recorder.list_runs())}}), flush=True)
"""


class Server:
    """The public server's process: its address, its process id and what it holds (`stats`)."""

    def __init__(self, work: Path):
        self.port = free_port()
        code = SERVER.format(root=str(ROOT), tests=str(ROOT / "tests"), work=str(work), port=self.port)
        env = {**os.environ, "REST_LAB_CACHE": str(work / "cache"), "GRADIO_TEMP_DIR": str(work / "gradio")}
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
        for line in iter(self.process.stdout.readline, ""):
            if line.strip() == "ready":
                break
        assert self.process.poll() is None, "the server started"
        self.url = f"http://127.0.0.1:{self.port}/"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stats(self) -> dict:
        self.process.stdin.write("stats\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.kill()
        self.process.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    handle = Server(tmp_path_factory.mktemp("public-sessions"))
    yield handle
    handle.close()


def warm_up(page, data) -> None:
    """Three visitors at addresses of their own explore first: the model, the stores and the shared table of the
    model's predictions are loaded before memory is measured."""
    for k in range(3):
        answer = page.call("explore", data, headers=forwarded(f"198.51.100.{200 + k}"))
        summary = str(answer.data[0]) if answer.data else answer.text()
        assert all(f"**{s}**" in summary for s in ("static", "answers", "request", "history", "model")), summary


def test_two_hundred_sessions_from_one_client_take_at_most_50_mb(server, capsys):
    page = many.Page(server.url)
    data = many.default_values(page, "explore", Context=CONTEXT)
    warm_up(page, data)
    before = many.rss_mb(server.pid)
    t0 = time.monotonic()
    answers = many.many_sessions(page, "explore", data, 200, forwarded(f"1.2.3.4, {CLIENT}"), threads=2)
    wall = time.monotonic() - t0
    time.sleep(1.0)
    after, stats = many.rss_mb(server.pid), server.stats()
    outcomes = Counter(a.outcome for a in answers)
    with capsys.disabled():
        print(f"\n200 new sessions of one client, each exploring with every store on: {dict(outcomes)} in "
              f"{wall:.0f} s; server memory {before:.0f} -> {after:.0f} MB (+{after - before:.1f} MB, "
              f"{(after - before) / 200 * 1024:.0f} kB per session); sessions held {stats['sessions']}, "
              f"forgotten {stats['forgotten']}")
    assert outcomes["done"] == 200 and all("**model**" in str(a.data[0]) for a in answers), "every call answered"
    assert after - before <= MEMORY_MB
    assert stats["held"][CLIENT] == 32 and stats["sessions"] <= sum(stats["held"].values()) + 2, \
        "the client holds at most max_sessions_per_address sessions, in the page's state too"


def attacker(page, sessions: int, log: list) -> None:
    """One client: `sessions` new session ids, each exploring and asking for a decode, eight at a time."""
    explore = many.default_values(page, "explore", Context=CONTEXT)
    chat = many.default_values(page, "chat", prompt=CONTEXT, **{"Max new tokens": 64})
    todo, lock = iter(range(sessions)), threading.Lock()

    def one() -> None:
        while True:
            with lock:
                if next(todo, None) is None:
                    return
            session = uuid.uuid4().hex[:11]
            for api, data in (("explore", explore), ("chat", chat)):
                answer = page.call(api, data, session, forwarded(CLIENT))
                log.append((api, "refused" if "network address already has" in answer.text() else answer.outcome))
    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def load_round(server, page, attacked: bool) -> dict:
    """Eight visitors for LOAD_S seconds, with or without one client opening 200 sessions meanwhile."""
    from gradio_client import Client

    honest: list = []
    attack: list = []
    until = time.monotonic() + LOAD_S
    threads = [threading.Thread(target=visitor, args=(server.url, Client, k, until, honest)) for k in range(USERS)]
    if attacked:
        threads.append(threading.Thread(target=attacker, args=(page, 200, attack)))
    before, at_start = many.rss_mb(server.pid), server.stats()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after, stats = many.rss_mb(server.pid), server.stats()
    waits = sorted(w for _, kind, _, w in honest if kind != "step")
    return {"honest": honest, "attack": attack, "stats": stats, "growth_mb": after - before,
            "cpu_s": stats["cpu_s"] - at_start["cpu_s"], "wall_s": time.monotonic() - until + LOAD_S,
            "forgotten": stats["forgotten"] - at_start["forgotten"], "median_s": waits[len(waits) // 2],
            "longest_s": waits[-1], "answered": Counter(k for k, _, state, _ in honest if state == "answered")}


def test_eight_visitors_are_served_while_one_client_opens_200_sessions(server, capsys):
    page = many.Page(server.url)
    warm_up(page, many.default_values(page, "explore", Context=CONTEXT))
    alone = load_round(server, page, attacked=False)
    attacked = load_round(server, page, attacked=True)
    with capsys.disabled():
        print(f"\nload: {USERS} visitors x {LOAD_S:.0f} s, alone and then while one client opened 200 sessions "
              f"({dict(Counter(attacked['attack']))})")
        for name, r in (("alone", alone), ("attacked", attacked)):
            print(f"  {name}: answered per visitor {sorted(r['answered'].values())}; their chat/race took median "
                  f"{r['median_s']:.1f} s, longest {r['longest_s']:.1f} s; server memory +{r['growth_mb']:.0f} MB; "
                  f"sessions forgotten {r['forgotten']}; {r['wall_s']:.0f} s in all, the server busy "
                  f"{r['cpu_s']:.0f} CPU s of it")
        print(f"  longest wait for a turn {attacked['stats']['longest_wait_s']:.1f} s; the most places one address "
              f"held {attacked['stats']['most_per_address']}; sessions held {attacked['stats']['sessions']}")
    for r in (alone, attacked):
        assert not [entry for entry in r["honest"] if entry[2].startswith(("error", "wrong"))], r["honest"]
        assert len(r["answered"]) == USERS and min(r["answered"].values()) >= 2, "every visitor served, more than once"
    stats = attacked["stats"]
    assert stats["most_per_address"] <= 2 and len(attacked["attack"]) == 400
    assert stats["held"][CLIENT] <= 32, "the client's sessions past its allowance were forgotten"
    assert attacked["growth_mb"] < LOAD_MB
