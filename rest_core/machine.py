"""What machine this is, as far as speed goes: the CPU, the instruction set torch uses, threads, versions.

The cost curve and the benchmark depend on it: the same code runs 2-3x apart on AVX2 and
AVX-512/AMX machines, so a calibration is kept per machine key and measured again when it changes.
"""
from __future__ import annotations

import hashlib
import os
import platform

import torch

# CPU features that change which kernels are fastest, reported when /proc/cpuinfo lists them
FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def cpu_info() -> dict:
    """CPU model name, vendor, family and model numbers and the features that matter for speed (from
    /proc/cpuinfo where there is one), and the instruction set torch uses.  A virtual machine often names
    its CPU only "AMD EPYC" or "Intel Xeon Processor"; the family and model numbers tell a Zen 3 from a
    Zen 5 there."""
    wanted = ("model name", "vendor_id", "cpu family", "model", "flags")
    found = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in wanted and key not in found:
                    found[key] = value.strip()
                if len(found) == len(wanted) or (not line.strip() and found):
                    break
    except OSError:
        pass
    flags = set(found.get("flags", "").split())
    return {"cpu": found.get("model name") or platform.processor() or platform.machine(),
            "cpu_vendor": found.get("vendor_id"),
            "cpu_family": f"{found['cpu family']}/{found['model']}" if "cpu family" in found and "model" in found
            else None,
            "cpu_features": [f for f in FEATURES if f in flags],
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def machine_key() -> str:
    """A short key that changes when the CPU, its instruction set, the thread count or torch changes."""
    info = cpu_info()
    text = "|".join(str(v) for v in (info["cpu"], info["cpu_vendor"], info["cpu_family"], info["cpu_features"],
                                     info["cpu_capability"], torch.__version__, torch.get_num_threads(),
                                     os.cpu_count()))
    return hashlib.sha256(text.encode()).hexdigest()[:10]
