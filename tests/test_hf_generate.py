"""REST as transformers' decoding loop: model.generate(..., custom_generate=rest_generate)."""
from __future__ import annotations

import pytest
import torch
import transformers.generation.utils as hf_utils
from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria
from transformers.generation.streamers import BaseStreamer

from datastores import RecycleStore, assemble_stores
from rest_core.hf_generate import rest_generate

from conftest import ROOT, load_module, make_tiny_lm
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
                              datastore=assemble_stores(model=RecycleStore(300)), rest_hook=steps.append)
    assert torch.equal(got, want)
    assert sum(len(s.new_tokens) for s in steps) == got.shape[1] - ids.shape[1]


def test_drafts_from_a_store_cut_the_passes_and_keep_the_output(tiny):
    ids = torch.tensor([[5, 6, 7, 8]])
    want = tiny.model.generate(ids, max_new_tokens=30, do_sample=False)
    store = BruteForceStore(want[0].tolist())  # a store that holds the answer: drafts get accepted
    steps = []
    got = tiny.model.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=rest_generate,
                              datastore=assemble_stores(static=store, request=False), rest_hook=steps.append)
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
    with pytest.raises(ValueError, match="beam search"):
        tiny.model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, num_beams=2, custom_generate=rest_generate)
    with pytest.raises(ValueError, match="output_scores"):
        tiny.model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, return_dict_in_generate=True,
                            output_scores=True, custom_generate=rest_generate)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        tiny.model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, prompt_lookup_num_tokens=3,
                            custom_generate=rest_generate)
    with pytest.raises(ValueError, match="datastore must be a store"):
        tiny.model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, datastore="/some/folder",
                            custom_generate=rest_generate)


class StopAfter(StoppingCriteria):
    """Stops a sequence once it holds `token`."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids == self.token).any(dim=1)


class Recorder(BaseStreamer):
    def __init__(self):
        self.ids, self.ended = [], False

    def put(self, value):
        self.ids.extend(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_stopping_criteria_cut_inside_a_multi_token_step(tiny):
    ids = torch.tensor([[5, 6, 7, 8]])
    full = tiny.model.generate(ids, max_new_tokens=30, do_sample=False)[0].tolist()
    stop_token = next(t for t in full[4 + 9:] if t not in full[:4 + 9])  # first seen late in the answer
    criteria = StoppingCriteriaList([StopAfter(stop_token)])
    want = tiny.model.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    steps = []
    got = tiny.model.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=criteria,
                              custom_generate=rest_generate, datastore=BruteForceStore(full), rest_hook=steps.append)
    assert torch.equal(got, want) and got[0, -1].item() == stop_token and got.shape[1] < len(full)
    assert len(steps[-1].new_tokens) >= 1 and sum(len(s.new_tokens) for s in steps) == got.shape[1] - 4
    assert any(s.accepted_drafts > 0 for s in steps), "drafts were accepted, so steps commit several tokens"


def test_return_dict_in_generate_gives_the_usual_output(tiny):
    ids = torch.tensor([[5, 6, 7]])
    want = tiny.model.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    got = tiny.model.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                              custom_generate=rest_generate)
    assert type(got).__name__ == type(want).__name__ == "GenerateDecoderOnlyOutput"
    assert torch.equal(got.sequences, want.sequences)


def hub_generate():
    """custom_generate/generate.py, loaded as transformers loads it from a repository."""
    return load_module(ROOT / "custom_generate" / "generate.py", "rest_hub_generate").generate


def test_the_hub_folder_streams_what_generate_streams(tiny, monkeypatch):
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = Recorder()
    want = tiny.model.generate(ids, max_new_tokens=20, do_sample=False, streamer=plain)
    # the folder names the rest-lab package as its requirement; this checkout is not installed as one
    # (tests/test_package.py runs the folder with the wheel installed)
    monkeypatch.setattr(hf_utils, "check_python_requirements", lambda *a, **k: None)
    rest = Recorder()
    got = tiny.model.generate(ids, max_new_tokens=20, do_sample=False, streamer=rest, custom_generate=str(ROOT),
                              trust_remote_code=True, datastore=BruteForceStore(want[0].tolist()))
    assert torch.equal(got, want)
    assert rest.ids == plain.ids == want[0].tolist() and rest.ended and plain.ended
    direct = Recorder()
    assert torch.equal(hub_generate()(model=tiny.model, inputs=ids, max_new_tokens=20, streamer=direct), want)
    assert direct.ids == want[0].tolist()


def test_greedy_on_the_default_model_with_stop_strings(default_lm, monkeypatch):
    tok, model = default_lm.tokenizer, default_lm.model
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    want = model.generate(ids, max_new_tokens=40, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=rest_generate), want)
    want = model.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=["return"], tokenizer=tok)
    assert tok.decode(want[0, ids.shape[1]:]).rstrip().endswith("return") and want.shape[1] < ids.shape[1] + 40
    got = model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=rest_generate,
                         stopping_criteria=StoppingCriteriaList([StopStringCriteria(tok, ["return"])]))
    assert torch.equal(got, want)
    monkeypatch.setattr(hf_utils, "check_python_requirements", lambda *a, **k: None)
    got = model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=str(ROOT), trust_remote_code=True,
                         stop_strings=["return"], tokenizer=tok)
    assert torch.equal(got, want)
