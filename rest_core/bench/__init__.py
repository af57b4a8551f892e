"""The benchmark: REST against plain decoding and Hugging Face generate(), measured (`python -m rest_core bench`).

Public face: `run_benchmark(lm, prompts, cfg, methods, static_store, out_dir, ...)` runs every method on
every prompt (`repeats` interleaved rounds) and writes results.json / results.md / chart.html;
`MethodRunner` runs one method on one prompt; `GREEDY_METHODS` / `SAMPLING_METHODS` name the methods;
`load_suite` / `BenchPrompt` give the prompts; `run_retrieval` times store lookups against store size;
`add_bench_parser` / `run_bench` are the command line.  Modules: methods (the methods, measured),
runner (the run), stats (numbers from the records), report (machine, Markdown, charts), retrieval,
suites, cli.
"""
from rest_core.bench.cli import add_bench_parser, run_bench
from rest_core.bench.methods import GREEDY_METHODS, SAMPLING_METHODS, TRACED, ForwardLog, MethodRunner
from rest_core.bench.report import machine_info, markdown
from rest_core.bench.retrieval import run_retrieval
from rest_core.bench.runner import rotated, run_benchmark
from rest_core.bench.stats import SUMMARY_KEYS, chi_square, summarize
from rest_core.bench.suites import SUITES, BenchPrompt, chat_prompts, humaneval_prompts, load_suite

__all__ = ["GREEDY_METHODS", "SAMPLING_METHODS", "SUITES", "SUMMARY_KEYS", "TRACED", "BenchPrompt", "ForwardLog",
           "MethodRunner", "add_bench_parser", "chat_prompts", "chi_square", "humaneval_prompts", "load_suite",
           "machine_info", "markdown", "rotated", "run_bench", "run_benchmark", "run_retrieval", "summarize"]
