"""`python -m rest_core generate | bench | traces`: the decoder from the command line."""
from __future__ import annotations

import argparse
import json
import sys
import time

DESCRIPTION = "REST Lab: retrieval-based speculative decoding you can see."


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    """Model, store and decoding settings shared by generate and bench."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="hub id or local folder (default: SmolLM2-135M-Instruct, offline)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.add_argument("--dtype", default=None, help="float32 (default), float16 or bfloat16 (GPU only)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off by default)")
    g = p.add_argument_group("stores")
    g.add_argument("--datastore", default="default",
                   help="'default' (Python sources, built on first use), 'none', or a store folder")
    g.add_argument("--no-request-store", action="store_true", help="do not draft from the prompt and answer so far")
    g.add_argument("--history", default="none",
                   help="'none' (default), 'default' (persisted past answers) or a history file")
    g = p.add_argument_group("retrieval and drafting")
    g.add_argument("--n-max", type=int, default=16, help="longest context suffix looked up (default 16)")
    g.add_argument("--n-min", type=int, default=2, help="shortest suffix that counts as a match (default 2)")
    g.add_argument("--max-matches", type=int, default=5000, help="continuations taken per store (default 5000)")
    g.add_argument("--continuation-len", type=int, default=10, help="tokens per continuation (default 10)")
    g.add_argument("--budget", default="auto",
                   help="draft tokens per step, or 'auto' to follow the measured cost model (default)")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-eos", action="store_true", help="do not stop at the end-of-sequence token")


def decode_config(args):
    from rest_core.decode import DecodeConfig
    from rest_core.retrieve import RetrieveSettings
    from rest_core.sampling import Sampling

    if args.budget == "auto":
        budget = None
    else:
        try:
            budget = int(args.budget)
        except ValueError:
            raise ValueError(f"--budget must be a whole number or 'auto', got {args.budget!r}.") from None
    return DecodeConfig(max_new_tokens=args.max_new_tokens,
                        sampling=Sampling(args.temperature, args.top_k, args.top_p, args.seed),
                        retrieve=RetrieveSettings(args.n_max, args.n_min, args.max_matches, args.continuation_len),
                        draft_budget=budget, stop_at_eos=not args.no_eos)


def _parser() -> argparse.ArgumentParser:
    from rest_core.traces.cli import add_traces_parser

    parser = argparse.ArgumentParser(prog="python -m rest_core", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="decode one prompt with REST")
    gen.add_argument("--prompt", required=True, help="text to continue (or a question, with --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--check", action="store_true",
                     help="also decode plainly and report whether the outputs are identical")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    gen.add_argument("--trace-db", default=None, help="record every step into this SQLite file")
    add_decode_arguments(gen)
    try:
        from rest_core.bench.runner import add_bench_parser
    except ImportError:  # the benchmark is optional at import time
        add_bench_parser = None
    if add_bench_parser is not None:
        add_bench_parser(sub)
    add_traces_parser(sub)
    return parser


def first_difference(lm, prompt, reference: list[int], other: list[int]) -> dict:
    """Where two decodes part, and the reference model's logit gap between the two tokens there."""
    import torch

    pos = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    out = {"first_difference": pos}
    if pos < min(len(reference), len(other)):
        with torch.inference_mode():
            ids = torch.tensor([list(prompt) + reference[:pos]], device=lm.device)
            logits = lm.model(input_ids=ids).logits[0, -1].float()
        out["logit_gap"] = float(logits[reference[pos]] - logits[other[pos]])
        out["tokens"] = {"plain": reference[pos], "rest": other[pos]}
    return out


def build_decoder(args, lm):
    from rest_core.cost import CostModel
    from rest_core.decode import RestDecoder
    from datastores.builtin import open_history, open_static_store

    static = open_static_store(args.datastore, lm.tokenizer)
    history = open_history(args.history, lm.tokenizer)
    auto = args.budget == "auto"  # a fixed budget needs no cost curve
    return RestDecoder(lm, static_store=static, history_store=history, use_request_store=not args.no_request_store,
                       budget_chooser=CostModel.for_model(lm) if auto else None)


