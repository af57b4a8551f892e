"""A linear layer that computes its product with one of several kernels, chosen per call from the row count.

Which kernel is fastest for which shape and row count on this machine is measured and kept by
`rest_core.kernels`; this module holds the kernels themselves (see that module for what each one is).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rest_core import native
from rest_core.rows import MAX_ROWS

KERNELS = ("default", "packed", "transposed", "blocked", "blocked_tall")  # index 0 is transformers' own F.linear
DEFAULT, PACKED, TRANSPOSED, BLOCKED, BLOCKED_TALL = range(len(KERNELS))
BLOCKED_KINDS = ("blocked", "blocked_tall")  # the kernels that read the weight's panels

Shape = tuple[int, int]  # (out_features, in_features)


def packing_available(model: nn.Module) -> bool:
    """oneDNN prepacking applies to float32 models on the CPU of a torch build with oneDNN."""
    param = next(model.parameters(), None)
    return (param is not None and param.device.type == "cpu" and param.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class TunedLinear(nn.Module):
    """An nn.Linear that uses, per call, the kernel measured fastest for that many rows (`KERNELS`), keeping
    its weight also in oneDNN's blocked layout where "packed" is used.  x: (..., in_features) ->
    (..., out_features).  The weight and bias are the original parameters (tied embeddings stay tied); the
    packed copy is made once and not updated."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed: Optional[torch.Tensor] = None  # oneDNN layout; a plain attribute, never saved or moved
        self.panels: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # the blocked kernel's weight and bias
        self.plan: tuple[int, ...] = ()  # per row count 0..MAX_ROWS, the kernel (index in KERNELS); empty: default

    @property
    def shape(self) -> Shape:
        return (self.out_features, self.in_features)

    def pack(self) -> None:
        if self.packed is None:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def pack_panels(self) -> bool:
        """The weight in the blocked kernel's panels (made once); False where that kernel is not available."""
        if self.panels is None and native.library() is not None:
            self.panels = native.pack(self.weight, self.bias)
        return self.panels is not None

    def blocked_forward(self, x: torch.Tensor) -> torch.Tensor:
        panels, bias = self.panels
        return native.linear(x, panels, bias, self.out_features)

    def blocked_tall_forward(self, x: torch.Tensor) -> torch.Tensor:
        panels, bias = self.panels
        return native.linear(x, panels, bias, self.out_features, tall=True)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def transposed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """W @ x.T, transposed back: the same product with the weight as the left-hand side."""
        rows = x.reshape(-1, self.in_features)  # (m, in)
        out = torch.mm(self.weight, rows.t()).t().contiguous()  # (m, out)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def default_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def kernel(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return (self.default_forward, self.packed_forward, self.transposed_forward, self.blocked_forward,
                self.blocked_tall_forward)[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        if plan and x.is_cpu and not torch.is_grad_enabled():
            k = plan[min(x.numel() // self.in_features, MAX_ROWS)]
            if k == PACKED:
                return self.packed_forward(x)
            if k == BLOCKED:
                return self.blocked_forward(x)
            if k == BLOCKED_TALL:
                return self.blocked_tall_forward(x)
            if k == TRANSPOSED:
                return self.transposed_forward(x)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
