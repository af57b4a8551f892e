"""What CPU this is, read once from /proc/cpuinfo: the facts a results page quotes and the key a native build is
kept under.  (rest_core.machine adds what torch tells: the instruction set it uses, its version, its threads.)

A virtual machine often names its CPU only "AMD EPYC" or "Intel Xeon Processor"; the family and model numbers
tell a Zen 3 from a Zen 5 there.
"""
from __future__ import annotations

import hashlib
import platform

# CPU features that change which kernels are fastest, reported when /proc/cpuinfo lists them
FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
CPUINFO_FIELDS = ("model name", "vendor_id", "cpu family", "model", "flags")


def cpuinfo_fields() -> dict[str, str]:
    """The first processor's CPUINFO_FIELDS as /proc/cpuinfo gives them (those it lists; empty where there is no
    /proc/cpuinfo)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in CPUINFO_FIELDS and key not in found:
                    found[key] = value.strip()
                if len(found) == len(CPUINFO_FIELDS) or (not line.strip() and found):
                    break
    except OSError:
        pass
    return found


def cpu_info() -> dict:
    """CPU model name, vendor, family and model numbers and the FEATURES that matter for speed (from
    /proc/cpuinfo where there is one)."""
    found = cpuinfo_fields()
    flags = set(found.get("flags", "").split())
    return {"cpu": found.get("model name") or platform.processor() or platform.machine(),
            "cpu_vendor": found.get("vendor_id"),
            "cpu_family": f"{found['cpu family']}/{found['model']}" if "cpu family" in found and "model" in found
            else None,
            "cpu_features": [f for f in FEATURES if f in flags]}


def cpu_key() -> str:
    """A short key of this CPU's architecture, model and whole instruction set (what -march=native compiles for)."""
    found = cpuinfo_fields()
    text = platform.machine() + "|" + "|".join(f"{k}={found.get(k)}" for k in CPUINFO_FIELDS)
    if not found:
        text += "|" + platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:10]
