"""The decoder on a CUDA GPU: exact greedy against plain decoding and generate(), exact sampling.

Skipped where torch sees no GPU (the CI machine); run on one with `python -m pytest tests/test_gpu.py`.
The tree pass on a GPU runs other matrix kernels than a one-token pass (cuBLAS picks them by
shape), so these tests are what shows the tree mask, the positions, the cache compaction and the
verification also hold there."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from datastores import RecycleStore, assemble_stores
from rest_core.decode import DecodeConfig, RestDecoder, plain_generate
from rest_core.retrieve import RetrieveSettings
from rest_core.sampling import Sampling, next_token_probs

from conftest import make_tiny_lm
from oracle import BruteForceStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 9, 69_999, 3], [65_536, 65_537, 12], list(range(100, 140))]


def on_gpu(lm):
    lm.model.to("cuda")
    return dataclasses.replace(lm, device=torch.device("cuda"))


@pytest.fixture(scope="module")
def gpu_lm():
    return on_gpu(make_tiny_lm())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_rest_on_the_gpu_equals_plain_decoding_and_generate(gpu_lm, prompt):
    cfg = DecodeConfig(max_new_tokens=40, draft_budget=12, stop_at_eos=False)
    plain = plain_generate(gpu_lm, prompt, cfg)
    rng = np.random.default_rng(0)
    noise = rng.integers(0, gpu_lm.model.config.vocab_size, size=200).tolist()
    wrong = list(prompt[-2:]) + [(t + 1) % gpu_lm.model.config.vocab_size for t in plain.tokens[:6]]
    store = BruteForceStore(noise[:100] + list(prompt) + plain.tokens + noise[100:] + wrong)
    rest = RestDecoder(gpu_lm, stores=assemble_stores(static=store)).generate(prompt, cfg)
    assert rest.tokens == plain.tokens
    assert rest.steps < plain.steps  # drafts were accepted: the tree pass really ran on the GPU
    with torch.inference_mode():
        out = gpu_lm.model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=40, do_sample=False,
                                    min_new_tokens=40)
    assert out[0, len(prompt):].tolist() == plain.tokens


def test_the_models_own_drafts_on_the_gpu_keep_greedy_exact(gpu_lm):
    recycled = RecycleStore(gpu_lm.vocab_size)
    dec = RestDecoder(gpu_lm, stores=assemble_stores(request=False, model=recycled))
    cfg = DecodeConfig(max_new_tokens=30, draft_budget=8, stop_at_eos=False)
    for prompt in ([5, 6, 7, 8], [5, 6, 7, 8]):
        res = dec.generate(prompt, cfg)
        assert res.tokens == plain_generate(gpu_lm, prompt, cfg).tokens
    assert res.accepted_by_source.get("model", 0) > 0


def test_rest_sampling_on_the_gpu_matches_the_exact_distribution():
    """A 5-token model, every 3-token continuation's exact probability, 800 REST samples drawn on the GPU."""
    from test_decode import SMALL, _chi_square_p

    cpu_lm = make_tiny_lm(seed=3, **SMALL)
    with torch.no_grad():
        cpu_lm.model.lm_head.weight.mul_(0.25)
    prompt, sampling = [1, 2], Sampling(temperature=0.9, top_p=0.95)
    expected = {}
    with torch.inference_mode():
        for seq in np.ndindex(5, 5, 5):
            p = 1.0
            for i in range(3):
                logits = cpu_lm.model(input_ids=torch.tensor([prompt + list(seq[:i])])).logits[0, -1]
                p *= float(next_token_probs(logits, sampling)[seq[i]])
            expected[tuple(seq)] = p
    lm = on_gpu(cpu_lm)
    dec = RestDecoder(lm, stores=assemble_stores(static=BruteForceStore([1, 2, 0, 1, 2, 1, 2, 3, 0, 0, 1, 2, 2, 2,
                                                                        3, 2, 0, 1]), request=False))
    runs, counts = 800, {}
    for seed in range(runs):
        cfg = DecodeConfig(max_new_tokens=3, draft_budget=6, stop_at_eos=False,
                           sampling=Sampling(sampling.temperature, sampling.top_k, sampling.top_p, seed),
                           retrieve=RetrieveSettings(n_max=4, n_min=1))
        seq = tuple(dec.generate(prompt, cfg).tokens)
        counts[seq] = counts.get(seq, 0) + 1
    assert _chi_square_p(counts, expected, runs) > 1e-3


def test_the_default_model_on_the_gpu_answers_as_generate_does():
    from rest_core.model import ModelLoadError, encode_prompt, load_model

    try:
        lm = load_model(device="cuda")
    except ModelLoadError as err:
        pytest.skip(f"default model not available here: {err}")
    prompt = encode_prompt(lm.tokenizer, "Write a Python function that checks whether a number is prime.", chat=True)
    cfg = DecodeConfig(max_new_tokens=64, draft_budget=16, stop_at_eos=True)
    dec = RestDecoder(lm, stores=assemble_stores(model=RecycleStore(lm.vocab_size)))
    first = dec.generate(prompt, cfg)
    again = dec.generate(prompt, cfg)  # drafts now come from what the first answer taught the model source
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=64, do_sample=False)
    reference = out[0, len(prompt):].tolist()
    assert first.tokens == again.tokens == reference[:len(first.tokens)]
    assert again.steps < len(again.tokens)  # the second answer was drafted and accepted
