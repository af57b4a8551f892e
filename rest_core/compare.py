"""Comparing two decodes of one prompt: the one meaning of "identical" in REST Lab.

Two outputs are identical when their tokens are equal one for one, each cut at its
first end-of-sequence token (what follows an EOS was never part of the answer).
Where they part, `first_difference` says at which token and how close the model's
two candidates were there: a tiny logit gap is a near-tie decided by rounding.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rest_core.model import LoadedModel


def cut_at_eos(tokens: Iterable[int], eos: Iterable[int] = ()) -> list[int]:
    """The tokens up to and including the first EOS."""
    stop = set(eos)
    out: list[int] = []
    for t in tokens:
        out.append(int(t))
        if out[-1] in stop:
            break
    return out


def identical(a: Sequence[int], b: Sequence[int], eos: Iterable[int] = ()) -> bool:
    """Equal token for token, both cut at their first EOS."""
    eos = set(eos)
    return cut_at_eos(a, eos) == cut_at_eos(b, eos)


@torch.inference_mode()
def first_difference(lm: LoadedModel, prompt: Sequence[int], reference: Sequence[int], other: Sequence[int]) -> dict:
    """Where two decodes part, and the reference model's logit gap between the two tokens there.

    Returns {"first_difference": index} and, when both outputs have a token at that
    index, "logit_gap" and the two "tokens".  Runs one model pass over prompt + agreed part.
    """
    pos = next((i for i, (x, y) in enumerate(zip(reference, other)) if x != y), min(len(reference), len(other)))
    out: dict = {"first_difference": pos}
    if pos < min(len(reference), len(other)):
        ids = torch.tensor([list(prompt) + list(reference[:pos])], device=lm.device)
        logits = lm.model(input_ids=ids).logits[0, -1].float()  # (V,)
        out["logit_gap"] = float(logits[reference[pos]] - logits[other[pos]])
        out["tokens"] = {"plain": int(reference[pos]), "rest": int(other[pos])}
    return out
