"""REST for a batch of served requests: one best chain per request, sized for the whole batch.

`RestDrafter.step` is called once per engine step with the running requests (their ids, the tokens the step just
gave each, and each one's prompt + output so far) and answers with the draft tokens each request should have
verified next.  It uses the decoder's own parts, not copies of them:

    retrieve (rest_core.retrieve)   the static and general-text stores, shared read-only by every request, the
                                    request's own store (prompt + output so far), the served outputs' history
                                    and the model's own predictions (source "model": datastores.RecycleStore,
                                    one table for every request, taught the top-k tokens of every row of logits
                                    the engine computed, which the proposer hands over: `predicted`), and for
                                    chat requests the dense store (datastores.dense: the places of a corpus
                                    where the model's hidden state was nearest the state that predicted the
                                    request's newest token, handed over from the engine's pass: `see_states`),
                                    searched only where the other sources leave the request's chain weak, as
                                    the decoder's fallback is (rest_core.draft)
    tree     (rest_core.tree)       the continuations merged into a draft tree
    rank     (rest_core.cost)       each node's chance of acceptance, learned per source as the decoder learns it
    chain                           an engine that verifies chains takes the tree's best path (the likeliest
                                    child at every depth)
    plan     (serving.load)         how many tokens of each chain the batch can afford, from the step cost and
                                    propose()'s own time, both measured live (serving.live); none at batch
                                    sizes where the steps that verified drafts gave fewer tokens per request
                                    and plain step's time than those that did not (serving.live.RealizedRates,
                                    nearby sizes weighed together); when nothing waits to join
                                    the batch (its requests started together and the engine's scheduler, where
                                    it can be asked, says nothing waits; or it shrank and none joined), only
                                    in steps where every request it ends with (the most tokens still to go)
                                    can gain, and only for the requests near those (serving.load.
                                    last_requests_gain), and not at all where batch ends like this one (its
                                    last requests' kind, its size) lately saved less time than their drafts
                                    spent (serving.live.WaveEnds, settled step by step)

A request's state lives exactly while the request is in the running batch: a request that finishes, is preempted
or is left out of a step is forgotten (its output joins the history once), and one that comes back is rebuilt
from its tokens.  So a server that has seen thousands of requests holds state for the running ones only.
"""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

from datastores import DenseStore, HistoryStore, RecycleStore, RequestStore, Store
from rest_core.cost import CostModel
from rest_core.retrieve import RetrieveSettings, query_suffix, retrieve
from rest_core.serving.live import LiveStepCost, ProposeTime, RealizedRates, RecentChains, WaveEnds, batch_group
from rest_core.serving.load import (
    AcceptanceProfile,
    ChanceCalibration,
    StepCost,
    last_requests_gain,
    last_requests_pay,
    plan_drafts,
    typical_pay,
)
from rest_core.tree import DraftTree, build_draft_tree, keep_nodes

TREE_NODES = 63  # candidate nodes a request's draft tree keeps before its best chain is taken
SAVE_EVERY = 32  # ended requests between two saves of the learned acceptance counts
ENDED_KEPT = 4096  # ids of recently ended requests remembered, so a preempted one's output joins the history once
LEARNED = 64  # drafts a source must have had tested before the cost model's chances alone value its chains
EXTEND_BELOW = 2  # a chain shorter than this is carried on from its end by one-token matches (`_extend`)


class RequestState:
    """What the drafter keeps for one running request.  Its store catches up when read: a step that looks nothing
    up only notes the request's new tokens (`pending`), and they are indexed, all at once, the next time the
    store is read (a lookup, or the request leaving)."""

    __slots__ = ("_store", "pending", "length", "first_output", "kind", "corrections", "chain", "chances")

    def __init__(self, store: RequestStore, length: int, first_output: int, kind: str):
        self._store = store  # prompt + output so far, less `pending`
        self.pending: list[int] = []  # tokens seen since the store was last read
        self.length = length  # tokens of the request seen so far (the store's and `pending`)
        self.first_output = first_output  # where the output begins in the store (as far as the drafter saw it)
        self.kind = kind  # "chat" or "text": the cost model learns acceptance per kind
        self.corrections: dict = {}  # the cost model's per-request record (CostModel.use_request)
        self.chain: Optional[DraftTree] = None  # the drafts proposed last step, awaiting the step's verdict
        self.chances: list[float] = []  # ... and the chances of its prefixes (before calibration)

    @property
    def store(self) -> RequestStore:
        """The request's store, with every token seen so far."""
        if self.pending:
            self._store.extend(self.pending)
            self.pending = []
        return self._store


