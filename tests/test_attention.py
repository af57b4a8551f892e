"""The native attention kernel against torch's SDPA, the choice between them, and where it is (not) used."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from datastores import assemble_stores
from rest_core import attention, native
from rest_core.attention import AttentionChoice, measure, tune_attention, uses_native
from rest_core.decode import DecodeConfig, RestDecoder, plain_generate
from rest_core.model import ATTENTION, gqa_sdpa_attention
from rest_core.rows import ROWS

from conftest import make_tiny_lm
from oracle import BruteForceStore

needs_kernel = pytest.mark.skipif(native.attention_library() is None, reason="no C++ compiler for the native kernels")
LOWEST = torch.finfo(torch.float32).min


def _reference(q, k, v, mask, scale):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous()


def _inputs(batch, heads, kv_heads, q_len, length, size, seed=0, room=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, heads, size, generator=g).transpose(1, 2)  # (B, H, Q, D), strided like a model's
    kv = torch.randn(2, batch, kv_heads, length + room, size, generator=g)[:, :, :, :length]  # views, room after
    return q, kv[0], kv[1]


def _tree_mask(batch, q_len, length, seed=0):
    """A random tree over the last q_len positions: every node sees the prefix, itself and some earlier nodes."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.ones(batch, 1, q_len, length, dtype=torch.bool)
    tree = (torch.rand(batch, 1, q_len, q_len, generator=g) < 0.4).tril() | torch.eye(q_len, dtype=torch.bool)
    allowed[..., length - q_len:] = tree
    return allowed


@needs_kernel
@pytest.mark.parametrize("batch,heads,kv_heads,q_len,length,size", [
    (1, 9, 3, 1, 300, 64),    # a one-token step of the default model's shape
    (1, 9, 3, 16, 1040, 64),  # a 16-node tree after a long prefix
    (1, 9, 3, 64, 100, 64),   # more rows than keys per thread
    (2, 8, 2, 5, 77, 128),    # a batch, another group size and head size, lengths not multiples of a vector
    (1, 4, 4, 3, 20, 32),     # no grouping, a short cache (one stretch)
])
def test_the_kernel_gives_what_sdpa_gives(batch, heads, kv_heads, q_len, length, size):
    q, k, v = _inputs(batch, heads, kv_heads, q_len, length, size, room=37)
    scale = size ** -0.5
    allowed = _tree_mask(batch, q_len, length)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, LOWEST)
    cases = [(additive, additive), (allowed, allowed), (additive[:1], additive[:1].expand(batch, -1, -1, -1))]
    if q_len == 1:
        cases.append((None, None))
    for mask, reference_mask in cases:
        got = native.attention(q, k, v, mask, scale)
        assert got is not None and got.shape == (batch, q_len, heads, size) and got.is_contiguous()
        torch.testing.assert_close(got, _reference(q, k, v, reference_mask, scale), atol=2e-6, rtol=1e-5)


@needs_kernel
def test_a_row_that_sees_no_key_gets_zeros_and_the_others_are_untouched():
    q, k, v = _inputs(1, 2, 1, 3, 50, 32)
    allowed = torch.ones(1, 1, 3, 50, dtype=torch.bool)
    allowed[0, 0, 1] = False
    got = native.attention(q, k, v, allowed, 0.2)
    assert torch.equal(got[0, 1], torch.zeros(2, 32))
    want = _reference(q, k, v, allowed, 0.2)
    torch.testing.assert_close(got[0, [0, 2]], want[0, [0, 2]], atol=2e-6, rtol=1e-5)


@needs_kernel
def test_a_row_comes_out_the_same_whatever_else_the_pass_holds():
    """A node's attention does not depend on how many other rows share the pass (the summation order is the
    row's own), so a tree pass and a one-token step over the same keys agree to the bit."""
    q, k, v = _inputs(1, 9, 3, 16, 500, 64)
    full = native.attention(q, k, v, None, 0.125)
    for row in (0, 7, 15):
        alone = native.attention(q[:, :, row:row + 1], k, v, None, 0.125)
        assert torch.equal(alone[0, 0], full[0, row])


@needs_kernel
def test_inputs_it_does_not_take_are_handed_back():
    q, k, v = _inputs(1, 4, 2, 2, 40, 64)
    mask = torch.zeros(1, 1, 2, 40)
    assert native.attention(q.double(), k.double(), v.double(), None, 0.1) is None  # not float32
    assert native.attention(q, k[..., :48], v[..., :48], None, 0.1) is None  # sizes that do not match
    q48, k48, v48 = _inputs(1, 4, 2, 2, 40, 48)  # a head size the kernel has no layout for: it says so
    assert native.attention(q48, k48, v48, None, 0.1) is None
    assert native.attention(q, k, v, mask.half(), 0.1) is None  # a mask of another type
    assert native.attention(q, k, v, torch.zeros(1, 4, 2, 40), 0.1) is None  # a mask per head
    assert native.attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, mask, 0.1) is None  # D strided


