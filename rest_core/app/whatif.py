""""What if" on a recorded step: the step run again with other settings, on the run's model.

The context before step k is the run's prompt plus every token steps 0..k-1 committed (checked
against the step's recorded prefix length and suffix).  From that context one REST step runs as
the decoder runs it (`rest_core.decode.rest_step`: retrieve, draft tree, one forward pass, verify)
with the draft budget, suffix lengths, continuation length and stores asked for.  The static store
is searched again and the request store rebuilt from the context; the history store and the model's
own predictions change as a visitor decodes and their state is not kept, so their continuations at
that step are replayed from the trace (`ReplayedStore`: at most 32 per store were recorded).

Greedy runs replay exactly.  A sampled run with a seed replays with the same uniform numbers (the
generator advanced past the draws of the earlier steps, checked against the draws recorded at this
step); without a seed, or when they disagree, the what-if accepts greedily and says so.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch

from datastores import DatastoreError, Lookup, RequestStore, StoreBase
from datastores.common import empty_lookup
from rest_core.decode import DEFAULT_BUDGET, DecodeConfig, Step, prefill, rest_step
from rest_core.model import LoadedModel
from rest_core.retrieve import MAX_MATCHES, RetrieveSettings
from rest_core.sampling import Sampling, draw_uniform
from rest_core.tree import DraftTree, keep_nodes

SOURCES = ("static", "answers", "request", "history", "model")  # the draft sources a what-if can switch
REPLAYED = ("answers", "history", "model")  # their state at a step is not kept: replayed from the trace
AS_RECORDED, AUTO, FIXED = "as recorded", "auto", "fixed"
AUTO_MAX_BUDGET = 63  # the largest tree the automatic budget starts from (rest_core.cost)


class WhatIfError(ValueError):
    """The step cannot be run again as asked; the message says why."""


@dataclass(frozen=True)
class WhatIf:
    """The settings a recorded step is run again with."""

    budget_mode: str = AS_RECORDED  # as recorded | auto (the cost model now) | fixed
    budget: int = 16  # draft tokens, for a fixed budget
    n_max: int = 16
    n_min: int = 2
    continuation_len: int = 10
    sources: tuple[str, ...] = SOURCES

    def check(self) -> WhatIf:
        """These settings, checked (ValueError naming the setting and its range)."""
        if self.budget_mode not in (AS_RECORDED, AUTO, FIXED):
            raise ValueError(f"The budget must be '{AS_RECORDED}', '{AUTO}' or '{FIXED}', not {self.budget_mode!r}.")
        if not 0 <= int(self.budget) <= 64:
            raise ValueError(f"The fixed budget must be between 0 and 64 draft tokens, not {self.budget}.")
        unknown = [s for s in self.sources if s not in SOURCES]
        if unknown:
            raise ValueError(f"Unknown store {unknown[0]!r}: choose among {', '.join(SOURCES)}.")
        RetrieveSettings(int(self.n_max), int(self.n_min), 1, int(self.continuation_len)).validate()
        return self


def run_sources(run: dict) -> list[str]:
    """The draft sources a recorded run used, from its store labels ("static:NAME", "request", ...)."""
    return [str(label).split(":")[0] for label in (run.get("stores") or [])]


def own_settings(run: dict) -> WhatIf:
    """The run's own settings, as a what-if starts from."""
    s = run.get("settings") or {}
    return WhatIf(AS_RECORDED, int(s["draft_budget"]) if str(s.get("draft_budget")).isdigit() else 16,
                  int(s.get("n_max") or 16), int(s.get("n_min") or 2), int(s.get("continuation_len") or 10),
                  tuple(src for src in SOURCES if src in run_sources(run)))


def step_context(run: dict, steps: Sequence[dict], k: int) -> list[int]:
    """Prompt + every token committed before step k: the context step k started from (WhatIfError when
    the recorded run does not rebuild it exactly)."""
    prompt = run.get("prompt_ids")
    if not prompt:
        raise WhatIfError("This run was recorded without its prompt's tokens, so the context of its steps cannot "
                          "be rebuilt: a what-if needs a run recorded by this version of REST Lab.")
    if not 0 <= k < len(steps) or any(s["step"] != i for i, s in enumerate(steps[:k + 1])):
        raise WhatIfError(f"Step {k} or a step before it is missing from the trace, so its context cannot be "
                          "rebuilt.")
    context = [int(t) for t in prompt] + [int(t) for s in steps[:k] for t in s["new_tokens"]]
    query = [int(t) for t in steps[k]["query"]]
    if len(context) - 1 != steps[k]["prefix_len"] or context[-len(query):] != query:
        raise WhatIfError(f"The recorded steps do not add up to step {k}'s context (its prefix or suffix differs), "
                          "so it cannot be run again exactly.")
    return context