def best_chain(tree: DraftTree, chooser: CostModel, limit: int) -> tuple[DraftTree, list[float]]:
    """The tree's best path of at most `limit` drafts (from the root, the child with the highest chance of being
    accepted at every depth) as a tree of its own, and the chance of each prefix of it being accepted."""
    if tree.draft_size == 0 or limit <= 0:
        return keep_nodes(tree, np.zeros(0, dtype=np.int64)), []
    order, chance = chooser.ranked(tree)
    by_node = np.zeros(len(tree))
    by_node[order] = chance
    node, nodes, chances = 0, [], []
    while len(nodes) < limit and tree.children[node]:
        node = max(tree.children[node].values(), key=lambda c: (by_node[c], -c))
        nodes.append(node)
        chances.append(float(by_node[node]))
    return keep_nodes(tree, np.array(nodes, dtype=np.int64)), chances


def join_chains(head: DraftTree, tail: DraftTree) -> DraftTree:
    """One chain of `head`'s drafts followed by `tail`'s (`tail`'s root stands for `head`'s last node)."""
    n = len(head) + tail.draft_size
    agree = None if head.agree is None or tail.agree is None else np.concatenate([head.agree, tail.agree[1:]])
    return DraftTree(np.concatenate([head.tokens, tail.tokens[1:]]), np.arange(-1, n - 1, dtype=np.int64),
                     np.arange(n, dtype=np.int64), np.concatenate([head.scores, tail.scores[1:]]),
                     [*head.sources, *tail.sources[1:]], np.concatenate([head.shares, tail.shares[1:]]),
                     np.concatenate([head.support, tail.support[1:]]), agree)


def _tested(chooser: CostModel, source: str) -> float:
    """How many of a source's drafts the cost model has seen put to the test."""
    counts = chooser.counts.get(source)
    return 0.0 if counts is None else float(counts[0].sum())