def cmd_generate(args) -> int:
    from rest_core.decode import plain_generate
    from rest_core.model import encode_prompt, load_model

    cfg = decode_config(args)
    cfg.validate()
    if not args.prompt.strip():
        raise ValueError("The prompt is empty: pass some text with --prompt.")
    lm = load_model(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    decoder = build_decoder(args, lm)
    prompt = encode_prompt(lm.tokenizer, args.prompt, chat=args.chat)
    recorder = run_id = None
    hook = None
    if args.trace_db:
        from rest_core.traces.recorder import TraceRecorder

        recorder = TraceRecorder(args.trace_db)
        run_id = recorder.start_run(model=lm.name, tokenizer_name=getattr(lm.tokenizer, "name_or_path", lm.name),
                                    stores=store_names(decoder), settings=settings_dict(args, cfg),
                                    prompt=args.prompt, prompt_tokens=prompt)
        hook = recorder.step_hook(run_id, lm.tokenizer)
    try:
        result = decoder.generate(prompt, cfg, hook=hook)
    except BaseException as err:
        if recorder is not None:
            recorder.finish_run(run_id, output="", new_tokens=None, steps=None, wall_s=None, mean_accepted=None,
                                status="stopped" if isinstance(err, KeyboardInterrupt) else "failed",
                                error=f"{type(err).__name__}: {err}")
        raise
    report = {"text": result.text, "new_tokens": result.new_tokens, "steps": result.steps,
              "mean_accepted": round(result.mean_accepted, 4), "wall_s": round(result.wall_s, 4),
              "tokens_per_s": round(result.tokens_per_s, 3), "stop_reason": result.stop_reason,
              "accepted_drafts": result.accepted_drafts, "no_draft_steps": result.no_draft_steps,
              "mean_budget": round(sum(result.budgets) / max(1, len(result.budgets)), 2),
              "phase_ms": {k: round(v, 2) for k, v in result.phase_ms.items()},
              "model": lm.name, "device": str(lm.device), "stores": store_names(decoder)}
    comparison = None
    if args.check:
        plain = plain_generate(lm, prompt, cfg)
        report["identical"] = plain.tokens == result.tokens
        report["plain_wall_s"] = round(plain.wall_s, 4)
        report["plain_tokens_per_s"] = round(plain.tokens_per_s, 3)
        report["speedup"] = round(plain.wall_s / result.wall_s, 3) if result.wall_s else None
        if not report["identical"]:
            report.update(first_difference(lm, prompt, plain.tokens, result.tokens))
        comparison = {"plain_wall_s": plain.wall_s, "plain_tokens_per_s": plain.tokens_per_s,
                      "speedup": report["speedup"], "identical": report["identical"]}
    if recorder is not None:
        recorder.finish_run(run_id, output=result.text, new_tokens=result.new_tokens, steps=result.steps,
                            wall_s=result.wall_s, mean_accepted=result.mean_accepted, status="done",
                            comparison=comparison)
        report["run_id"] = run_id
        report["trace_db"] = str(recorder.path)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        print(result.text)
        summary = (f"\n[{result.new_tokens} tokens in {result.steps} steps: {result.mean_accepted:.2f} tokens/step, "
                   f"{result.tokens_per_s:.1f} tokens/s]")
        if args.check:
            summary += f" [plain: {report['plain_tokens_per_s']:.1f} tokens/s; identical: {report['identical']}]"
        print(summary, file=sys.stderr)
    return 0


def store_names(decoder) -> list[str]:
    names = []
    if decoder.static_store is not None:
        names.append(f"static:{decoder.static_store.path}")
    if decoder.use_request_store:
        names.append("request")
    if decoder.history_store is not None:
        names.append(f"history:{getattr(decoder.history_store, 'path', None)}")
    return names


def settings_dict(args, cfg) -> dict:
    return {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.sampling.temperature,
            "top_k": cfg.sampling.top_k, "top_p": cfg.sampling.top_p, "seed": cfg.sampling.seed,
            "n_max": cfg.retrieve.n_max, "n_min": cfg.retrieve.n_min, "max_matches": cfg.retrieve.max_matches,
            "continuation_len": cfg.retrieve.continuation_len, "draft_budget": cfg.draft_budget or "auto",
            "stop_at_eos": cfg.stop_at_eos, "chat": getattr(args, "chat", False)}


def main(argv=None) -> int:
    from datastores import DatastoreError

    from rest_core.decode import PromptError
    from rest_core.model import ModelLoadError

    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        return args.func(args)
    except (ModelLoadError, PromptError, DatastoreError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
