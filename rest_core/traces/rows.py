"""Rows of the trace store: their shapes (TypedDicts) and how a `StepTrace` becomes rows.

The readers of `TraceRecorder` return plain dicts; these TypedDicts say what is in them:
`RunRow` (get_run, list_runs), `StepRow` (load_steps), `StepDetail` (load_step: a step
row with its `NodeRow`s, `BranchRow`s and mask block).  Source names are open-ended
strings: any name a store gives round-trips.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, NotRequired, Optional, TypedDict

import numpy as np

from rest_core.phases import PHASES
from rest_core.trace import Branch, StepTrace
from rest_core.traces.masks import decode_block, encode_block, mask_tree_block
from rest_core.traces.tokens import token_label


class RunRow(TypedDict):
    id: int
    started_at: str  # ISO 8601, UTC
    finished_at: Optional[str]
    model: Optional[str]
    tokenizer: Optional[str]
    stores: Any  # what the caller passed, e.g. ["static:/path", "request"]
    settings: dict[str, Any]  # every decoding setting
    prompt: Optional[str]
    output: Optional[str]
    prompt_tokens: Optional[int]
    prompt_ids: Optional[list[int]]
    new_tokens: Optional[int]
    steps: Optional[int]
    wall_s: Optional[float]
    mean_accepted: Optional[float]
    status: str  # running | done | failed | stopped | interrupted
    error: Optional[str]
    pid: Optional[int]
    host: Optional[str]
    proc_start: Optional[str]
    plain_wall_s: Optional[float]
    plain_tokens_per_s: Optional[float]
    speedup: Optional[float]
    identical: Optional[int]  # 1 / 0, None when not compared


class StepRow(TypedDict):
    """One step as `load_steps` returns it (its tree mask and nodes left out)."""

    run_id: int
    step: int
    prefix_len: int
    query: list[int]
    matched_len: dict[str, int]  # source -> length of the longest matched suffix
    draft_size: int
    accepted_len: int  # draft tokens accepted (bonus not counted)
    bonus_token: int
    bonus_text: str
    new_tokens: list[int]  # committed by the step
    new_texts: list[str]
    accepted_sources: list[str]  # source of each accepted draft token
    position_ids: list[int]
    mask_dtype: str
    t_retrieve_ms: Optional[float]  # one t_<phase>_ms per rest_core.phases.PHASES
    t_tree_ms: Optional[float]
    t_forward_ms: Optional[float]
    t_verify_ms: Optional[float]
    t_commit_ms: Optional[float]


class NodeRow(TypedDict):
    run_id: int
    step: int
    node: int
    parent: int  # -1 for the root
    depth: int
    token_id: int
    token_text: str
    score: float
    source: str  # "" for the root
    model_choice: int
    model_choice_text: str
    chosen: Optional[int]  # the model's choice at the parent is this token (None at the root)
    accepted: int  # on the accepted path
    prob: Optional[float]  # the model's probability of this token at its parent (None: root, or not recorded)
    choice_prob: Optional[float]  # the model's probability of model_choice after this node (None: not recorded)
    top_tokens: Optional[list[int]]  # the model's likeliest next tokens after this node (None: not recorded)
    top_texts: Optional[list[str]]
    top_probs: Optional[list[float]]
    uniform: Optional[float]  # sampling: the uniform number drawn at this node (None: not visited, or greedy)


class BranchRow(TypedDict):
    run_id: int
    step: int
    branch: int
    source: str
    tokens: list[int]
    text: str
    count: int


class StepDetail(StepRow):
    """One step as `load_step` returns it."""

    mask_block: np.ndarray  # (q, q) bool, True = may attend
    nodes: list[NodeRow]
    branches: list[BranchRow]
    mask: NotRequired[Any]  # with mask="torch" / "numpy": the full mask


STEP_COLUMNS = (
    "run_id", "step", "prefix_len", "query", "matched_len", "draft_size", "accepted_len",
    "bonus_token", "bonus_text", "new_tokens", "new_texts", "accepted_sources",
    "position_ids", "tree_mask", "mask_dtype",
) + tuple(f"t_{p}_ms" for p in PHASES) + ("budget_choice", "neighbours")
ADDED_STEP_COLUMNS = {"budget_choice": "TEXT", "neighbours": "TEXT"}
NODE_COLUMNS = (
    "run_id", "step", "node", "parent", "depth", "token_id", "token_text", "score", "source",
    "model_choice", "model_choice_text", "chosen", "accepted",
) + ("prob", "choice_prob", "top_tokens", "top_texts", "top_probs", "uniform", "chance")
# columns added to draft_nodes after the first schema: a store written before them gets them (NULL) on opening
ADDED_NODE_COLUMNS = {"prob": "REAL", "choice_prob": "REAL", "top_tokens": "TEXT", "top_texts": "TEXT",
                      "top_probs": "TEXT", "uniform": "REAL", "chance": "REAL"}
BRANCH_COLUMNS = ("run_id", "step", "branch", "source", "tokens", "text", "count")
JSON_COLUMNS = frozenset({"stores", "settings", "prompt_ids", "query", "matched_len", "new_tokens", "new_texts",
                          "accepted_sources", "position_ids", "tokens", "top_tokens", "top_texts", "top_probs",
                          "budget_choice", "neighbours"})
MAX_BRANCHES_PER_SOURCE = 32  # continuations stored per source and step (the most frequent ones)


class TokenTexts(dict):
    """Token id -> display text, cached: texts[id] is tokenizer.decode([id]) (its
    convert_ids_to_tokens form when that decodes to nothing; '<id>' without a tokenizer)."""

    def __init__(self, tokenizer: Any = None):
        super().__init__()
        self.tokenizer = tokenizer
        self.labels: dict[int, str] = {}

    def __missing__(self, token_id: int) -> str:
        if self.tokenizer is None:
            text = f"<{token_id}>"
        else:
            text = self.tokenizer.decode([token_id])
            if not text and hasattr(self.tokenizer, "convert_ids_to_tokens"):
                text = str(self.tokenizer.convert_ids_to_tokens(token_id))
        self[token_id] = text
        return text

    def join(self, ids: Iterable[int]) -> str:
        return "".join(map(self.__getitem__, ids))

    def label(self, token_id: int) -> str:
        """The token's text for a label: a character split across tokens shows as its bytes (`‹E2 80›`)."""
        if token_id not in self.labels:
            self.labels[token_id] = token_label(self.tokenizer, token_id, self[token_id])
        return self.labels[token_id]


