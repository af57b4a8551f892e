"""`python -m rest_core generate | bench | traces | datastore | tune`: REST Lab from the command line."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Optional

from datastores import (
    DatastoreError,
    assemble_stores,
    open_history,
    open_recycle,
    open_static_store,
    store_labels,
)
from rest_core.bench.cli import add_bench_parser
from rest_core.cli_args import add_decode_arguments, answers_for, decode_config, dense_for
from rest_core.compare import first_difference, identical
from rest_core.cost import CostModel
from rest_core.datastore_cli import add_datastore_parser
from rest_core.decode import DecodeResult, PromptError, RestDecoder, plain_generate
from rest_core.model import LoadedModel, ModelLoadError, encode_prompt, load_model
from rest_core.traces.cli import add_traces_parser
from rest_core.traces.recorder import TraceRecorder
from rest_core.tune import add_tune_parser

DESCRIPTION = "REST Lab: retrieval-based speculative decoding you can see."


def _parser(prog: str = "python -m rest_core") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="decode one prompt with REST")
    gen.add_argument("--prompt", required=True, help="text to continue (or a question, with --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--check", action="store_true",
                     help="also decode plainly and report whether the outputs are identical")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    gen.add_argument("--trace-db", default=None, help="record every step into this SQLite file")
    add_decode_arguments(gen)
    gen.set_defaults(func=cmd_generate)
    add_bench_parser(sub)
    add_serving_parsers(sub)
    add_traces_parser(sub)
    add_datastore_parser(sub)
    add_tune_parser(sub)
    return parser


def add_serving_parsers(sub: argparse._SubParsersAction) -> None:
    """`serve` and `calibrate-vllm`: vLLM with REST drafting (run in .venv-vllm, see rest_core.serving.launch)."""
    srv = sub.add_parser("serve", help="serve a model with vLLM's OpenAI-compatible server and REST drafting",
                         description="Start `vllm serve MODEL --speculative-config '{\"method\": \"custom_class\", "
                                     "\"model\": \"rest_core.vllm.RestProposer\", ...}'` in .venv-vllm; every "
                                     "other option goes to vLLM as it is (e.g. --port 8000 --max-model-len 2048).")
    srv.add_argument("model", nargs="?", default=None, help="folder or hub id (default: REST Lab's default model)")
    srv.add_argument("--drafts", type=int, default=8, help="most draft tokens per request and step (default 8)")
    srv.set_defaults(func=cmd_serve, vllm_args=[])
    cal = sub.add_parser("calibrate-vllm", help="measure vLLM's step cost on this machine for REST drafting")
    cal.add_argument("model", nargs="?", default=None, help="folder or hub id (default: REST Lab's default model)")
    cal.add_argument("--rounds", type=int, default=2, help="measurements of every cell; each keeps its fastest")
    cal.add_argument("--dtype", default="auto", help="as the model is served (vLLM's --dtype; default: auto)")
    cal.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    cal.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    cal.add_argument("--max-model-len", type=int, default=None)
    cal.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                     help="measure the model run eagerly (default); --no-enforce-eager for an engine served without "
                          "vLLM's --enforce-eager (CUDA graphs, torch.compile)")
    cal.set_defaults(func=cmd_calibrate_vllm)


def cmd_serve(args: argparse.Namespace) -> int:
    from rest_core.serving.launch import serve

    if args.drafts < 1:
        raise ValueError(f"--drafts must be at least 1, got {args.drafts}.")
    return serve(args.model, args.drafts, args.vllm_args)


def cmd_calibrate_vllm(args: argparse.Namespace) -> int:
    from rest_core.serving.launch import run_module, served_model, vllm_python

    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}.")
    from rest_core.serving.engine import CALIBRATION_SETTINGS, calibration_options

    vllm_python()  # no vLLM environment: said before the model is fetched or converted
    settings = {name: getattr(args, name) for name in CALIBRATION_SETTINGS}
    return run_module("rest_core.serving.calibrate",
                      [served_model(args.model), "--rounds", str(args.rounds), *calibration_options(settings)])


def build_decoder(args: argparse.Namespace, lm: LoadedModel) -> RestDecoder:
    """The stores and budget the arguments ask for."""
    cfg = decode_config(args)
    stores = assemble_stores(static=open_static_store(args.datastore, lm.tokenizer),
                             answers=answers_for(args, lm, chat=bool(getattr(args, "chat", False))),
                             request=not args.no_request_store,
                             history=open_history(args.history, lm.tokenizer, cfg.retrieve.n_max, cfg.retrieve.n_min),
                             model=open_recycle(args.model_drafts, lm.tokenizer, lm.vocab_size, lm.name),
                             dense=dense_for(args, lm, chat=bool(getattr(args, "chat", False)), build=False),
                             n_max=cfg.retrieve.n_max, n_min=cfg.retrieve.n_min)
    auto = cfg.draft_budget is None  # a fixed budget needs no cost curve
    kind = "chat" if getattr(args, "chat", False) else "text"  # acceptance is learned per kind of text
    return RestDecoder(lm, stores=stores, budget_chooser=CostModel.for_model(lm, stores, kind=kind) if auto else None)


def save_learned(decoder: RestDecoder) -> None:
    """Keep what this decode taught: the answer in a persisted history, the acceptance statistics."""
    for store in decoder.stores:
        if getattr(store, "path", None) is not None and hasattr(store, "save"):
            store.save()
    if decoder.budget_chooser is not None:
        decoder.budget_chooser.save_stats()


def _decode_recorded(decoder: RestDecoder, prompt: list[int], cfg, recorder: Optional[TraceRecorder],
                     run_id: Optional[int]) -> DecodeResult:
    hook = recorder.step_hook(run_id, decoder.lm.tokenizer) if recorder is not None else None
    try:
        return decoder.generate(prompt, cfg, hook=hook)
    except BaseException as err:
        if recorder is not None:
            recorder.finish_run(run_id, output="", new_tokens=None, steps=None, wall_s=None, mean_accepted=None,
                                status="stopped" if isinstance(err, KeyboardInterrupt) else "failed",
                                error=f"{type(err).__name__}: {err}")
        raise


def _report(result: DecodeResult, lm: LoadedModel, decoder: RestDecoder) -> dict:
    return {"text": result.text, "new_tokens": result.new_tokens, "steps": result.steps,
            "mean_accepted": round(result.mean_accepted, 4), "wall_s": round(result.wall_s, 4),
            "tokens_per_s": round(result.tokens_per_s, 3), "stop_reason": result.stop_reason,
            "accepted_drafts": result.accepted_drafts, "no_draft_steps": result.no_draft_steps,
            "mean_budget": round(sum(result.budgets) / max(1, len(result.budgets)), 2),
            "phase_ms": {k: round(v, 2) for k, v in result.phase_ms.items()},
            "model": lm.name, "device": str(lm.device), "stores": store_labels(decoder.stores)}


def _check_against_plain(lm: LoadedModel, prompt: list[int], cfg, result: DecodeResult, report: dict) -> dict:
    """Decode plainly too; adds identical / speedup to the report and returns the run's comparison record."""
    plain = plain_generate(lm, prompt, cfg)
    report["identical"] = identical(plain.tokens, result.tokens, lm.eos_token_ids)
    report["plain_wall_s"] = round(plain.wall_s, 4)
    report["plain_tokens_per_s"] = round(plain.tokens_per_s, 3)
    report["speedup"] = round(plain.wall_s / result.wall_s, 3) if result.wall_s else None
    if not report["identical"]:
        report.update(first_difference(lm, prompt, plain.tokens, result.tokens))
    return {"plain_wall_s": plain.wall_s, "plain_tokens_per_s": plain.tokens_per_s,
            "speedup": report["speedup"], "identical": report["identical"]}


