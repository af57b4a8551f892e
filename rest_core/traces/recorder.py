"""Trace store: every step of every REST run, in one SQLite file.

A `TraceRecorder` writes a run row when decoding starts, one transaction per
step from the decoder's hook (the step row, its draft-tree nodes and the
retrieved branches), and the outcome when decoding ends.  The readers give
back plain dicts, which the figures draw and `load_trace` turns back into a
`StepTrace`, so any step can be replayed with no model loaded.

Several processes and threads may write at once: WAL journal, a busy timeout,
one connection per thread (and per process after a fork), and `BEGIN
IMMEDIATE` so a writer waits for the lock instead of failing half-way.  A run
whose process died while it was 'running' is marked 'interrupted' the next
time the file is opened on the same host.

The tree mask is stored as its q x q tree block ("1" = may attend); the
recorder refuses a mask whose prefix columns are not all visible or whose
values are not exactly 0 / finfo(dtype).min, so block + prefix_len + dtype
rebuild the exact tensor the model received.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import sqlite_utils
import torch

from rest_core.trace import PHASES, Branch, StepTrace

FINAL_STATUSES = ("done", "failed", "stopped")
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
    t_retrieve_ms REAL,
    t_tree_ms REAL,
    t_forward_ms REAL,
    t_verify_ms REAL,
    t_commit_ms REAL,
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
    source TEXT,
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
"""

STEP_COLUMNS = (
    "run_id", "step", "prefix_len", "query", "matched_len", "draft_size", "accepted_len",
    "bonus_token", "bonus_text", "new_tokens", "new_texts", "accepted_sources",
    "position_ids", "tree_mask", "mask_dtype",
) + tuple(f"t_{p}_ms" for p in PHASES)
NODE_COLUMNS = (
    "run_id", "step", "node", "parent", "depth", "token_id", "token_text", "score", "source",
    "model_choice", "model_choice_text", "chosen", "accepted",
)
BRANCH_COLUMNS = ("run_id", "step", "branch", "source", "tokens", "text", "count")
_JSON_COLUMNS = {"stores", "settings", "prompt_ids", "query", "matched_len", "new_tokens", "new_texts",
                 "accepted_sources", "position_ids", "tokens"}


