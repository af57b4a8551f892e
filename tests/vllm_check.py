"""Run by tests/test_vllm.py in .venv-vllm: greedy outputs of plain vLLM and of vLLM with REST drafting.

    python tests/vllm_check.py MODEL OUT.json [SUITE]   -> {"plain": {batch: [[ids]...]}, "rest": {...},
        "accepted": n, "report": the drafter's last report (REST_LAB_PROPOSE_LOG)}

on the first PROMPTS prompts of SUITE (default: humaneval).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROMPTS = 8
MAX_TOKENS = 48


def outputs(llm, prompts, batch: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    out = []
    for start in range(0, len(prompts), batch):
        group = [{"prompt_token_ids": p} for p in prompts[start:start + batch]]
        out += [list(r.outputs[0].token_ids) for r in llm.generate(group, params, use_tqdm=False)]
    return out


def main(model: str, path: str, suite: str = "humaneval") -> None:
    from vllm import LLM

    from rest_core.bench.suites import load_suite
    from rest_core.bench.vllm_bench import ENGINE, counters, speculative_config
    from rest_core.model import load_tokenizer

    prompts = [list(p.ids) for p in load_suite(suite, load_tokenizer(model), PROMPTS)]
    result = {}
    for method in ("plain", "rest"):
        llm = LLM(model, speculative_config=speculative_config(method, 8), **{**ENGINE, "max_model_len": 1024})
        result[method] = {str(b): outputs(llm, prompts, b) for b in (1, 8)}
        if method == "rest":
            result["accepted"] = counters(llm)["vllm:spec_decode_num_accepted_tokens"]
            report = os.environ.get("REST_LAB_PROPOSE_LOG")
            result["report"] = json.loads(Path(report).read_text()) if report else None
        llm.llm_engine.engine_core.shutdown()
        del llm
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
