"""Files REST Lab keeps: the cache folder, writes that land whole or not at all, JSON that reads as absent when it
cannot be read."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Optional


def cache_dir() -> Path:
    """REST_LAB_CACHE or ~/.cache/rest-lab, created on demand."""
    d = Path(os.environ.get("REST_LAB_CACHE") or Path.home() / ".cache" / "rest-lab").expanduser()
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file whole or not at all: a temporary sibling (one per process and thread), then a rename (OSError
    on failure, leaving no temporary file behind)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def safe_file_name(name: str) -> str:
    """A model or store name as one file-name part: letters, digits, '-', '_' and '.' kept, the rest '_'."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def read_json(path: Optional[Path]) -> Any:
    """The JSON value in a file; None when there is no path, no file, or it cannot be read or parsed."""
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError):
        return None


def write_json(path: Path, data: Any) -> None:
    """`data` as JSON, atomically; a cache that cannot be written is skipped (what it holds stays in force for
    this process)."""
    try:
        write_atomic(path, json.dumps(data).encode("utf-8"))
    except OSError:
        pass
