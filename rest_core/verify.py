"""Verification: one forward pass over the tree, then the walk that decides which
drafted tokens the model agrees with, and its bonus token.

`tree_forward` flattens the tree for the model (node 0 = root, the last committed
token; positions prefix_len + depth; the tree mask) and runs it in one pass.

Greedy: from the root, descend into the child whose token is the model's argmax;
when no child matches (or at a leaf) the argmax is the bonus token.  The result
is exactly what one-token greedy decoding would have produced.

Sampling (exact for a tree of point-mass drafts): at each visited node draw
y ~ p, the same processed distribution plain sampling uses; descend if y is a
child, else emit y.  This equals the multi-draft rejection rule (accept child
c_i with probability r(c_i), else zero it and renormalise r; emit y ~ r when
all are rejected): every token keeps probability p(y).  One draw per visited
node, shared by all paths through it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from rest_core.sampling import Sampling, draw_uniform, greedy_choices, next_token_probs, token_at
from rest_core.tree import DraftTree, tree_mask, tree_positions

if TYPE_CHECKING:
    from transformers import DynamicCache

    from rest_core.model import LoadedModel


@dataclass
class Verdict:
    accepted_nodes: list[int]  # root first, then each accepted draft node
    bonus_token: int
    model_choices: list[int]  # per node: the verifier's token (drawn at visited nodes when sampling)
    # sampling: per visited node, the uniform number drawn there and the (V,) distribution it was drawn from
    draws: dict[int, tuple[float, torch.Tensor]] = field(default_factory=dict)


def tree_forward(lm: LoadedModel, tree: DraftTree, prefix_len: int,
                 cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One model pass over every tree node; the cache grows by q entries (commit keeps the accepted ones).

    Returns (logits (q, V), position ids (1, q), the 4D mask passed to the model or None for a
    one-token step, which runs with the model's own causal mask)."""
    q = len(tree)
    ids = torch.from_numpy(tree.tokens).to(lm.device).unsqueeze(0)  # (1, q)
    positions = tree_positions(tree, prefix_len, lm.device)  # (1, q)
    mask = tree_mask(tree, prefix_len, lm.dtype, lm.device) if q > 1 else None  # (1, 1, q, prefix_len + q)
    logits = lm.forward(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache).logits[0]
    return logits, positions, mask


def verify_greedy(tree: DraftTree, logits: torch.Tensor, choices: Optional[list[int]] = None) -> Verdict:
    """logits: (q, V) for the q tree nodes; `choices`: their argmax when the caller has it already."""
    choices = choices if choices is not None else greedy_choices(logits)
    path = [0]
    node = 0
    while (child := tree.children[node].get(choices[node])) is not None:
        path.append(child)
        node = child
    return Verdict(path, choices[node], choices)


def verify_sampling(tree: DraftTree, logits: torch.Tensor, cfg: Sampling, gen: torch.Generator,
                    choices: Optional[list[int]] = None) -> Verdict:
    choices = choices if choices is not None else greedy_choices(logits)
    path = [0]
    node = 0
    draws = {}
    while True:
        probs = next_token_probs(logits[node], cfg)
        u = draw_uniform(gen)  # one uniform per visited node, as draw_token consumes it
        drawn = token_at(probs, u)
        draws[node] = (u, probs)  # kept, not copied: what a trace shows of this draw
        choices[node] = drawn
        child = tree.children[node].get(drawn)
        if child is None:
            return Verdict(path, drawn, choices, draws)
        path.append(child)
        node = child


def verify(tree: DraftTree, logits: torch.Tensor, cfg: Sampling, gen: Optional[torch.Generator],
           choices: Optional[list[int]] = None) -> Verdict:
    """The accepted path and bonus token; `choices`: every node's argmax when the caller has it already (the
    native top-k of the stores that learn from the model gives it in the same read of the logits)."""
    if cfg.greedy:
        return verify_greedy(tree, logits, choices)
    return verify_sampling(tree, logits, cfg, gen, choices)
