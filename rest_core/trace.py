"""What one decoding step looked like: the object every per-step hook receives.

A `StepTrace` is the product of one REST step, built only when a hook or a
stream asks for it (plain `generate()` never builds one).  Fields follow the
step's phases: the query suffix and what each source retrieved, the draft tree,
the exact tree mask handed to the model, the model's choice at every node, the
accepted path with its bonus token, and the time each phase took.

Tree layout, shared by every consumer (recorder, figures, app):
node 0 is the root, the last committed token (its key/value is not yet in the
cache); nodes 1.. are draft tokens sorted by depth; ``tree_parents[i] < i``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class Branch:
    """One distinct continuation found by one source, with how often it occurred."""

    source: str  # the store's draft source name
    tokens: tuple[int, ...]
    count: int


@dataclass
class StepTrace:
    step: int  # 0-based index of this step (one forward pass)
    prefix_len: int  # tokens already in the KV cache when the step ran
    query: list[int]  # the newest context tokens that were looked up (longest suffix tried)
    matched_len: dict[str, int]  # per draft source: length of the longest suffix that matched (0 = none)
    branches: list[Branch]  # every retrieved continuation, aggregated per source
    tree_tokens: list[int]  # node token ids; node 0 = root (last committed token)
    tree_parents: list[int]  # parent node index; -1 for the root
    tree_depths: list[int]  # root = 0
    tree_scores: list[float]  # merged retrieval weight of the prefix ending at each node (root: total)
    tree_sources: list[str]  # source contributing most weight to each node ("" for root)
    position_ids: list[int]  # positions passed to the model: prefix_len + depth
    mask: torch.Tensor  # the exact 4D float mask passed to the model, (1, 1, q, prefix_len + q)
    model_choices: list[int]  # per node: the token the verifier chose after it
    # (greedy: argmax; sampling: the drawn token at visited nodes, argmax elsewhere)
    accepted_nodes: list[int]  # path from the root through every accepted draft node
    bonus_token: int  # the token the model produced after the last accepted node
    new_tokens: list[int]  # tokens committed by this step (accepted drafts + bonus), after EOS/length cuts
    timings_ms: dict[str, float] = field(default_factory=dict)  # keys: rest_core.phases.PHASES
    # What the model thought, from the verify pass's logits (empty when not known, e.g. an old trace).
    # The distribution is the one the verifier used: softmax of the logits for greedy, after
    # temperature / top-k / top-p when sampling.
    draft_probs: list[Optional[float]] = field(default_factory=list)  # per node: its token's probability
    # at its parent (None at the root)
    choice_probs: list[float] = field(default_factory=list)  # per node: the probability of its model choice
    top_tokens: list[list[int]] = field(default_factory=list)  # per node: the model's likeliest next tokens
    top_probs: list[list[float]] = field(default_factory=list)  # per node: their probabilities
    uniforms: dict[int, float] = field(default_factory=dict)  # sampling: visited node -> the uniform drawn there
    # the cost model's choice (rest_core.cost.CostModel.decide): candidates, kept, expected_accepted,
    # relative_cost, request_factors; None when no cost model chose (a fixed budget, nothing retrieved)
    budget_choice: Optional[dict] = None
    # per node: the chance the cost model gave it of being accepted (its path's product; None at the root);
    # empty when no cost model chose
    node_chances: list[Optional[float]] = field(default_factory=list)
    # per dense source (datastores.dense): each neighbour its drafts came from, nearest first, as {"position": its
    # place in the store's token stream, "similarity", "before": the token ids up to and including it, "after":
    # the ids that followed it there}; empty for the text sources
    neighbours: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def draft_size(self) -> int:
        """Number of draft nodes (root excluded)."""
        return len(self.tree_tokens) - 1

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens accepted this step (root and bonus excluded)."""
        return len(self.accepted_nodes) - 1


StepHook = Callable[[StepTrace], None]