def _insert_sql(table: str, columns: tuple[str, ...]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


def default_db_path() -> Path:
    """traces.sqlite in the project cache (REST_LAB_CACHE, or ~/.cache/rest-lab)."""
    from rest_core.model import cache_root

    return cache_root() / "traces.sqlite"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


# ---------------------------------------------------------------- processes

def _proc_stat(pid: int) -> Optional[tuple[str, str]]:
    """(state, start time in clock ticks) from /proc, or None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
    return fields[0], fields[19]


def _process_start(pid: int) -> Optional[str]:
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def process_alive(pid: Optional[int], proc_start: Optional[str]) -> bool:
    """Is the process that wrote a run still the same living process?"""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, start = stat
    return state not in ("Z", "X") and (proc_start is None or start == proc_start)


# ---------------------------------------------------------------- tree mask

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def mask_tree_block(mask: torch.Tensor, prefix_len: int, q: int) -> np.ndarray:
    """The (q, q) bool block of `mask` (True = may attend), after checking that the
    prefix columns are all 0 and every value is 0 or finfo(dtype).min.

    Works on the bit patterns through numpy: exact for every float dtype, and far
    cheaper than torch reductions when the CPU is busy with the model.
    """
    expected = (1, 1, q, prefix_len + q)
    if tuple(mask.shape) != expected:
        raise ValueError(f"tree mask has shape {tuple(mask.shape)}, expected {expected}")
    int_dtype = _INT_OF_WIDTH[mask.element_size()]
    bits = mask[0, 0].detach().cpu().view(int_dtype).numpy()  # (q, prefix_len + q)
    magnitude = np.iinfo(bits.dtype).max  # every bit but the sign: 0.0 and -0.0 both allow
    if prefix_len and np.any(bits[:, :prefix_len] & magnitude):
        raise ValueError("tree mask blocks some prefix column: every node must see the whole prefix")
    block = bits[:, prefix_len:]
    allowed = (block & magnitude) == 0
    blocked = torch.tensor(torch.finfo(mask.dtype).min, dtype=mask.dtype).view(int_dtype).item()
    if not np.all(allowed | (block == blocked)):
        raise ValueError("tree mask holds values other than 0 and finfo(dtype).min")
    return allowed


def encode_block(block: np.ndarray) -> str:
    rows = np.where(block, ord("1"), ord("0")).astype(np.uint8)
    return json.dumps([row.tobytes().decode("ascii") for row in rows])


def decode_block(text: str) -> np.ndarray:
    rows = json.loads(text)
    if not rows:
        return np.zeros((0, 0), dtype=bool)
    return np.frombuffer("".join(rows).encode("ascii"), dtype=np.uint8).reshape(len(rows), -1) == ord("1")


def full_mask(block: np.ndarray, prefix_len: int, dtype: torch.dtype | str = torch.float32) -> torch.Tensor:
    """The 4D mask (1, 1, q, prefix_len + q) the model received, rebuilt from its tree block."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    q = block.shape[0]
    out = torch.zeros(1, 1, q, prefix_len + q, dtype=dtype)  # prefix columns: all visible
    tree = torch.from_numpy(np.ascontiguousarray(block, dtype=bool))
    out[0, 0, :, prefix_len:] = torch.where(tree, 0.0, torch.finfo(dtype).min).to(dtype)
    return out


# ---------------------------------------------------------------- trace -> rows

class TokenTexts(dict):
    """Token id -> display text, cached: texts[id] is tokenizer.decode([id]) (its
    convert_ids_to_tokens form when that decodes to nothing; '<id>' without a tokenizer)."""

    def __init__(self, tokenizer: Any = None):
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        if self.tokenizer is None:
            text = f"<{token_id}>"
        else:
            text = self.tokenizer.decode([token_id])
            if not text and hasattr(self.tokenizer, "convert_ids_to_tokens"):
                text = str(self.tokenizer.convert_ids_to_tokens(token_id))
        self[token_id] = text
        return text

    def join(self, ids) -> str:
        return "".join(map(self.__getitem__, ids))


def _ids_json(ids) -> str:
    return "[" + ",".join(map(str, map(int, ids))) + "]"


MAX_BRANCHES_PER_SOURCE = 32  # continuations stored per source and step (the most frequent ones)


def trace_rows(run_id: int, t: StepTrace, texts: TokenTexts) -> tuple[tuple, list[tuple], list[tuple]]:
    """One step as (steps row, draft_nodes rows, branches rows), columns in *_COLUMNS order."""
    q = len(t.tree_tokens)
    if not (len(t.tree_parents) == len(t.tree_depths) == len(t.tree_scores) == len(t.tree_sources)
            == len(t.model_choices) == len(t.position_ids) == q):
        raise ValueError(f"step {t.step}: per-node lists differ in length from tree_tokens ({q})")
    block = mask_tree_block(t.mask, t.prefix_len, q)
    tokens = [int(x) for x in t.tree_tokens]
    choices = [int(x) for x in t.model_choices]
    new_tokens = [int(x) for x in t.new_tokens]
    on_path = set(t.accepted_nodes)
    timings = t.timings_ms or {}
    step_row = (
        run_id, t.step, t.prefix_len, _ids_json(t.query),
        json.dumps({k: int(v) for k, v in t.matched_len.items()}), q - 1, len(t.accepted_nodes) - 1,
        int(t.bonus_token), texts[int(t.bonus_token)], _ids_json(new_tokens),
        json.dumps([texts[x] for x in new_tokens]),
        json.dumps([t.tree_sources[n] for n in t.accepted_nodes[1:]]),
        _ids_json(t.position_ids), encode_block(block), str(t.mask.dtype).removeprefix("torch."),
    ) + tuple(timings.get(p) for p in PHASES)
    node_rows = []
    for i in range(q):
        parent = int(t.tree_parents[i])
        node_rows.append((
            run_id, t.step, i, parent, int(t.tree_depths[i]), tokens[i], texts[tokens[i]],
            float(t.tree_scores[i]), t.tree_sources[i], choices[i], texts[choices[i]],
            None if parent < 0 else int(choices[parent] == tokens[i]), int(i in on_path),
        ))
    kept = _top_branches(t.branches, MAX_BRANCHES_PER_SOURCE)
    branch_rows = [(run_id, t.step, k, b.source, _ids_json(b.tokens), texts.join(b.tokens), int(b.count))
                   for k, b in enumerate(kept)]
    return step_row, node_rows, branch_rows


def _top_branches(branches, limit: int) -> list:
    """The `limit` most frequent continuations of each source, in the trace's order (a short match in a
    big store can return thousands of distinct ones; storing them all would cost more than the step)."""
    ranked: dict[str, list[int]] = {}
    for i, b in enumerate(branches):
        ranked.setdefault(b.source, []).append(i)
    keep = set()
    for idx in ranked.values():
        keep.update(sorted(idx, key=lambda i: (-branches[i].count, branches[i].tokens))[:limit])
    return [b for i, b in enumerate(branches) if i in keep]


def _decode_json(row: dict) -> dict:
    for key in _JSON_COLUMNS.intersection(row):
        if isinstance(row[key], str):
            row[key] = json.loads(row[key])
    return row


# ---------------------------------------------------------------- the store

class TraceRecorder:
    """Runs and their steps in one SQLite file (default: traces.sqlite in the project cache)."""

    def __init__(self, path: str | Path | None = None, *, busy_timeout_s: float = 30.0):
        self.path = Path(path) if path is not None else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.busy_timeout_s = busy_timeout_s
        self.host = socket.gethostname()
        self._local = threading.local()
        self._opened: list[tuple[int, sqlite3.Connection]] = []  # (opening pid, connection)
        self._opened_lock = threading.Lock()
        with self._transaction() as conn:
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
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
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")  # take the write lock now (waits up to busy_timeout_s)
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

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
        ids = None if isinstance(prompt_tokens, int) else _ids_json(prompt_tokens)
        count = prompt_tokens if ids is None else len(prompt_tokens)
        row = dict(started_at=_now(), model=model, tokenizer=tokenizer_name,
                   stores=json.dumps(stores, default=str), settings=json.dumps(settings, default=str, sort_keys=True),
                   prompt=prompt, prompt_tokens=count, prompt_ids=ids, new_tokens=0, steps=0, status="running",
                   pid=pid, host=self.host, proc_start=_process_start(pid))
        with self._transaction() as conn:
            cur = conn.execute(f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                               tuple(row.values()))
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

    # -- reading
    def list_runs(self, *, status: Optional[str] = None, limit: Optional[int] = None) -> list[dict]:
        """Runs, newest first."""
        sql = "SELECT * FROM runs" + (" WHERE status = ?" if status else "") + " ORDER BY id DESC"
        params = [status] if status else []
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return [_decode_json(r) for r in self.db.query(sql, params)]

    def get_run(self, run_id: int) -> dict:
        rows = list(self.db.query("SELECT * FROM runs WHERE id = ?", [run_id]))
        if not rows:
            raise KeyError(f"no run {run_id}")
        return _decode_json(rows[0])

    def load_steps(self, run_id: int) -> list[dict]:
        """Every step row of a run, in order, JSON decoded (tree_mask left out: see load_step)."""
        columns = ", ".join(c for c in STEP_COLUMNS if c != "tree_mask")
        return [_decode_json(r) for r in
                self.db.query(f"SELECT {columns} FROM steps WHERE run_id = ? ORDER BY step", [run_id])]

    def load_step(self, run_id: int, step: int, *, mask: Optional[str] = None) -> dict:
        """One step with its nodes, branches and `mask_block` (q x q bool, True = may attend).

        mask="torch" adds `mask`: the 4D tensor (1, 1, q, prefix_len + q) in the recorded
        dtype, equal to the one the model received; mask="numpy" adds it as a
        (q, prefix_len + q) float array (bfloat16 widened to float32).
        """
        rows = list(self.db.query("SELECT * FROM steps WHERE run_id = ? AND step = ?", [run_id, step]))
        if not rows:
            raise KeyError(f"no step {step} in run {run_id}")
        out = _decode_json(rows[0])
        out["mask_block"] = decode_block(out.pop("tree_mask"))
        out["nodes"] = list(self.db.query(
            "SELECT * FROM draft_nodes WHERE run_id = ? AND step = ? ORDER BY node", [run_id, step]))
        out["branches"] = [_decode_json(r) for r in self.db.query(
            "SELECT * FROM branches WHERE run_id = ? AND step = ? ORDER BY branch", [run_id, step])]
        if mask is not None:
            full = full_mask(out["mask_block"], out["prefix_len"], out["mask_dtype"])
            if mask == "torch":
                out["mask"] = full
            elif mask == "numpy":
                out["mask"] = (full[0, 0].float() if full.dtype == torch.bfloat16 else full[0, 0]).numpy()
            else:
                raise ValueError("mask must be None, 'torch' or 'numpy'")
        return out

    def load_trace(self, run_id: int, step: int) -> StepTrace:
        """The recorded step as a StepTrace again (no model needed)."""
        s = self.load_step(run_id, step, mask="torch")
        nodes = s["nodes"]
        return StepTrace(
            step=s["step"], prefix_len=s["prefix_len"], query=s["query"], matched_len=s["matched_len"],
            branches=[Branch(b["source"], tuple(b["tokens"]), b["count"]) for b in s["branches"]],
            tree_tokens=[n["token_id"] for n in nodes], tree_parents=[n["parent"] for n in nodes],
            tree_depths=[n["depth"] for n in nodes], tree_scores=[n["score"] for n in nodes],
            tree_sources=[n["source"] for n in nodes], position_ids=s["position_ids"], mask=s["mask"],
            model_choices=[n["model_choice"] for n in nodes],
            accepted_nodes=[n["node"] for n in nodes if n["accepted"]],
            bonus_token=s["bonus_token"], new_tokens=s["new_tokens"],
            timings_ms={p: s[f"t_{p}_ms"] for p in PHASES if s[f"t_{p}_ms"] is not None},
        )
