"""The trace database in Datasette: table and column descriptions, and the README's questions as canned queries.

`python -m rest_core traces serve [--db PATH] [--port 8001]` starts Datasette on the trace file
with this metadata (Datasette is an optional extra: `pip install datasette`).  `metadata(name)`
is the same dict for anyone who opens the file in Datasette their own way.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rest_core.phases import PHASE_NOTES, PHASES

TABLES = {
    "runs": ("One row per decode: model, stores, settings, prompt, output, speed, and for comparison runs the plain "
             "decode beside it.", {
                 "stores": "JSON list of the draft stores, e.g. static:python-..., request, history, model",
                 "settings": "JSON: every decoding setting of the run",
                 "steps": "forward passes after the prompt",
                 "mean_accepted": "new tokens per forward pass",
                 "status": "running, done, failed, stopped, or interrupted (the process died)",
                 "speedup": "plain decoding's wall time over REST's (comparison runs only)",
                 "identical": "1 when REST's tokens equal plain decoding's, each cut at its first EOS",
             }),
    "steps": ("One row per REST step (one forward pass).", {
        "prefix_len": "tokens already in the KV cache when the step ran",
        "matched_len": "JSON: length of the longest context suffix each store matched (0 = none)",
        "draft_size": "draft tokens sent to the model (the root excluded)",
        "accepted_len": "draft tokens the model agreed with",
        "bonus_text": "the token the model added itself after the last accepted node",
        "accepted_sources": "JSON: the draft source of each committed draft token",
        "tree_mask": "the q x q tree block of the mask the model received: one string of 0/1 per node, 1 = may attend",
        **{f"t_{p}_ms": f"milliseconds in the {p} phase: {PHASE_NOTES[p]}" for p in PHASES},
        "budget_choice": "JSON: the cost model's choice: candidate draft nodes, the ones kept, the accepted drafts "
                         "expected of them, the pass's cost relative to a one-token pass, each source's correction "
                         "in this request (NULL when it did not choose)",
        "neighbours": "JSON: per dense source, the corpus places whose hidden state was nearest the model's (their "
                      "position, similarity and the text before and after them), nearest first (NULL: none)",
    }),
    "draft_nodes": ("One row per node of a step's draft tree (node 0 = the root, the last committed token).", {
        "source": "the draft source contributing most to this node: static, request, history, model, ...",
        "score": "merged weight of the prefix ending at this node",
        "model_choice_text": "the model's own next token after this node",
        "accepted": "1 when the node is on the accepted path",
        "prob": "the model's probability of this node's token at its parent (NULL at the root)",
        "choice_prob": "the model's probability of model_choice after this node",
        "top_tokens": "JSON: the model's likeliest next tokens after this node (top_texts, top_probs beside)",
        "uniform": "sampling: the uniform number drawn at this node (NULL where the walk did not go)",
        "chance": "the cost model's estimate that this node would be accepted (the product of its path's conditional "
                  "chances; NULL at the root and where no cost model chose)",
    }),
    "branches": ("One row per distinct continuation a store retrieved at a step (the 32 most frequent per source).", {
        "count": "how often the continuation occurred (for the model source: its prior chance x 1000)",
    }),
}

QUERIES = {
    "runs_by_speed": ("Runs, newest first, with their speed",
                      "select id, model, status, steps, new_tokens, round(new_tokens / wall_s, 2) as tokens_per_s, "
                      "speedup, identical from runs order by id desc limit 50"),
    "acceptance_by_source": ("Which source's drafts the model accepts",
                             "select source, count(*) as drafted, sum(accepted) as accepted, "
                             "round(avg(accepted), 3) as acceptance from draft_nodes where node > 0 "
                             "group by source order by drafted desc"),
    "chance_calibration": ("Did the cost model's chances come true: drafted nodes by estimated chance, and how "
                           "many were accepted",
                           "select round(chance, 1) as chance, count(*) as drafted, "
                           "round(avg(chance), 3) as expected, round(avg(accepted), 3) as accepted "
                           "from draft_nodes where node > 0 and chance is not null group by round(chance, 1) "
                           "order by 1"),
    "phase_ms": ("Mean milliseconds per phase of one run",
                 "select " + ", ".join(f'round(avg(t_{p}_ms), 2) as "{p}"' for p in PHASES)
                 + " from steps where run_id = :run_id"),
    "disagreements": ("Where draft and model parted: the drafted children of the last accepted node vs the "
                      "model's token",
                      "select s.step, p.token_text as last_accepted, group_concat(n.token_text, ' | ') as drafted, "
                      "s.bonus_text as model from steps s join draft_nodes p on p.run_id = s.run_id and "
                      "p.step = s.step and p.accepted = 1 and p.depth = s.accepted_len join draft_nodes n on "
                      "n.run_id = s.run_id and n.step = s.step and n.parent = p.node where s.run_id = :run_id "
                      "group by s.step"),
}


def metadata(database: str = "traces") -> dict:
    """Datasette metadata for a trace file opened under this database name (its file name without .sqlite)."""
    tables = {name: {"description": text, "columns": columns} for name, (text, columns) in TABLES.items()}
    queries = {name: {"title": title, "sql": sql} for name, (title, sql) in QUERIES.items()}
    return {"title": "REST Lab traces",
            "description": "Every step of every recorded REST decode: what each store retrieved, the draft tree, "
                           "the mask the model received, what it accepted, and how long each phase took.",
            "databases": {database: {"tables": tables, "queries": queries}}}


def datasette_installed() -> bool:
    return importlib.util.find_spec("datasette") is not None


def serve(db: Path, port: int = 8001, host: str = "127.0.0.1") -> int:
    """Run Datasette on the trace file with this metadata until interrupted; 2 when Datasette is missing."""
    if not datasette_installed():
        print("error: Datasette is not installed: `pip install datasette` (or `.venv/bin/python -m pip install "
              "datasette`), then run this again", file=sys.stderr)
        return 2
    if not db.is_file():
        print(f"error: no trace file at {db}: record a run first (generate --trace-db, or the app)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        meta = Path(tmp) / "metadata.json"
        meta.write_text(json.dumps(metadata(db.stem)), encoding="utf-8")
        cmd = [sys.executable, "-m", "datasette", "serve", str(db), "--metadata", str(meta), "--port", str(port),
               "--host", host]
        print(f"Datasette on http://{host}:{port}/ (Ctrl-C stops it)", flush=True)
        try:
            return subprocess.run(cmd, check=False).returncode
        except KeyboardInterrupt:
            return 0
