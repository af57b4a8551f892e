"""What the cost model learns about acceptance, and where it keeps it between runs.

A draft node whose parent was accepted counts, hit or miss, in a cell of its source's counts: its depth (1, 2, 3,
4 and deeper), its support (the continuation rows through it) and its ratio (its share of its parent's rows).
`node_cells` places a tree's nodes; `fade` keeps the counts adapting.  `KeptStats` is the part of the cost model that
keeps the counts per model, store and kind of text in one JSON file (`stats_path_for`), with the agreement sums.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from rest_base.files import cache_dir, read_json, safe_file_name, write_json
from rest_core.tree import DraftTree

BINS = np.array([0.0, 0.05, 0.15, 0.3, 0.5, 0.7, 0.9, 1.0001])  # ratio bins (a node's share of its parent's rows)
DEPTHS = 4  # depth cells: 1, 2, 3, 4 and deeper
SUPPORT = np.array([0.0, 2.0, 4.0, 16.0])  # support cells: 1, 2-3, 4-15, 16+ rows through the node
SHAPE = (2, DEPTHS, len(SUPPORT), len(BINS) - 1)  # drafted / accepted counts per source
CELLS = DEPTHS * len(SUPPORT) * (len(BINS) - 1)  # cells per kind of count, flattened (C order of SHAPE[1:])
MAX_COUNT = 5000.0  # per cell: older observations fade so the calibration keeps adapting
STATS_VERSION = 3  # 3: the model source drafts from pairs of tokens too (its cells mean other things)
AGREE_LEVELS = 3  # nodes drafted by 1, 2, 3 or more sources (rows of that many sources run through the node)


class KeptStats:
    """Saving and loading the cost model's acceptance counts (`counts`, `agreement`, per `labels` and `kind`, in
    `stats_path`: the cost model's fields, rest_core.cost.CostModel)."""

    def save_stats(self) -> None:
        """Keep the acceptance counts for the next run, per store (they depend on model and store, not on
        hardware); the other stores' counts in the file stay.  Called by whoever owns the cost model, after a
        decode; the decoder writes no files."""
        if self.stats_path is None:
            return
        data = read_json(self.stats_path)
        stores = _stored_counts(data)
        stores.update({self._disk_key(self.labels.get(k, k)): v.tolist() for k, v in self.counts.items()})
        agreement = _stored_agreement(data)
        agreement[self.kind] = self.agreement.tolist()
        write_json(self.stats_path, {"version": STATS_VERSION, "shape": list(SHAPE), "bins": BINS.tolist(),
                                     "stores": stores, "agreement": agreement})

    def load_stats(self) -> None:
        """Counts saved by earlier runs with this model for these stores, and this kind's agreement sums;
        anything unreadable is ignored."""
        data = read_json(self.stats_path)
        saved = _stored_counts(data)
        agreement = _stored_agreement(data).get(self.kind)
        self.agreement = np.asarray(agreement, dtype=float) if agreement is not None else np.zeros((2, AGREE_LEVELS))
        counts = {}
        for key, value in saved.items():
            label = self._label_of(key)
            if label is None:  # another kind's
                continue
            name = next((n for n, lab in self.labels.items() if lab == label), None if self.labels else label)
            if name is not None:
                counts[name] = np.asarray(value, dtype=float)
        self.counts = counts

    def _disk_key(self, label: str) -> str:
        """The key of a store's counts on disk: its label, and the kind of text when told."""
        return f"{label} [{self.kind}]" if self.kind else label

    def _label_of(self, key: str) -> Optional[str]:
        """The store label of a key on disk when it holds this kind's counts, else None."""
        if self.kind:
            suffix = f" [{self.kind}]"
            return key[:-len(suffix)] if key.endswith(suffix) else None
        return None if key.endswith("]") and " [" in key else key


def fade(counts: np.ndarray) -> None:
    """A source's counts after a step: cells past MAX_COUNT drafted are scaled back to it, so older
    observations fade and the calibration keeps adapting."""
    full = counts[0] > MAX_COUNT
    if full.any():
        counts *= np.where(full, MAX_COUNT / np.maximum(counts[0], 1.0), 1.0)



def node_cells(tree: DraftTree) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per draft node: its ratio (share of its parent's rows, or its own share under a parent of another
    source), its cell (depth, support, ratio bin) as one index into a source's counts flattened per kind
    (`CELLS` of them), and its source name (an array, for masks)."""
    parents = tree.parents[1:]
    shares = tree.shares[1:]
    parent_share = tree.shares[parents]
    named = np.array(tree.sources)
    same = named[parents] == named[1:]
    ratio = np.where(same & (parent_share > 0), shares / np.maximum(parent_share, 1e-12), shares)
    ratio = np.minimum(np.maximum(ratio, 0.0), 1.0)
    depth = np.minimum(tree.depths[1:] - 1, DEPTHS - 1)  # draft nodes are at depth 1 and deeper
    # np.digitize(x, increasing bins) - 1 is searchsorted(bins, x, "right") - 1; support and ratio are >= 0
    sup = np.minimum(SUPPORT.searchsorted(tree.support[1:], "right") - 1, len(SUPPORT) - 1)
    rbin = np.minimum(BINS.searchsorted(ratio, "right") - 1, len(BINS) - 2)
    return ratio, (depth * len(SUPPORT) + sup) * (len(BINS) - 1) + rbin, named[1:]


def _stored_agreement(data) -> dict[str, list]:
    """Per kind of text, the agreement levels' (accepted, expected) sums a stats file holds (empty for a file of
    another version or without them; a kind whose sums are unreadable is left out)."""
    if not isinstance(data, dict) or data.get("version") != STATS_VERSION:
        return {}
    found = data.get("agreement")
    out = {}
    for kind, value in (found.items() if isinstance(found, dict) else ()):
        try:
            arr = np.asarray(value, dtype=float)
        except (TypeError, ValueError):
            continue
        if arr.shape == (2, AGREE_LEVELS) and np.isfinite(arr).all() and (arr >= 0).all():
            out[str(kind)] = value
    return out


def _stored_counts(data) -> dict[str, list]:
    """The per-store counts of a stats file this version wrote (empty for anything else)."""
    if not isinstance(data, dict) or data.get("version") != STATS_VERSION or data.get("shape") != list(SHAPE) \
            or data.get("bins") != BINS.tolist() or not isinstance(data.get("stores"), dict):
        return {}
    out = {}
    for label, value in data["stores"].items():
        try:
            arr = np.asarray(value, dtype=float)
        except (TypeError, ValueError):
            return {}
        if arr.shape != SHAPE or not np.isfinite(arr).all() or (arr < 0).any():
            return {}
        out[str(label)] = value
    return out



def stats_path_for(model_name: str) -> Path:
    return cache_dir() / "cost" / f"{safe_file_name(model_name)}-acceptance-v{STATS_VERSION}.json"
