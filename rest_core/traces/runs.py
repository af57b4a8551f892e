"""The run table: one list of columns (header, getter) for every place that lists runs
(the `traces list` command and the app's run table)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

Column = tuple[str, Callable[[dict], Any]]


def short(text: Optional[str], n: int = 40) -> str:
    """Text on one line (newlines as ↵), cut to n characters with an ellipsis."""
    text = (text or "").replace("\n", "↵")
    return text if len(text) <= n else text[: n - 1] + "…"


def tokens_per_s(run: Mapping) -> Optional[float]:
    """New tokens per second of wall time, or None while unknown."""
    return run["new_tokens"] / run["wall_s"] if run.get("wall_s") and run.get("new_tokens") is not None else None


def tokens_per_pass(run: Mapping) -> Optional[float]:
    """New tokens per forward pass (step), or None before the first step."""
    return run["new_tokens"] / run["steps"] if run.get("steps") and run.get("new_tokens") is not None else None


def _rounded(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(value, digits)


RUN_COLUMNS: list[Column] = [
    ("id", lambda r: r["id"]),
    ("started (UTC)", lambda r: (r.get("started_at") or "")[:19].replace("T", " ")),
    ("status", lambda r: r["status"]),
    ("model", lambda r: r.get("model")),
    ("prompt", lambda r: short(r.get("prompt"), 60)),
    ("new tokens", lambda r: r.get("new_tokens")),
    ("steps", lambda r: r.get("steps")),
    ("tokens/pass", lambda r: _rounded(tokens_per_pass(r), 2)),
    ("tokens/s", lambda r: _rounded(tokens_per_s(r), 1)),
    ("speedup", lambda r: _rounded(r.get("speedup"), 2)),
    ("identical", lambda r: {1: "yes", 0: "no"}.get(r.get("identical"), "")),
]
