"""The key/value cache every pass writes to: transformers' DynamicCache whose full-attention layers grow in place.

transformers' `DynamicLayer` appends each pass's keys and values with `torch.cat`, which copies the layer's
whole cache at every step: at a 1,024-token context SmolLM2-135M copies 30 layers x 2 x 768 KB, 47 MB per
one-token step, and more as the context grows.  `GrowingLayer` keeps one buffer per layer with room to spare
(twice what is filled when it runs out), writes each pass's entries after the filled part and hands attention
a view of the filled part.  Cropping only moves the fill mark; REST's compaction after a verify pass
(`keep_path`, called by `rest_core.commit`) moves the accepted nodes' rows down inside the buffers, every
layer in one native call, and then the mark.  Attention sees the same numbers; decoding gives the same tokens.

Plain decoding, REST, the cost curve's calibration, the verify-pass benchmark and the `generate()` baselines
of the benchmark all use this cache (`new_cache`), so every comparison stays like for like.  Layers of other
kinds (sliding-window, linear-attention, quantized) are kept as transformers makes them.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rest_core import native

MIN_ROOM = 256  # positions a layer's first buffer holds at least


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that writes new entries into a buffer with room to spare instead of concatenating.

    `keys` / `values` are views of the filled part, (batch, kv_heads, filled, head_dim).  Setting them to a view
    of the buffer that starts at its first position (a crop, REST's compaction) moves the fill mark; setting
    them to any other tensor (transformers moving, reordering or repeating a cache) makes that tensor the
    buffer; setting them to None empties the layer."""

    def __init__(self) -> None:
        self._buffers: list[Optional[torch.Tensor]] = [None, None]  # keys, values
        self._filled = 0
        super().__init__()

    def _view(self, i: int) -> Optional[torch.Tensor]:
        buf = self._buffers[i]
        return None if buf is None else buf[:, :, :self._filled]

    def _adopt(self, i: int, t: Optional[torch.Tensor]) -> None:
        buf = self._buffers[i]
        if t is None or t.dim() != 4:  # emptied (reset; the base class's empty placeholder)
            self._buffers[i] = None
            self._filled = 0
        elif (buf is not None and t.data_ptr() == buf.data_ptr() and t.stride() == buf.stride()
              and t.shape[:2] == buf.shape[:2] and t.shape[3] == buf.shape[3] and t.shape[2] <= buf.shape[2]):
            self._filled = t.shape[2]  # the buffer's own first positions: a crop
        else:
            self._buffers[i] = t
            self._filled = t.shape[2]

    @property
    def keys(self) -> Optional[torch.Tensor]:
        return self._view(0)

    @keys.setter
    def keys(self, t: Optional[torch.Tensor]) -> None:
        self._adopt(0, t)

    @property
    def values(self) -> Optional[torch.Tensor]:
        return self._view(1)

    @values.setter
    def values(self, t: Optional[torch.Tensor]) -> None:
        self._adopt(1, t)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._buffers = [None, None]
        self._filled = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pass's (batch, kv_heads, q, head_dim) keys and values after the filled part (the buffers
        grown first when they lack room) and return views of everything filled."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, q = self._filled, key_states.shape[-2]
        for i, new in enumerate((key_states, value_states)):
            buf = self._buffers[i]
            if (buf is None or start + q > buf.shape[2] or buf.shape[:2] != new.shape[:2]
                    or buf.shape[3] != new.shape[3] or buf.dtype != new.dtype or buf.device != new.device):
                grown = new.new_empty((*new.shape[:2], max(MIN_ROOM, 2 * (start + q)), new.shape[3]))
                if start:
                    grown[:, :, :start] = buf[:, :, :start]
                self._buffers[i] = buf = grown
            buf[:, :, start:start + q] = new
        self._filled = start + q
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._filled if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` positions (a negative count, as DynamicLayer takes it)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, not {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._filled = max(0, self._filled + tokens_to_remove)

    def reset(self) -> None:
        """Empty the layer.  (transformers' own reset zeroes the buffers in place in some 5.x releases,
        which would leave the fill mark, and so the length, where it was.)"""
        self._buffers = [None, None]
        self._filled = 0

    @property
    def room(self) -> int:
        """Positions the buffers hold before they grow again (0 before the first pass)."""
        buf = self._buffers[0]
        return 0 if buf is None else buf.shape[2]


def keep_path(layers: list[GrowingLayer], start: int, nodes: list[int]) -> None:
    """REST's compaction after a verify pass (rest_core.commit) for the growing layers of a cache: keep positions
    [0, start), then positions start + n for n in `nodes` (increasing: the accepted path), and drop the rest.  A
    path along the first nodes only moves the fill marks; otherwise the kept rows move down inside the buffers,
    every layer in one native call where the kernel library can be had."""
    end = start + len(nodes)
    for layer in layers:
        if end > layer.get_seq_length():
            raise ValueError(f"keep_path: {len(nodes)} nodes after position {start}, "
                             f"but the layer holds {layer.get_seq_length()} positions")
    if nodes != list(range(len(nodes))):
        buffers = [buf for layer in layers for buf in layer._buffers]
        if not native.keep_rows(buffers, start, np.asarray(nodes, dtype=np.int64)):
            idx = torch.tensor(nodes, device=buffers[0].device) + start
            for buf in buffers:
                buf[:, :, start:end] = buf.index_select(2, idx)
    for layer in layers:
        layer._filled = end


def new_cache(model: nn.Module) -> DynamicCache:
    """A DynamicCache for `model` (a transformers model, or anything with its `config`) whose plain full-attention
    layers are GrowingLayers; other kinds of layer stay as transformers makes them."""
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = GrowingLayer()
    return cache
