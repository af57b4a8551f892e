"""What drafts cost a vLLM step when only some requests of the batch have them: steps of B requests where
given requests get given draft counts, timed by the calibration's fixed-draft proposer.

`rest-lab calibrate-vllm` measures T(B, D) with every request drafting alike; the drafter's plan interpolates it
for batches where few requests draft.  This checks that interpolation: whether the first draft in a batch
costs a jump (a batch with a draft leaving vLLM's decode-only path) or its share of a straight line.

    .venv-vllm/bin/python tools/vllm_draft_cost.py MODEL --batch 16 --rounds 3
    (run it with the environment `rest_core.serving.launch.vllm_env` gives: Intel OpenMP preloaded, the KV
    cache bounded, this checkout on PYTHONPATH)

Each case is a list of draft counts, one per request, given as e.g. `1x4+15x0` (one request with 4 drafts, 15
with none); the default cases at --batch 16 are none, one request with 1 and with 4, four with 1, all with 1 and
all with 2.  Prints each case's median step time per round, and the median over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = 24  # tokens per request: the first is the prefill's, the rest are timed steps
PROMPT_TOKENS = 64


def parse_case(text: str) -> list[int]:
    """`1x4+15x0` -> [4, 0, 0, ...]: counts of requests x drafts each."""
    out: list[int] = []
    for part in text.split("+"):
        n, _, k = part.partition("x")
        if not (n.isdigit() and k.isdigit() and int(n) >= 1):
            raise SystemExit(f"case {text!r}: write REQUESTSxDRAFTS parts joined by '+', e.g. 1x4+15x0")
        out += [int(k)] * int(n)
    return out


def case_name(counts: list[int]) -> str:
    """[4, 0, 0, 0] -> `1x4+3x0`: runs of equal draft counts, as parse_case reads them."""
    runs: list[list[int]] = []
    for k in counts:
        if runs and runs[-1][1] == k:
            runs[-1][0] += 1
        else:
            runs.append([1, k])
    return "+".join(f"{n}x{k}" for n, k in runs)


def default_cases(batch: int) -> list[str]:
    """No drafts; one request with 1 and with 4; four requests (at most) with 1; every request with 1 and 2."""
    few = min(4, batch)
    cases = [[0] * batch, [1] + [0] * (batch - 1), [4] + [0] * (batch - 1), [1] * few + [0] * (batch - few),
             [1] * batch, [2] * batch]
    return list(dict.fromkeys(case_name(c) for c in cases))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the served model folder (REST Lab's converted copy for the default model)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--cases", nargs="+", default=None, metavar="CASE")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    cases = {c: parse_case(c) for c in (args.cases or default_cases(args.batch))}
    if any(len(ks) != args.batch or max(ks) > 8 for ks in cases.values()):
        raise SystemExit(f"every case must give {args.batch} requests (--batch) at most 8 drafts each")

    from vllm import LLM, SamplingParams

    from rest_core.machine import cpu_info, cpu_line
    from rest_core.serving.calibrate import FIRST, PACKAGE

    log = Path(tempfile.mkdtemp(prefix="draft-cost-")) / "steps.jsonl"
    log.touch()
    os.environ["REST_LAB_CALIBRATION_LOG"] = str(log)
    llm = LLM(args.model, speculative_config={"method": "custom_class", "model": f"{PACKAGE}.FixedDrafts",
                                              "num_speculative_tokens": 8},
              enforce_eager=True, dtype="float32", max_model_len=2048)
    rng = np.random.default_rng(0)

    def step_ms(ks: list[int]) -> float:
        prompts = [{"prompt_token_ids": [FIRST + k, *rng.integers(FIRST + 16, 30000, PROMPT_TOKENS - 1).tolist()]}
                   for k in ks]
        seen = len(log.read_text().splitlines())
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True), use_tqdm=False)
        rows = [json.loads(line) for line in log.read_text().splitlines()[seen:]]
        times = [ms for b, d, ms in (r for r in rows if isinstance(r, list)) if b == len(ks) and d == sum(ks)]
        return statistics.median(times) if times else float("nan")

    print(cpu_line(cpu_info()))
    step_ms([0] * args.batch)  # warm-up
    got: dict[str, list[float]] = {c: [] for c in cases}
    for rnd in range(args.rounds):
        for name, ks in cases.items():
            got[name].append(step_ms(ks))
            print(f"round {rnd + 1}: {name:12s} ({sum(ks):3d} drafts) {got[name][-1]:7.1f} ms", flush=True)
    base = statistics.median(got[next(iter(cases))])
    for name, ks in cases.items():
        ms = statistics.median(got[name])
        per = f", {(ms - base) / sum(ks):.2f} ms per draft over the first case" if sum(ks) else ""
        print(f"{name:12s} median {ms:7.1f} ms{per}")
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    sys.exit(main())
