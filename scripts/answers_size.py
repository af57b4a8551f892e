"""Does a larger general-text store draft chat answers better?  Tokens per pass against its size.

Builds stores from the first n of the general-text store's answers (shuffled with seed 0; the answers
are read from its answers.jsonl, nothing is generated) and decodes the chat suite with rest_full's
stores around each (the Python store, that store, the request store, a history and the model's own
predictions, the last two in memory and empty at first), once with the draft budget fixed at 8 (what
the stores offer) and once chosen by the cost model (what the decoder keeps), and prints tokens per
pass and the committed drafts per source.  Every size gets fresh stores and a fresh cost model on the
same cost curve; no timing is compared, so the machine's load does not matter.

    .venv/bin/python scripts/answers_size.py     # sizes 0 64 128 257 514, the README's 16 chat prompts
    .venv/bin/python scripts/answers_size.py --sizes 0 514 --prompts 'explain-*'
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datastores import HistoryStore, RecycleStore, assemble_stores, open_default_store
from datastores.answers import ANSWERS_FILE, answers_store_path, index_answers
from rest_core.bench.suites import BENCHMARK_CHAT_PROMPTS, load_suite
from rest_core.cost import CostModel
from rest_core.decode import DecodeConfig, RestDecoder
from rest_core.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 64, 128, 257, 514])
    ap.add_argument("--prompts", nargs="+", default=list(BENCHMARK_CHAT_PROMPTS), help="chat prompt ids or patterns")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    lm = load_model()
    tok = lm.tokenizer
    path = answers_store_path(lm.name, tok) / ANSWERS_FILE
    if not path.is_file():
        sys.exit(f"No general-text store answers at {path}: run ./run.sh (or the app) once to build the store.")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if max(args.sizes) > len(records):
        sys.exit(f"The store holds {len(records)} answers; pick sizes up to that.")
    order = list(range(len(records)))
    random.Random(0).shuffle(order)
    static = open_default_store(tok, progress=False)
    prompts = [p.ids for p in load_suite("chat", tok, pick=args.prompts)]
    curve = CostModel.for_model(lm, kind="chat").times_ms
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            store = index_answers(Path(tmp) / f"answers-{n}", tok, [records[i] for i in order[:n]]) if n else None
            for budget in (8, None):
                stores = assemble_stores(static=static, answers=store, request=True, history=HistoryStore(path=None),
                                         model=RecycleStore(lm.vocab_size))
                chooser = CostModel(times_ms=curve.copy(), labels={s.source: s.label for s in stores}, kind="chat")
                decoder = RestDecoder(lm, stores=stores, budget_chooser=chooser)
                tokens = steps = 0
                accepted: dict[str, int] = {}
                for ids in prompts:
                    res = decoder.generate(list(ids), DecodeConfig(max_new_tokens=args.max_new_tokens,
                                                                   draft_budget=budget))
                    tokens += len(res.tokens)
                    steps += res.steps
                    for source, count in res.accepted_by_source.items():
                        accepted[source] = accepted.get(source, 0) + count
                by_source = ", ".join(f"{s} {c}" for s, c in sorted(accepted.items(), key=lambda kv: -kv[1]))
                print(f"{n:4d} answers, budget {'cost model' if budget is None else budget}: "
                      f"{tokens / steps:.3f} tokens per pass over {steps} passes; committed drafts: {by_source}",
                      flush=True)


if __name__ == "__main__":
    main()
