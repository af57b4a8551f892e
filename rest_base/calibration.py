"""One file per timed choice: what REST Lab measured on this machine (the linear kernels, the attention kernel, the
cost curve), kept in the cache until the machine, the code that measured it or what it was measured with changes.

A `CalibrationFile` is named by its kind (the cache's sub-folder: "kernels", "cost"), what it is for (a model, a
head shape) and the machine's key (the caller's: rest_core.machine.machine_key), and holds a version of its layout
and method and the facts the measurement was made with (`made_with`: the kernel source's hash, the row counts
timed, ...), beside the measurement itself.  Reading gives the stored data only where the version and every one of
those facts match; a missing, unreadable or other file reads as absent (None), and the caller measures again.
Writing is atomic (a reader never sees half a file), and a file that cannot be written is skipped: the measurement
holds for the process that made it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rest_base.files import cache_dir, read_json, safe_file_name, write_json


def _as_json(value: Any) -> Any:
    """A value as it reads back from JSON (tuples as lists, keys as strings), so a fact compares equal to itself."""
    return json.loads(json.dumps(value))


@dataclass(frozen=True)
class CalibrationFile:
    """`<cache>/<kind>/<name>-<machine>.json`: one measurement, with the version and the facts it was made with."""

    kind: str  # the cache's sub-folder
    name: str  # what was measured (a model, a head shape), as one file-name part
    machine: str  # the machine's key
    version: int  # of the file's layout and of the method
    made_with: dict = field(default_factory=dict)  # fact -> JSON value; a file made with others is not this one's

    @property
    def path(self) -> Path:
        return cache_dir() / self.kind / f"{safe_file_name(self.name)}-{self.machine}.json"

    def read(self) -> Optional[dict]:
        """The stored fields (the measurement, the version and facts included) when this version and these facts
        made them; None for a missing, unreadable or other file."""
        data = read_json(self.path)
        if not isinstance(data, dict) or data.get("version") != self.version:
            return None
        if any(data.get(fact) != value for fact, value in _as_json(self.made_with).items()):
            return None
        return data

    def write(self, measurement: dict) -> None:
        """Keep `measurement` (JSON fields) with this version, these facts and the time it was written."""
        write_json(self.path, {"version": self.version, **_as_json(self.made_with),
                               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **measurement})
