"""Measure T(B, D), the time of one vLLM engine step over B requests with D draft tokens, on this machine.

    .venv-vllm/bin/python -m rest_core.serving.calibrate MODEL      (or `rest-lab calibrate-vllm MODEL`)

The engine runs (in a process of its own, as when serving) with a proposer that drafts k tokens for every
request (tokens the model will not accept, so every step verifies all of them), for every batch size of
serving.load.BATCHES and every k of DRAFTS, twice, interleaved; a step's time is the time between two calls of
the proposer, which is what a served step costs with drafting included.  Each cell keeps its lower round (other
programs only ever add time), and the table is saved per model, engine and machine (serving.load.curve_path),
where `RestProposer` reads it, as measured: a step with more tokens can be the quicker one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rest_core.serving.launch import LAUNCHED_ON
from rest_core.serving.load import BATCHES, DRAFTS, StepCost, save_curve

MAX_TOKENS = 16  # tokens per request in a measurement: the first is the prefill's, the rest are timed steps
PROMPT_TOKENS = 64
PACKAGE = "rest_core.serving.calibrate"  # where the engine finds FixedDrafts
FIRST = 1000  # a measuring prompt's first token is FIRST + the drafts it gets per step


class FixedDrafts:
    """The proposer while measuring: for every decoding request as many drafts as its prompt's first token says
    (id FIRST + k), drafts the model will not accept; each step's (requests, drafts, ms) goes to the file named by
    REST_LAB_CALIBRATION_LOG (the engine runs in a process of its own, as it does when serving)."""

    def __init__(self, vllm_config: Any):
        from rest_core.serving.engine import engine_key

        self.vocab = vllm_config.model_config.get_vocab_size()
        self.log = open(os.environ["REST_LAB_CALIBRATION_LOG"], "a", buffering=1)
        self.log.write(json.dumps({"key": engine_key(vllm_config)}) + "\n")
        self.last: tuple[float, int, int] | None = None  # (time, requests, drafts) of the previous call

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load (vLLM's CPU runner calls it on every proposer)."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        now = time.perf_counter()
        decoding = all(len(s) for s in sampled_token_ids)
        if self.last is not None and decoding and self.last[1] == len(sampled_token_ids):
            self.log.write(json.dumps([self.last[1], self.last[2], (now - self.last[0]) * 1e3]) + "\n")
        out = [[(int(s[-1]) + 7 + 13 * j) % self.vocab for j in range(int(token_ids_cpu[i, 0]) - FIRST)]
               if len(s) else [] for i, s in enumerate(sampled_token_ids)]
        self.last = (time.perf_counter(), len(sampled_token_ids), sum(map(len, out))) if decoding else None
        return out


def measure(llm, batch: int, k: int, log: Path, rng: np.random.Generator) -> float:
    """Median step time (ms) of `batch` requests with `k` drafts each."""
    from vllm import SamplingParams

    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": [FIRST + k, *rng.integers(FIRST + 16, min(vocab, 30000), PROMPT_TOKENS - 1)
                                     .tolist()]} for _ in range(batch)]
    seen = len(log.read_text().splitlines())
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    rows = [json.loads(line) for line in log.read_text().splitlines()[seen:]]
    times = [ms for b, d, ms in (r for r in rows if isinstance(r, list)) if b == batch and d == batch * k]
    if not times:
        raise RuntimeError(f"no complete step was timed at batch {batch} with {k} drafts")
    return statistics.median(times)


def calibrate(model: str, rounds: int = 2, **engine: Any) -> tuple[str, StepCost]:
    """Measure the table on an engine for `model` (`engine`: vLLM.LLM options) and save it; (key, table)."""
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.jsonl"
        log.touch()
        os.environ["REST_LAB_CALIBRATION_LOG"] = str(log)
        drafts = {"method": "custom_class", "model": f"{PACKAGE}.FixedDrafts", "num_speculative_tokens": max(DRAFTS)}
        llm = LLM(model, speculative_config=drafts, **engine)
        rng = np.random.default_rng(0)
        best = np.full((len(BATCHES), len(DRAFTS)), np.inf)
        measure(llm, 1, 0, log, rng)  # warm-up
        for _ in range(rounds):
            for i, batch in enumerate(BATCHES):
                for j, k in enumerate(DRAFTS):
                    best[i, j] = min(best[i, j], measure(llm, batch, k, log, rng))
        key = json.loads(log.read_text().splitlines()[0])["key"]
        llm.llm_engine.engine_core.shutdown()
    # kept as measured: a step's cost need not rise with its tokens (on a Zen 4, vLLM's CPU engine took 55 ms for
    # a step over 2 tokens in all, 48 over 1 and 41-45 over 3 to 6), so no cell is evened out with its neighbours
    cost = StepCost(BATCHES, DRAFTS, tuple(tuple(round(float(x), 3) for x in row) for row in best))
    # the machine key of the process that asked for it (rest-lab serve, the benchmark), which tells its table apart
    # where this environment's torch differs from that one's (serving.launch.has_curve)
    path = save_curve(key, cost, {"model": model, "engine": engine, "measured_ms": best.round(3).tolist(),
                                  "launched_on": os.environ.get(LAUNCHED_ON)})
    print(f"step cost saved to {path}")
    return key, cost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rest-lab calibrate-vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the served model (a folder or hub id), as given to vLLM")
    ap.add_argument("--rounds", type=int, default=2)
    # the engine settings a step's cost depends on: measure with those the model is served with
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="auto", help="as vLLM's --dtype (auto: the model's own)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--pipeline-parallel-size", type=int, default=1)
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="run the model eagerly (the default here); --no-enforce-eager measures a compiling engine "
                         "(CUDA graphs, torch.compile), as vLLM serves without --enforce-eager")
    args = ap.parse_args(argv)
    key, cost = calibrate(args.model, rounds=args.rounds, max_model_len=args.max_model_len, dtype=args.dtype,
                          tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size, enforce_eager=args.enforce_eager)
    print(key)
    for b, row in zip(cost.batches, cost.ms):
        print(f"batch {b:3d}: " + "  ".join(f"{k} drafts {ms:8.1f} ms" for k, ms in zip(cost.drafts, row)))
    return 0


if __name__ == "__main__":
    from rest_core.serving.launch import set_vllm_defaults

    set_vllm_defaults()
    sys.exit(main())
