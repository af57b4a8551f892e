"""`python -m rest_core traces list | show RUN | export RUN [--html F] [--json F] [--csv F] | serve [--db PATH]`.

list   : the recorded runs, newest first
show   : one run's summary and a table of its steps
export : a run as one self-contained HTML page with every figure (plotly.js inlined
         once; works offline), as JSON (the run and every step with its draft tree,
         branches and tree-mask block) and/or as CSV (one row per step)
serve  : the trace file in Datasette, with table descriptions and canned queries
"""
from __future__ import annotations

import argparse
import csv
import html
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from rest_core.phases import PHASES
from rest_core.traces import figures
from rest_core.traces.datasette import serve
from rest_core.traces.recorder import TraceRecorder, default_db_path
from rest_core.traces.rows import RunRow, StepDetail, StepRow
from rest_core.traces.runs import RUN_COLUMNS, Column, short, tokens_per_s


def format_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A plain-text table: numbers right-aligned, text left-aligned."""
    cells = [[_cell(get(r)) for _, get in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _) in enumerate(columns)]
    numeric = [all(_is_number(get(r)) for r in rows) if rows else False for _, get in columns]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line([h for h, _ in columns]), line(["-" * w for w in widths])] + [line(c) for c in cells])


def _is_number(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    return str(v)


def _matched(source: str) -> Column:
    return f"match {source}", lambda s: (s["matched_len"] or {}).get(source)


def _phase_ms(phase: str) -> Column:
    return f"{phase} ms", lambda s: s[f"t_{phase}_ms"]


def step_columns(steps: Sequence[StepRow]) -> list[Column]:
    """The columns of `traces show`: one "match <source>" column per source the steps name."""
    sources = dict.fromkeys(src for s in steps for src in (s["matched_len"] or {}))
    return [
        ("step", lambda s: s["step"]),
        ("prefix", lambda s: s["prefix_len"]),
        *map(_matched, sources),
        ("draft", lambda s: s["draft_size"]),
        ("accepted", lambda s: s["accepted_len"]),
        ("bonus", lambda s: figures.show_token(s["bonus_text"] or "")),
        ("committed text", lambda s: short(figures.show_token("".join(s["new_texts"])), 30)),
        *map(_phase_ms, PHASES),
    ]


def run_summary(run: RunRow) -> list[tuple[str, str]]:
    """(label, value) pairs describing a run, for text and HTML."""
    keys = ["id", "status", "error", "model", "tokenizer", "stores", "settings", "started_at", "finished_at",
            "prompt_tokens", "new_tokens", "steps", "mean_accepted", "wall_s", "plain_wall_s",
            "plain_tokens_per_s", "speedup", "identical", "pid", "host"]
    out = [(k, _cell(run.get(k))) for k in keys if run.get(k) is not None]
    rate = tokens_per_s(run)
    if rate is not None:
        out.append(("tokens_per_s", f"{rate:.2f}"))
    return out


def report_html(run: RunRow, steps: Sequence[StepRow], detailed: Sequence[StepDetail], note: str = "") -> str:
    """One page with every figure of a run; plotly.js is inlined in the first figure only."""
    figs = [figures.speed_figure(steps, run), figures.acceptance_histogram(steps), figures.phase_breakdown(steps)]
    for step in detailed:
        figs += [figures.draft_tree_figure(step), figures.mask_heatmap(step)]
    parts = [f.to_html(full_html=False, include_plotlyjs=(i == 0), config={"displaylogo": False})
             for i, f in enumerate(figs)]
    summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in run_summary(run))
    per_step = "".join(f'<section class="step">{a}{b}</section>' for a, b in zip(parts[3::2], parts[4::2]))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>REST Lab run {run['id']}</title>
<style>
body {{ font-family: DejaVu Sans, Arial, sans-serif; font-size: 17px; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; }} th, td {{ text-align: left; padding: 3px 12px; border-bottom: 1px solid #ddd; }}
td {{ white-space: pre-wrap; max-width: 70em; }} h2 {{ margin-top: 36px; }}
</style></head><body>
<h1>REST Lab run {run['id']}: {html.escape(str(run.get('model') or ''))}</h1>
<table>{summary}</table>
<h2>Output by origin</h2>
{figures.origin_text_html(steps, prompt=run.get('prompt'))}
<h2>Speed, acceptance, time per phase</h2>
{''.join(parts[:3])}
<h2>Draft trees and tree masks</h2>
<p>{html.escape(note)}</p>
{per_step}
</body></html>
"""


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", type=Path, default=None, help=f"trace database (default: {default_db_path()})")
    return common


