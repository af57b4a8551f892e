"""The tree mask as stored: its q x q tree block, as q strings of "0"/"1" ("1" = may attend).

`mask_tree_block` refuses a mask whose prefix columns are not all visible or whose
values are not exactly 0 / finfo(dtype).min, so block + prefix_len + dtype rebuild
the exact tensor the model received (`full_mask`, through `rest_core.tree.mask_from_allowed`).
"""
from __future__ import annotations

import json

import numpy as np
import torch

from rest_core.tree import mask_from_allowed

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def mask_tree_block(mask: torch.Tensor, prefix_len: int, q: int) -> np.ndarray:
    """The (q, q) bool block of `mask` (True = may attend), after checking that the
    prefix columns are all 0 and every value is 0 or finfo(dtype).min.

    Works on the bit patterns through numpy: exact for every float dtype, and far
    cheaper than torch reductions when the CPU is busy with the model.
    """
    expected = (1, 1, q, prefix_len + q)
    if tuple(mask.shape) != expected:
        raise ValueError(f"tree mask has shape {tuple(mask.shape)}, expected {expected}")
    int_dtype = _INT_OF_WIDTH[mask.element_size()]
    bits = mask[0, 0].detach().cpu().view(int_dtype).numpy()  # (q, prefix_len + q)
    magnitude = np.iinfo(bits.dtype).max  # every bit but the sign: 0.0 and -0.0 both allow
    if prefix_len and np.any(bits[:, :prefix_len] & magnitude):
        raise ValueError("tree mask blocks some prefix column: every node must see the whole prefix")
    block = bits[:, prefix_len:]
    allowed = (block & magnitude) == 0
    blocked = torch.tensor(torch.finfo(mask.dtype).min, dtype=mask.dtype).view(int_dtype).item()
    if not np.all(allowed | (block == blocked)):
        raise ValueError("tree mask holds values other than 0 and finfo(dtype).min")
    return allowed


def encode_block(block: np.ndarray) -> str:
    """A (q, q) bool block as JSON: q strings of '0'/'1'."""
    rows = np.where(block, ord("1"), ord("0")).astype(np.uint8)
    return json.dumps([row.tobytes().decode("ascii") for row in rows])


def decode_block(text: str) -> np.ndarray:
    """The (q, q) bool block `encode_block` wrote."""
    rows = json.loads(text)
    if not rows:
        return np.zeros((0, 0), dtype=bool)
    return np.frombuffer("".join(rows).encode("ascii"), dtype=np.uint8).reshape(len(rows), -1) == ord("1")


def full_mask(block: np.ndarray, prefix_len: int, dtype: torch.dtype | str = torch.float32) -> torch.Tensor:
    """The 4D mask (1, 1, q, prefix_len + q) the model received, rebuilt from its tree block."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return mask_from_allowed(np.asarray(block, dtype=bool), prefix_len, dtype)
