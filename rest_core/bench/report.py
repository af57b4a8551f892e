"""The benchmark's outputs: the machine it ran on, results.md, the chart (HTML and PNG), results.json."""
from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import plotly.graph_objects as go
import torch
import transformers
from plotly.subplots import make_subplots

from rest_core.bench.methods import TRACED
from rest_core.machine import code_version, cpu_info, cpu_line

if TYPE_CHECKING:
    from rest_core.model import LoadedModel

CHROMIUM = Path("/usr/bin/chromium")  # kaleido's browser for chart.png, when BROWSER_PATH names none


# -- the machine ----------------------------------------------------------------------------------------

def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(lm: LoadedModel | type[_CpuOnly]) -> dict:
    """What the numbers depend on: CPU, cores, threads, library versions, device, dtype, model, load."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {**cpu_info(), "cores": os.cpu_count(), "usable_cores": usable, "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "device": str(lm.device), "dtype": str(lm.dtype).replace("torch.", ""), "model": lm.name,
            "model_source": lm.source, "loadavg_start": loadavg(), "code": code_version(),
            "date": time.strftime("%Y-%m-%d")}
    kernels = getattr(lm, "kernels", None)
    info["kernels"] = kernels.describe() if kernels is not None else "transformers' default linear kernels"
    attn = getattr(lm, "attention", None)
    info["attention"] = attn.describe() if attn is not None else "torch SDPA"
    if lm.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(lm.device)
    return info


def machine_info_cpu() -> dict:
    """machine_info without a model: the CPU, as store lookups run there."""
    info = machine_info(_CpuOnly)
    for k in ("device", "dtype", "model", "model_source", "kernels", "attention"):
        info.pop(k, None)
    return info


class _CpuOnly:
    name, source = "-", "-"
    device, dtype = torch.device("cpu"), "-"


# -- results.md -----------------------------------------------------------------------------------------

def fmt(x: float | None, spec: str = ".2f", none: str = "–") -> str:
    """x formatted with spec, or `none` when x is None."""
    return none if x is None else format(x, spec)


def _speedup_cell(s: dict, rounds: int) -> str:
    """'1.23×', and with several rounds the spread: '1.23× (1.20–1.25)'."""
    if s["speedup"] is None:
        return "–"
    spread = f" ({s['speedup_min']:.2f}–{s['speedup_max']:.2f})" if rounds > 1 else ""
    return f"{s['speedup']:.2f}×{spread}"


def _table(summ: dict) -> list[str]:
    rounds = len(summ.get("rounds", ())) or 1
    head = ["method", "tokens/s", "speedup" + (" (min–max)" if rounds > 1 else ""), "ms/token", "accepted/pass",
            "acceptance", "no-draft steps", "retrieve p50/p99 ms", "verify cost (model)", "fwd ms/step",
            "fwd cost (measured)", "mean budget", f"same as {summ['reference']}", "failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, s in summ["methods"].items():
        ret = "–" if s["retrieve_ms_p50"] is None else f"{s['retrieve_ms_p50']:.2f} / {s['retrieve_ms_p99']:.2f}"
        row = [m, fmt(s["tokens_per_s"]), _speedup_cell(s, rounds),
               fmt(s["ms_per_token"], ".1f"), fmt(s["mean_accepted"]), fmt(s["acceptance_rate"], ".1%"),
               fmt(s["no_draft_share"], ".1%"), ret, fmt(s["verify_cost_rel_model"]),
               fmt(s["forward_ms_per_step"], ".1f"), fmt(s["verify_cost_rel_measured"]), fmt(s["mean_budget"], ".1f"),
               f"{s['identical']}/{s['compared']}", str(s["prompts_failed"])]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _source_table(by_source: dict) -> list[str]:
    """Per REST method and draft source: draft nodes sent, committed draft tokens, acceptance."""
    if not by_source:
        return []
    lines = ["| method | draft source | draft nodes sent | committed draft tokens | acceptance |",
             "|---|---|---|---|---|"]
    for m, sources in by_source.items():
        for src, c in sources.items():
            lines.append(f"| {m} | {src} | {c['drafted']:,} | {c['accepted']:,} | {fmt(c['acceptance_rate'], '.1%')} |")
    return lines + [""]


def _per_prompt_table(pp: dict | None, rounds: int) -> list[str]:
    """Per prompt: rest_full's tokens/s over the baseline's, median and min–max over rounds (several rounds only)."""
    if not pp or rounds < 2:
        return []
    lines = [f"| prompt | {pp['method']} / {pp['baseline']} tokens/s, median | min–max | rounds |", "|---|---|---|---|"]
    for e in pp["prompts"]:
        spread = "–" if e["min"] is None else f"{e['min']:.2f}–{e['max']:.2f}"
        lines.append(f"| {e['prompt']} | {fmt(e['median'])} | {spread} | "
                     f"{sum(x is not None for x in e['ratios'])}/{len(e['ratios'])} |")
    return lines + [""]


def _speed_note(summ: dict, rounds: int) -> str:
    if rounds < 2:
        return (f"Speedup is over the faster of the baselines ({summ['baseline']}); tokens/s = all new tokens / all "
                "wall time (prefill included) over the prompts a method completed.")
    return (f"{rounds} rounds. Tokens/s, ms/token and speedup are the median over rounds of each round's suite figure "
            "(tokens/s = all new tokens / all wall time of that round, prefill included, over the prompts the method "
            f"completed; speedup = that over the tokens/s of the baseline, {summ['baseline']}, the faster baseline by "
            "median, in the same round), with the min–max over rounds in brackets. Every other column pools the "
            "records of all rounds; 'same as' counts every round. Per prompt: the method's tokens/s over the "
            "baseline's on that prompt in each round; median and min–max over the rounds where both completed.")


def _method_notes(summ: dict, greedy: bool) -> list[str]:
    rounds = len(summ.get("rounds", ())) or 1
    return [_speed_note(summ, rounds),
            "Accepted/pass = new tokens per forward pass (ours: prefill not counted; generate(): its first call "
            "runs the prompt and yields the first token)."
            + (" HF prompt-lookup drafts are read from the query sizes of its forward calls." if greedy else ""),
            ("Verify cost (model) = mean calibrated cost of the step's query size relative to a one-token pass; "
             "measured = mean forward ms per step / plain's forward ms per step."),
            ("rest_full's history store is in memory and starts empty: it holds this run's earlier rest_full "
             "answers only"
             + (" (rest_text has its own, of its own answers)" if "rest_text" in (summ.get("by_source") or {}) else "")
             + "." + (" It is emptied at the start of every round." if rounds > 1 else "")),
            ("The model's own predictions (source 'model', rest_full, rest_text and rest_model) are in memory, one "
             "table per method, and start empty: each learns from its own method's forward passes over this run's "
             "prompts." + (" They are emptied at the start of every round." if rounds > 1 else "")),
            *(["The dense store (source 'dense', rest_full and rest_dense) is searched with the hidden state that "
               "predicted the newest committed token, kept from the step's own forward pass (in rest_full only in the "
               "steps where the other stores have no draft worth a pass); it is built once from the model's answers "
               "to the general-text store's requests, none of them a benchmark prompt."]
              if any("dense" in sources for sources in (summ.get("by_source") or {}).values()) else []),
            ("Draft sources: draft nodes sent to the model and committed draft tokens per source, summed over "
             "prompts" + (" and rounds" if rounds > 1 else "") + "; acceptance = committed / sent."),
            "Methods ran interleaved prompt by prompt, the order rotating per prompt, after one untimed warm-up."]


def _check_notes(ch: dict, rounds: int = 1) -> list[str]:
    notes = []
    for label, c in (("", ch), (" (both with the default kernels)", ch.get("default_kernels", {}))):
        if c.get("plain_vs_hf_ms_per_token_ratio") is not None:
            verdict = "(within 5%)." if c["plain_within_5pct_of_hf"] else f"— FLAG: {c['plain_vs_hf_flag']}."
            notes.append(f"Plain loop vs generate(){label}: {c['plain_vs_hf_ms_per_token_ratio']:.3f}× the time per "
                         f"token {verdict}")
    for d in ch.get("differences", []):
        gap = f", logit gap {d['logit_gap']:.4g}" if d.get("logit_gap") is not None else ""
        where = f" (round {d.get('round', 0) + 1})" if rounds > 1 else ""
        notes.append(f"{d['method']} differs from {d['reference']} on {d['prompt']}{where} at token "
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
    rounds = st.get("repeats", 1)
    lines = [(f"# REST Lab benchmark: {st['suite']} ({st['mode']}, {st['prompts']} prompts, "
              f"max {st['max_new_tokens']} new tokens{f', {rounds} rounds' if rounds > 1 else ''})"), "",
             (f"Machine: {cpu_line(mc)}, {mc['cores']} cores ({mc['usable_cores']} usable), torch threads "
              f"{mc['torch_threads']}, device {mc['device']}{gpu}, {mc['dtype']}; torch {mc['torch']}, transformers "
              f"{mc['transformers']}; model {mc['model']}; load average {mc.get('loadavg_start')} at start, "
              f"{mc.get('loadavg_end')} at end."), "",
             f"Linear kernels: {mc.get('kernels', 'not recorded')}. Attention: {mc.get('attention', 'torch SDPA')}.",
             "", f"Code: {mc.get('code', 'not recorded')}; run on {mc.get('date', 'an unrecorded date')}.", "",
             f"Command: `{results.get('command') or '(library call)'}`", "",
             *_table(summ), "", *_source_table(summ.get("by_source")),
             *_per_prompt_table(summ.get("per_prompt"), rounds),
             *_per_prompt_table(summ.get("per_prompt_default_kernels"), rounds)]
    notes = _method_notes(summ, greedy) + _check_notes(results.get("checks", {}), rounds)
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
