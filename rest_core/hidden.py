"""The model's hidden state at one layer, kept from passes the decoder runs anyway.

Layers are numbered as transformers numbers `output_hidden_states`: 0 is the token embedding, i (1..n-1)
the output of decoder layer i - 1, and n (the number of decoder layers) the final norm's output -- what
the output layer reads.  `StateTap` keeps one layer's output of every forward call through a hook on that
module (no extra pass, no other layer returned); `sequence_states` runs the base model over whole
documents, for building a dense store (datastores.dense).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch


def layer_count(model: torch.nn.Module) -> int:
    """Decoder layers of a causal LM (the number of the final norm's output)."""
    return int(model.config.num_hidden_layers)


def layer_module(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    """The module whose output is hidden state number `layer` (ValueError for a layer the model has not)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    n = layer_count(model)
    if base is None or layers is None or len(layers) != n:
        raise ValueError(f"{type(model).__name__} does not keep its decoder layers at .model.layers: the dense source "
                         "cannot read its hidden states")
    if not 1 <= layer <= n:
        raise ValueError(f"hidden state {layer} does not exist: this model has 1..{n} "
                         f"(1..{n - 1}: a decoder layer's output, {n}: the final norm's)")
    if layer == n:
        norm = getattr(base, "norm", None)
        if norm is None:
            raise ValueError(f"{type(model).__name__} has no final norm at .model.norm; pick a layer below {n}")
        return norm
    return layers[layer - 1]


class StateTap:
    """A forward hook on one layer: `rows()` is that layer's output (q, d) of the newest forward call, float32.

    The output is copied in the hook (a few kilobytes per pass) so that nothing a later kernel writes can change
    it.  `close()` removes the hook."""

    def __init__(self, model: torch.nn.Module, layer: int):
        self.layer = int(layer)
        self._last: Optional[torch.Tensor] = None
        self._handle = layer_module(model, self.layer).register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        out = output[0] if isinstance(output, tuple) else output  # (B, q, d)
        self._last = out[0].detach().float().clone()

    def rows(self) -> Optional[torch.Tensor]:
        """(q, d) of the newest call (None before any)."""
        return self._last

    def row(self, i: int) -> Optional[np.ndarray]:
        """(d,) float32 of one position of the newest call (None before any)."""
        return None if self._last is None else self._last[i].numpy()

    def close(self) -> None:
        self._handle.remove()
        self._last = None


@torch.inference_mode()
def sequence_states(model: torch.nn.Module, docs: Sequence[Sequence[int]], layer: int,
                    device: torch.device | str = "cpu") -> list[np.ndarray]:
    """Hidden state `layer` at every position of each document, one document per pass of the base model (no
    output layer, no padding): [(len(doc), d) float32]."""
    tap = StateTap(model, layer)
    base = model.model
    out = []
    try:
        for doc in docs:
            base(input_ids=torch.tensor([list(doc)], device=device), use_cache=False)
            out.append(tap.rows().cpu().numpy())
    finally:
        tap.close()
    return out


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, shape and 64 of its values evenly spaced: two models whose hidden
    states differ (other weights, other architecture) get different fingerprints; it takes milliseconds."""
    h = hashlib.sha256(type(model).__name__.encode())
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // 64)
        h.update(f"{name}{tuple(param.shape)}".encode())
        h.update(flat[::step][:64].float().cpu().numpy().tobytes())
    return h.hexdigest()


def state_reader(model: torch.nn.Module, layer: int, device: torch.device | str = "cpu"):
    """A function from one document's token ids to its (len, d) float32 states at `layer` (for
    datastores.dense.build_dense_store)."""
    return lambda ids: sequence_states(model, [ids], layer, device)[0]


def dense_layer(model: torch.nn.Module) -> int:
    """The hidden state the built-in dense store keeps: the output of the decoder layer three quarters of the way
    up (22 of the default model's 30), which covered as many of the steps the text sources miss as the last
    layers and more than the middle or early ones (docs/bench/dense-coverage.md)."""
    return 3 * layer_count(model) // 4


def open_model_dense(lm, spec: Optional[str] = "default", progress: bool = True, layer: Optional[int] = None,
                     dim: Optional[int] = None):
    """The dense store `spec` names for this model (datastores.open_dense): 'default' builds the built-in one on
    first use -- after the general-text store it is made from, which is built first when missing -- 'none'/None:
    off, else a store folder.  `layer` / `dim` (default: `dense_layer`, datastores.dense.DEFAULT_DIM) pick
    which built-in store."""
    from functools import partial

    from datastores import open_answers, open_dense
    from datastores.dense import DEFAULT_DIM
    from rest_core.model import generate_batch

    if spec in (None, "none"):
        return None
    layer = dense_layer(lm.model) if layer is None else layer
    if spec == "default":  # its corpus is the general-text store's answers
        open_answers("default", lm.name, lm.tokenizer, generate=partial(generate_batch, lm), progress=progress)
    return open_dense(spec, lm.name, lm.tokenizer, model_fingerprint(lm.model), layer,
                      states=state_reader(lm.model, layer, lm.device), dim=dim or DEFAULT_DIM, progress=progress)


def state_taps(lm, stores: Sequence) -> dict[int, StateTap]:
    """A hidden-state hook per layer some store drafts from (`Store.state_layer`); close them when done.  A store
    built from another model's states refuses this one (its `check_model`, datastores.DatastoreError)."""
    wanting = [s for s in stores if getattr(s, "state_layer", None) is not None]
    if wanting:
        fingerprint = model_fingerprint(lm.model)
        for store in wanting:
            check = getattr(store, "check_model", None)
            if check is not None:
                check(fingerprint)
    return {layer: StateTap(lm.model, layer) for layer in sorted({s.state_layer for s in wanting})}


def tell_states(stores: Sequence, taps: dict[int, StateTap], row: int, token: int) -> None:
    """Hand each store that drafts from the model's state the newest pass's state at `row`, which predicted
    `token` (the newest committed token)."""
    for store in stores:
        tap = taps.get(getattr(store, "state_layer", None))
        state = tap.row(row) if tap is not None else None
        if state is not None:
            store.see_state(state, token)


def neighbour_windows(lookups: Sequence, stores: Sequence, window: int = 12) -> dict:
    """The StepTrace field `neighbours`: per dense source, each neighbour's stream position, similarity and the
    tokens around it there (`window` up to and including it, `window` after it), where its store can say."""
    found = {}
    for lk, store in zip(lookups, stores):
        near = getattr(lk, "neighbours", None)  # a lookup-like answer of a store of one's own may have none
        if not near:
            continue
        around = getattr(store, "around", None)
        rows = []
        for position, similarity in near:
            before, after = around(position, window, window) if around is not None else ([], [])
            rows.append({"position": int(position), "similarity": float(similarity), "before": before, "after": after})
        found[lk.source] = rows
    return found