def cmd_generate(args: argparse.Namespace) -> int:
    cfg = decode_config(args)
    cfg.validate()
    if not args.prompt.strip():
        raise ValueError("The prompt is empty: pass some text with --prompt.")
    lm = load_model(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    decoder = build_decoder(args, lm)
    prompt = encode_prompt(lm.tokenizer, args.prompt, chat=args.chat)
    recorder = run_id = None
    if args.trace_db:
        recorder = TraceRecorder(args.trace_db)
        run_id = recorder.start_run(model=lm.name, tokenizer_name=getattr(lm.tokenizer, "name_or_path", lm.name),
                                    stores=store_labels(decoder.stores),
                                    settings={**cfg.settings(), "chat": args.chat},
                                    prompt=args.prompt, prompt_tokens=prompt)
    result = _decode_recorded(decoder, prompt, cfg, recorder, run_id)
    save_learned(decoder)
    report = _report(result, lm, decoder)
    comparison = _check_against_plain(lm, prompt, cfg, result, report) if args.check else None
    if recorder is not None:
        recorder.finish_run(run_id, output=result.text, new_tokens=result.new_tokens, steps=result.steps,
                            wall_s=result.wall_s, mean_accepted=result.mean_accepted, status="done",
                            comparison=comparison)
        report["run_id"] = run_id
        report["trace_db"] = str(recorder.path)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
        return 0
    print(result.text)
    summary = (f"\n[{result.new_tokens} tokens in {result.steps} steps: {result.mean_accepted:.2f} tokens/step, "
               f"{result.tokens_per_s:.1f} tokens/s]")
    if args.check:
        summary += f" [plain: {report['plain_tokens_per_s']:.1f} tokens/s; identical: {report['identical']}]"
    print(summary, file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m rest_core") -> int:
    args, extra = _parser(prog).parse_known_args(argv)
    if extra and getattr(args, "func", None) is not cmd_serve:
        _parser(prog).parse_args(argv)  # exits with argparse's message about the unknown arguments
    args.vllm_args = extra if getattr(args, "func", None) is cmd_serve else []
    try:
        return args.func(args)
    except (ModelLoadError, PromptError, DatastoreError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def console_main() -> int:
    """The `rest-lab` command an installed package puts on the PATH: the same commands as `python -m rest_core`."""
    return main(prog="rest-lab")
