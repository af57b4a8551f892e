"""`python -m rest_core bench`: REST against plain decoding and Hugging Face generate(), measured.

`--suite humaneval` or `--suite chat` runs every method on every prompt (see
`rest_core.bench.runner`); `--suite retrieval` times store lookups against store size
instead (see `rest_core.bench.retrieval`).  `rest_core.cli` adds this command with
`add_bench_parser`, and the parsed arguments run through `run_bench`.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import sys
from pathlib import Path

from datastores import open_static_store
from rest_core.bench.methods import (
    ANSWERS_METHOD,
    DEFAULT_KERNELS,
    DENSE_METHOD,
    GREEDY_METHODS,
    SAMPLING_METHODS,
    TEXT_METHOD,
    TRACED,
)
from rest_core.bench.report import markdown
from rest_core.bench.retrieval import retrieval_markdown, run_retrieval
from rest_core.bench.runner import run_benchmark
from rest_core.bench.suites import SUITES, chat_prompts, humaneval_prompts, load_suite
from rest_core.bench.verify_pass import run_verify_pass
from rest_core.cli_args import add_decode_arguments, answers_for, decode_config, dense_for
from rest_core.model import load_model, load_tokenizer

__all__ = ["add_bench_parser", "run_bench"]


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` command to a `python -m rest_core` subparsers object."""
    p = subparsers.add_parser("bench", help="benchmark REST against plain decoding and HF generate()",
                              description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("benchmark")
    g.add_argument("--suite", default=None, nargs="+", choices=[*SUITES, "retrieval", "verify"],
                   help="humaneval (164 completion prompts), chat (instruction prompts, chat template), retrieval, "
                        "or verify (the cost of one forward pass over q tokens, tuned vs default kernels); with "
                        "--engine vllm one or both of humaneval and chat (default both)")
    g.add_argument("--retrieval", action="store_true", help="the store lookup micro-benchmark (= --suite retrieval)")
    g.add_argument("--limit", type=int, default=None, help="first N prompts only")
    g.add_argument("--engine", default="rest", choices=("rest", "vllm"),
                   help="rest: REST Lab's own decoding loop (default); vllm: vLLM plain, ngram, suffix and REST "
                        "drafting at several batch sizes (in .venv-vllm: scripts/setup.sh --vllm)")
    g.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16], help="vllm: requests in flight")
    g.add_argument("--vllm-methods", nargs="+", default=None,
                   help="vllm: plain ngram suffix rest (default: these four), empty (a proposer that never drafts); "
                        "METHOD@K gives a drafting method its own draft length (e.g. rest@16; the others: 8)")
    g.add_argument("--vllm-rounds-at", nargs="+", default=None, metavar="BATCH=N",
                   help="vllm: more rounds (interleaved) at these batch sizes than --repeats, e.g. 16=3")
    g.add_argument("--vllm-waves", type=int, default=None, metavar="N",
                   help="vllm: N samples a round side by side: one engine per method serves N waves of --limit "
                        "distinct prompts, the methods taking turns")
    g.add_argument("--prompts", nargs="+", default=None, metavar="ID",
                   help="only the prompts with these ids (shell patterns work: 'explain-*'); before --limit")
    g.add_argument("--methods", nargs="+", default=None, choices=GREEDY_METHODS + (TRACED, TEXT_METHOD),
                   help="default: all (greedy) or plain rest_static rest_full rest_model (sampling)")
    g.add_argument("--repeats", type=int, default=1,
                   help="run every method on every prompt N rounds, interleaved; speed figures are medians over "
                        "rounds, with the spread, and a per-prompt table is added")
    g.add_argument("--kernels-ab", action="store_true",
                   help="also run every method with transformers' default linear kernels (<method>@default), "
                        "interleaved with the kernels chosen on this machine")
    g.add_argument("--out", default=None, help="output folder (default bench_out/<suite>-<timestamp>)")
    g.add_argument("--prompt-lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens for generate()")
    g.add_argument("--chi2-prompts", type=int, default=1, help="prompts for the first-token chi-square (sampling)")
    g.add_argument("--chi2-seeds", type=int, default=200, help="seeds per prompt and method; 0 skips the check")
    g.add_argument("--no-png", action="store_true", help="do not write chart.png")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--sizes", default="1000000,10000000",
                   help="retrieval: store sizes in tokens, comma-separated (the full store is always added)")
    g.add_argument("--contexts", type=int, default=2000, help="retrieval: lookups per context kind and store")
    add_decode_arguments(p)
    p.set_defaults(func=run_bench)
    return p


