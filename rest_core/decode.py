"""The decode loops: plain autoregressive decoding and REST, side by side.

One REST step (`rest_step`) runs the five phases of rest_core.phases in order:

    retrieve  -> look the newest tokens up in every store       (retrieve.py; draft.py: the fallback stores)
    tree      -> merge continuations into a draft tree, sized    (tree.py, cost.py)
    forward   -> one model pass over the flattened tree          (verify.py: tree_forward)
    verify    -> walk the tree with the model's choices          (verify.py: verify)
    commit    -> keep the accepted path in the KV cache          (commit.py)

The KV cache always holds every committed token except the newest one, which
is the root of the next tree.  With no retrieved continuation the tree is the
root alone: an ordinary one-token step, never a dummy draft.  The decoder reads
and tells its stores (datastores.Store) but writes no files: saving a history or
learned acceptance statistics is the caller's call.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, TypeVar

import numpy as np
import torch
from transformers import DynamicCache

from datastores import Lookup, Store
from rest_core.commit import compact_cache
from rest_core.draft import draft
from rest_core.hidden import StateTap, neighbour_windows, state_taps, tell_states
from rest_core.kv_cache import new_cache
from rest_core.model import LoadedModel
from rest_core.phases import PHASES, PhaseTimer
from rest_core.retrieve import RetrieveSettings
from rest_core.sampling import Sampling, draw_token, greedy_choices, next_token_probs, successors_and_choices
from rest_core.trace import Branch, StepHook, StepTrace
from rest_core.tree import DraftTree, row_order
from rest_core.verify import Verdict, tree_forward, verify

if TYPE_CHECKING:
    from rest_core.cost import CostModel

DEFAULT_BUDGET = 16  # draft nodes per step when no cost model decides
# (prompt + answer so far, how many of them the step just committed) -> how many of those to keep
# when decoding must stop here, or None to go on
StopCheck = Callable[[Sequence[int], int], Optional[int]]
TOP_K = 5  # the model's likeliest next tokens kept per node in a trace
T = TypeVar("T")  # what a step generator yields
R = TypeVar("R")  # what it returns


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    sampling: Sampling = Sampling()
    retrieve: RetrieveSettings = RetrieveSettings()
    draft_budget: Optional[int] = None  # draft nodes per step; None = chosen by the cost model
    source_weights: tuple[tuple[str, float], ...] = (("static", 1.0), ("request", 1.0), ("history", 1.0))
    stop_at_eos: bool = True

    def settings(self) -> dict:
        """The config as a flat record (runs, reports): the one place its fields are named."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.sampling.temperature,
                "top_k": self.sampling.top_k, "top_p": self.sampling.top_p, "seed": self.sampling.seed,
                "n_max": self.retrieve.n_max, "n_min": self.retrieve.n_min, "max_matches": self.retrieve.max_matches,
                "continuation_len": self.retrieve.continuation_len,
                "draft_budget": "auto" if self.draft_budget is None else self.draft_budget,
                "stop_at_eos": self.stop_at_eos}

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}.")
        if self.draft_budget is not None and not 0 <= self.draft_budget <= 512:
            raise ValueError(f"draft_budget must be in 0..512 (or None for automatic), got {self.draft_budget}.")
        self.sampling.validate()
        self.retrieve.validate()


@dataclass
class DecodeResult:
    prompt_tokens: list[int]
    tokens: list[int]  # new tokens (EOS included when decoding stopped on it)
    text: str
    steps: int  # forward passes after the prefill (one per emitted token for plain decoding)
    wall_s: float  # prefill included
    prefill_s: float
    stop_reason: str  # "eos" | "length" | "context" | "stopped" (a stop_check said so)
    accepted_drafts: int = 0
    no_draft_steps: int = 0
    draft_tokens: int = 0  # draft nodes sent to the model, all steps
    phase_ms: dict[str, float] = field(default_factory=dict)  # summed over steps
    retrieve_ms: list[float] = field(default_factory=list)  # per step
    budgets: list[int] = field(default_factory=list)  # per step
    drafted_by_source: dict[str, int] = field(default_factory=dict)  # draft nodes sent to the model, per source
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # committed draft tokens, per source

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_accepted(self) -> float:
        """New tokens per forward pass (1.0 for plain decoding)."""
        return len(self.tokens) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0


