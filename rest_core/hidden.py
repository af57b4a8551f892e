"""The model's hidden state at one layer, kept from passes the decoder runs anyway.

Layers are numbered as transformers numbers `output_hidden_states`: 0 is the token embedding, i (1..n-1)
the output of decoder layer i - 1, and n (the number of decoder layers) the final norm's output -- what
the output layer reads.  `StateTap` keeps one layer's output of every forward call through a hook on that
module (no extra pass, no other layer returned); `sequence_states` runs the base model over whole
documents, for building a dense store (datastores.dense).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
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


BATCH_TOKENS = 1024  # padded tokens per pass when reading documents (docs/bench/dense-build.md: on 2 CPU cores a
# pass over one 200-token answer already keeps the cores busy, so batching there neither gains nor loses much)


class _Reached(Exception):
    """Raised by sequence_states' hook once the layer it reads has run: the layers above it are not needed."""


def length_batches(lengths: Sequence[int], batch_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """Indices of documents in batches of similar length, longest first: each batch's rows padded to its longest
    hold at most `batch_tokens` tokens (a longer document gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@torch.inference_mode()
def sequence_states(model: torch.nn.Module, docs: Sequence[Sequence[int]], layer: int,
                    device: torch.device | str = "cpu", batch_tokens: int = BATCH_TOKENS) -> list[np.ndarray]:
    """Hidden state `layer` at every position of each document: [(len(doc), d) float32], in the order given.

    Documents of similar length share a pass (`length_batches`), right-padded: in a causal model a position never
    sees the ones after it, so the pads change no real position's state (the attention mask says so anyway), and
    every row's positions count from 0 as they would alone.  The pass stops at `layer` (the layers above it and the
    output layer are not run)."""
    width_of = int(model.config.hidden_size)
    out: list[np.ndarray] = [np.zeros((0, width_of), np.float32)] * len(docs)
    kept: dict[str, torch.Tensor] = {}

    def keep(module, args, output) -> None:
        kept["rows"] = (output[0] if isinstance(output, tuple) else output).detach()  # (b, width, d)
        raise _Reached

    handle = layer_module(model, layer).register_forward_hook(keep)
    try:
        for batch in length_batches([len(d) for d in docs], batch_tokens):
            batch = [i for i in batch if len(docs[i]) > 0]
            if not batch:
                continue
            width = len(docs[batch[0]])  # the longest of the batch
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, :len(docs[i])] = torch.as_tensor(list(docs[i]), dtype=torch.long)
                mask[row, :len(docs[i])] = 1
            positions = torch.arange(width).expand(len(batch), width)
            try:
                model.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=positions.to(device), use_cache=False)
            except _Reached:
                pass
            rows = kept.pop("rows").float().cpu()
            for row, i in enumerate(batch):
                out[i] = rows[row, :len(docs[i])].numpy().copy()
    finally:
        handle.remove()
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


def state_reader(model: torch.nn.Module, layer: int, device: torch.device | str = "cpu",
                 turn: Optional[Callable[[], AbstractContextManager]] = None) -> Callable[[list[list[int]]], list]:
    """A function from documents (token id lists) to their (len, d) float32 states at `layer`, for
    datastores.dense.build_dense_store.  `turn` (when given) is entered around each call: a server that decodes on
    the same model lets a waiting decode go first between two calls (a call hooks the model's layer, so no decode
    may run during one)."""
    def read(docs: list[list[int]]) -> list[np.ndarray]:
        with turn() if turn is not None else nullcontext():
            return sequence_states(model, docs, layer, device)
    return read


def dense_layer(model: torch.nn.Module) -> int:
    """The hidden state the built-in dense store keeps for this model (`default_dense_layer`)."""
    return default_dense_layer(layer_count(model))


def default_dense_layer(layers: int) -> int:
    """The hidden state the built-in dense store keeps for a model of `layers` decoder layers: the output of the
    layer three quarters of the way up (22 of the default model's 30), which covered as many of the steps the text
    sources miss as the last layers and more than the middle or early ones (docs/bench/dense-coverage.md)."""
    return 3 * int(layers) // 4


def open_model_dense(lm, spec: Optional[str] = "default", progress: bool = True, layer: Optional[int] = None,
                     dim: Optional[int] = None, turn: Optional[Callable[[], AbstractContextManager]] = None,
                     build: bool = True):
    """The dense store `spec` names for this model (datastores.open_dense): 'default' builds the built-in one on
    first use -- after the general-text store it is made from, which is built first when missing -- unless `build`
    is False (then a DatastoreError says how to build it); 'none'/None: off, else a store folder.  `layer` / `dim`
    (default: `dense_layer`, datastores.dense.DEFAULT_DIM) pick which built-in store; `turn`: see `state_reader`."""
    from functools import partial

    from datastores import open_answers, open_dense
    from datastores.dense import DEFAULT_DIM
    from rest_core.model import generate_batch

    if spec in (None, "none"):
        return None
    layer = dense_layer(lm.model) if layer is None else layer
    if spec == "default" and build:  # its corpus is the general-text store's answers
        open_answers("default", lm.name, lm.tokenizer, generate=partial(generate_batch, lm), progress=progress)
    return open_dense(spec, lm.name, lm.tokenizer, model_fingerprint(lm.model), layer,
                      states=state_reader(lm.model, layer, lm.device, turn) if build else None, dim=dim or DEFAULT_DIM,
                      progress=progress)


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
