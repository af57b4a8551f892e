"""Commit: keep only the accepted path in the KV cache.

After a verify pass the cache holds prefix + q entries (every tree node).  The
accepted nodes move to the slots right after the prefix and the rest is cut.
Keys are cached after rotary embedding; an accepted node of depth d was computed
at position prefix + d and lands in slot prefix + d, so nothing is re-rotated.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rest_core.kv_cache import GrowingLayer, keep_path

if TYPE_CHECKING:
    from transformers import DynamicCache


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError("This model's cache type has no per-layer tensors; REST needs a DynamicCache.")
    return layers


def compact_cache(cache: DynamicCache, prefix_len: int, accepted_nodes: list[int]) -> None:
    """Keep slots [0, prefix_len) and the accepted tree nodes, in path order."""
    layers = _layers(cache)
    growing = [layer for layer in layers if type(layer) is GrowingLayer]
    if growing:  # the decoder's own cache: rows move inside the layers' buffers (rest_core.kv_cache)
        keep_path(growing, prefix_len, accepted_nodes)
    others = [layer for layer in layers if type(layer) is not GrowingLayer]
    if not others:
        return
    keep = len(accepted_nodes)
    contiguous = accepted_nodes == list(range(keep))  # path along the first nodes: a crop suffices
    idx = None
    for layer in others:
        keys, values = layer.keys, layer.values  # (B, kv_heads, prefix_len + q, head_dim)
        if contiguous and keys.shape[2] == prefix_len + keep:
            continue  # every node kept in order (a one-token step, a chain accepted whole): nothing to move or cut
        if not contiguous:
            if idx is None or idx.device != keys.device:
                idx = torch.tensor(accepted_nodes, device=keys.device) + prefix_len
            keys[:, :, prefix_len:prefix_len + keep] = keys.index_select(2, idx)
            values[:, :, prefix_len:prefix_len + keep] = values.index_select(2, idx)
        layer.keys = keys[:, :, :prefix_len + keep]
        layer.values = values[:, :, :prefix_len + keep]