def test_the_choice_takes_native_only_where_both_neighbours_were_faster():
    timings = {256: {r: {"sdpa": 1.0, "native": 0.97 if r == 1 else 0.5 if r <= 8 else 2.0} for r in ROWS},
               1024: {r: {"sdpa": 1.0, "native": 0.5} for r in ROWS}}
    rows = attention._native_rows(timings)
    # at 256 positions: 1 row within the margin (SDPA), 9..11 between 8 (faster) and 12 (slower): SDPA too
    assert rows == {256: frozenset(range(2, 9)), 1024: frozenset(range(1, 65))}
    shape = (4, 2, 16)
    attention._choices[shape] = AttentionChoice(shape, timings, rows)
    try:
        assert not uses_native(shape, 1, 300) and uses_native(shape, 1, 600) and uses_native(shape, 1, 5000)
        assert uses_native(shape, 8, 40) and not uses_native(shape, 10, 40) and uses_native(shape, 10, 2000)
        assert not uses_native(shape, 65, 2000)  # beyond the grid (a prefill): SDPA
        assert not uses_native((4, 4, 16), 8, 300)  # a head shape not measured
    finally:
        del attention._choices[shape]


@needs_kernel
def test_the_measured_choice_is_cached_per_shape_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("REST_LAB_RECALIBRATE", raising=False)
    monkeypatch.setattr(attention, "measure",
                        lambda shape, progress=None: measure(shape, layers=2, lengths=(64,), rounds=1))
    monkeypatch.setattr(attention, "_choices", {})
    lm = make_tiny_lm()
    first = tune_attention(lm.model)
    assert first is not None and first.source == "measured" and first.shape == (4, 2, 16)
    files = list((tmp_path / "kernels").glob("attention-4x2x16-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["shape"] == [4, 2, 16]
    again = tune_attention(lm.model)
    assert again.source == str(files[0]) and again.native_rows == first.native_rows
    assert set(first.native_rows) == {64}
    wins = first.native_rows[64]
    assert all(uses_native((4, 2, 16), r, 64) == (r in wins) for r in range(1, 65))
    again.enabled = False
    assert not any(uses_native((4, 2, 16), r, 64) for r in range(1, 65))
    monkeypatch.setenv("REST_LAB_KERNELS", "default")
    assert tune_attention(lm.model) is None
    monkeypatch.delenv("REST_LAB_KERNELS")
    monkeypatch.setattr(native, "attention", lambda *args: None)  # a head size the kernel has no layout for
    assert tune_attention(lm.model) is None


@needs_kernel
def test_the_model_runs_the_native_kernel_where_chosen_and_decodes_the_same(monkeypatch):
    """A model attending through REST's attention function uses the kernel for the chosen row counts only; plain
    and REST decoding give the same tokens as with SDPA."""
    lm = make_tiny_lm()
    lm.model.set_attn_implementation(ATTENTION)
    shape = (4, 2, 16)
    calls = []
    real = native.attention

    def counting(*args):
        out = real(*args)
        calls.append(args[0].shape[2])
        return out

    monkeypatch.setattr(native, "attention", counting)
    prompt, cfg = [5, 6, 7, 8, 5, 6, 7], DecodeConfig(max_new_tokens=24)
    monkeypatch.setattr(attention, "_choices", {})
    want = plain_generate(lm, prompt, cfg).tokens
    assert calls == []
    everywhere = {256: frozenset(range(1, 65))}
    monkeypatch.setattr(attention, "_choices", {shape: AttentionChoice(shape, native_rows=everywhere)})
    assert plain_generate(lm, prompt, cfg).tokens == want
    assert calls and set(calls) == {1}  # the one-token steps; the prefill (causal, no mask) stays with SDPA
    calls.clear()
    stores = assemble_stores(static=BruteForceStore(want * 3), request=False)
    assert RestDecoder(lm, stores=stores).generate(prompt, cfg).tokens == want
    assert any(q > 1 for q in calls)  # tree passes, under their masks


@needs_kernel
def test_the_attention_function_keeps_sdpa_for_what_the_kernel_does_not_do(monkeypatch):
    shape = (4, 2, 64)
    everywhere = {256: frozenset(range(1, 65))}
    monkeypatch.setattr(attention, "_choices", {shape: AttentionChoice(shape, native_rows=everywhere)})
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    q, k, v = _inputs(1, 4, 2, 4, 30, 64)
    used = []
    monkeypatch.setattr(native, "attention", lambda *a: used.append(1))  # returns None: SDPA must follow
    out, _ = gqa_sdpa_attention(module, q, k, v, None, scaling=0.125)  # four rows, no mask: causal
    assert used == [] and out.shape == (1, 4, 4, 64)
    gqa_sdpa_attention(module, q, k, v, torch.zeros(1, 1, 4, 30), scaling=0.125, sliding_window=16)
    assert used == []
    out, _ = gqa_sdpa_attention(module, q, k, v, torch.zeros(1, 1, 4, 30), scaling=0.125)
    assert used == [1] and out.shape == (1, 4, 4, 64)  # asked, refused, answered by SDPA
