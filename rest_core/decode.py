"""The decode loops: plain autoregressive decoding and REST, side by side.

A REST step runs four named phases (plus the bookkeeping that follows):

    retrieve  -> look the newest tokens up in every store       (retrieve.py)
    tree      -> merge continuations into a draft tree           (tree.py)
    forward   -> one model pass over the flattened tree          (here)
    verify    -> walk the tree with the model's choices          (verify.py)
    commit    -> keep the accepted path in the KV cache          (commit.py)

The KV cache always holds every committed token except the newest one, which
is the root of the next tree.  With no retrieved continuation the tree is the
root alone: an ordinary one-token step, never a dummy draft.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from rest_core.commit import compact_cache
from rest_core.model import LoadedModel
from rest_core.retrieve import RetrieveSettings, query_suffix, retrieve
from rest_core.sampling import Sampling, draw_token, next_token_probs
from rest_core.trace import Branch, StepHook, StepTrace
from rest_core.tree import build_draft_tree, prune_tree, root_only, tree_mask, tree_positions
from rest_core.verify import verify


DEFAULT_BUDGET = 16  # draft nodes per step when no cost model decides


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    sampling: Sampling = Sampling()
    retrieve: RetrieveSettings = RetrieveSettings()
    draft_budget: Optional[int] = None  # draft nodes per step; None = chosen by the cost model
    source_weights: tuple[tuple[str, float], ...] = (("static", 1.0), ("request", 1.0), ("history", 1.0))
    stop_at_eos: bool = True

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
    stop_reason: str  # "eos" | "length" | "context"
    accepted_drafts: int = 0
    no_draft_steps: int = 0
    draft_tokens: int = 0  # draft nodes sent to the model, all steps
    phase_ms: dict[str, float] = field(default_factory=dict)  # summed over steps
    retrieve_ms: list[float] = field(default_factory=list)  # per step
    budgets: list[int] = field(default_factory=list)  # per step

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


def _check_prompt(lm: LoadedModel, prompt: Sequence[int], cfg: DecodeConfig) -> int:
    if len(prompt) == 0:
        raise PromptError("The prompt is empty: type some text to continue or a question to answer.")
    vocab = lm.model.get_input_embeddings().num_embeddings
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


def _prefill(lm: LoadedModel, prompt: Sequence[int]) -> DynamicCache:
    """Run every prompt token but the last through the model; the last is the first root."""
    cache = DynamicCache(config=lm.model.config)
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


@torch.inference_mode()
def plain_generate(lm: LoadedModel, prompt: Sequence[int], cfg: DecodeConfig = DecodeConfig(),
                   on_token: Optional[Callable[[int], None]] = None) -> DecodeResult:
    """Plain autoregressive decoding: one forward pass per token, same sampling as REST."""
    cfg.validate()
    room = _check_prompt(lm, prompt, cfg)
    gen = cfg.sampling.generator(lm.device)
    eos = lm.eos_token_ids
    start = time.perf_counter()
    cache = _prefill(lm, prompt)
    prefill_s = time.perf_counter() - start
    last, out, reason = prompt[-1], [], "context"
    while len(out) < room:
        ids = torch.tensor([[last]], device=lm.device)
        logits = lm.forward(input_ids=ids, cache=cache).logits[0, -1]  # (V,)
        if cfg.sampling.greedy:
            last = int(logits.argmax())
        else:
            last = draw_token(next_token_probs(logits, cfg.sampling), gen)
        out.append(last)
        if on_token is not None:
            on_token(last)
        if cfg.stop_at_eos and last in eos:
            reason = "eos"
            break
    else:
        reason = "length" if room == cfg.max_new_tokens else "context"
    wall = time.perf_counter() - start
    return DecodeResult(list(prompt), out, lm.tokenizer.decode(out, skip_special_tokens=True), steps=len(out),
                        wall_s=wall, prefill_s=prefill_s, stop_reason=reason)


class RestDecoder:
    """REST decoding over a static datastore and the dynamic stores.

    `stores` are objects with ``source`` and ``lookup(...)`` (see datastores):
    a static TokenDatastore, a HistoryStore of past answers; the request store
    (prompt + answer so far) is made per call when ``use_request_store``.
    `budget_chooser` (a cost.CostModel) picks the draft size per step when the
    config leaves draft_budget to it; without one the budget is DEFAULT_BUDGET.
    """

    def __init__(self, lm: LoadedModel, static_store=None, history_store=None, use_request_store: bool = True,
                 budget_chooser=None):
        self.lm = lm
        self.static_store = static_store
        self.history_store = history_store
        self.use_request_store = use_request_store
        self.budget_chooser = budget_chooser

    # -- public API -------------------------------------------------------
    def generate(self, prompt: Sequence[int], cfg: DecodeConfig = DecodeConfig(), hook: Optional[StepHook] = None,
                 update_history: bool = True) -> DecodeResult:
        steps = self._run(prompt, cfg, want_trace=hook is not None, update_history=update_history)
        while True:
            try:
                trace = next(steps)
            except StopIteration as done:
                return done.value
            if hook is not None:
                hook(trace)

    def stream(self, prompt: Sequence[int], cfg: DecodeConfig = DecodeConfig(),
               update_history: bool = True) -> Iterator[StepTrace]:
        """Yield a StepTrace per step; the generator's return value is the DecodeResult."""
        return (yield from self._run(prompt, cfg, want_trace=True, update_history=update_history))

    # -- the loop -----------------------------------------------------------
    @torch.inference_mode()
    def _run(self, prompt: Sequence[int], cfg: DecodeConfig, want_trace: bool, update_history: bool):
        cfg.validate()
        lm = self.lm
        room = _check_prompt(lm, prompt, cfg)
        gen = cfg.sampling.generator(lm.device)
        eos = lm.eos_token_ids
        weights = dict(cfg.source_weights)
        stores = [s for s in (self.static_store, self.history_store) if s is not None]
        if self.use_request_store:
            from datastores import RequestStore

            stores.insert(1 if self.static_store is not None else 0,
                          RequestStore(prompt, n_max=cfg.retrieve.n_max, n_min=cfg.retrieve.n_min))
        request_store = next((s for s in stores if s.source == "request"), None)

        start = time.perf_counter()
        cache = _prefill(lm, prompt)
        _sync(lm.device)
        prefill_s = time.perf_counter() - start
        context = list(prompt)
        out: list[int] = []
        res = DecodeResult(list(prompt), out, "", 0, 0.0, prefill_s, "context",
                           phase_ms={p: 0.0 for p in ("retrieve", "tree", "forward", "verify", "commit")})
        chooser = self.budget_chooser if cfg.draft_budget is None else None
        if cfg.draft_budget is not None:
            max_budget = cfg.draft_budget
        else:
            max_budget = chooser.max_budget if chooser is not None else DEFAULT_BUDGET
        step = 0
        while len(out) < room:
            prefix_len = len(context) - 1
            budget = max(0, min(max_budget, lm.max_positions - prefix_len - 1))

            t0 = time.perf_counter()
            query = query_suffix(context, cfg.retrieve)
            lookups = retrieve(query, stores, cfg.retrieve) if budget > 0 else []
            t1 = time.perf_counter()
            tree = build_draft_tree(context[-1], lookups, budget, weights) if lookups else root_only(context[-1])
            if chooser is not None:
                budget = chooser.choose(tree)
                tree = prune_tree(tree, budget)
            q = len(tree)
            ids = torch.from_numpy(tree.tokens).to(lm.device).unsqueeze(0)  # (1, q)
            positions = tree_positions(tree, prefix_len, lm.device)  # (1, q)
            mask = tree_mask(tree, prefix_len, lm.dtype, lm.device) if q > 1 else None  # (1, 1, q, prefix+q)
            t2 = time.perf_counter()
            logits = lm.forward(input_ids=ids, position_ids=positions, attention_mask=mask,
                                cache=cache).logits[0]  # (q, V)
            _sync(lm.device)
            t3 = time.perf_counter()
            verdict = verify(tree, logits, cfg.sampling, gen)
            t4 = time.perf_counter()
            compact_cache(cache, prefix_len, verdict.accepted_nodes)
            proposed = [int(tree.tokens[n]) for n in verdict.accepted_nodes[1:]] + [verdict.bonus_token]
            new, reason = _cut(proposed, room - len(out), eos, cfg.stop_at_eos)
            out.extend(new)
            context.extend(new)
            if request_store is not None:
                request_store.extend(new)
            t5 = time.perf_counter()

            timings = {"retrieve": (t1 - t0) * 1e3, "tree": (t2 - t1) * 1e3, "forward": (t3 - t2) * 1e3,
                       "verify": (t4 - t3) * 1e3, "commit": (t5 - t4) * 1e3}
            for phase, ms in timings.items():
                res.phase_ms[phase] += ms
            res.retrieve_ms.append(timings["retrieve"])
            res.budgets.append(budget)
            res.draft_tokens += q - 1
            res.accepted_drafts += min(len(verdict.accepted_nodes) - 1, len(new))  # committed drafts only
            res.no_draft_steps += q == 1
            res.steps += 1
            if chooser is not None:
                chooser.observe(tree, verdict.accepted_nodes, timings["forward"])
            if want_trace:
                yield self._trace(step, prefix_len, query, lookups, tree, positions, mask, logits, verdict,
                                  new, timings)
            step += 1
            if reason is not None:
                res.stop_reason = "context" if reason == "length" and room < cfg.max_new_tokens else reason
                break
        res.wall_s = time.perf_counter() - start
        res.text = lm.tokenizer.decode(out, skip_special_tokens=True)
        if chooser is not None:
            chooser.save_stats()
        if update_history and self.history_store is not None and out:
            self.history_store.add(out)
            if getattr(self.history_store, "path", None) is not None:
                self.history_store.save()
        return res

    @staticmethod
    def _trace(step, prefix_len, query, lookups, tree, positions, mask, logits, verdict, new, timings) -> StepTrace:
        branches = []
        for lk in lookups:
            if lk.continuations.shape[0] == 0:
                continue
            uniq, counts = np.unique(lk.continuations, axis=0, return_counts=True)
            found = [Branch(lk.source, tuple(int(t) for t in row if t >= 0), int(count))
                     for row, count in zip(uniq, counts)]
            branches.extend(sorted(found, key=lambda b: (-b.count, b.tokens)))
        q = len(tree)
        if mask is None:  # a one-token step runs with the model's own causal mask: all of the prefix, itself
            mask = torch.zeros((1, 1, 1, prefix_len + 1))
        return StepTrace(
            step=step, prefix_len=prefix_len, query=[int(t) for t in query],
            matched_len={lk.source: int(lk.matched_len) for lk in lookups},
            branches=branches,
            tree_tokens=tree.tokens.tolist(), tree_parents=tree.parents.tolist(), tree_depths=tree.depths.tolist(),
            tree_scores=[float(s) for s in tree.scores], tree_sources=list(tree.sources),
            position_ids=positions[0].tolist(), mask=mask, model_choices=list(verdict.model_choices[:q]),
            accepted_nodes=list(verdict.accepted_nodes), bonus_token=int(verdict.bonus_token),
            new_tokens=list(new), timings_ms=timings)

