"""Trace store: every step of every REST run, in one SQLite file.

A `TraceRecorder` writes a run row when decoding starts, one transaction per
step from the decoder's hook (the step row, its draft-tree nodes and the
retrieved branches), and the outcome when decoding ends.  The readers give
back plain dicts (shapes: `rest_core.traces.rows`), which the figures draw and
`load_trace` turns back into a `StepTrace`, so any step can be replayed with no
model loaded.

Several processes and threads may write at once: WAL journal, a busy timeout,
one connection per thread (and per process after a fork), and `BEGIN
IMMEDIATE` so a writer waits for the lock instead of failing half-way.  A run
whose process died while it was 'running' is marked 'interrupted' the next
time the file is opened on the same host.

The tree mask is stored as its q x q tree block (`rest_core.traces.masks`).
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import sqlite_utils
import torch

from datastores.common import cache_dir
from rest_core.phases import PHASES
from rest_core.trace import StepTrace
from rest_core.traces.liveness import process_alive, process_start
from rest_core.traces.masks import decode_block, full_mask
from rest_core.traces.rows import (
    ADDED_NODE_COLUMNS,
    ADDED_STEP_COLUMNS,
    BRANCH_COLUMNS,
    NODE_COLUMNS,
    STEP_COLUMNS,
    RunRow,
    StepDetail,
    StepRow,
    TokenTexts,
    decode_json,
    ids_json,
    step_trace,
    trace_rows,
)

# TokenTexts lives in rows; re-exported for existing callers
__all__ = ["COMPARISON_FIELDS", "FINAL_STATUSES", "SCHEMA", "TokenTexts", "TraceRecorder", "default_db_path"]

FINAL_STATUSES = ("done", "failed", "stopped", "partial")  # partial: decoded to the end, steps not all recorded
COMPARISON_FIELDS = ("plain_wall_s", "plain_tokens_per_s", "speedup", "identical")

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY,
    started_at TEXT NOT NULL,
    finished_at TEXT,
    model TEXT,
    tokenizer TEXT,
    stores TEXT,            -- JSON
    settings TEXT,          -- JSON: every decoding setting
    prompt TEXT,
    output TEXT,
    prompt_tokens INTEGER,
    prompt_ids TEXT,        -- JSON token ids of the prompt, when the caller gave them
    new_tokens INTEGER,
    steps INTEGER,
    wall_s REAL,
    mean_accepted REAL,
    status TEXT NOT NULL,   -- running | done | failed | stopped | interrupted
    error TEXT,
    pid INTEGER,
    host TEXT,
    proc_start TEXT,        -- start time of the writing process (tells a reused pid apart)
    plain_wall_s REAL,
    plain_tokens_per_s REAL,
    speedup REAL,
    identical INTEGER
);
CREATE TABLE IF NOT EXISTS steps (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    step INTEGER NOT NULL,
    prefix_len INTEGER NOT NULL,
    query TEXT,             -- JSON token ids
    matched_len TEXT,       -- JSON {source: suffix length}
    draft_size INTEGER,
    accepted_len INTEGER,   -- draft tokens accepted (bonus not counted)
    bonus_token INTEGER,
    bonus_text TEXT,
    new_tokens TEXT,        -- JSON token ids committed by the step
    new_texts TEXT,         -- JSON per-token texts of new_tokens
    accepted_sources TEXT,  -- JSON source of each accepted draft token
    position_ids TEXT,      -- JSON
    tree_mask TEXT NOT NULL, -- JSON list of q strings of 0/1: the q x q tree block
    mask_dtype TEXT NOT NULL,
""" + "".join(f"    t_{p}_ms REAL,\n" for p in PHASES) + """    budget_choice TEXT,     -- JSON: why
    neighbours TEXT,        -- JSON: per dense source, the neighbours drafted from and the text around them
    PRIMARY KEY (run_id, step)
);
CREATE TABLE IF NOT EXISTS draft_nodes (
    run_id INTEGER NOT NULL,
    step INTEGER NOT NULL,
    node INTEGER NOT NULL,
    parent INTEGER,
    depth INTEGER,
    token_id INTEGER,
    token_text TEXT,
    score REAL,
    source TEXT,            -- any source name
    model_choice INTEGER,
    model_choice_text TEXT,
    chosen INTEGER,         -- the model's choice at the parent is this token (NULL at the root)
    accepted INTEGER,       -- on the accepted path
    PRIMARY KEY (run_id, step, node),
    FOREIGN KEY (run_id, step) REFERENCES steps(run_id, step)
);
CREATE TABLE IF NOT EXISTS branches (
    run_id INTEGER NOT NULL,
    step INTEGER NOT NULL,
    branch INTEGER NOT NULL,
    source TEXT,
    tokens TEXT,            -- JSON token ids
    text TEXT,
    count INTEGER,
    PRIMARY KEY (run_id, step, branch),
    FOREIGN KEY (run_id, step) REFERENCES steps(run_id, step)
);
CREATE INDEX IF NOT EXISTS runs_by_status ON runs(status);
CREATE INDEX IF NOT EXISTS runs_by_owner ON runs(json_extract(settings, '$.app_session'));
CREATE INDEX IF NOT EXISTS runs_by_address ON runs(json_extract(settings, '$.app_address'));
"""
OWNER = "json_extract(settings, '$.app_session')"  # the app visitor who recorded a run (NULL: outside the app)
ADDRESS = "json_extract(settings, '$.app_address')"  # a tag of that visitor's client address (NULL: none)

