"""The benchmark's outputs: the machine it ran on, results.md, the chart (HTML and PNG), results.json."""
from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import plotly.graph_objects as go
import torch
import transformers
from plotly.subplots import make_subplots

from rest_core.bench.methods import TRACED

if TYPE_CHECKING:
    from rest_core.model import LoadedModel

CHROMIUM = Path("/usr/bin/chromium")  # kaleido's browser for chart.png, when BROWSER_PATH names none


# -- the machine ----------------------------------------------------------------------------------------

def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


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


def machine_info(lm: LoadedModel | type[_CpuOnly]) -> dict:
    """What the numbers depend on: CPU, cores, threads, library versions, device, dtype, model, load."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {**cpu_info(), "cores": os.cpu_count(), "usable_cores": usable, "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "device": str(lm.device), "dtype": str(lm.dtype).replace("torch.", ""), "model": lm.name,
            "model_source": lm.source, "loadavg_start": loadavg()}
    if lm.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(lm.device)
    return info


def machine_info_cpu() -> dict:
    """machine_info without a model: the CPU, as store lookups run there."""
    info = machine_info(_CpuOnly)
    for k in ("device", "dtype", "model", "model_source"):
        info.pop(k, None)
    return info


class _CpuOnly:
    name, source = "-", "-"
    device, dtype = torch.device("cpu"), "-"


def cpu_line(mc: dict) -> str:
    """'<model> (<vendor>, torch uses <instruction set>)' for the machine line of a report."""
    capability = f"torch uses {mc['cpu_capability']}" if mc.get("cpu_capability") else None
    details = [d for d in (mc.get("cpu_vendor"), capability) if d]
    return mc["cpu"] + (f" ({', '.join(details)})" if details else "")


# -- results.md -----------------------------------------------------------------------------------------

def fmt(x: float | None, spec: str = ".2f", none: str = "–") -> str:
    """x formatted with spec, or `none` when x is None."""
    return none if x is None else format(x, spec)


def _table(summ: dict) -> list[str]:
    head = ["method", "tokens/s", "speedup", "ms/token", "accepted/pass", "acceptance", "no-draft steps",
            "retrieve p50/p99 ms", "verify cost (model)", "fwd ms/step", "fwd cost (measured)", "mean budget",
            f"same as {summ['reference']}", "failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, s in summ["methods"].items():
        ret = "–" if s["retrieve_ms_p50"] is None else f"{s['retrieve_ms_p50']:.2f} / {s['retrieve_ms_p99']:.2f}"
        row = [m, fmt(s["tokens_per_s"]), fmt(s["speedup"], ".2f") + ("×" if s["speedup"] is not None else ""),
               fmt(s["ms_per_token"], ".1f"), fmt(s["mean_accepted"]), fmt(s["acceptance_rate"], ".1%"),
               fmt(s["no_draft_share"], ".1%"), ret, fmt(s["verify_cost_rel_model"]),
               fmt(s["forward_ms_per_step"], ".1f"), fmt(s["verify_cost_rel_measured"]), fmt(s["mean_budget"], ".1f"),
               f"{s['identical']}/{s['compared']}", str(s["prompts_failed"])]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _method_notes(summ: dict, greedy: bool) -> list[str]:
    return [(f"Speedup is over the faster of the baselines ({summ['baseline']}); tokens/s = all new tokens / all "
             "wall time (prefill included) over the prompts a method completed."),
            "Accepted/pass = new tokens per forward pass (ours: prefill not counted; generate(): its first call "
            "runs the prompt and yields the first token)."
            + (" HF prompt-lookup drafts are read from the query sizes of its forward calls." if greedy else ""),
            ("Verify cost (model) = mean calibrated cost of the step's query size relative to a one-token pass; "
             "measured = mean forward ms per step / plain's forward ms per step."),
            ("rest_full's history store is in memory and starts empty: it holds this run's earlier rest_full "
             "answers only."),
            "Methods ran interleaved prompt by prompt, the order rotating per prompt, after one untimed warm-up."]


def _check_notes(ch: dict) -> list[str]:
    notes = []
    if ch.get("plain_vs_hf_ms_per_token_ratio") is not None:
        notes.append(f"Plain loop vs generate(): {ch['plain_vs_hf_ms_per_token_ratio']:.3f}× the time per token "
                     + ("(within 5%)." if ch["plain_within_5pct_of_hf"] else f"— FLAG: {ch['plain_vs_hf_flag']}."))
    for d in ch.get("differences", []):
        gap = f", logit gap {d['logit_gap']:.4g}" if d.get("logit_gap") is not None else ""
        notes.append(f"{d['method']} differs from {d['reference']} on {d['prompt']} at token "
                     f"{d.get('first_difference')}{gap}.")
    if ch.get("errors"):
        notes.append(f"{len(ch['errors'])} failed runs (see results.json), e.g. {ch['errors'][0]['method']} on "
                     f"{ch['errors'][0]['prompt']}: {ch['errors'][0]['error'][:200]}")
    return notes


def _distribution_notes(dc: dict) -> list[str]:
    notes = []
    if "skipped" in dc:
        notes.append(f"First-token chi-square check skipped ({dc['skipped']}).")
    for entry in dc.get("prompts", []):
        parts = []
        for m, r in entry["methods"].items():
            pv = r.get("p_value")
            parts.append(f"{m} p={pv:.3g} ({r.get('bins')} bins, drafts at the root in "
                         f"{fmt(r.get('share_with_drafts'), '.0%')} of runs)" if pv is not None
                         else f"{m}: {r.get('note', 'n/a')}")
        notes.append(f"First-token chi-square over {dc['seeds']} seeds on {entry['prompt']}: " + "; ".join(parts)
                     + ".")
    return notes


def _recording_note(rc: dict) -> str:
    per = rc["per_method"]
    return (f"Recording every step to SQLite: {rc['overhead_per_step']:+.1%} wall time per step "
            f"({per[TRACED]['ms_per_step']:.1f} vs {per['rest_static']['ms_per_step']:.1f} ms), "
            f"{rc['db_bytes_per_1000_steps'] / 1e6:.2f} MB of database per 1,000 steps.")


def markdown(results: dict) -> str:
    """results.md: the machine line, the command, the per-method table and the notes."""
    st, mc, summ = results["settings"], results["machine"], results["summary"]
    greedy = st["mode"] == "greedy"
    gpu = f" ({mc['gpu']})" if mc.get("gpu") else ""
    lines = [(f"# REST Lab benchmark: {st['suite']} ({st['mode']}, {st['prompts']} prompts, "
              f"max {st['max_new_tokens']} new tokens)"), "",
             (f"Machine: {cpu_line(mc)}, {mc['cores']} cores ({mc['usable_cores']} usable), torch threads "
              f"{mc['torch_threads']}, device {mc['device']}{gpu}, {mc['dtype']}; torch {mc['torch']}, transformers "
              f"{mc['transformers']}; model {mc['model']}; load average {mc.get('loadavg_start')} at start, "
              f"{mc.get('loadavg_end')} at end."), "",
             f"Command: `{results.get('command') or '(library call)'}`", "",
             *_table(summ), ""]
    notes = _method_notes(summ, greedy) + _check_notes(results.get("checks", {}))
    if not greedy and results.get("distribution_check"):
        notes += _distribution_notes(results["distribution_check"])
    rc = results.get("recording")
    if rc and rc.get("overhead_per_step") is not None:
        notes.append(_recording_note(rc))
    if results.get("interrupted"):
        notes.append("INTERRUPTED: partial results.")
    if results.get("png_note"):
        notes.append(results["png_note"])
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# -- the chart --------------------------------------------------------------------------------------------

def chart(results: dict) -> go.Figure:
    summ = results["summary"]["methods"]
    names = list(summ)
    tps = [summ[m]["tokens_per_s"] or 0 for m in names]
    acc = [summ[m]["mean_accepted"] or 0 for m in names]
    labels = [f"{summ[m]['speedup']:.2f}×" if summ[m]["speedup"] is not None else "" for m in names]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens/s (speedup over the faster baseline)",
                                                        "mean new tokens per forward pass"))
    fig.add_trace(go.Bar(x=names, y=tps, text=labels, textposition="outside", marker_color="#4c78a8",
                         name="tokens/s"), row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=acc, text=[f"{a:.2f}" for a in acc], textposition="outside",
                         marker_color="#f58518", name="accepted/pass"), row=1, col=2)
    st, mc = results["settings"], results["machine"]
    fig.update_layout(title=f"REST Lab bench: {st['suite']}, {st['mode']}, {st['prompts']} prompts, "
                            f"{mc['model']} on {mc['device']} ({mc['cpu']})",
                      showlegend=False, height=480, width=1150, margin={"t": 90})
    fig.update_yaxes(rangemode="tozero")
    return fig


@contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """os.environ[name] = value for the duration of the block only."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def write_png(fig: go.Figure, path: Path) -> str | None:
    """Write a PNG with kaleido (Chromium at /usr/bin/chromium when present); a note when it cannot.

    The browser is named to kaleido through BROWSER_PATH for this export only: the rest of
    the process (an app, a test run) never sees it."""
    browser = None if os.environ.get("BROWSER_PATH") or not CHROMIUM.exists() else str(CHROMIUM)
    try:
        with _environ("BROWSER_PATH", browser) if browser else nullcontext():
            fig.write_image(str(path), width=1150, height=480)
        return None
    except Exception as err:  # kaleido and its browser fail in many ways; the PNG is optional
        return f"chart.png skipped: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def write_outputs(results: dict, out: Path, png: bool = True, fig: go.Figure | None = None) -> None:
    """results.json, results.md, chart.html and (unless png=False) chart.png in out."""
    out.mkdir(parents=True, exist_ok=True)
    fig = fig if fig is not None else chart(results)
    fig.write_html(str(out / "chart.html"), include_plotlyjs=True)
    results["png_note"] = (write_png(fig, out / "chart.png") if png else "chart.png not written (--no-png)")
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False), encoding="utf-8")
    (out / "results.md").write_text(markdown(results), encoding="utf-8")