class PromptError(ValueError):
    """The prompt cannot be decoded as given (empty, or longer than the model's context)."""


def check_prompt(lm: LoadedModel, prompt: Sequence[int], cfg: DecodeConfig) -> int:
    """Refuse an empty or over-long prompt or unknown token ids; the tokens there is room for."""
    if len(prompt) == 0:
        raise PromptError("The prompt is empty: type some text to continue or a question to answer.")
    vocab = lm.vocab_size
    bad = [t for t in prompt if not 0 <= int(t) < vocab]
    if bad:
        raise PromptError(f"The prompt holds token ids outside the model's vocabulary (0..{vocab - 1}): {bad[:5]}. "
                          f"Encode the text with this model's tokenizer.")
    limit = lm.max_positions
    if len(prompt) >= limit:
        raise PromptError(f"The prompt has {len(prompt)} tokens but the model's context holds {limit}: "
                          f"shorten it to fewer than {limit} tokens.")
    return min(cfg.max_new_tokens, limit - len(prompt))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(lm: LoadedModel, prompt: Sequence[int]) -> DynamicCache:
    """Run every prompt token but the last through the model; the last is the first root."""
    cache = new_cache(lm.model)
    if len(prompt) > 1:
        ids = torch.tensor([list(prompt[:-1])], device=lm.device)
        lm.forward(input_ids=ids, cache=cache, logits_to_keep=1)
    return cache


def _cut(tokens: list[int], room: int, eos: set[int], stop_at_eos: bool) -> tuple[list[int], Optional[str]]:
    """Cut a step's new tokens at the first EOS and at the remaining room."""
    if stop_at_eos:
        for i, tok in enumerate(tokens):
            if tok in eos:
                if i + 1 <= room:
                    return tokens[: i + 1], "eos"
                break
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None


def run_through(steps: Generator[T, None, R], each: Callable[[T], None]) -> R:
    """Run a decode's step generator to its end, handing every item it yields to `each`; its return value."""
    while True:
        try:
            item = next(steps)
        except StopIteration as done:
            return done.value
        each(item)


def plain_generate(lm: LoadedModel, prompt: Sequence[int], cfg: DecodeConfig = DecodeConfig(),
                   on_token: Optional[Callable[[int], None]] = None) -> DecodeResult:
    """Plain autoregressive decoding: one forward pass per token, same sampling as REST."""
    return run_through(plain_steps(lm, prompt, cfg), on_token if on_token is not None else lambda token: None)


@torch.inference_mode()
def plain_steps(lm: LoadedModel, prompt: Sequence[int],
                cfg: DecodeConfig = DecodeConfig()) -> Generator[int, None, DecodeResult]:
    """Plain decoding one pass at a time: yields every new token (the first after the prefill); the
    generator's return value is the DecodeResult (its wall time runs from the first step to the last,
    whatever ran between two of them)."""
    cfg.validate()
    room = check_prompt(lm, prompt, cfg)
    gen = cfg.sampling.generator(lm.device)
    eos = lm.eos_token_ids
    start = time.perf_counter()
    cache = prefill(lm, prompt)
    prefill_s = time.perf_counter() - start
    last, out, reason = prompt[-1], [], "context"
    while len(out) < room:
        ids = torch.tensor([[last]], device=lm.device)
        logits = lm.forward(input_ids=ids, cache=cache).logits[0, -1]  # (V,)
        if cfg.sampling.greedy:
            last = greedy_choices(logits[None])[0]
        else:
            last = draw_token(next_token_probs(logits, cfg.sampling), gen)
        out.append(last)
        yield last
        if cfg.stop_at_eos and last in eos:
            reason = "eos"
            break
    else:
        reason = "length" if room == cfg.max_new_tokens else "context"
    wall = time.perf_counter() - start
    return DecodeResult(list(prompt), out, lm.decode(out), steps=len(out),
                        wall_s=wall, prefill_s=prefill_s, stop_reason=reason)


