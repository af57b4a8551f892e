"""`python -m rest_core bench --suite verify`: what one verify pass over q tree nodes costs, and where it goes.

For q = 1..64 tokens after a prefix of 256 and of 1024 tokens (a 4D float tree mask, the decoder's cache,
as `rest_core.verify.tree_forward` runs it) this times one forward pass with the linear kernels
chosen on this machine (`rest_core.kernels`) and with transformers' default kernels, interleaved
pass by pass (the order alternating) so machine noise hits both alike: medians over rounds with the
quartiles.  A torch-profiler breakdown per operator group (linear layers, attention, cache
concatenation, the rest) at a few q shows where the extra cost of q > 1 goes.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from rest_core import native
from rest_core.bench.report import loadavg, machine_info
from rest_core.cost import GRID
from rest_core.kv_cache import new_cache
from rest_core.machine import cpu_line
from rest_core.model import LoadedModel

PREFIXES = (256, 1024)
PROFILE_Q = (1, 8, 16, 64)
MODES = ("tuned", "default")  # the kernels chosen on this machine; transformers' own
GROUPS = {"linear": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "mkldnn::_linear_pointwise",
                     native.PROFILE_NAME),
          "attention": ("scaled_dot_product", "aten::_scaled_dot_product", native.ATTENTION_PROFILE_NAME),
          "cache concatenation": ("aten::cat",)}


class PrefixPass:
    """One forward pass over q tokens (random unless given) after a fixed random prefix, timed, the cache cropped
    back after it; `logits` keeps the last pass's (q, V) logits."""

    def __init__(self, lm: LoadedModel, prefix_len: int):
        self.lm, self.prefix_len = lm, prefix_len
        self.gen = torch.Generator().manual_seed(prefix_len)
        self.vocab = lm.vocab_size
        self.cache = new_cache(lm.model)
        self.logits: Optional[torch.Tensor] = None
        ids = torch.randint(0, self.vocab, (1, prefix_len), generator=self.gen).to(lm.device)
        lm.forward(input_ids=ids, cache=self.cache, logits_to_keep=1)

    def random_ids(self, q: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (1, q), generator=self.gen)  # (1, q)

    def __call__(self, q: int, ids: Optional[torch.Tensor] = None) -> float:
        lm, p = self.lm, self.prefix_len
        ids = (self.random_ids(q) if ids is None else ids).to(lm.device)  # (1, q)
        pos = torch.arange(p, p + q, device=lm.device)[None]  # (1, q)
        mask = torch.zeros((1, 1, q, p + q), dtype=lm.dtype, device=lm.device) if q > 1 else None
        _sync(lm)
        t0 = time.perf_counter()
        self.logits = lm.forward(input_ids=ids, position_ids=pos, attention_mask=mask, cache=self.cache).logits[0]
        _sync(lm)
        ms = (time.perf_counter() - t0) * 1e3
        self.cache.crop(-q)
        return ms


def _sync(lm: LoadedModel) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)


def _set_mode(lm: LoadedModel, mode: str) -> None:
    if lm.kernels is not None:
        lm.kernels.enabled = mode == "tuned"
    if lm.attention is not None:
        lm.attention.enabled = mode == "tuned"


def _stats(xs: Sequence[float]) -> dict:
    a = np.asarray(xs, dtype=float)
    return {"median": round(float(np.median(a)), 3), "p25": round(float(np.percentile(a, 25)), 3),
            "p75": round(float(np.percentile(a, 75)), 3), "n": int(a.size)}


@torch.inference_mode()
def cost_curves(lm: LoadedModel, modes: Sequence[str], prefixes: Sequence[int] = PREFIXES,
                grid: Sequence[int] = GRID, rounds: int = 7) -> dict:
    """{prefix: {mode: {q: stats of one pass in ms}}}: every q and mode timed once per round, interleaved."""
    out = {}
    for p in prefixes:
        run = PrefixPass(lm, p)
        samples: dict = defaultdict(lambda: defaultdict(list))
        for r in range(rounds + 1):
            for q in grid:
                for mode in (modes if r % 2 else list(reversed(modes))):
                    _set_mode(lm, mode)
                    ms = run(q)
                    if r:  # round 0 warms every size and kernel up
                        samples[mode][q].append(ms)
        out[p] = {m: {q: _stats(samples[m][q]) for q in grid} for m in modes}
    _set_mode(lm, "tuned")
    return out


