"""What the page's live view costs the decode: the Chat tab against the Race tab, in Chromium on this machine.

Starts the app (the default model and stores; a private trace store, everything else from the real cache),
opens it in Debian's Chromium as a visitor on the same machine would, and for each prompt runs a race (plain and
REST in turn, REST timed by its own steps) and the same prompt in the Chat tab (REST with the live view), each as a new
visitor (a page of its own: neither drafts from the other's answer), in turn first; one chat warms the process up
(long enough for a live redraw, so the page has learned what a redraw costs, as after a visitor's first answer).
Both are recorded, so the trace store tells for each: tokens per second, tokens per pass, the forward pass's
milliseconds per step and the step's whole time.  Reports per prompt the Chat tab's REST tokens/s over the
race's, its forward ms per step over the race's for the same tree sizes, and the Chat tab's estimated speedup
against the race's measured one.

    .venv/bin/python tools/live_cost.py
    .venv/bin/python tools/live_cost.py --rounds 2 --max-new-tokens 128 --width 1920
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rest_core.machine import code_version, cpu_info, cpu_line  # noqa: E402

PROMPTS = ("How can I improve my time management skills? Give three tips.",
           "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
           "Give me three tips for learning a new language.")
WARM_UP = "Write a short poem about the sea, in four verses."  # long enough for a live redraw (its cost is learned)
CHROMIUM = "/usr/bin/chromium"
WAIT_MS = 900_000
SERVER = """
import os, sys
sys.path.insert(0, {root!r})
import app
from rest_core import app as sup
from rest_core.app import live, pacing
for name, value in {knobs!r}.items():  # the live view's pacing, for side-by-side runs of other settings
    for module in (live, pacing):
        if hasattr(module, name):
            setattr(module, name, value)