def aggregate_branches(lookups: Sequence[Lookup]) -> list[Branch]:
    """Every distinct retrieved continuation per source with how often it occurred, most frequent first
    (ties in token order)."""
    branches = []
    for lk in lookups:
        rows = lk.continuations
        k = rows.shape[0]
        if k == 0:
            continue
        rows = rows[row_order(rows)]  # equal rows side by side: a run of them is one branch
        first = np.ones(k, dtype=bool)
        first[1:] = (rows[1:] != rows[:-1]).any(axis=1)
        starts = np.flatnonzero(first)
        counts = np.diff(np.append(starts, k)).tolist()
        found = [Branch(lk.source, tuple(t for t in row if t >= 0), count)
                 for row, count in zip(rows[starts].tolist(), counts)]
        found.sort(key=lambda b: (-b.count, b.tokens))
        branches.extend(found)
    return branches


@dataclass
class Step:
    """Everything one REST step produced, for the loop's totals and the per-step trace."""

    prefix_len: int
    query: list[int]  # the newest n_max context tokens, as looked up
    lookups: list
    budget: int
    tree: DraftTree
    positions: torch.Tensor  # (1, q)
    mask: Optional[torch.Tensor]  # (1, 1, q, prefix_len + q); None for a one-token step
    logits: torch.Tensor  # (q, V)
    verdict: Verdict
    new_tokens: list[int]  # committed, after the EOS / room cut
    stop: Optional[str]  # "eos" | "length" when this step ends the decode
    timings_ms: dict[str, float]
    sampling: Sampling = Sampling()
    budget_choice: Optional[dict] = None  # why the cost model kept what it kept (CostModel.decide)
    stores: Sequence[Store] = ()  # the stores looked up (a trace reads the dense store's neighbours' text there)

    def node_probs(self, k: int = TOP_K) -> dict:
        """The StepTrace probability fields: per node the probability of its token at its parent (None at
        the root) and of the model's choice after it, and the k likeliest next tokens with their
        probabilities, from the distributions the verifier used (built for a trace only: the plain loop
        never pays for it)."""
        tree, logits = self.tree, self.logits
        if self.sampling.greedy:
            probs = logits.float().softmax(-1)  # (q, V)
        else:  # the distributions drawn from where the walk went, the same processing elsewhere
            probs = torch.stack([self.verdict.draws[i][1] if i in self.verdict.draws
                                 else next_token_probs(logits[i], self.sampling) for i in range(len(tree))])
        top = probs.topk(min(k, probs.shape[-1]), dim=-1)
        parents = torch.as_tensor(tree.parents[1:], dtype=torch.long)
        drafted = probs[parents, torch.as_tensor(tree.tokens[1:], dtype=torch.long)].tolist() if len(tree) > 1 else []
        chosen = probs[torch.arange(len(tree)), torch.as_tensor(self.verdict.model_choices[:len(tree)])].tolist()
        return {"draft_probs": [None] + drafted, "choice_probs": chosen, "top_tokens": top.indices.tolist(),
                "top_probs": top.values.tolist()}

    def trace(self, index: int) -> StepTrace:
        tree, verdict = self.tree, self.verdict
        q = len(tree)
        mask = self.mask
        if mask is None:  # a one-token step runs with the model's own causal mask: all of the prefix, itself
            mask = torch.zeros((1, 1, 1, self.prefix_len + 1))
        return StepTrace(
            step=index, prefix_len=self.prefix_len, query=[int(t) for t in self.query],
            matched_len={lk.source: int(lk.matched_len) for lk in self.lookups},
            branches=aggregate_branches(self.lookups),
            tree_tokens=tree.tokens.tolist(), tree_parents=tree.parents.tolist(), tree_depths=tree.depths.tolist(),
            tree_scores=[float(s) for s in tree.scores], tree_sources=list(tree.sources),
            position_ids=self.positions[0].tolist(), mask=mask, model_choices=list(verdict.model_choices[:q]),
            accepted_nodes=list(verdict.accepted_nodes), bonus_token=int(verdict.bonus_token),
            new_tokens=list(self.new_tokens), timings_ms=dict(self.timings_ms),
            **self.node_probs(), uniforms={node: u for node, (u, _) in self.verdict.draws.items()},
            **_chances_apart(self.budget_choice), neighbours=neighbour_windows(self.lookups, self.stores))


