"""A run exported as JSON (`traces export RUN --json FILE`), read back with the trace store's readers.

`ExportedRun` answers `get_run`, `step_count`, `load_steps` and `load_step` for its one run as a
`TraceRecorder` does, from the file alone: no SQLite file, no model, nothing written.  The page
replays the example run that ships with it this way, the same for every visitor.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rest_core.traces.masks import full_mask
from rest_core.traces.rows import RunRow, StepDetail, StepRow


class ExportError(ValueError):
    """The file is not a run export this reader understands; the message says what is wrong."""


def _block(rows: Any, step: int) -> np.ndarray:
    """The (q, q) bool tree-mask block from its exported rows of '0'/'1'."""
    if not isinstance(rows, list) or not all(isinstance(r, str) and set(r) <= {"0", "1"} for r in rows):
        raise ExportError(f"step {step}: tree_mask must be a list of strings of 0 and 1")
    if not rows:
        return np.zeros((0, 0), dtype=bool)
    if any(len(r) != len(rows) for r in rows):
        raise ExportError(f"step {step}: tree_mask is not square")
    return np.array([[c == "1" for c in r] for r in rows], dtype=bool)


class ExportedRun:
    """One exported run, read-only; `run_id` is the id it answers to (the file's own id unless given)."""

    def __init__(self, data: dict, run_id: Optional[int] = None):
        if not isinstance(data, dict) or not isinstance(data.get("run"), dict) or not isinstance(
                data.get("steps"), list):
            raise ExportError("not a run export: expected an object with 'run' and 'steps' "
                              "(write one with `python -m rest_core traces export RUN --json FILE`)")
        self.run: dict = dict(data["run"])
        self.run_id = int(self.run.get("id", 0) if run_id is None else run_id)
        self.run["id"] = self.run_id
        self._steps: list[dict] = []
        for i, step in enumerate(data["steps"]):
            if not isinstance(step, dict) or step.get("step") != i or not isinstance(step.get("nodes"), list):
                raise ExportError(f"step {i} is missing or out of order")
            detail = dict(step, run_id=self.run_id, mask_block=_block(step.get("tree_mask"), i))
            detail.pop("tree_mask", None)
            self._steps.append(detail)

    @classmethod
    def from_file(cls, path: str | Path, run_id: Optional[int] = None) -> ExportedRun:
        """Read an export (ExportError naming the file when it cannot be read or is not one)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ExportError(f"cannot read the run export {Path(path).name}: {err}") from None
        return cls(data, run_id)

    def _check(self, run_id: int) -> None:
        if int(run_id) != self.run_id:
            raise KeyError(f"no run {run_id}")

    def get_run(self, run_id: int) -> RunRow:
        self._check(run_id)
        return copy.deepcopy(self.run)

    def step_count(self, run_id: int) -> int:
        return len(self._steps) if int(run_id) == self.run_id else 0

    def load_steps(self, run_id: int, since_step: int = 0) -> list[StepRow]:
        """The step rows from `since_step` on, without nodes, branches and mask (as load_steps gives them)."""
        self._check(run_id)
        skip = ("nodes", "branches", "mask_block")
        return [{k: copy.deepcopy(v) for k, v in s.items() if k not in skip} for s in self._steps[since_step:]]

    def load_step(self, run_id: int, step: int, *, mask: Optional[str] = None) -> StepDetail:
        """One step with its nodes, branches and mask block (mask="torch" / "numpy" adds the full mask)."""
        self._check(run_id)
        if not 0 <= int(step) < len(self._steps):
            raise KeyError(f"no step {step} in run {run_id}")
        out = copy.deepcopy(self._steps[int(step)])
        if mask is not None:
            full = full_mask(out["mask_block"], out["prefix_len"], out.get("mask_dtype") or "float32")
            out["mask"] = full if mask == "torch" else full[0, 0].float().numpy()
        return out
