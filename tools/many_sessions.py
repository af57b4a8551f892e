"""One client as many visitors: open many sessions of a REST Lab page and call one endpoint from each.

A Gradio page names a session by an id the client chooses (`session_hash`), so one script can be any
number of visitors.  This opens `--sessions` new session ids, each calling `--api` once through the
page's own queue (raw requests to /gradio_api/queue/join and /gradio_api/queue/data, as a browser
sends them), optionally all at once, from one client address (`--forwarded-for`: the address a proxy
in front of the server would name), and reports what each call got and, given the server's process
id, how the server's memory (RSS) grew.

    .venv/bin/python tools/many_sessions.py http://127.0.0.1:7860/ --sessions 200 --api explore \
        --server-pid 12345
    .venv/bin/python tools/many_sessions.py http://127.0.0.1:7860/ --sessions 30 --api chat --at-once

The tests (tests/test_public_server.py, tests/test_public_sessions.py) drive a loopback server in public
mode with these functions.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mb(pid: int) -> float:
    """A process's resident memory in MB (0 when it cannot be read)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass
class Answer:
    """What one call got: "done" (the handler's outputs), "error" (the handler or the queue refused, with its
    message) or "refused" (the HTTP status and text of a join the server turned away)."""

    outcome: str
    data: list = field(default_factory=list)
    message: str = ""
    status: int = 200
    wait_s: float = 0.0  # from the join until the handler started
    total_s: float = 0.0
    toasts: list = field(default_factory=list)  # the warnings and notes the page showed on the way

    def text(self) -> str:
        return self.message or json.dumps(self.data, default=str)


class Page:
    """A page's API as a browser calls it: the endpoints' numbers and inputs, read from its /config."""

    def __init__(self, url: str, timeout_s: float = 300.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        config = httpx.get(f"{self.url}/config", timeout=60).json()
        self.fns = {d["api_name"]: d for d in config["dependencies"] if d.get("api_name")}
        self.components = {c["id"]: c for c in config["components"]}

    def inputs(self, api_name: str) -> list[dict]:
        """The input components of an endpoint, in order (type and props)."""
        return [self.components[i] for i in self.fns[api_name]["inputs"]]

    def call(self, api_name: str, data: list, session: Optional[str] = None,
             headers: Optional[dict] = None) -> Answer:
        """Call `api_name` once as session `session` (a new id when None); the State input is sent as None, as
        the browser sends it."""
        session = session or uuid.uuid4().hex[:11]
        fn = self.fns[api_name]
        body = {"data": data, "event_data": None, "fn_index": fn["id"], "trigger_id": None,
                "session_hash": session}
        t0 = time.monotonic()
        with httpx.Client(timeout=self.timeout_s, headers=headers or {}) as http:
            joined = http.post(f"{self.url}/gradio_api/queue/join", json=body)
            if joined.status_code != 200:
                return Answer("refused", message=_detail(joined), status=joined.status_code,
                              total_s=time.monotonic() - t0)
            return self._listen(http, session, t0)

    def _listen(self, http: httpx.Client, session: str, t0: float) -> Answer:
        started, toasts = None, []
        with http.stream("GET", f"{self.url}/gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data:"):
                    continue
                msg = json.loads(line[5:])
                kind = msg.get("msg")
                if kind == "log":
                    toasts.append(str(msg.get("log")))
                if kind == "process_starts" and started is None:
                    started = time.monotonic()
                if kind == "process_completed":
                    wait = (started or time.monotonic()) - t0
                    output = msg.get("output") or {}
                    if msg.get("success"):
                        return Answer("done", data=output.get("data") or [], wait_s=wait,
                                      total_s=time.monotonic() - t0, toasts=toasts)
                    return Answer("error", message=str(output.get("error") or output), wait_s=wait,
                                  total_s=time.monotonic() - t0, toasts=toasts)
                if kind in ("close_stream", "unexpected_error"):
                    return Answer("error", message=str(msg.get("message") or kind), total_s=time.monotonic() - t0)
        return Answer("error", message="the stream ended without an answer", total_s=time.monotonic() - t0)


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail") or response.text)
    except ValueError:
        return response.text


def default_values(page: Page, api_name: str, **changes: Any) -> list:
    """The endpoint's inputs at the page's own defaults (components by label or elem_id may be changed)."""
    values = []
    for component in page.inputs(api_name):
        props = component.get("props", {})
        keys = {props.get("label"), props.get("elem_id")}
        hit = next((changes[k] for k in keys if k in changes), None)
        values.append(hit if hit is not None else (None if component["type"] == "state" else props.get("value")))
    return values


def forwarded(address: str) -> dict:
    """The header a proxy in front of the server adds for a client at `address`."""
    return {"X-Forwarded-For": address}


def many_sessions(page: Page, api_name: str, data: list, sessions: int, headers: Optional[dict] = None,
                  at_once: bool = False, threads: int = 8) -> list[Answer]:
    """Call `api_name` from `sessions` new session ids (all at once, or `threads` at a time)."""
    answers: list[Optional[Answer]] = [None] * sessions
    ids = [uuid.uuid4().hex[:11] for _ in range(sessions)]
    lock = threading.Lock()
    todo = iter(range(sessions))

    def worker() -> None:
        while True:
            with lock:
                k = next(todo, None)
            if k is None:
                return
            try:
                answers[k] = page.call(api_name, data, ids[k], headers)
            except httpx.HTTPError as err:
                answers[k] = Answer("error", message=f"{type(err).__name__}: {err}")

    pool = [threading.Thread(target=worker) for _ in range(sessions if at_once else min(threads, sessions))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return [a for a in answers if a is not None]


def summary(answers: list[Answer]) -> dict:
    """Outcomes counted, and the messages of the calls that did not get an answer."""
    return {"outcomes": dict(Counter(a.outcome for a in answers)),
            "messages": dict(Counter(a.message[:120] for a in answers if a.outcome != "done"))}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--api", default="explore", help="endpoint to call from each session (default explore)")
    parser.add_argument("--forwarded-for", default="", help="send X-Forwarded-For with this address")
    parser.add_argument("--at-once", action="store_true", help="every session at the same moment")
    parser.add_argument("--server-pid", type=int, default=0, help="report the server's memory growth")
    args = parser.parse_args(argv)
    page = Page(args.url)
    data = default_values(page, args.api)
    headers = forwarded(args.forwarded_for) if args.forwarded_for else None
    before = rss_mb(args.server_pid) if args.server_pid else 0.0
    t0 = time.monotonic()
    answers = many_sessions(page, args.api, data, args.sessions, headers, at_once=args.at_once)
    report = {"sessions": args.sessions, "api": args.api, "wall_s": round(time.monotonic() - t0, 1),
              **summary(answers)}
    if args.server_pid:
        after = rss_mb(args.server_pid)
        report.update(server_rss_mb=[round(before, 1), round(after, 1)], growth_mb=round(after - before, 1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
