"""The datastore explorer: the longest suffix of a context each store holds, what followed it
there, and the draft tree REST would build from it, without running the model (the "model"
source answers from the visitor's table of the model's earlier predictions) -- except for the dense
source, which needs the model's hidden state: one pass over the context gives it."""
from __future__ import annotations

from collections import Counter

import numpy as np

from datastores import DatastoreError, Lookup, assemble_stores
from rest_core.app.decoding import answers_store_for, dense_store_for, static_store_for
from rest_core.app.engine import Engine
from rest_core.app.explain import recycled_after
from rest_core.app.panels import panel
from rest_core.app.policy import markdown_text
from rest_core.app.replay import suffix_html
from rest_core.app.session import Session
from rest_core.app.settings import Settings
from rest_core.decode import DecodeConfig, PromptError, aggregate_branches
from rest_core.hidden import sequence_states
from rest_core.retrieve import query_suffix, retrieve
from rest_core.traces import figures
from rest_core.traces.recorder import TokenTexts
from rest_core.tree import DraftTree, build_draft_tree

ROWS_PER_STORE = 25  # continuations listed per store


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'s' if n != 1 else ''}"


def _tree_figure(tree: DraftTree, texts: TokenTexts):
    nodes = [{"node": i, "parent": int(tree.parents[i]), "depth": int(tree.depths[i]),
              "token_text": texts.label(int(tree.tokens[i])), "score": float(tree.scores[i]), "source": tree.sources[i]}
             for i in range(len(tree))]
    leaves = len(tree) - len(set(tree.parents.tolist()) - {-1})
    return panel(figures.continuation_tree_figure(nodes), max(400, 26 * leaves + 180))


def _found(lk: Lookup) -> str:
    """What one store found, for the summary line."""
    if lk.source == "dense":
        if not lk.neighbours:
            return "**dense**: no place near the model's state there whose next token is the context's last"
        sims = [s for _, s in lk.neighbours]
        return (f"**dense**: {_plural(len(sims), 'place')} where the model's hidden state was near "
                f"(similarity {max(sims):.2f}–{min(sims):.2f})")
    if lk.source != "model":
        return (f"**{lk.source}**: longest suffix {_plural(lk.matched_len, 'token')}, "
                f"{_plural(lk.total_matches, 'occurrence')}")
    if not lk.matched_len:
        return "**model** (its own earlier predictions): nothing recycled yet after the last token"
    paths = len(np.unique(lk.continuations, axis=0))  # rows repeat in proportion to their chance
    seen = " (seen together before)" if lk.matched_len >= 2 else ""
    return f"**model** (its own earlier predictions): {_plural(paths, 'recycled path')} after " \
           f"{recycled_after(lk.matched_len)}{seen}"


def _neighbour_texts(lookups: list[Lookup], stores: list, texts: TokenTexts) -> dict:
    """Per dense source, its neighbours with the text around each (as a recorded step has them)."""
    found = {}
    for lk, store in zip(lookups, stores):
        if lk.neighbours and hasattr(store, "around"):
            found[lk.source] = [{"position": p, "similarity": s, "before_text": texts.join(before),
                                 "after_text": texts.join(after)}
                                for p, s in lk.neighbours for before, after in [store.around(p)]]
    return found


def explore(engine: Engine, session: Session, settings: Settings, context: str, budget: int) -> dict:
    """The longest suffix of `context` each chosen store holds, and the tree it would draft."""
    if not (context or "").strip():
        raise PromptError("Type a context to look up (for example the start of a line of Python code).")
    slot = engine.model(settings.model)
    ids = slot.lm.tokenizer(context, add_special_tokens=False)["input_ids"]
    rs = settings.retrieve_settings()
    rs.validate()
    static, notice = static_store_for(engine, slot, session, settings)
    history = (session.history_store(slot.lm.name, DecodeConfig(retrieve=rs)) if settings.history_store
               else None)
    model = session.recycle_store(slot) if settings.model_drafts else None
    # the request store holds the context itself (its newest token has nothing after it)
    answers = answers_store_for(engine, slot, settings)
    dense = dense_store_for(slot, settings) if len(ids) > 1 else None
    stores = assemble_stores(static=static, answers=answers, request=settings.request_store and len(ids) > 1,
                             history=history, model=model, dense=dense, n_max=rs.n_max, n_min=rs.n_min)
    if not stores:
        raise DatastoreError("No store is switched on: choose a datastore or turn on the request store.")
    for store in stores:  # each store sees the context as it would at a decode's first step
        store.begin(ids, rs.n_max, rs.n_min)
    if dense is not None:  # the state that predicted the context's last token, from one pass over the context
        with slot.lock:
            dense.see_state(sequence_states(slot.lm.model, [ids[:-1]], dense.state_layer, slot.lm.device)[0][-1],
                            int(ids[-1]))
    query = query_suffix(ids, rs)
    lookups = retrieve(query, stores, rs)
    tree = build_draft_tree(int(ids[-1]), lookups, int(budget))
    texts = TokenTexts(slot.lm.tokenizer)
    listed: Counter = Counter()
    rows = []
    for b in aggregate_branches(lookups):  # most frequent first, per store
        listed[b.source] += 1
        if listed[b.source] <= ROWS_PER_STORE:
            rows.append([b.source, figures.show_token(texts.join(list(b.tokens))), b.count])
    summary = " · ".join(_found(lk) for lk in lookups)
    summary += f" · draft tree: **{tree.draft_size}** tokens (budget {int(budget)})"
    if notice:
        summary += "\n\n" + markdown_text(notice, 600)
    step = {"query": [int(t) for t in query], "matched_len": {lk.source: lk.matched_len for lk in lookups},
            "neighbours": _neighbour_texts(lookups, stores, texts)}
    return {"suffix": suffix_html(step, texts), "summary": summary, "continuations": rows,
            "tree": _tree_figure(tree, texts)}