def _chances_apart(why: Optional[dict]) -> dict:
    """The StepTrace fields of the cost model's choice: its reasons (budget_choice) and, per node, the chance
    it gave each kept node (node_chances: None at the root)."""
    if why is None:
        return {"budget_choice": None}
    reasons = {k: v for k, v in why.items() if k != "chances"}
    chances = why.get("chances")
    return {"budget_choice": reasons, "node_chances": [None, *chances] if chances else []}


def rest_step(lm: LoadedModel, cache: DynamicCache, context: list[int], stores: Sequence[Store], cfg: DecodeConfig,
              max_budget: int, chooser: Optional[CostModel], gen: Optional[torch.Generator], room: int,
              taps: Optional[dict[int, StateTap]] = None) -> Step:
    """One REST step: retrieve, draft tree, forward, verify, commit.  Extends `context`, `cache` and the stores
    (`taps`: the hidden-state hooks of the stores that draft from the model's state, `state_taps`)."""
    timer = PhaseTimer(sync=(lambda: torch.cuda.synchronize(lm.device)) if lm.device.type == "cuda" else None)
    prefix_len = len(context) - 1
    budget = max(0, min(max_budget, lm.max_positions - prefix_len - 1))
    query, lookups, tree, why = draft(timer, context, stores, cfg.retrieve, budget, dict(cfg.source_weights), chooser)
    if chooser is not None:
        budget = tree.draft_size
    with timer("forward"):
        logits, positions, mask = tree_forward(lm, tree, prefix_len, cache)
    with timer("verify"):
        want = max((s.successors_k for s in stores), default=0)  # the stores that learn from the model's top k
        top, choices = successors_and_choices(logits, want) if want > 0 else (None, None)
        verdict = verify(tree, logits, cfg.sampling, gen, choices)
    with timer("commit"):
        if top is not None:
            _teach(stores, tree, top, context[-2] if len(context) > 1 else -1)
        if len(tree) > 1:  # a one-token pass added just the root's slot, which is kept: nothing to compact
            compact_cache(cache, prefix_len, verdict.accepted_nodes)
        proposed = [int(tree.tokens[n]) for n in verdict.accepted_nodes[1:]] + [verdict.bonus_token]
        new, stop = _cut(proposed, room, lm.eos_token_ids, cfg.stop_at_eos)
        context.extend(new)
        for store in stores:
            store.extend(new)
        if taps and len(new) == len(proposed):  # the last accepted node's state predicted the bonus token
            tell_states(stores, taps, verdict.accepted_nodes[-1], verdict.bonus_token)
    return Step(prefix_len, query, lookups, budget, tree, positions, mask, logits, verdict, new, stop, timer.ms,
                cfg.sampling, why, stores)


def _teach(stores: Sequence[Store], tree: DraftTree, top: np.ndarray, before_root: int) -> None:
    """Hand every node's top predictions ((q, k) token ids, best first), and the token before each node (its
    parent's; `before_root` for the root), to the stores that learn from the model."""
    previous = tree.tokens[np.maximum(tree.parents, 0)]
    previous[0] = before_root
    for store in stores:
        if store.successors_k > 0:
            store.observe(tree.tokens, top[:, :store.successors_k], previous)


