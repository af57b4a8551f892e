"""Record the example run the page ships with (assets/example-run.json) and check it replays.

    .venv/bin/python scripts/make_example_run.py [--out assets/example-run.json] [--max-new-tokens 64]

The default model continues the start of a Python script with the page's default stores (the
built-in store, the request store, the model's own predictions starting empty), greedy, with a
fixed draft budget; every step is recorded in a temporary trace store and exported as JSON (the format of
`python -m rest_core traces export RUN --json`), without the recording machine's name or process,
plus the text of every token of the prompt and the answer, so the page can replay it with no
tokenizer loaded.  The run is decoded a second time without drafts to check the answer is
plain greedy decoding's, token for token.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datastores import RecycleStore, assemble_stores, open_default_store, store_labels  # noqa: E402
from rest_core.app.settings import BUILT_IN  # noqa: E402
from rest_core.decode import DecodeConfig, RestDecoder, plain_generate  # noqa: E402
from rest_core.model import encode_prompt, load_model  # noqa: E402
from rest_core.traces.cli import run_json  # noqa: E402
from rest_core.traces.exported import ExportedRun  # noqa: E402
from rest_core.traces.recorder import TokenTexts, TraceRecorder  # noqa: E402

PROMPT = "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser("
PRIVATE = ("pid", "host", "proc_start")  # where it was recorded: not shipped


def record(max_new_tokens: int, budget: int, db: Path) -> tuple[dict, list[int]]:
    """Decode PROMPT with REST, every step recorded in db; the exported run and the plain greedy tokens."""
    lm = load_model()
    static = open_default_store(lm.tokenizer)
    stores = assemble_stores(static=static, request=True, model=RecycleStore(lm.vocab_size))
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, draft_budget=budget)
    decoder = RestDecoder(lm, stores=stores)
    prompt = encode_prompt(lm.tokenizer, PROMPT)
    rec = TraceRecorder(db)
    settings = {**cfg.settings(), "chat": False, "static": BUILT_IN, "request_store": True, "history_store": False,
                "model_drafts": True}
    run_id = rec.start_run(model=lm.name, tokenizer_name=str(getattr(lm.tokenizer, "name_or_path", lm.name)),
                           stores=store_labels(stores), settings=settings, prompt=PROMPT, prompt_tokens=prompt)
    result = decoder.generate(prompt, cfg, hook=rec.step_hook(run_id, lm.tokenizer))
    rec.finish_run(run_id, output=result.text, new_tokens=result.new_tokens, steps=result.steps,
                   wall_s=result.wall_s, mean_accepted=result.mean_accepted)
    data = run_json(rec, rec.get_run(run_id))
    for key in PRIVATE:
        data["run"].pop(key, None)
    texts = TokenTexts(lm.tokenizer)
    data["run"]["token_texts"] = {str(t): texts[t] for t in dict.fromkeys([*prompt, *result.tokens])}
    plain = plain_generate(lm, prompt, cfg)
    if plain.tokens != result.tokens:
        raise SystemExit("REST's answer differs from plain greedy decoding: not shipping this run")
    return data, plain.tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "assets" / "example-run.json")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=16, help="draft tokens per step (a fixed budget draws "
                        "trees worth looking at; on a CPU the automatic one often keeps a single node)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data, _ = record(args.max_new_tokens, args.budget, Path(tmp) / "traces.sqlite")
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    ExportedRun(json.loads(text))  # the page can read it back
    args.out.write_text(text, encoding="utf-8")
    steps = data["steps"]
    accepted = sum(s["accepted_len"] for s in steps)
    print(f"wrote {args.out} ({len(text) / 1e3:.0f} kB): {len(steps)} steps, {data['run']['new_tokens']} tokens, "
          f"{accepted} of them drafted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
