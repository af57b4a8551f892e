"""What machine this is, as far as speed goes: the CPU, the instruction set torch uses, threads, versions.

The cost curve and the benchmark depend on it: the same code runs 2-3x apart on AVX2 and
AVX-512/AMX machines, so a calibration is kept per machine key and measured again when it changes.  The CPU's own
facts come from `rest_base.machine` (the one reader of /proc/cpuinfo).
"""
from __future__ import annotations

import hashlib
import os

import torch

from rest_base import machine as cpu


def cpu_info() -> dict:
    """`rest_base.machine.cpu_info` (CPU model name, vendor, family and model numbers, the features that matter
    for speed) and the instruction set torch uses."""
    return {**cpu.cpu_info(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def machine_key() -> str:
    """A short key that changes when the CPU, its instruction set, the thread count or torch changes."""
    info = cpu_info()
    text = "|".join(str(v) for v in (info["cpu"], info["cpu_vendor"], info["cpu_family"], info["cpu_features"],
                                     info["cpu_capability"], torch.__version__, torch.get_num_threads(),
                                     os.cpu_count()))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def code_version() -> str:
    """Which code is running, for results pages: the git commit of the checkout this package runs from
    ("3a527d1", "+ uncommitted changes" when the work tree differs from it), else the installed version."""
    import subprocess
    from importlib import metadata
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if (root / ".git").exists():
        try:
            run = dict(cwd=root, capture_output=True, text=True, timeout=10, check=True)
            commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], **run).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run).stdout.strip()
            return f"commit {commit}" + (" + uncommitted changes" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return f"rest-lab {metadata.version('rest-lab')}"
    except metadata.PackageNotFoundError:
        return "unknown (not a git checkout, not an installed package)"


def cpu_line(mc: dict) -> str:
    """'<model> (<vendor> family/model <f>/<m>, <features>, torch uses <instruction set>)' for the machine line of
    a report."""
    family = f"family/model {mc['cpu_family']}" if mc.get("cpu_family") else None
    vendor = " ".join(d for d in (mc.get("cpu_vendor"), family) if d) or None
    features = ", ".join(mc.get("cpu_features") or []) or None
    capability = f"torch uses {mc['cpu_capability']}" if mc.get("cpu_capability") else None
    details = [d for d in (vendor, features, capability) if d]
    return mc["cpu"] + (f" ({', '.join(details)})" if details else "")
