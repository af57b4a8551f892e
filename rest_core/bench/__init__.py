"""The benchmark: REST against plain decoding and Hugging Face generate(), measured (`python -m rest_core bench`).

Public face: `run_benchmark(lm, prompts, cfg, methods, static_store, out_dir, ...)` runs every method on
every prompt (`repeats` interleaved rounds) and writes results.json / results.md / chart.html;
`MethodRunner` runs one method on one prompt; `GREEDY_METHODS` / `SAMPLING_METHODS` name the methods;
`load_suite` / `BenchPrompt` give the prompts; `run_retrieval` times store lookups against store size;
`add_bench_parser` / `run_bench` are the command line.  Modules: methods (the methods, measured),
runner (the run), stats (numbers from the records), report (machine, Markdown, charts), retrieval,
suites, cli; vllm_bench and vllm_report are the same suites served by vLLM (run in .venv-vllm).

Its names load on first use (PEP 562), so `rest_core.bench.suites` imports without the benchmark's plotting and
tracing dependencies (the vLLM benchmark reads the suites in an environment that has neither).
"""
from __future__ import annotations

import importlib

_WHERE = {"add_bench_parser": "cli", "run_bench": "cli", "GREEDY_METHODS": "methods", "SAMPLING_METHODS": "methods",
          "TRACED": "methods", "ForwardLog": "methods", "MethodRunner": "methods", "machine_info": "report",
          "markdown": "report", "run_retrieval": "retrieval", "rotated": "runner", "run_benchmark": "runner",
          "SUMMARY_KEYS": "stats", "chi_square": "stats", "summarize": "stats", "SUITES": "suites",
          "BenchPrompt": "suites", "chat_prompts": "suites", "humaneval_prompts": "suites", "load_suite": "suites"}

__all__ = ["GREEDY_METHODS", "SAMPLING_METHODS", "SUITES", "SUMMARY_KEYS", "TRACED", "BenchPrompt", "ForwardLog",
           "MethodRunner", "add_bench_parser", "chat_prompts", "chi_square", "humaneval_prompts", "load_suite",
           "machine_info", "markdown", "rotated", "run_bench", "run_benchmark", "run_retrieval", "summarize"]


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rest_core.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rest_core.bench.{module}"), name)