class ReplayedStore(StoreBase):
    """A draft source answering with the continuations a recorded step stored for it (suffix length as
    recorded; rows cut to the continuation length asked for)."""

    def __init__(self, source: str, matched_len: int, branches: Sequence[dict]):
        self.source, self.matched_len = source, int(matched_len)
        self.branches = [(tuple(int(t) for t in b["tokens"]), int(b["count"])) for b in branches
                         if b["source"] == source and b["tokens"]]

    def lookup(self, context: Any, n_max: int = 16, n_min: int = 2, max_matches: int = 5000,
               continuation_len: int = 10) -> Lookup:
        if not self.matched_len or not self.branches:
            return empty_lookup(self.source, continuation_len)
        rows = np.full((len(self.branches), continuation_len), -1, dtype=np.int64)  # (distinct, L)
        for i, (tokens, _) in enumerate(self.branches):
            rows[i, :min(len(tokens), continuation_len)] = tokens[:continuation_len]
        rows = np.repeat(rows, [count for _, count in self.branches], axis=0)[:max_matches]  # (k, L)
        return Lookup(self.source, self.matched_len, int(rows.shape[0]), rows)


class RecordedPick:
    """Keeps the draft nodes a recorded step kept (matched by their tokens from the root): the automatic
    budget's choice at that step, as recorded, applied to a tree built again."""

    def __init__(self, nodes: Sequence[dict]):
        paths: dict[int, tuple[int, ...]] = {}
        for n in nodes:
            paths[n["node"]] = () if n["parent"] < 0 else paths[n["parent"]] + (int(n["token_id"]),)
        self.paths = set(paths.values())

    def decide(self, tree: DraftTree) -> tuple[DraftTree, None]:
        """The rebuilt tree cut to the recorded nodes, and no reasons (no cost model chose)."""
        paths: list[tuple[int, ...]] = [()]
        keep = []
        for i in range(1, len(tree)):
            paths.append(paths[int(tree.parents[i])] + (int(tree.tokens[i]),))
            if paths[i] in self.paths and (tree.parents[i] == 0 or int(tree.parents[i]) in keep):
                keep.append(i)
        return keep_nodes(tree, np.array(keep, dtype=np.int64)), None


def replayed_sampling(run: dict, steps: Sequence[dict], k: int, step: dict) -> tuple[Sampling, Any, str]:
    """(sampling, generator, how it is drawn, in words) for running step k again."""
    s = run.get("settings") or {}
    temperature = float(s.get("temperature") or 0.0)
    if temperature <= 0:
        return Sampling(), None, "greedy, as recorded: the model's likeliest token at every node"
    sampling = Sampling(temperature=temperature, top_k=int(s.get("top_k") or 0), top_p=float(s.get("top_p") or 1.0),
                        seed=None if s.get("seed") in (None, "") else int(s["seed"]))
    greedy = replace(sampling, temperature=0.0)
    if sampling.seed is None:
        return greedy, None, ("this run was sampled without a seed, so its draws cannot be repeated: the what-if "
                              "accepts greedily (the model's likeliest token at every node)")
    gen = sampling.generator(torch.device("cpu"))
    for _ in range(sum(int(r["accepted_len"]) + 1 for r in steps[:k])):  # one uniform per node visited before
        draw_uniform(gen)
    drawn = [n["uniform"] for n in sorted(step["nodes"], key=lambda n: n["depth"]) if n.get("uniform") is not None]
    peek = torch.Generator().set_state(gen.get_state())
    if not drawn or any(abs(draw_uniform(peek) - u) > 1e-12 for u in drawn):
        return greedy, None, ("this run's recorded draws could not be repeated here: the what-if accepts greedily "
                              "(the model's likeliest token at every node)")
    return sampling, gen, (f"sampled with the run's seed {sampling.seed}, the generator advanced past the earlier "
                           "steps' draws: the same uniform numbers the run drew at this step")