def add_traces_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `traces` (list | show | export) to a CLI's subparsers; sets func=run_traces."""
    common = _common()
    p = subparsers.add_parser("traces", help="recorded runs: list, show, export to HTML")
    sub = p.add_subparsers(dest="traces_command", required=True)
    ls = sub.add_parser("list", parents=[common], help="list recorded runs, newest first")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--status", choices=["running", "done", "failed", "stopped", "interrupted"])
    show = sub.add_parser("show", parents=[common], help="a run's summary and its steps")
    show.add_argument("run", type=int)
    export = sub.add_parser("export", parents=[common], help="a run as an HTML page, JSON or CSV")
    export.add_argument("run", type=int)
    export.add_argument("--html", type=Path, default=None, help="every figure of the run in one offline page")
    export.add_argument("--json", type=Path, default=None,
                        help="the run and every step: tree nodes, branches, tree-mask block ('1' = may attend)")
    export.add_argument("--csv", type=Path, default=None, help="one row per step (lists and maps as JSON)")
    export.add_argument("--max-trees", type=int, default=20,
                        help="draw the tree and mask of the first N steps (default 20)")
    serve = sub.add_parser("serve", parents=[common], help="open the trace file in Datasette (optional extra)")
    serve.add_argument("--port", type=int, default=8001)
    serve.add_argument("--host", default="127.0.0.1")
    p.set_defaults(func=run_traces)
    return p


def run_traces(args: argparse.Namespace) -> int:
    if args.traces_command == "serve":
        return serve(Path(args.db or default_db_path()), port=args.port, host=args.host)
    rec = TraceRecorder(args.db)
    try:
        if args.traces_command == "list":
            runs = rec.list_runs(status=args.status, limit=args.limit)
            print(format_table(runs, RUN_COLUMNS) if runs else f"no runs in {rec.path}")
            return 0
        try:
            run = rec.get_run(args.run)
        except KeyError:
            print(f"no run {args.run} in {rec.path}", file=sys.stderr)
            return 1
        steps = rec.load_steps(run["id"])
        if args.traces_command == "show":
            width = max(len(k) for k, _ in run_summary(run))
            print("\n".join(f"{k.ljust(width)}  {v}" for k, v in run_summary(run)))
            print(f"{'output'.ljust(width)}  {run.get('output') or ''}\n")
            print(format_table(steps, step_columns(steps)) if steps else "no steps recorded")
            return 0
        if not (args.html or args.json or args.csv):
            print("export: name at least one output: --html FILE, --json FILE or --csv FILE", file=sys.stderr)
            return 2
        if args.html:
            _export_html(rec, run, steps, args.html, args.max_trees)
        if args.json:
            _write(args.json, json.dumps(run_json(rec, run), ensure_ascii=False, indent=1))
        if args.csv:
            _write(args.csv, steps_csv(steps))
        return 0
    finally:
        rec.close()


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path} ({len(text) / 1e6:.2f} MB)")


def _export_html(rec: TraceRecorder, run: dict, steps: list, path: Path, max_trees: int) -> None:
    shown = steps[: max(0, max_trees)]
    note = (f"Showing the first {len(shown)} of {len(steps)} steps (--max-trees)." if len(shown) < len(steps)
            else f"All {len(steps)} steps.")
    _write(path, report_html(run, steps, [rec.load_step(run["id"], s["step"]) for s in shown], note))


def run_json(rec: TraceRecorder, run: dict) -> dict:
    """The run and every step in full; the tree-mask block as one string of 0/1 per query node."""
    steps = []
    for row in rec.load_steps(run["id"]):
        step = dict(rec.load_step(run["id"], row["step"]))
        block = step.pop("mask_block", None)
        step.pop("tree_mask", None)
        if block is not None:
            step["tree_mask"] = ["".join("1" if v else "0" for v in line) for line in block.tolist()]
        steps.append(step)
    return {"run": dict(run), "steps": steps}


def steps_csv(steps: Sequence[dict]) -> str:
    """One row per step with every stored column; lists and maps as JSON text."""
    out = io.StringIO()
    columns = list(steps[0]) if steps else ["step"]
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for s in steps:
        writer.writerow({k: json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else v
                         for k, v in s.items()})
    return out.getvalue()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rest_core.traces.cli")
    add_traces_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
