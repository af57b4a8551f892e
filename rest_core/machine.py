"""What machine this is, as far as speed goes: the CPU, the instruction set torch uses, threads, versions.

The cost curve and the benchmark depend on it: the same code runs 2-3x apart on AVX2 and
AVX-512/AMX machines, so a calibration is kept per machine key and measured again when it changes.
"""
from __future__ import annotations

import hashlib
import os
import platform

import torch


def cpu_info() -> dict:
    """CPU model name and vendor (from /proc/cpuinfo where there is one) and the instruction set torch uses."""
    found = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "vendor_id") and key not in found:
                    found[key] = value.strip()
                if len(found) == 2:
                    break
    except OSError:
        pass
    return {"cpu": found.get("model name") or platform.processor() or platform.machine(),
            "cpu_vendor": found.get("vendor_id"), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def machine_key() -> str:
    """A short key that changes when the CPU, its instruction set, the thread count or torch changes."""
    info = cpu_info()
    text = "|".join(str(v) for v in (info["cpu"], info["cpu_vendor"], info["cpu_capability"], torch.__version__,
                                     torch.get_num_threads(), os.cpu_count()))
    return hashlib.sha256(text.encode()).hexdigest()[:10]
