"""The cache every pass writes to: layers that grow in place, crop by moving their fill mark, and give the same
keys, values and tokens as transformers' concatenating cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache, MistralConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from rest_core.commit import compact_cache
from rest_core.kv_cache import MIN_ROOM, GrowingLayer, new_cache
from rest_core.tree import build_draft_tree, tree_mask, tree_positions

from oracle import OracleLookup


def _kv(length: int, seed: int, batch: int = 1, heads: int = 2, dim: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, length, dim, generator=g), torch.randn(batch, heads, length, dim, generator=g))


def test_entries_are_written_in_place_until_the_room_runs_out_then_kept_when_it_grows():
    layer, reference = GrowingLayer(), DynamicLayer()
    k, v = _kv(100, 0)
    layer.update(k, v)
    reference.update(k, v)
    first = layer.keys.data_ptr()
    assert layer.room == MIN_ROOM and layer.get_seq_length() == 100
    for i in range(1, 200):  # one-token steps: the buffer stays put until it is full, then doubles
        k, v = _kv(1, i)
        keys, values = layer.update(k, v)
        want_k, want_v = reference.update(k, v)
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)
        if 100 + i <= MIN_ROOM:
            assert keys.data_ptr() == first
    assert layer.get_seq_length() == 299 and layer.room == 2 * (MIN_ROOM + 1)
    assert torch.equal(layer.keys, reference.keys) and torch.equal(layer.values, reference.values)


def test_a_crop_moves_the_fill_mark_and_the_next_entries_land_after_it():
    layer = GrowingLayer()
    k, v = _kv(10, 1)
    layer.update(k, v)
    layer.crop(-4)
    assert layer.get_seq_length() == 6 and torch.equal(layer.keys, k[:, :, :6])
    k2, v2 = _kv(3, 2)
    keys, values = layer.update(k2, v2)
    assert torch.equal(keys, torch.cat([k[:, :, :6], k2], dim=2))
    assert torch.equal(values, torch.cat([v[:, :, :6], v2], dim=2))
    layer.crop(-100)  # more than it holds: empty, not negative
    assert layer.get_seq_length() == 0
    with pytest.raises(ValueError, match="negative count"):
        layer.crop(3)


def test_setting_other_tensors_replaces_the_buffer_and_none_empties_it():
    """transformers moves, reorders and repeats a cache by assigning new tensors to keys and values."""
    layer = GrowingLayer()
    layer.update(*_kv(5, 3))
    k, v = _kv(7, 4, batch=2)
    layer.keys, layer.values = k, v  # e.g. a batch repeated for beam search
    assert layer.get_seq_length() == 7 and torch.equal(layer.keys, k)
    k2, v2 = _kv(1, 5, batch=2)
    keys, _ = layer.update(k2, v2)  # the adopted tensor is full: the next entry grows it, content kept
    assert torch.equal(keys, torch.cat([k, k2], dim=2)) and layer.room >= MIN_ROOM
    layer.reset()
    assert layer.keys is None and layer.values is None and layer.get_seq_length() == 0
    layer.update(*_kv(2, 6))
    assert layer.get_seq_length() == 2


@pytest.mark.parametrize("make", [lambda m: DynamicCache(config=m.config), new_cache], ids=["concatenating", "growing"])
def test_compaction_after_a_tree_pass_equals_a_fresh_prefill_for_either_cache(tiny_lm, make):
    model = tiny_lm.model
    prefix = [7, 8, 9, 10, 11]
    rows = np.array([[20, 21, 22], [30, 31, 32], [30, 33, 34], [20, 23, -1]])
    tree = build_draft_tree(12, [OracleLookup("static", 2, 4, rows)], budget=20)
    cache = make(model)
    with torch.inference_mode():
        tiny_lm.forward(input_ids=torch.tensor([prefix]), cache=cache)
        tiny_lm.forward(input_ids=torch.from_numpy(tree.tokens)[None],
                        position_ids=tree_positions(tree, len(prefix), torch.device("cpu")),
                        attention_mask=tree_mask(tree, len(prefix), torch.float32, torch.device("cpu")), cache=cache)
        n30 = tree.children[0][30]
        path = [0, n30, tree.children[n30][33]]
        compact_cache(cache, len(prefix), path)
        tiny_lm.forward(input_ids=torch.tensor([[40]]), cache=cache)  # the next step writes after the kept path
        fresh = DynamicCache(config=model.config)
        tiny_lm.forward(input_ids=torch.tensor([prefix + [12, 30, 33, 40]]), cache=fresh)
    assert cache.get_seq_length() == fresh.get_seq_length() == len(prefix) + 4
    for got, want in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)


def test_only_plain_full_attention_layers_are_replaced():
    config = MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = torch.nn.Module()
    model.config = config
    kinds = [type(layer) for layer in new_cache(model).layers]
    assert kinds == [DynamicSlidingWindowLayer, GrowingLayer, DynamicSlidingWindowLayer]


@pytest.mark.parametrize("lookup", [None, 3], ids=["greedy", "prompt-lookup"])
def test_generate_gives_the_same_tokens_with_the_growing_cache(tiny_lm, lookup):
    """The benchmark hands generate() this cache too; prompt lookup crops it after rejected drafts."""
    model = tiny_lm.model
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]])
    kw = dict(max_new_tokens=40, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    with torch.inference_mode():
        want = model.generate(ids, **kw)
        cache = new_cache(model)
        got = model.generate(ids, **{tiny_lm.cache_kw: cache}, **kw)
    assert torch.equal(got, want)
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    assert cache.get_seq_length() >= got.shape[1] - 1  # generate() wrote into the cache it was given


@pytest.mark.parametrize("library", [True, False])
def test_keep_path_moves_the_accepted_rows_of_every_layer_and_drops_the_rest(monkeypatch, library):
    """The native move (every layer in one call) and torch's gather keep the same rows in the same places; the
    prefix never moves; a path along the first nodes only moves the fill mark."""
    from rest_core import native
    from rest_core.kv_cache import keep_path
    if not library:
        monkeypatch.setattr(native, "_optional", {"cache-rows": None})
    gen = torch.Generator().manual_seed(1)
    layers = [GrowingLayer() for _ in range(3)]
    filled = [(torch.randn(2, 3, 20, 8, generator=gen), torch.randn(2, 3, 20, 8, generator=gen)) for _ in layers]
    for layer, (k, v) in zip(layers, filled):
        layer.update(k, v)
    keep_path(layers, 12, [0, 2, 5, 7])
    for layer, (k, v) in zip(layers, filled):
        want = [*range(12), 12, 14, 17, 19]
        assert layer.get_seq_length() == 16
        assert torch.equal(layer.keys, k[:, :, want]) and torch.equal(layer.values, v[:, :, want])
    keep_path(layers, 12, [0, 1])  # a chain: a crop
    assert all(layer.get_seq_length() == 14 for layer in layers)
    assert torch.equal(layers[0].keys, filled[0][0][:, :, [*range(12), 12, 14]])
    with pytest.raises(ValueError, match="holds 14 positions"):
        keep_path(layers, 12, [0, 1, 2, 3])
    before = layers[0].keys.clone()  # the filled part (the room past it holds whatever memory held)
    assert not native.keep_rows([layers[0]._buffers[0]], 0, np.array([1, 0], dtype=np.int64))  # not increasing
    assert torch.equal(layers[0].keys, before)  # refused: nothing moved