def _group(name: str) -> str:
    for group, names in GROUPS.items():
        if any(name.startswith(n) for n in names):
            return group
    return "other"


@torch.inference_mode()
def operator_profile(lm: LoadedModel, modes: Sequence[str], prefixes: Sequence[int] = PREFIXES,
                     qs: Sequence[int] = PROFILE_Q, passes: int = 5) -> list[dict]:
    """Per prefix, q and mode: self CPU ms per pass of each operator group, and the top operators with shapes."""
    rows = []
    for p in prefixes:
        run = PrefixPass(lm, p)
        for q in qs:
            for mode in modes:
                _set_mode(lm, mode)
                run(q)
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    for _ in range(passes):
                        run(q)
                groups: dict[str, float] = defaultdict(float)
                top = []
                for ev in prof.key_averages(group_by_input_shape=True):
                    if ev.key.startswith(("aten::", "mkldnn::", "rest_lab::")):
                        ms = ev.self_cpu_time_total / 1e3 / passes
                        groups[_group(ev.key)] += ms
                        top.append({"op": ev.key, "shapes": str(ev.input_shapes)[:80], "ms": round(ms, 3),
                                    "calls": ev.count // passes})
                top.sort(key=lambda t: -t["ms"])
                rows.append({"prefix": p, "q": q, "mode": mode, "top": top[:8],
                             "groups_ms": {k: round(v, 3) for k, v in groups.items()}})
    _set_mode(lm, "tuned")
    return rows


def run_verify_pass(lm: LoadedModel, out: Path, rounds: int = 7, command: str = "") -> dict:
    """Measure the cost curves and the profile; write results.json and results.md to `out`."""
    modes = list(MODES) if lm.kernels is not None else ["default"]
    results = {"command": command, "machine": machine_info(lm), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "kernels": lm.kernels.describe() if lm.kernels is not None else "transformers' own (not tuned)",
               "kernel_calibration_s": round(lm.kernels.measured_s, 2) if lm.kernels is not None else None,
               "rounds": rounds}
    results["curves"] = cost_curves(lm, modes, rounds=rounds)
    results["profile"] = operator_profile(lm, modes)
    results["machine"]["loadavg_end"] = loadavg()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(verify_markdown(results))
    return results


def verify_markdown(results: dict) -> str:
    """The cost curve (ms and relative to one token, per kernel mode and prefix) and the profile table."""
    mc = results["machine"]
    cpu = cpu_line(mc) if "cpu" in mc else "?"
    lines = [f"# Verify pass cost: {cpu}, torch threads {mc.get('torch_threads', '?')}", "",
             f"Kernels: {results['kernels']}; attention (tuned): {mc.get('attention', 'torch SDPA')}; "
             f"load average {mc.get('loadavg_start')} at start, "
             f"{mc.get('loadavg_end')} at end.", "", f"Code: {mc.get('code', 'not recorded')}; run on "
             f"{mc.get('date', 'an unrecorded date')}.", "", f"Command: `{results['command']}`", ""]
    for p, by_mode in results["curves"].items():
        modes = list(by_mode)
        lines += [f"## Prefix {p}: one forward pass over q tokens, ms (median, p25–p75 of {results['rounds']} "
                  f"interleaved rounds), and × a one-token pass of the same kernels", "",
                  "| q | " + " | ".join(f"{m} ms | {m} ×" for m in modes) + " |",
                  "|---|" + "---|---|" * len(modes)]
        qs = list(by_mode[modes[0]])
        for q in qs:
            cells = []
            for m in modes:
                s, one = by_mode[m][q], by_mode[m][qs[0]]["median"]
                cells.append(f"{s['median']:.1f} ({s['p25']:.1f}–{s['p75']:.1f}) | {s['median'] / one:.2f}")
            lines.append(f"| {q} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Where the time goes (torch profiler, self CPU ms per pass)", "",
              "| prefix | q | kernels | linear | attention | cache concatenation | other | total |",
              "|---|---|---|---|---|---|---|---|"]
    for row in results["profile"]:
        g = row["groups_ms"]
        parts = [g.get(k, 0.0) for k in ("linear", "attention", "cache concatenation", "other")]
        lines.append(f"| {row['prefix']} | {row['q']} | {row['mode']} | " + " | ".join(f"{v:.1f}" for v in parts)
                     + f" | {sum(parts):.1f} |")
    return "\n".join(lines) + "\n"
