"""REST as transformers' decoding loop: model.generate(..., custom_generate=rest_generate)."""
from __future__ import annotations

import pytest
import torch

from datastores import RecycleStore, assemble_stores
from rest_core.hf_generate import rest_generate

from conftest import make_tiny_lm
from oracle import BruteForceStore


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_lm(vocab_size=300, max_positions=256)


@pytest.mark.parametrize("prompt", [[5, 6, 7, 8], [9, 10, 11, 12, 13, 9, 10, 11]])
def test_greedy_output_is_generates_own(tiny, prompt):
    ids = torch.tensor([prompt])
    want = tiny.model.generate(ids, max_new_tokens=30, do_sample=False)
    steps = []
    got = tiny.model.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=rest_generate,
                              rest_stores=assemble_stores(model=RecycleStore(300)), rest_hook=steps.append)
    assert torch.equal(got, want)
    assert sum(len(s.new_tokens) for s in steps) == got.shape[1] - ids.shape[1]


def test_drafts_from_a_store_cut_the_passes_and_keep_the_output(tiny):
    ids = torch.tensor([[5, 6, 7, 8]])
    want = tiny.model.generate(ids, max_new_tokens=30, do_sample=False)
    store = BruteForceStore(want[0].tolist())  # a store that holds the answer: drafts get accepted
    steps = []
    got = tiny.model.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=rest_generate,
                              rest_stores=assemble_stores(static=store, request=False), rest_hook=steps.append)
    assert torch.equal(got, want) and len(steps) < 30 / 2


def test_sampling_is_repeatable_under_torch_manual_seed(tiny):
    ids = torch.tensor([[5, 6, 7]])
    torch.manual_seed(3)
    a = tiny.model.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9,
                            custom_generate=rest_generate)
    torch.manual_seed(3)
    b = tiny.model.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9,
                            custom_generate=rest_generate)
    assert torch.equal(a, b) and a.shape[1] <= 3 + 12


def test_what_it_cannot_do_is_refused_clearly(tiny):
    with pytest.raises(ValueError, match="one sequence at a time"):
        tiny.model.generate(torch.tensor([[5, 6], [7, 8]]), max_new_tokens=4, do_sample=False,
                            custom_generate=rest_generate)
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
        tiny.model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False, repetition_penalty=1.3,
                            custom_generate=rest_generate)
