"""Write the default model's general-text answers into the package (datastores/shipped/), so a fresh machine
or a restarted Space indexes them in a second instead of having the model answer 514 requests.

    .venv/bin/python scripts/ship_answers.py [--out datastores/shipped/answers-SmolLM2-135M-Instruct.jsonl.gz]

It reads the answers kept beside this machine's built general-text store of the default model (any chat
decode builds it: `python -m rest_core generate --chat --prompt Hi`), checks they answer exactly today's
requests (datastores/answer_prompts.py), and writes them with the tokenizer's fingerprint: a machine with
another tokenizer, or other requests, ignores them and builds its own.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datastores.answer_prompts import answer_prompts  # noqa: E402
from datastores.answers import ANSWERS_FILE, answers_store_path, read_answers, shipped_path, write_shipped  # noqa: E402
from rest_core.model import DEFAULT_HUB_ID, DEFAULT_MODEL, load_tokenizer  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=shipped_path(DEFAULT_MODEL))
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer()
    kept = answers_store_path(DEFAULT_MODEL, tokenizer) / ANSWERS_FILE
    records = read_answers(kept, answer_prompts())
    if records is None:
        print(f"error: no complete answers at {kept}; build the general-text store first "
              "(`python -m rest_core generate --chat --prompt Hi`)", file=sys.stderr)
        return 2
    out = write_shipped([DEFAULT_MODEL, DEFAULT_HUB_ID], tokenizer, records, args.out)
    print(f"{len(records)} answers ({sum(len(r['ids']) for r in records):,} tokens) -> {out} "
          f"({out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