@dataclass
class Replay:
    """What a what-if needs besides the model: the context, the stores and the budget decision."""

    context: list[int]
    stores: list
    cfg: DecodeConfig
    max_budget: int
    chooser: Any  # None (fixed budget), a cost model (auto) or a RecordedPick (as recorded)
    gen: Optional[torch.Generator]
    room: int  # tokens the run could still commit
    notes: list[str] = field(default_factory=list)


def replay_plan(run: dict, steps: Sequence[dict], k: int, step: dict, wi: WhatIf, static: Any,
                chooser_for: Any, max_positions: int) -> Replay:
    """Context, stores and budget for running step k again (`static`: the static store, or None;
    `chooser_for(stores)`: the cost model for those stores, or None)."""
    s = run.get("settings") or {}
    context = step_context(run, steps, k)
    notes: list[str] = []
    stores: list = []
    recorded = step.get("matched_len") or {}
    if "static" in wi.sources and static is not None:
        stores.append(static)
    if "request" in wi.sources:
        request = RequestStore(n_max=wi.n_max, n_min=wi.n_min)
        request.begin(run["prompt_ids"], wi.n_max, wi.n_min)
        request.extend(context[len(run["prompt_ids"]):])
        stores.append(request)
    for source in REPLAYED:
        if source not in wi.sources:
            continue
        if source not in recorded:
            notes.append(f"The run did not draft from the {source} store, so there is nothing of it to replay.")
            continue
        stores.append(ReplayedStore(source, recorded[source], step["branches"]))
        notes.append(f"The {'model' if source == 'model' else source} source is replayed from the trace: its "
                     "state at this step is not kept, so the continuations it gave then are used (at most 32 were "
                     "recorded; its suffix length stays as recorded).")
    retrieve = RetrieveSettings(wi.n_max, wi.n_min, int(s.get("max_matches") or MAX_MATCHES), wi.continuation_len)
    sampling, gen, drawn = replayed_sampling(run, steps, k, step)
    notes.append(f"Acceptance: {drawn}.")
    cfg = DecodeConfig(max_new_tokens=int(s.get("max_new_tokens") or 128), sampling=sampling, retrieve=retrieve,
                       stop_at_eos=bool(s.get("stop_at_eos", True)))
    room = min(cfg.max_new_tokens, max_positions - len(run["prompt_ids"])) - (len(context) - len(run["prompt_ids"]))
    recorded_budget = s.get("draft_budget")
    if wi.budget_mode == FIXED or (wi.budget_mode == AS_RECORDED and str(recorded_budget).isdigit()):
        budget = int(wi.budget) if wi.budget_mode == FIXED else int(recorded_budget)
        return Replay(context, stores, replace(cfg, draft_budget=budget), budget, None, gen, room, notes)
    if wi.budget_mode == AS_RECORDED:
        notes.append(f"Budget as recorded: the {step['draft_size']} draft nodes the cost model kept at this step, "
                     "wherever the tree built again holds them.")
        return Replay(context, stores, cfg, AUTO_MAX_BUDGET, RecordedPick(step["nodes"]), gen, room, notes)
    chooser = chooser_for(stores)
    if chooser is None:
        notes.append(f"No cost model is measured here: the automatic budget keeps {DEFAULT_BUDGET} draft nodes.")
        return Replay(context, stores, cfg, DEFAULT_BUDGET, None, gen, room, notes)
    notes.append("Budget auto: chosen by the cost model as it stands now (it has learned since the run).")
    return Replay(context, stores, cfg, int(getattr(chooser, "max_budget", AUTO_MAX_BUDGET)), chooser, gen, room,
                  notes)


@torch.inference_mode()
def replay_step(lm: LoadedModel, plan: Replay, index: int) -> Step:
    """Run the planned step: the context through the model, then one REST step (nothing is recorded and
    no store but the what-if's own request store changes)."""
    if plan.room <= 0:
        raise WhatIfError("The run had no room left for tokens at this step.")
    try:
        cache = prefill(lm, plan.context)
        return rest_step(lm, cache, list(plan.context), plan.stores, plan.cfg, plan.max_budget, plan.chooser,
                         plan.gen, plan.room)
    except DatastoreError as err:
        raise WhatIfError(f"Step {index} could not be run again: {err}") from None
