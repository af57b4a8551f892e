"""Is the process that wrote a run still alive?  (pid + its start time, from /proc)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def _proc_stat(pid: int) -> Optional[tuple[str, str]]:
    """(state, start time in clock ticks) from /proc, or None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
    return fields[0], fields[19]


def process_start(pid: int) -> Optional[str]:
    """The start time of process `pid` (tells a reused pid apart), or None where unknown."""
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def process_alive(pid: Optional[int], proc_start: Optional[str]) -> bool:
    """Is the process that wrote a run still the same living process?"""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, start = stat
    return state not in ("Z", "X") and (proc_start is None or start == proc_start)