def ids_json(ids: Iterable[int]) -> str:
    """Token ids as a JSON list (faster than json.dumps on numpy integers)."""
    return "[" + ",".join(map(str, map(int, ids))) + "]"


def decode_json(row: dict) -> dict:
    """A row read from the store with its JSON columns decoded, in place."""
    for key in JSON_COLUMNS.intersection(row):
        if isinstance(row[key], str):
            row[key] = json.loads(row[key])
    return row


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
    probs = _node_probs(t, q)
    if t.node_chances and len(t.node_chances) != q:
        raise ValueError(f"step {t.step}: {len(t.node_chances)} node chances for {q} nodes")
    chances = [None if c is None else float(c) for c in t.node_chances] if t.node_chances else [None] * q
    timings = t.timings_ms or {}
    step_row = (
        run_id, t.step, t.prefix_len, ids_json(t.query),
        json.dumps({k: int(v) for k, v in t.matched_len.items()}), q - 1, len(t.accepted_nodes) - 1,
        int(t.bonus_token), texts.label(int(t.bonus_token)), ids_json(new_tokens),
        json.dumps([texts[x] for x in new_tokens]),
        json.dumps([t.tree_sources[n] for n in t.accepted_nodes[1:]]),
        ids_json(t.position_ids), encode_block(block), str(t.mask.dtype).removeprefix("torch."),
    ) + tuple(timings.get(p) for p in PHASES) + (None if t.budget_choice is None else json.dumps(t.budget_choice),
                                                  _neighbours_json(t, texts))
    node_rows = []
    for i in range(q):
        parent = int(t.tree_parents[i])
        node_rows.append((
            run_id, t.step, i, parent, int(t.tree_depths[i]), tokens[i], texts.label(tokens[i]),
            float(t.tree_scores[i]), t.tree_sources[i], choices[i], texts.label(choices[i]),
            None if parent < 0 else int(choices[parent] == tokens[i]), int(i in on_path),
        ) + probs(i, texts) + (chances[i],))
    kept = _top_branches(t.branches, MAX_BRANCHES_PER_SOURCE)
    branch_rows = [(run_id, t.step, k, b.source, ids_json(b.tokens), texts.join(b.tokens), int(b.count))
                   for k, b in enumerate(kept)]
    return step_row, node_rows, branch_rows