defaults = sup.Settings(mode="chat", max_new_tokens={tokens})
demo = app.build_demo(trace_db={db!r}, defaults=defaults)
app.launch(demo, server_port={port}, quiet=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_cache(real: Path, into: Path) -> Path:
    """A cache folder whose every entry links to the real cache's, but for the trace store and session folders."""
    into.mkdir(parents=True, exist_ok=True)
    for entry in real.iterdir():
        if entry.name not in ("traces.sqlite", "traces.sqlite-wal", "traces.sqlite-shm", "app-sessions"):
            (into / entry.name).symlink_to(entry)
    return into


def start_server(db: Path, port: int, tokens: int, cache: Path, knobs: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "REST_LAB_CACHE": str(cache), "GRADIO_ANALYTICS_ENABLED": "False"}
    code = SERVER.format(root=str(ROOT), db=str(db), port=port, tokens=tokens, knobs=knobs or {})
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def wait_ready(page) -> None:
    """Until the status line says every store this machine has is ready (nothing loading or building)."""
    deadline = time.monotonic() + WAIT_MS / 1e3
    while time.monotonic() < deadline:
        text = page.inner_text(".status")
        if "✓ Model" in text and not re.search(r"being built|building|Loading", text):
            return
        time.sleep(2)
    raise TimeoutError("the page's stores did not become ready")


def new_done_run(db: Path, after: int, timeout_s: float = WAIT_MS / 1e3) -> int:
    """The id of the first run after `after` that is done (its outcome written), waiting for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if db.exists():
            con = sqlite3.connect(db)
            try:
                row = con.execute("select min(id) from runs where id > ? and status = 'done'", (after,)).fetchone()
            finally:
                con.close()
            if row and row[0] is not None:
                return int(row[0])
        time.sleep(1)
    raise TimeoutError("no run finished in time")


def latest_run(db: Path) -> int:
    if not db.exists():
        return 0
    con = sqlite3.connect(db)
    try:
        return int(con.execute("select coalesce(max(id), 0) from runs").fetchone()[0])
    finally:
        con.close()


def fresh_page(browser, port: int, width: int):
    """A new visitor: a page of its own (its own session), once its prompt box is there."""
    page = browser.new_page(viewport={"width": width, "height": 1000})
    page.set_default_timeout(WAIT_MS)
    deadline = time.monotonic() + 300
    while True:
        try:
            page.goto(f"http://127.0.0.1:{port}/")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    page.wait_for_selector("#prompt textarea")
    # as a visitor who reads the page before typing: its panels drawn (the plotting library loaded)
    page.wait_for_selector("#tree-plot .js-plotly-plot .main-svg", state="attached")
    return page


def submit(page, db: Path, tab: str, box: str, button: str, prompt: str) -> int:
    """Type `prompt` into `box` of `tab`, press `button`; the id of the run it recorded, once done."""
    page.get_by_role("tab", name=tab).click()
    if tab == "Chat":
        page.get_by_role("button", name="Clear chat").click()  # a chat turn like the race's: no earlier turns
    page.fill(box, prompt)
    before = latest_run(db)
    page.click(button)
    return new_done_run(db, before)


def race(page, db: Path, prompt: str) -> int:
    run_id = submit(page, db, "Race", "#race-prompt textarea", "#race-btn", prompt)
    page.wait_for_function("() => /×/.test(document.querySelector('#race-verdict').innerText)", timeout=WAIT_MS)
    return run_id


def chat(page, db: Path, prompt: str) -> int:
    run_id = submit(page, db, "Chat", "#prompt textarea", "#prompt button.submit-button", prompt)
    page.wait_for_selector('#metrics [data-state="done"]', timeout=WAIT_MS)
    return run_id


def run_numbers(db: Path, run_id: int) -> dict:
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    run = dict(con.execute("select * from runs where id = ?", (run_id,)).fetchone())
    steps = [dict(r) for r in con.execute("select * from steps where run_id = ? order by step", (run_id,))]
    con.close()
    forward: dict[int, list[float]] = {}
    for s in steps:
        if s["t_forward_ms"]:
            forward.setdefault(int(s["draft_size"]) + 1, []).append(float(s["t_forward_ms"]))
    tokens = sum(len(json.loads(s["new_tokens"])) for s in steps)
    return {"run": run_id, "prompt": run["prompt"], "tokens": tokens, "steps": len(steps),
            "tokens_per_s": tokens / run["wall_s"] if run["wall_s"] else None,
            "step_ms": 1e3 * run["wall_s"] / max(1, len(steps)),
            "per_pass": tokens / max(1, len(steps)), "forward": forward,
            "speedup": run["speedup"], "settings": json.loads(run["settings"] or "{}"),
            "plain_ms_per_token": 1e3 / run["plain_tokens_per_s"] if run.get("plain_tokens_per_s") else None}


def forward_ratio(chat: dict, race: dict) -> float | None:
    """The chat's forward ms over the race's, for the tree sizes both ran (weighted by the chat's steps)."""
    ratios, weights = [], []
    for q, times in chat["forward"].items():
        if q in race["forward"]:
            ratios.append(statistics.median(times) / statistics.median(race["forward"][q]))
            weights.append(len(times))
    return sum(r * w for r, w in zip(ratios, weights)) / sum(weights) if weights else None


def estimate_of(page) -> tuple[float | None, float | None]:
    """The Chat tab's estimated speedup and the plain pace (ms per token) its note says it divided."""
    text = page.inner_text("#metrics")
    found = re.search(r"([0-9.]+)×\s*speedup \(est\.\)", text)
    pace = re.search(r"plain decoding at ([0-9.]+) ms per token", text)
    return (float(found.group(1)) if found else None), (float(pace.group(1)) if pace else None)


def measure(args: argparse.Namespace) -> dict:
    from playwright.sync_api import sync_playwright

    real = Path(os.environ.get("REST_LAB_CACHE") or Path.home() / ".cache" / "rest-lab").expanduser()
    work = Path(tempfile.mkdtemp(prefix="live-cost-"))
    db, port = work / "traces.sqlite", free_port()
    knobs = {name: value for name, value in (("FIGURE_INTERVAL_S", args.figure_interval),
                                              ("TEXT_INTERVAL_S", args.text_interval)) if value is not None}
    server = start_server(db, port, args.max_new_tokens, private_cache(real, work / "cache"), knobs)
    rows = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run"])
            open_page = partial(fresh_page, browser, port, args.width)
            with closing(open_page()) as page:  # the stores ready and the process warm before anything is timed
                wait_ready(page)
                chat(page, db, WARM_UP)
            for rnd in range(args.rounds):
                for i, prompt in enumerate(args.prompts):
                    # each in a page of its own (a new visitor: no past answers, the model's predictions not
                    # learned from the other), in turn first, so neither drafts from the other nor gains from drift
                    ids = {}
                    order = ("race", "chat") if (rnd + i) % 2 == 0 else ("chat", "race")
                    for kind in order:
                        with closing(open_page()) as page:
                            ids[kind] = (race if kind == "race" else chat)(page, db, prompt)
                            if kind == "chat":
                                ids["estimate"], ids["plain_ms"] = estimate_of(page)
                    r, c = run_numbers(db, ids["race"]), run_numbers(db, ids["chat"])
                    rows.append({"round": rnd, "prompt": prompt, "order": order, "race": r, "chat": c,
                                 "estimate": ids["estimate"], "estimate_plain_ms": ids["plain_ms"],
                                 "tokens_per_s_ratio": c["tokens_per_s"] / r["tokens_per_s"],
                                 "step_ratio": c["step_ms"] / r["step_ms"], "forward_ratio": forward_ratio(c, r)})
                    print(_line(rows[-1]), flush=True)
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
    return {"machine": cpu_line(cpu_info()), "code": code_version(), "width": args.width, "knobs": knobs,
            "rows": rows}


def _line(row: dict) -> str:
    r, c = row["race"], row["chat"]
    fwd = f"{row['forward_ratio']:.2f}" if row["forward_ratio"] else "–"
    est = f"{row['estimate']:.2f}×" if row["estimate"] else "–"
    return (f"{row['prompt'][:48]!r}: race REST {r['tokens_per_s']:.1f} tok/s ({r['per_pass']:.2f}/pass, "
            f"{r['speedup']:.2f}× measured) | chat {c['tokens_per_s']:.1f} tok/s ({c['per_pass']:.2f}/pass, "
            f"est. {est}) | chat/race tokens/s {row['tokens_per_s_ratio']:.2f}, time per step "
            f"{row['step_ratio']:.2f}, forward ms {fwd}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", nargs="+", default=list(PROMPTS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--figure-interval", type=float, default=None,
                    help="seconds between the live figures' redraws (default: the page's; 1e9: none while decoding)")
    ap.add_argument("--text-interval", type=float, default=None, help="seconds between the streamed text's updates")
    ap.add_argument("--json", type=Path, default=None, help="write every number here too")
    args = ap.parse_args(argv)
    out = measure(args)
    print(f"Machine: {out['machine']}; code {out['code']}; Chromium {args.width} px wide on the same machine")
    ratios = [r["tokens_per_s_ratio"] for r in out["rows"]]
    fwd = [r["forward_ratio"] for r in out["rows"] if r["forward_ratio"]]
    per_step = [r["step_ratio"] for r in out["rows"]]
    print(f"time per step, chat / race: median {statistics.median(per_step):.2f} "
          f"({min(per_step):.2f}-{max(per_step):.2f})")
    off = [r["estimate"] - r["race"]["speedup"] for r in out["rows"] if r["estimate"] and r["race"]["speedup"]]
    print(f"chat / race REST tokens/s: median {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); "
          f"forward ms per step, chat / race: median {statistics.median(fwd):.2f}" if fwd else "")
    if off:
        print(f"chat estimate - race's measured speedup: median {statistics.median(off):+.2f}x "
              f"({min(off):+.2f} to {max(off):+.2f})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