def _command_line() -> str:
    return "python -m rest_core " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed `bench` arguments describe; print results.md; return the exit status."""
    if args.engine == "vllm":
        return _run_vllm(args)
    if args.suite is not None and len(args.suite) > 1:
        raise ValueError(f"--suite takes one suite with REST Lab's own loop, got {' '.join(args.suite)}: run one "
                         "command per suite (--engine vllm takes humaneval and chat together).")
    suite = "retrieval" if args.retrieval else (args.suite[0] if args.suite else None)
    if suite is None:
        raise ValueError("Choose a suite: --suite humaneval, chat or retrieval.")
    out = Path(args.out or Path("bench_out") / f"{suite}-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    if suite == "retrieval":
        return _run_retrieval(args, out)
    if suite == "verify":
        lm = load_model(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
        run_verify_pass(lm, out, rounds=7 * args.repeats, command=_command_line())  # --repeats N: 7N rounds
        print((out / "results.md").read_text())
        print(f"results in {out}/ (results.json, results.md)")
        return 0
    if args.history != "none" or args.no_request_store:
        print("note: --history and --no-request-store are ignored by bench: each method fixes its stores",
              file=sys.stderr)
    cfg = decode_config(args)
    cfg.validate()
    lm = load_model(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    prompts = load_suite(suite, lm.tokenizer, args.limit, args.prompts)
    static = open_static_store(args.datastore, lm.tokenizer)
    answers = answers_for(args, lm, chat=suite == "chat")
    dense = dense_for(args, lm, chat=suite == "chat")
    methods = kernel_variants(lm, args.methods, cfg, answers is not None, dense is not None) if args.kernels_ab \
        else args.methods
    results = run_benchmark(lm, prompts, cfg, methods, static, out, suite=suite, datastore=args.datastore,
                            command=_command_line(), prompt_lookup_tokens=args.prompt_lookup_tokens,
                            chi2_prompts=args.chi2_prompts, chi2_seeds=args.chi2_seeds, png=not args.no_png,
                            progress=not args.no_progress, repeats=args.repeats, answers_store=answers,
                            dense_store=dense)
    print(markdown(results))
    print(f"results in {out}/ (results.json, results.md, chart.html"
          f"{', chart.png' if (out / 'chart.png').exists() else ''})")
    return 0


def kernel_variants(lm, methods: list[str] | None, cfg, answers: bool = True, dense: bool = True) -> list[str]:
    """Every method twice: with the kernels chosen on this machine and with the default ones ('@default')."""
    if lm.kernels is None:
        raise ValueError("--kernels-ab needs the tuned linear kernels: they apply to a float32 model on the CPU, "
                         "and REST_LAB_KERNELS=default turns them off.")
    names = list(methods or (m for m in (GREEDY_METHODS if cfg.sampling.greedy else SAMPLING_METHODS)
                             if (answers or m != ANSWERS_METHOD) and (dense or m != DENSE_METHOD)))
    return names + [m + DEFAULT_KERNELS for m in names]


def _run_retrieval(args: argparse.Namespace, out: Path) -> int:
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    base = open_static_store(args.datastore, tokenizer)
    if base is None:
        raise ValueError("The retrieval benchmark needs a store: drop --datastore none.")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes must be whole numbers separated by commas, got {args.sizes!r}.") from None
    texts = [t for _, t, _ in humaneval_prompts()] + [t for _, t, _ in chat_prompts()]
    results = run_retrieval(base, sizes, tokenizer, texts, out, count=args.contexts,
                            lookup={"n_max": args.n_max, "n_min": args.n_min, "max_matches": args.max_matches,
                                    "continuation_len": args.continuation_len},
                            command=_command_line(), png=not args.no_png, progress=not args.no_progress)
    print(retrieval_markdown(results))
    print(f"results in {out}/")
    return 0


def _run_vllm(args: argparse.Namespace) -> int:
    """The vLLM benchmark (rest_core.bench.vllm_bench) in the vLLM environment, on the suite(s) asked for; the step
    cost REST's proposer plans with measured first where none was."""
    from rest_core.bench.vllm_bench import DEFAULT_METHODS, ENGINE, engine_settings, starts_rest
    from rest_core.serving.launch import ensure_step_cost, run_module, served_model

    suites = args.suite or list(SUITES)
    if set(suites) - set(SUITES):
        raise ValueError(f"--engine vllm runs the {' and '.join(SUITES)} suites, not {' '.join(suites)}.")
    model = served_model(args.model)
    if starts_rest(args.vllm_methods or DEFAULT_METHODS):
        status = ensure_step_cost(model, engine_settings(args.dtype or ENGINE["dtype"]))
        if status:
            return status
    argv = ["--model", model, "--suite", *suites,
            "--limit", str(args.limit or 16), "--batches", *map(str, args.batches),
            "--max-new-tokens", str(args.max_new_tokens), "--rounds", str(args.repeats)]
    if args.vllm_methods:
        argv += ["--methods", *args.vllm_methods]
    if args.vllm_rounds_at:
        argv += ["--rounds-at", *args.vllm_rounds_at]
    if args.vllm_waves:
        argv += ["--waves", str(args.vllm_waves)]
    if args.dtype:
        argv += ["--dtype", args.dtype]  # the served model's (vLLM's default here: float32, as REST Lab's on a CPU)
    if args.out:
        argv += ["--out", args.out]
    return run_module("rest_core.bench.vllm_bench", argv)