def _neighbours_json(t: StepTrace, texts: TokenTexts) -> Optional[str]:
    """The dense sources' neighbours as JSON, each with the text around it (None when the step has none)."""
    if not t.neighbours:
        return None
    return json.dumps({source: [{**n, "before_text": texts.join(n.get("before", ())),
                                 "after_text": texts.join(n.get("after", ()))} for n in found]
                       for source, found in t.neighbours.items()})


def _node_probs(t: StepTrace, q: int):
    """The probability columns of node i (prob, choice_prob, top_tokens, top_texts, top_probs, uniform),
    all None when the trace carries no probabilities."""
    known = len(t.draft_probs) == len(t.choice_probs) == len(t.top_tokens) == len(t.top_probs) == q

    def columns(i: int, texts: TokenTexts) -> tuple:
        u = t.uniforms.get(i)
        if not known:
            return None, None, None, None, None, u
        prob = t.draft_probs[i]
        top = [int(x) for x in t.top_tokens[i]]
        return (None if prob is None else float(prob), float(t.choice_probs[i]), ids_json(top),
                json.dumps([texts.label(x) for x in top]), json.dumps([float(p) for p in t.top_probs[i]]), u)

    return columns


def _top_branches(branches: Sequence[Branch], limit: int) -> list[Branch]:
    """The `limit` most frequent continuations of each source, in the trace's order (a short match in a
    big store can return thousands of distinct ones; storing them all would cost more than the step)."""
    ranked: dict[str, list[int]] = {}
    for i, b in enumerate(branches):
        ranked.setdefault(b.source, []).append(i)
    keep = set()
    for idx in ranked.values():
        keep.update(sorted(idx, key=lambda i: (-branches[i].count, branches[i].tokens))[:limit])
    return [b for i, b in enumerate(branches) if i in keep]


def step_detail(t: StepTrace, texts: TokenTexts, run_id: int = 0) -> StepDetail:
    """A step as `TraceRecorder.load_step` would give it back once recorded, without storing it (a step
    computed for a look only, such as a replayed step under other settings)."""
    step_row, node_rows, branch_rows = trace_rows(run_id, t, texts)
    out = decode_json(dict(zip(STEP_COLUMNS, step_row)))
    out["mask_block"] = decode_block(out.pop("tree_mask"))
    out["nodes"] = [decode_json(dict(zip(NODE_COLUMNS, row))) for row in node_rows]
    out["branches"] = [decode_json(dict(zip(BRANCH_COLUMNS, row))) for row in branch_rows]
    return out


def step_trace(step: StepDetail) -> StepTrace:
    """A step loaded with its torch mask (load_step(..., mask="torch")) as a StepTrace again."""
    nodes = step["nodes"]
    return StepTrace(
        step=step["step"], prefix_len=step["prefix_len"], query=step["query"], matched_len=step["matched_len"],
        branches=[Branch(b["source"], tuple(b["tokens"]), b["count"]) for b in step["branches"]],
        tree_tokens=[n["token_id"] for n in nodes], tree_parents=[n["parent"] for n in nodes],
        tree_depths=[n["depth"] for n in nodes], tree_scores=[n["score"] for n in nodes],
        tree_sources=[n["source"] for n in nodes], position_ids=step["position_ids"], mask=step["mask"],
        model_choices=[n["model_choice"] for n in nodes],
        accepted_nodes=[n["node"] for n in nodes if n["accepted"]],
        bonus_token=step["bonus_token"], new_tokens=step["new_tokens"],
        timings_ms={p: step[f"t_{p}_ms"] for p in PHASES if step[f"t_{p}_ms"] is not None},
        **_stored_probs(nodes), budget_choice=step.get("budget_choice"),
        neighbours={source: [{k: n[k] for k in ("position", "similarity", "before", "after")} for n in found]
                    for source, found in (step.get("neighbours") or {}).items()},
        node_chances=[n.get("chance") for n in nodes] if any(n.get("chance") is not None for n in nodes) else [],
    )


def _stored_probs(nodes: Sequence[dict]) -> dict:
    """The StepTrace probability fields from node rows (empty lists for a trace recorded without them)."""
    uniforms = {n["node"]: n["uniform"] for n in nodes if n.get("uniform") is not None}
    if not nodes or any(n.get("top_tokens") is None for n in nodes):
        return {"uniforms": uniforms}
    return {"draft_probs": [n["prob"] for n in nodes], "choice_probs": [n["choice_prob"] for n in nodes],
            "top_tokens": [n["top_tokens"] for n in nodes],
            "top_probs": [n["top_probs"] for n in nodes], "uniforms": uniforms}