class RestDecoder:
    """REST decoding over any stores (datastores.Store; see datastores.assemble_stores).

    Every store is told where each request stands (begin / extend / end), so the request
    store follows the answer and the history store learns finished answers.
    `budget_chooser` (a cost.CostModel) picks the draft size per step when the config
    leaves draft_budget to it (`decide(tree)`: the cut tree and why), told when each request
    begins (`begin_request`) and what every step accepted (`observe`); without one the budget is
    DEFAULT_BUDGET.  `undisturbed(since)`: whether nothing else took the cores since `since` (perf_counter);
    a step it denies teaches acceptance but not the cost curve.
    """

    def __init__(self, lm: LoadedModel, stores: Sequence[Store] = (), budget_chooser=None,
                 undisturbed: Optional[Callable[[float], bool]] = None):
        self.lm = lm
        self.stores = list(stores)
        self.budget_chooser = budget_chooser
        self.undisturbed = undisturbed

    def generate(self, prompt: Sequence[int], cfg: DecodeConfig = DecodeConfig(), hook: Optional[StepHook] = None,
                 update_history: bool = True, stop_check: Optional[StopCheck] = None) -> DecodeResult:
        """Decode; `hook` (if any) receives a StepTrace per step; `update_history` lets stores keep the answer;
        `stop_check(sequence, new)` (if any) sees prompt + answer after each step, `new` of them just committed,
        and returns how many of those to keep when decoding must stop there (None: go on)."""
        steps = self._run(prompt, cfg, want_trace=hook is not None, update_history=update_history,
                          stop_check=stop_check)
        return run_through(steps, hook)

    def stream(self, prompt: Sequence[int], cfg: DecodeConfig = DecodeConfig(),
               update_history: bool = True) -> Iterator[StepTrace]:
        """Yield a StepTrace per step; the generator's return value is the DecodeResult."""
        return (yield from self._run(prompt, cfg, want_trace=True, update_history=update_history))

    @torch.inference_mode()
    def _run(self, prompt: Sequence[int], cfg: DecodeConfig, want_trace: bool, update_history: bool,
             stop_check: Optional[StopCheck] = None):
        cfg.validate()
        lm = self.lm
        room = check_prompt(lm, prompt, cfg)
        gen = cfg.sampling.generator(lm.device)
        chooser = self.budget_chooser if cfg.draft_budget is None else None
        max_budget = cfg.draft_budget if cfg.draft_budget is not None else \
            (chooser.max_budget if chooser is not None else DEFAULT_BUDGET)
        for store in self.stores:
            store.begin(prompt, cfg.retrieve.n_max, cfg.retrieve.n_min)
        if chooser is not None:
            chooser.begin_request()
        taps = state_taps(lm, self.stores)
        try:
            return (yield from self._loop(prompt, cfg, want_trace, update_history, stop_check, room, gen, chooser,
                                          max_budget, taps))
        finally:
            for tap in taps.values():
                tap.close()

    def _loop(self, prompt, cfg, want_trace, update_history, stop_check, room, gen, chooser, max_budget, taps):
        lm = self.lm
        start = time.perf_counter()
        cache = prefill(lm, prompt)
        _sync(lm.device)
        if taps and len(prompt) > 1:  # the prefill's last state predicted the prompt's last token
            tell_states(self.stores, taps, -1, prompt[-1])
        res = DecodeResult(list(prompt), [], "", 0, 0.0, time.perf_counter() - start, "context",
                           phase_ms={p: 0.0 for p in PHASES})
        context = list(prompt)
        while len(res.tokens) < room:
            began = time.perf_counter()
            step = rest_step(lm, cache, context, self.stores, cfg, max_budget, chooser, gen, room - len(res.tokens),
                             taps)
            keep = stop_check(context, len(step.new_tokens)) if stop_check is not None else None
            if keep is not None and (step.stop is None or keep < len(step.new_tokens)):
                del step.new_tokens[keep:]
                step.stop = "stopped"
            _tally(res, step)
            if chooser is not None:
                quiet = self.undisturbed is None or self.undisturbed(began)
                chooser.observe(step.tree, step.verdict.accepted_nodes, step.timings_ms["forward"] if quiet else None)
            if want_trace:
                yield step.trace(res.steps - 1)
            if step.stop is not None:
                res.stop_reason = "context" if step.stop == "length" and room < cfg.max_new_tokens else step.stop
                break
        res.wall_s = time.perf_counter() - start
        res.text = lm.decode(res.tokens)
        for store in self.stores:
            store.end(res.tokens, update_history)
        return res


def _tally(res: DecodeResult, step: Step) -> None:
    """Add one step to the decode's totals."""
    res.tokens.extend(step.new_tokens)
    for phase, ms in step.timings_ms.items():
        res.phase_ms[phase] += ms
    res.retrieve_ms.append(step.timings_ms["retrieve"])
    res.budgets.append(step.budget)
    res.draft_tokens += len(step.tree) - 1
    committed = min(len(step.verdict.accepted_nodes) - 1, len(step.new_tokens))  # committed drafts only
    res.accepted_drafts += committed
    for source in step.tree.sources[1:]:
        res.drafted_by_source[source] = res.drafted_by_source.get(source, 0) + 1
    for node in step.verdict.accepted_nodes[1:1 + committed]:
        source = step.tree.sources[node]
        res.accepted_by_source[source] = res.accepted_by_source.get(source, 0) + 1
    res.no_draft_steps += len(step.tree) == 1
    res.steps += 1