_STEP_LIST_COLUMNS = ", ".join(c for c in STEP_COLUMNS if c != "tree_mask")  # what load_steps reads


def _insert_sql(table: str, columns: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def _add_missing_columns(conn: sqlite3.Connection, table: str, columns: dict[str, str]) -> None:
    """Columns added to a table after its first schema, for a store written before them (their values NULL)."""
    have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
    for name, kind in columns.items():
        if name not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def default_db_path() -> Path:
    """traces.sqlite in the project cache (REST_LAB_CACHE, or ~/.cache/rest-lab)."""
    return cache_dir() / "traces.sqlite"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class TraceRecorder:
    """Runs and their steps in one SQLite file (default: traces.sqlite in the project cache)."""

    def __init__(self, path: str | Path | None = None, *, busy_timeout_s: float = 30.0,
                 max_bytes: Optional[int] = None):
        """max_bytes: the file never grows past this (a write that would fails with "database or disk is
        full", as on a full disk; `prune` makes room)."""
        self.path = Path(path) if path is not None else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.busy_timeout_s = busy_timeout_s
        self.max_bytes = max_bytes
        self.host = socket.gethostname()
        self._local = threading.local()
        self._opened: list[tuple[int, sqlite3.Connection]] = []  # (opening pid, connection)
        self._opened_lock = threading.Lock()
        with self._transaction() as conn:
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            _add_missing_columns(conn, "draft_nodes", ADDED_NODE_COLUMNS)
            _add_missing_columns(conn, "steps", ADDED_STEP_COLUMNS)
        self.mark_interrupted()

    # -- connections: one per thread, reopened after a fork
    def _conn(self) -> sqlite3.Connection:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # WAL: a process crash loses no committed step
            conn.execute("PRAGMA foreign_keys=ON")
            if self.max_bytes:
                page = conn.execute("PRAGMA page_size").fetchone()[0]
                conn.execute(f"PRAGMA max_page_count = {max(16, int(self.max_bytes) // page)}")
            local.conn, local.pid = conn, os.getpid()
            local.db = sqlite_utils.Database(conn, execute_plugins=False)
            with self._opened_lock:
                self._opened.append((os.getpid(), conn))
        return local.conn

    @property
    def db(self) -> sqlite_utils.Database:
        """This thread's sqlite-utils handle on the store (for ad-hoc queries)."""
        self._conn()
        return self._local.db

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed at the end, rolled back on any error (a failed COMMIT too)."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")  # take the write lock now (waits up to busy_timeout_s)
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # a failed COMMIT (e.g. a deferred constraint) leaves it open
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        """Close this process's connections (a forked child leaves its parent's alone)."""
        with self._opened_lock:
            for pid, conn in self._opened:
                if pid == os.getpid():
                    conn.close()
            self._opened.clear()
        self._local = threading.local()

    # -- writing
    def start_run(self, *, model: str, tokenizer_name: str, stores: Any, settings: dict,
                  prompt: str, prompt_tokens: int | Sequence[int]) -> int:
        """A new run, status 'running'. prompt_tokens: the prompt's token count, or its ids."""
        pid = os.getpid()
        ids = None if isinstance(prompt_tokens, int) else ids_json(prompt_tokens)
        count = prompt_tokens if ids is None else len(prompt_tokens)
        row = dict(started_at=_now(), model=model, tokenizer=tokenizer_name,
                   stores=json.dumps(stores, default=str), settings=json.dumps(settings, default=str, sort_keys=True),
                   prompt=prompt, prompt_tokens=count, prompt_ids=ids, new_tokens=0, steps=0, status="running",
                   pid=pid, host=self.host, proc_start=process_start(pid))
        with self._transaction() as conn:
            cur = conn.execute(_insert_sql("runs", list(row)), tuple(row.values()))
            return int(cur.lastrowid)

    def step_hook(self, run_id: int, tokenizer: Any = None) -> Callable[[StepTrace], None]:
        """A hook for the decoder: records each StepTrace in its own transaction."""
        texts = TokenTexts(tokenizer)
        insert_step = _insert_sql("steps", STEP_COLUMNS)
        insert_node = _insert_sql("draft_nodes", NODE_COLUMNS)
        insert_branch = _insert_sql("branches", BRANCH_COLUMNS)
        committed = [0]

        def record_step(trace: StepTrace) -> None:
            step_row, node_rows, branch_rows = trace_rows(run_id, trace, texts)
            with self._transaction() as conn:
                conn.execute(insert_step, step_row)
                conn.executemany(insert_node, node_rows)
                conn.executemany(insert_branch, branch_rows)
                conn.execute("UPDATE runs SET steps = ?, new_tokens = ? WHERE id = ?",
                             (trace.step + 1, committed[0] + len(trace.new_tokens), run_id))
            committed[0] += len(trace.new_tokens)

        return record_step

    def finish_run(self, run_id: int, *, output: Optional[str] = None, new_tokens: Optional[int] = None,
                   steps: Optional[int] = None, wall_s: Optional[float] = None,
                   mean_accepted: Optional[float] = None, status: str = "done", error: Optional[str] = None,
                   comparison: Optional[dict] = None) -> None:
        """End a run. A count left None keeps what the step hook wrote (steps, new_tokens)."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"status must be one of {FINAL_STATUSES}, not {status!r}")
        extra = dict(comparison or {})
        unknown = set(extra) - set(COMPARISON_FIELDS)
        if unknown:
            raise ValueError(f"unknown comparison fields {sorted(unknown)}; known: {COMPARISON_FIELDS}")
        if extra.get("identical") is not None:
            extra["identical"] = int(bool(extra["identical"]))
        row = dict(finished_at=_now(), status=status, error=error, **extra, **{k: v for k, v in dict(
            output=output, new_tokens=new_tokens, steps=steps, wall_s=wall_s, mean_accepted=mean_accepted).items()
            if v is not None})
        with self._transaction() as conn:
            cur = conn.execute(f"UPDATE runs SET {', '.join(f'{k} = ?' for k in row)} WHERE id = ?",
                               (*row.values(), run_id))
        if cur.rowcount == 0:
            raise KeyError(f"no run {run_id}")

    def mark_interrupted(self) -> list[int]:
        """Mark 'interrupted' the runs of this host still 'running' whose process is gone."""
        rows = self.db.query("SELECT id, pid, proc_start FROM runs WHERE status = 'running' AND host = ?",
                             [self.host])
        dead = [r["id"] for r in rows if not process_alive(r["pid"], r["proc_start"])]
        if dead:
            with self._transaction() as conn:
                conn.executemany(
                    "UPDATE runs SET status = 'interrupted', error = ? WHERE id = ? AND status = 'running'",
                    [(f"writer process ended before the run finished (seen {_now()})", i) for i in dead])
        return dead

    # -- keeping the store bounded
    def delete_runs(self, run_ids: Sequence[int]) -> None:
        """Remove runs with every row of theirs (one transaction per 500 runs)."""
        ids = [int(i) for i in run_ids]
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            marks = ", ".join("?" * len(chunk))
            with self._transaction() as conn:
                for table in ("branches", "draft_nodes", "steps"):
                    conn.execute(f"DELETE FROM {table} WHERE run_id IN ({marks})", chunk)
                conn.execute(f"DELETE FROM runs WHERE id IN ({marks})", chunk)

    def used_bytes(self) -> int:
        """Bytes of the file in use (pages not on the free list)."""
        conn = self._conn()
        pages, free, size = (conn.execute(f"PRAGMA {p}").fetchone()[0]
                             for p in ("page_count", "freelist_count", "page_size"))
        return (pages - free) * size

    def prune(self, *, keep: int, owner: Optional[str] = None, keep_per_owner: Optional[int] = None,
              max_bytes: Optional[int] = None, address: Optional[str] = None,
              keep_per_address: Optional[int] = None) -> list[int]:
        """Make room for one more run: remove the oldest finished runs beyond `keep_per_owner` of `owner`'s, beyond
        `keep_per_address` of those recorded from `address` (a tag), beyond `keep` in all, and, while more than 3/4
        of `max_bytes` is in use, more of the oldest.  Runs still running are never removed.  Returns the removed
        ids."""
        removed: list[int] = []
        finished = "status != 'running'"
        for column, value, kept in ((OWNER, owner, keep_per_owner), (ADDRESS, address, keep_per_address)):
            if value is not None and kept is not None:
                ids = [r[0] for r in self.db.execute(
                    f"SELECT id FROM runs WHERE {column} = ? AND {finished} ORDER BY id DESC LIMIT -1 OFFSET ?",
                    [value, max(0, kept - 1)]).fetchall()]
                removed += [i for i in ids if i not in removed]
        ids = [r[0] for r in self.db.execute(
            f"SELECT id FROM runs WHERE {finished} ORDER BY id DESC LIMIT -1 OFFSET ?", [max(0, keep - 1)])]
        removed += [i for i in ids if i not in removed]
        self.delete_runs(removed)
        while max_bytes and self.used_bytes() > 0.75 * max_bytes:
            ids = [r[0] for r in self.db.execute(f"SELECT id FROM runs WHERE {finished} ORDER BY id LIMIT 20")]
            if not ids:
                break
            self.delete_runs(ids)
            removed += ids
        return removed

    # -- reading
    def list_runs(self, *, status: Optional[str] = None, limit: Optional[int] = None,
                  owner: Optional[str] = None) -> list[RunRow]:
        """Runs, newest first.  owner: only the runs of that app visitor (settings' app_session) and the
        runs recorded outside the app, without their output and prompt ids (a listing's columns)."""
        where, params = [], []
        if status:
            where.append("status = ?")
            params.append(status)
        columns = "*"
        if owner is not None:
            where.append(f"({OWNER} = ? OR {OWNER} IS NULL)")
            params.append(owner)
            columns = ", ".join(c for c in self.db["runs"].columns_dict if c not in ("output", "prompt_ids"))
        sql = f"SELECT {columns} FROM runs" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return [decode_json(r) for r in self.db.query(sql, params)]

    def get_run(self, run_id: int) -> RunRow:
        rows = list(self.db.query("SELECT * FROM runs WHERE id = ?", [run_id]))
        if not rows:
            raise KeyError(f"no run {run_id}")
        return decode_json(rows[0])

    def load_steps(self, run_id: int, since_step: int = 0) -> list[StepRow]:
        """The step rows of a run with step >= since_step, in order, JSON decoded (tree mask, nodes and
        branches left out: see load_step).  A live view passes the number of steps it already has."""
        sql = f"SELECT {_STEP_LIST_COLUMNS} FROM steps WHERE run_id = ? AND step >= ? ORDER BY step"
        return [decode_json(r) for r in self.db.query(sql, [run_id, since_step])]

    def step_count(self, run_id: int) -> int:
        """How many steps of the run are recorded (0 for an unknown run)."""
        return self.db.execute("SELECT count(*) FROM steps WHERE run_id = ?", [run_id]).fetchone()[0]

    def load_step(self, run_id: int, step: int, *, mask: Optional[str] = None) -> StepDetail:
        """One step with its nodes, branches and `mask_block` (q x q bool, True = may attend).

        mask="torch" adds `mask`: the 4D tensor (1, 1, q, prefix_len + q) in the recorded
        dtype, equal to the one the model received; mask="numpy" adds it as a
        (q, prefix_len + q) float array (bfloat16 widened to float32).
        """
        if mask not in (None, "torch", "numpy"):
            raise ValueError("mask must be None, 'torch' or 'numpy'")
        rows = list(self.db.query("SELECT * FROM steps WHERE run_id = ? AND step = ?", [run_id, step]))
        if not rows:
            raise KeyError(f"no step {step} in run {run_id}")
        out = decode_json(rows[0])
        out["mask_block"] = decode_block(out.pop("tree_mask"))
        out["nodes"] = [decode_json(r) for r in self.db.query(
            "SELECT * FROM draft_nodes WHERE run_id = ? AND step = ? ORDER BY node", [run_id, step])]
        out["branches"] = [decode_json(r) for r in self.db.query(
            "SELECT * FROM branches WHERE run_id = ? AND step = ? ORDER BY branch", [run_id, step])]
        if mask is not None:
            full = full_mask(out["mask_block"], out["prefix_len"], out["mask_dtype"])
            if mask == "torch":
                out["mask"] = full
            else:
                out["mask"] = (full[0, 0].float() if full.dtype == torch.bfloat16 else full[0, 0]).numpy()
        return out

    def load_trace(self, run_id: int, step: int) -> StepTrace:
        """The recorded step as a StepTrace again (no model needed)."""
        return step_trace(self.load_step(run_id, step, mask="torch"))