class RestDrafter:
    """Draft chains for every running request of a served model (see the module's docstring).

    shared: per kind of request ("chat" / "text") the read-only stores every such request drafts from, in merge
    order (the request's own store and the history are added after them); choosers: per kind, the cost model that
    ranks and learns acceptance; cost: the calibrated step cost (refreshed here from the engine's real steps);
    max_drafts: the most drafts one request may get (the engine's num_speculative_tokens); max_len: the model's
    context; chat_markers: token ids that only a chat template puts in a prompt (they tell a chat request from
    plain text); clock: the time in seconds (the engine's steps are timed between two calls of `step`);
    predictions: the table of the model's own top predictions, drafted from as source "model" and taught by
    `predicted` (None: no such source, as where the engine's logits cannot be read); dense: the dense store chat
    requests fall back on, queried with the hidden states `see_states` hands over (None: no such source)."""

    def __init__(self, shared: dict[str, list[Store]], choosers: dict[str, CostModel], cost: StepCost,
                 max_drafts: int, max_len: int, chat_markers: Sequence[int] = (),
                 history: Optional[HistoryStore] = None, settings: Optional[RetrieveSettings] = None,
                 clock: Optional[Callable[[], float]] = None, predictions: Optional[RecycleStore] = None,
                 dense: Optional[DenseStore] = None, wave_ends: Optional[WaveEnds] = None):
        self.shared, self.choosers = shared, choosers
        self.cost = cost if isinstance(cost, LiveStepCost) else LiveStepCost(cost)
        self.propose_time = ProposeTime()
        self.clock = clock or (lambda: time.perf_counter())  # looked up at each call
        self.max_drafts, self.max_len = max_drafts, max_len
        self.chat_markers = frozenset(int(t) for t in chat_markers)
        self.history = history
        self.predictions = predictions
        self._top: Optional[Any] = None  # the engine's last step's top-k tokens per row of logits
        self.dense = dense
        self._states: dict = {}  # the engine's last pass's hidden states per request (`see_states`)
        self.settings = settings or RetrieveSettings(continuation_len=max(1, min(max_drafts, 24)))
        self._one_token = dataclasses.replace(self.settings, n_min=1)  # `_extend`'s look-ups
        self.requests: dict[str, RequestState] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._left = 0  # requests that left the batch so far
        self.profile = AcceptanceProfile(depth=max(1, max_drafts))
        self.calibration = {kind: ChanceCalibration(depth=max(1, max_drafts)) for kind in choosers}
        self.recent = RecentChains()  # what the newest lookups found
        self.realized = RealizedRates()  # what drafting really brought, per group of batch sizes
        self.wave_ends = wave_ends or WaveEnds()  # ... and for the requests a batch ends with (`_end_key`)
        # this step's drafting for those requests: (the tokens each request may still produce, the end's key),
        # set by `_draft`; and the last step's, to be settled at this one: the same, the drafts given and
        # propose()'s ms (`step`)
        self._end_drafting: Optional[tuple[dict[str, int], str]] = None
        self._wave_step: Optional[tuple[dict[str, int], str, int, float]] = None
        self._end_size: Optional[int] = None  # the batch's size when it was first served for its last requests
        # when step() last returned, the drafts it gave, and its own time (ms)
        self._last: Optional[tuple[float, dict[str, int], float]] = None
        # drafted / accepted: drafts verified and kept; expected: the plan's chances of those drafts, summed
        self.stats = {"steps": 0, "drafting_steps": 0, "drafted": 0, "accepted": 0, "expected": 0.0,
                      # propose()'s own time, in all and in the steps that looked up; the engine's time between
                      # two calls, over the steps where every request only decoded (timed_steps of them)
                      "propose_ms": 0.0, "drafting_propose_ms": 0.0, "engine_ms": 0.0, "timed_steps": 0,
                      # steps whose logits taught the model's predictions, and those whose rows did not add up to
                      # the requests and drafts the drafter knows of (nothing taught)
                      "predicted_steps": 0, "predicted_skipped": 0,
                      # requests whose chain was weak and the dense store was searched for, the chains that then
                      # began with its draft, and its drafts verified and kept
                      "dense_lookups": 0, "dense_chains": 0, "dense_drafted": 0, "dense_accepted": 0,
                      # steps served for the requests the batch ends with (nothing waited to join it)
                      "last_request_steps": 0,
                      # ... of them, those that looked nothing up as drafting for last requests lost (WaveEnds)
                      "wave_end_off_steps": 0}
        self.report = None  # a serving.config.ProposeLog, where one is asked for: told of every step's stats
        self._running: set = set()  # the requests of the last step
        self.draining = False  # the batch has shrunk since a request last joined (`_watch_joining`)
        self.together = False  # its requests started together, nothing waiting as far as known (ditto)
        self._pays: tuple = (None, None, False)  # what `_drafting_pays` last weighed, and its answer

    # -- the requests ------------------------------------------------------------------------------------------
    def _forget_absent(self, running: set) -> None:
        """Drop every request that left the batch; its output joins the history (once per request id).  At a batch's
        end what its drafting brought so far is kept (WaveEnds.save): its last request leaves unseen."""
        gone = [r for r in self.requests if r not in running]
        for rid in gone:
            state = self.requests.pop(rid)
            if self.history is not None and rid not in self._ended:
                output = state.store.tokens[state.first_output:]
                if output.size:
                    self.history.add(output)
            self._ended[rid] = None
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
            self._left += 1
            if self._left % SAVE_EVERY == 0:
                self.save_stats()
        if gone and (self.draining or self.together):
            self.wave_ends.save()

    # -- the model's own predictions -------------------------------------------------------------------------------
    def wants_predictions(self) -> bool:
        """Whether the step the engine runs now should hand over its logits' top tokens: it verifies drafts this
        drafter gave (a step without drafts, where drafting does not pay, is not worth reading every row of its
        logits for; the table learns again once drafting does)."""
        return self.predictions is not None and self._last is not None and any(self._last[1].values())

    def predicted(self, top: Any) -> None:
        """The top-k token ids (rows x k, best first; a tensor or an array) of every row of logits the engine's
        step computed: per request in the batch's order, one row for its newest token and one for each draft
        it was given (a request reading its prompt: one row).  Taught at the next `step`."""
        self._top = top

    # -- the model's hidden states (the dense source) ---------------------------------------------------------
    def wants_states(self) -> bool:
        """Whether the engine's passes should hand over hidden states (there is a dense store to query)."""
        return self.dense is not None

    def see_states(self, states: dict) -> None:
        """The hidden states of the engine's newest pass at the dense store's layer, per request: {request id:
        ((rows, d) array, the request's tokens in the pass)}, every row where the request's tokens were few (a
        decoding request's newest token and its drafts), else the last one alone (rest_core.serving.engine.
        watch_states).  Read at the next `step`."""
        self._states = states

    def _hidden(self, rid: str, new: Sequence[int], states: dict) -> Optional[np.ndarray]:
        """The hidden state that predicted the request's newest token, from the step's pass: a decoding request
        read its newest token and its drafts, and the row of the last one it kept predicted the new token; a
        request that read (the rest of) its prompt predicted its first token at the prompt's last row."""
        got = states.get(rid)
        if got is None or not len(new):
            return None
        rows, read = got
        if self._last is not None and rid in self._last[1]:
            j = len(new) - 1
            return rows[j] if len(rows) == read and j < read else None
        return rows[-1]

    def _teach(self, req_ids: Sequence[str], sampled: Sequence[Sequence[int]], lengths: Sequence[int],
               tokens: np.ndarray) -> None:
        """Teach the predictions table what the model predicted after each token its last step read: a
        request's newest token before the step, then the drafts it was given (the rows that follow a rejected
        draft too: the model's prediction in that context all the same).  Rows that do not add up to the drafts
        the drafter gave (the engine verified fewer, or a warm-up pass) teach nothing."""
        top, self._top = self._top, None
        if top is None or self.predictions is None:
            return
        if hasattr(top, "cpu"):
            top = top.cpu().numpy()
        top = np.asarray(top)
        given = self._last[1] if self._last is not None else {}
        counts = [1 + given.get(rid, 0) for rid in req_ids]
        if top.ndim != 2 or sum(counts) != len(top):
            self.stats["predicted_skipped"] += 1
            return
        read, before, at, start = [], [], [], 0
        for i, (rid, n) in enumerate(zip(req_ids, counts)):
            root = int(lengths[i]) - len(sampled[i]) - 1  # the newest token before the step
            if len(sampled[i]) and root >= 0:
                state = self.requests.get(rid)
                chain = state.chain if state is not None else None
                drafts = chain.tokens[1:].tolist() if chain is not None else []
                if len(drafts) == n - 1 and (chain is None or int(chain.tokens[0]) == int(tokens[i, root])):
                    fed = [int(tokens[i, root]), *drafts]
                    read += fed
                    before += [int(tokens[i, root - 1]) if root > 0 else -1, *fed[:-1]]
                    at += range(start, start + n)
            start += n
        if read:
            self.predictions.observe(np.array(read, dtype=np.int64), top[at], np.array(before, dtype=np.int64))
        self.stats["predicted_steps"] += 1

    def _kind(self, tokens: np.ndarray) -> str:
        head = tokens[:8].tolist()
        return "chat" if self.chat_markers and any(t in self.chat_markers for t in head) else "text"

    def _follow(self, rid: str, new: Sequence[int], length: int, row: np.ndarray) -> RequestState:
        """The request's state after this step: extended by its new tokens (learning from the verdict on the
        chain it was given), or rebuilt from its tokens when it is new or did not continue where it stood."""
        state = self.requests.get(rid)
        if state is not None and state.length + len(new) == length:
            if state.chain is not None:
                self._learn(state, new)
            state.pending.extend(new)
            state.length = length
            return state
        tokens = np.asarray(row[:length], dtype=np.int64)
        state = RequestState(self._request_store(tokens), length, length - len(new), self._kind(tokens))
        self.requests[rid] = state
        return state

    def _learn(self, state: RequestState, new: Sequence[int]) -> None:
        """The step's verdict on the request's chain: the drafts it kept are the first len(new) - 1 tokens."""
        chain, chances, state.chain, state.chances = state.chain, state.chances, None, []
        if chain is None or chain.draft_size == 0:
            return
        drafted = chain.tokens[1:].tolist()
        accepted = 0
        while accepted < min(len(new) - 1, len(drafted)) and int(new[accepted]) == drafted[accepted]:
            accepted += 1
        if accepted < len(drafted) and len(new) > accepted and int(new[accepted]) == drafted[accepted]:
            drafted = drafted[:accepted]  # the engine verified fewer drafts than given: the rest were never tested
            chain = keep_nodes(chain, np.arange(1, accepted + 1))
        if not drafted:
            return
        chooser = self.choosers[state.kind]
        chooser.use_request(state.corrections)
        chooser.observe(chain, list(range(accepted + 1)), None)
        self.profile.observe(len(drafted), accepted)
        calibration = self.calibration[state.kind]
        self.stats["expected"] += sum(calibration.apply(chances[:len(drafted)]))
        calibration.observe(chances[:len(drafted)], accepted)
        self.stats["drafted"] += len(drafted)
        self.stats["accepted"] += accepted
        if self.dense is not None:
            from_dense = [source == self.dense.source for source in chain.sources[1:len(drafted) + 1]]
            self.stats["dense_drafted"] += sum(from_dense)
            self.stats["dense_accepted"] += sum(from_dense[:accepted])

    # -- one engine step ---------------------------------------------------------------------------------------
    def step(self, req_ids: Sequence[str], sampled: Sequence[Sequence[int]], lengths: Sequence[int],
             tokens: np.ndarray, remaining: Optional[Sequence[int]] = None, waiting: Optional[int] = None
             ) -> list[list[int]]:
        """Draft tokens for each running request (row i: req_ids[i], the tokens sampled[i] this step gave it,
        tokens[i, :lengths[i]] its prompt + output so far); a request still reading its prompt gets none.
        remaining[i]: the most tokens request i may still produce, where the engine says (its max_tokens);
        waiting: the requests waiting to be scheduled, where the engine says.  When nothing waits to join the
        batch they tell which requests it ends with (`_last_requests`).
        The engine's step since the last call and this call's own time are measured on the way."""
        start = self.clock()
        self._time_engine(start, req_ids, sampled)
        self._settle_wave_step(req_ids, remaining)
        self._watch_joining(req_ids, remaining, waiting)
        out, drafting = self._draft(req_ids, sampled, lengths, tokens, remaining)
        end = self.clock()
        ms = (end - start) * 1e3
        self.propose_time.add(drafting, len(req_ids), ms)
        self.stats["propose_ms"] += ms
        self.stats["drafting_propose_ms"] += ms if drafting else 0.0
        if self._end_drafting is not None:
            self._wave_step = (*self._end_drafting, sum(map(len, out)), ms)
        if self.report is not None:
            self.report.tick(self.stats)
        self._last = (end, {rid: len(out[i]) for i, rid in enumerate(req_ids) if len(sampled[i])}, ms)
        return out

    def _time_engine(self, now: float, req_ids: Sequence[str], sampled: Sequence[Sequence[int]]) -> None:
        """The engine's step between the last call and this one, as a reading of the step cost, when it only
        decoded: every request in it was decoding at the last call too (no prompt was read in the step), so it
        ran over len(req_ids) requests with the drafts they were given then."""
        if self._last is None:
            return
        end, given, propose_ms = self._last
        if all(len(s) for s in sampled) and all(rid in given for rid in req_ids):
            drafts, engine_ms = sum(given[rid] for rid in req_ids), (now - end) * 1e3
            self.cost.observe(len(req_ids), drafts, engine_ms)
            self.realized.observe(len(req_ids), drafts, sum(map(len, sampled)), engine_ms + propose_ms,
                                  plain_ms=self.cost(len(req_ids), 0))
            self.stats["engine_ms"] += engine_ms
            self.stats["timed_steps"] += 1

    def _watch_joining(self, req_ids: Sequence[str], remaining: Optional[Sequence[int]],
                       waiting: Optional[int]) -> None:
        """Whether nothing waits to join the batch: it has shrunk since a request last joined (a server with
        requests waiting replaces a finished one at once, and so does the benchmark's sustained load), or its
        requests started together (the tokens they may still produce within max_drafts of each other when the
        last of them joined: a batch submitted at once, not a server whose requests came one by one, where each
        request's own time counts) and the scheduler said nothing waited then.  Where the scheduler cannot be
        asked (vLLM's CPU engine runs the model in a process of its own) requests that started together are
        taken for a batch with nothing behind it until one of them leaves and another joins: the first batch of
        a longer queue is served so too."""
        running = set(req_ids)
        if running - self._running:
            self.wave_ends.begin()
            self._end_size = None
            self.draining = False
            self.together = (waiting in (0, None) and remaining is not None and len(remaining) > 1
                             and max(remaining) - min(remaining) <= self.max_drafts)
        elif len(running) < len(self._running):
            self.draining = True
        self._running = running

    def _last_requests(self, remaining: Optional[Sequence[int]], batch: int) -> Optional[tuple[set, set]]:
        """When nothing waits to join the batch (`_watch_joining`) and `remaining` (one per row) says what each
        request may still produce: the rows of the requests it ends with (the most tokens still to go) and of
        those near them (within max_drafts: any of them may end it, as a request may stop before its max_tokens);
        else None: every request's tokens count alike."""
        if not (self.draining or self.together) or remaining is None or batch < 2:
            return None
        top = max(remaining)
        return ({i for i, r in enumerate(remaining) if r == top},
                {i for i, r in enumerate(remaining) if r >= top - self.max_drafts})

    def _draft(self, req_ids: Sequence[str], sampled: Sequence[Sequence[int]], lengths: Sequence[int],
               tokens: np.ndarray, remaining: Optional[Sequence[int]] = None) -> tuple[list[list[int]], bool]:
        """The step's drafts, and whether the stores were looked up for them."""
        self.stats["steps"] += 1
        self._end_drafting = None
        self._teach(req_ids, sampled, lengths, tokens)
        states, self._states = self._states, {}
        self._forget_absent(set(req_ids))
        rows = []
        for i, rid in enumerate(req_ids):
            if len(sampled[i]):
                rows.append((i, self._follow(rid, sampled[i], int(lengths[i]), tokens[i])))
        out: list[list[int]] = [[] for _ in req_ids]
        batch = len(req_ids)
        base_ms = self.propose_time.plain_ms(batch)
        self.recent.tick()
        if remaining is not None and len(remaining) != batch:  # not one per row: nothing said
            remaining = None
        ends = self._last_requests(remaining, batch)
        if remaining is not None:
            # a request with r tokens left makes at most r in its next step, its token and r - 1 drafts: vLLM
            # verifies every draft it is given all the same, so one with a token or none left is not looked up
            rows = [(i, state) for i, state in rows if remaining[i] > 1]
        if ends is not None:
            self.stats["last_request_steps"] += 1
            # only the requests near the last are worth drafting for, and only if every last one can gain: one
            # still reading its prompt cannot this step, nor one with a single token to go
            last, near = ends
            decoding = {i for i, _ in rows}
            key = self._end_key([state for i, state in rows if i in last], batch)
            rows = [(i, state) for i, state in rows if i in near] if last <= decoding else []
            if rows and self.wave_ends.losing(key):  # such ends lately spent more than they saved
                self.stats["wave_end_off_steps"] += 1
                rows = []
        counts_of = None if ends is None else (len(ends[0]), len(ends[1]))
        if not rows or self.realized.losing(batch) or not self._drafting_pays(batch, base_ms, counts_of):
            return out, False
        if ends is not None:  # settled at the next step, when what the drafts brought is known
            self._end_drafting = (dict(zip(req_ids, map(int, remaining))), key)
        self.stats["drafting_steps"] += 1
        weak_below = self._draft_bar(batch) if self.dense is not None else 0.0
        chains, raw, chances = [], [], []
        for i, state in rows:
            hidden = self._hidden(req_ids[i], sampled[i], states) if self.dense is not None else None
            chain, chance = self._chain(state, tokens[i], int(lengths[i]), hidden, weak_below,
                                        None if remaining is None else int(remaining[i]) - 1)
            chains.append(chain)
            raw.append(chance)
            chances.append(self.calibration[state.kind].apply(chance))
            self.recent.add(chances[-1])
        base = None  # the plan's default: every request's tokens count in full
        if ends is not None:
            firsts = [c[0] if c else 0.0 for (i, _), c in zip(rows, chances) if i in ends[0]]
            if not last_requests_gain(firsts, self.cost, batch, base_ms):  # not every last one would gain
                return out, True  # the lookups are settled as spent
            base = float(len(rows))  # the near requests' tokens count in full, the others' not at all
        counts = plan_drafts(chances, self.cost, batch=batch, base_ms=base_ms,  # the lookups are made: not counted
                             base=base)
        if self.cost.probe(batch):  # the newest steps cannot tell what a draft costs: this one drafts half
            counts = [k // 2 for k in counts]
        for (i, state), chain, chance, k in zip(rows, chains, raw, counts):
            state.chain, state.chances = (keep_nodes(chain, np.arange(1, k + 1)), chance[:k]) if k else (None, [])
            out[i] = chain.tokens[1:k + 1].tolist()
        return out, True

    def _end_key(self, states: Sequence[RequestState], batch: int) -> str:
        """What a batch end is weighed with (WaveEnds): the kind most of its last requests are (`text` for none)
        and the group of batch sizes (serving.live.batch_group) it had when first served for them this end, as
        'chat/8': an end of 13 requests that all run to max_tokens is not one of two."""
        if self._end_size is None:
            self._end_size = batch
        kinds = [state.kind for state in states]
        kind = max(sorted(set(kinds)), key=kinds.count) if kinds else "text"
        return f"{kind}/{batch_group(self._end_size)}"

    def _settle_wave_step(self, req_ids: Sequence[str], remaining: Optional[Sequence[int]]) -> None:
        """What the last step's drafting for the batch's last requests brought (WaveEnds), against what its drafts
        added to the engine's step and its lookups to propose().  A plain step over B requests takes about F + c B
        (the step cost's: c its mean slope from one request to B, F the rest), so a batch's plain steps take F per
        step and c per step each request is in the batch: the step saved F for each step its end came sooner (the
        most tokens still to go among the requests of both steps fell by more than one) and c for each draft kept
        (a request in the batch a step less)."""
        if self._wave_step is None:
            return
        before, key, drafts, ms = self._wave_step
        self._wave_step = None
        if remaining is None or len(remaining) != len(req_ids):
            return
        now = {rid: int(r) for rid, r in zip(req_ids, remaining)}
        both = before.keys() & now.keys()
        if not both:
            return
        batch = len(before)
        gained = max(0, max(before[rid] for rid in both) - max(now[rid] for rid in both) - 1)
        kept = sum(max(0, before[rid] - now[rid] - 1) for rid in both)
        plain = self.cost(batch, 0)
        per_request = (plain - self.cost(1, 0)) / (batch - 1) if batch > 1 else 0.0
        saved = gained * (plain - batch * per_request) + kept * per_request
        spent = self.cost(batch, drafts) - plain + max(0.0, ms - self.propose_time.plain_ms(batch))
        self.wave_ends.observe(key, saved, spent)

    def _drafting_pays(self, batch: int, base_ms: float, ends: Optional[tuple[int, int]] = None) -> bool:
        """serving.load.typical_pay for the recent chains at this batch size (with `ends`, how many requests the
        batch ends with and how many are near them: serving.load.last_requests_pay, the near ones looked up),
        asked again only when what it weighs has changed: the typical chains, the batch size, the step cost's fit
        or level (to 5%: it scales the engine's times, which propose()'s own are weighed against), or propose()'s
        times (to 0.1 ms).  Right after a forward pass its table work runs from cold caches: 0.17 ms of a 0.34 ms
        step that looked nothing up, at 16 requests on a 2-core Zen 5."""
        prior = self.profile.chain(self.max_drafts)
        looked = batch if ends is None else ends[1]
        typical = self.recent.typical(looked, prior)
        overhead_ms = self.propose_time.drafting_ms(batch) * looked / batch
        key = (batch, ends, self.cost.fits, round(self.cost.level * 20), round(overhead_ms, 1), round(base_ms, 1))
        asked, answered, pays = self._pays
        if asked is not typical or answered != key:
            if ends is None:
                pays = typical_pay(typical, self.cost, batch, overhead_ms, base_ms)
            else:
                pays = last_requests_pay(self.recent.typical(ends[0], prior), typical, self.cost, batch,
                                         overhead_ms, base_ms)
            self._pays = (typical, key, pays)
        return pays

    def warm_up(self) -> None:
        """Do once, at start-up, what the first lookups would otherwise do on the engine's critical path: load
        (or build) the native code of the stores, the tree and the ranking (and the dense store's search)."""
        probe = np.array([7, 8, 9, 7, 8], dtype=np.int64)
        hidden = np.ones(self.dense.mean.shape[0], dtype=np.float32) if self.dense is not None else None
        for kind in self.choosers:
            store = self._request_store(probe)
            self._chain(RequestState(store, len(probe), len(probe), kind), probe, len(probe), hidden, weak_below=1.0)
        self.stats["dense_lookups"] = self.stats["dense_chains"] = 0

    def _chain(self, state: RequestState, row: np.ndarray, length: int, hidden: Optional[np.ndarray] = None,
               weak_below: float = 0.0, most: Optional[int] = None) -> tuple[DraftTree, list[float]]:
        """The request's best chain and its prefixes' chances of acceptance (`hidden`: the state that predicted
        its newest token, for the dense store where the other sources leave the chain weak: its first draft's
        calibrated chance below `weak_below`; `most`: the drafts its tokens left can use)."""
        room = min(self.max_drafts, self.max_len - length - 1)
        if most is not None:
            room = min(room, most)
        context = row[max(0, length - self.settings.n_max):length].tolist()
        stores = self._stores(state, self.history, self.predictions)
        query = query_suffix(context, self.settings)
        lookups = retrieve(query, stores, self.settings) if room > 0 else []
        tree = build_draft_tree(context[-1], lookups, TREE_NODES)
        chooser = self.choosers[state.kind]
        chooser.use_request(state.corrections)
        chain, chances = best_chain(tree, chooser, room)
        if hidden is not None and room > 0 and state.kind == "chat" and self._weak(state.kind, chances, weak_below):
            chain, chances = self._fall_back(context, query, lookups, hidden, chain, chances, room, chooser)
        if chain.draft_size < min(EXTEND_BELOW, room):
            chain, chances = self._extend(state, context, chain, chances, room, chooser)
        if chances and any(_tested(chooser, name) < LEARNED for name in set(chain.sources[1:])):
            # a source the cost model knows little of: its prior is shy by design, and a chain that is never
            # drafted never teaches it; value the chain as recent drafts fared until its counts speak
            chances = [max(c, p) for c, p in zip(chances, self.profile.chain(len(chances)))]
        return chain, chances

    def _draft_bar(self, batch: int) -> float:
        """The chance a draft needs to be worth its share of a step over `batch` requests: what one draft adds to
        the step's time, in the step's own tokens."""
        plain = self.cost(batch, 0)
        return batch * (self.cost(batch, 1) - plain) / plain if plain > 0 else 0.0

    def _weak(self, kind: str, chances: list[float], below: float) -> bool:
        """Whether a chain's first draft, at its calibrated chance, is below `below`."""
        return not chances or self.calibration[kind].apply(chances[:1])[0] < below

    def _fall_back(self, context: list[int], query: list[int], lookups: list, hidden: np.ndarray, chain: DraftTree,
                   chances: list[float], room: int, chooser: CostModel) -> tuple[DraftTree, list[float]]:
        """The best chain of the tree drafted again with the dense store's continuations beside the others'."""
        self.stats["dense_lookups"] += 1
        self.dense.see_state(hidden, context[-1])
        extra = retrieve(query, [self.dense], self.settings)
        if not extra[0].continuations.shape[0]:
            return chain, chances
        tree = build_draft_tree(context[-1], [*lookups, *extra], TREE_NODES)
        again, more = best_chain(tree, chooser, room)
        if more and again.sources[1] == self.dense.source:
            self.stats["dense_chains"] += 1
        return again, more

    def _extend(self, state: RequestState, context: list[int], chain: DraftTree, chances: list[float], room: int,
                chooser: CostModel) -> tuple[DraftTree, list[float]]:
        """A chain the stores' matches of two tokens or more leave short, carried on from its end by what followed
        its newest token alone (as prompt lookup does from one token) in the shared stores and the request, and
        by the model's own predictions after it (the history is indexed from two tokens and left out): the plan
        weighs those drafts at their chances like any, and an engine whose step over a few tokens costs no more
        than one over one token (measured: serving.load) takes them."""
        query = query_suffix(context + chain.tokens[1:].tolist(), self.settings)
        stores = self._stores(state, self.predictions)
        tree = build_draft_tree(query[-1], retrieve(query, stores, self._one_token), TREE_NODES)
        tail, more = best_chain(tree, chooser, room - chain.draft_size)
        if not more:
            return chain, chances
        last = chances[-1] if chances else 1.0
        return join_chains(chain, tail), chances + [last * c for c in more]

    def _request_store(self, tokens: Sequence[int] | np.ndarray) -> RequestStore:
        """A request's own store, indexed from one-token suffixes so that `_extend` can look its newest token up."""
        return RequestStore(tokens, n_max=self.settings.n_max, n_min=1)

    def _stores(self, state: RequestState, *more: Optional[Store]) -> list[Store]:
        """What a request drafts from, in merge order: the shared stores of its kind, its own, then `more`."""
        return [*self.shared.get(state.kind, ()), state.store, *(store for store in more if store is not None)]

    def save_stats(self) -> None:
        """Keep what the choosers learned for the next run (the decoder's acceptance files)."""
        for chooser in self.choosers.values():
            chooser.save_stats()
