"""The general-text store: the model's own answers to a varied set of chat requests.

Chat answers are drafted best from text that reads like this model's chat answers, and
none reads more like them than its own answers to other requests.  This store is built
once per model on a machine: every request of `answer_prompts()` goes through the chat
template, the model answers it greedily (in batches, so a few hundred answers take
minutes on a CPU), and each answer -- with the template's assistant header before it and
the end-of-turn token after it, exactly as the ids appear in a chat -- becomes one
document of a token store whose drafts carry the source name "answers".

The answers are written beside the store as JSONL (request, answer) so a person can read
what the store holds, and a rebuild of the index reuses them.  The default model's answers also ship
with the package (`datastores/shipped/`, written by `scripts/ship_answers.py`): a machine whose
tokenizer is the one they were made with indexes them in a second instead of answering for minutes.
Generation needs the model, which lives above this package: the caller passes `generate`, a
function from a batch of prompt id lists to the answer id lists (see rest_core.model.generate_batch).
"""
from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from datastores.answer_prompts import answer_prompts
from datastores.build import build_from_token_documents
from datastores.common import DatastoreError
from datastores.fingerprint import tokenizer_fingerprint
from datastores.static import TokenDatastore
from rest_base.files import cache_dir, safe_file_name, write_atomic

SOURCE = "answers"
ANSWERS_FILE = "answers.jsonl"
SHIPPED = Path(__file__).with_name("shipped")  # answers made once and shipped, one file per model
BATCH = 32  # requests answered together (more rows per pass: far more tokens per second on a CPU)
MAX_ANSWER_TOKENS = 256

Generate = Callable[[list[list[int]], int], list[list[int]]]  # (prompt id lists, max new tokens) -> answer ids


def answers_store_path(model_name: str, tokenizer: Any) -> Path:
    """Per model (the answers are the model's) and tokenizer (the ids are the tokenizer's)."""
    return cache_dir() / "stores" / f"answers-{safe_file_name(model_name)}-{tokenizer_fingerprint(tokenizer)[:12]}"


def _chat_ids(tokenizer: Any, text: str, generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=generation_prompt,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def assistant_header(tokenizer: Any) -> list[int]:
    """The ids the chat template puts between a user turn and the answer (e.g. '<|im_start|>assistant\\n')."""
    with_prompt = _chat_ids(tokenizer, "x", True)
    without = _chat_ids(tokenizer, "x", False)
    if with_prompt[:len(without)] != without:
        return []
    return with_prompt[len(without):]


def end_of_turn(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [int(eos)] if isinstance(eos, int) else []


def generate_answers(tokenizer: Any, generate: Generate, prompts: Sequence[str], batch: int = BATCH,
                     max_new_tokens: int = MAX_ANSWER_TOKENS, progress: bool = True) -> list[dict]:
    """Every request answered: [{"prompt", "answer", "ids"}] in the order of prompts.

    Requests are batched by length (little padding); each answer's ids stop at the first
    end-of-sequence token (kept)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DatastoreError("the general-text store is built from chat answers, and this model has no chat "
                             "template; use the Python store (or your own) with this model")
    encoded = [_chat_ids(tokenizer, p, True) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    answers: list[Optional[list[int]]] = [None] * len(prompts)
    bar = _progress(len(prompts), progress)
    t0 = time.perf_counter()
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        outs = generate([encoded[i] for i in chunk], max_new_tokens)
        for i, ids in zip(chunk, outs):
            answers[i] = list(ids)
        bar(len(chunk))
    bar(0, done=True, seconds=time.perf_counter() - t0)
    return [{"prompt": p, "answer": tokenizer.decode(a, skip_special_tokens=True), "ids": a}
            for p, a in zip(prompts, answers)]


def _progress(total: int, show: bool):
    state = {"n": 0}

    def step(k: int, done: bool = False, seconds: float = 0.0) -> None:
        state["n"] += k
        if show and not done:
            print(f"\r  answered {state['n']}/{total} requests", end="", flush=True)
        if show and done:
            print(f"\r  answered {state['n']}/{total} requests in {seconds:.0f} s", flush=True)
    return step


def build_answers_store(path: str | Path, tokenizer: Any, generate: Optional[Generate],
                        prompts: Optional[Sequence[str]] = None, batch: int = BATCH,
                        max_new_tokens: int = MAX_ANSWER_TOKENS, progress: bool = True,
                        model_name: str = "") -> TokenDatastore:
    """Answer the requests (or reuse the answers kept at path, or those shipped for `model_name` with this
    tokenizer) and index them as a store at path.  Without `generate`, only kept or shipped answers will do
    (DatastoreError otherwise)."""
    path = Path(path)
    prompts = list(answer_prompts() if prompts is None else prompts)
    if not prompts:
        raise DatastoreError("no requests to answer: pass at least one prompt")
    records = read_answers(path / ANSWERS_FILE, prompts) or shipped_answers(model_name, tokenizer, prompts)
    if records is None:
        if generate is None:
            raise DatastoreError(f"the general-text store for {model_name or 'this model'} is not built yet; any "
                                 "chat decode builds it first (10-25 minutes on 2 CPU cores, once): "
                                 "`python -m rest_core generate --chat --prompt Hi`")
        if progress:
            print(f"Building the general-text store at {path}: the model answers {len(prompts)} requests "
                  f"(once; up to {max_new_tokens} tokens each)...", flush=True)
        records = generate_answers(tokenizer, generate, prompts, batch, max_new_tokens, progress)
    store = index_answers(path, tokenizer, records)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    write_atomic(path / ANSWERS_FILE, text)
    return store


def index_answers(path: str | Path, tokenizer: Any, records: Sequence[dict]) -> TokenDatastore:
    """A store at path of these answers ({"ids": ...} records), each a document as the ids appear in a chat:
    the template's assistant header, the answer, its end-of-turn token."""
    path = Path(path)
    header, eot = assistant_header(tokenizer), end_of_turn(tokenizer)
    docs = []
    for rec in records:
        ids = list(rec["ids"])
        if eot and (not ids or ids[-1] != eot[0]):
            ids = ids + eot  # an answer cut at max_new_tokens still ends its turn in the store
        docs.append(header + ids)
    build_from_token_documents(path, docs, tokenizer, overwrite=True)
    return TokenDatastore.open(path, tokenizer=tokenizer, name=path.name, source=SOURCE)


def answer_documents(tokenizer: Any, records: Sequence[dict]) -> list[tuple[list[int], int]]:
    """Each answer as the model read it in a chat -- its request through the template, the answer, its end-of-turn
    token -- with the position of the template's last token (the state there predicted the answer's first
    token): the documents of a dense store over these answers (datastores.dense)."""
    eot = end_of_turn(tokenizer)
    docs = []
    for rec in records:
        prefix = _chat_ids(tokenizer, rec["prompt"], True)
        ids = list(rec["ids"])
        if eot and (not ids or ids[-1] != eot[0]):
            ids = ids + eot
        docs.append((prefix + ids, len(prefix) - 1))
    return docs


def read_kept_answers(path: Path) -> list[dict]:
    """The (request, answer) records kept beside a built general-text store (DatastoreError when there are none)."""
    try:
        lines = (Path(path) / ANSWERS_FILE).read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatastoreError(f"the general-text store's answers at {path} cannot be read ({exc}); build it first: "
                             "`python -m rest_core generate --chat --prompt Hi`") from None
    if not all(isinstance(r, dict) and isinstance(r.get("prompt"), str) and isinstance(r.get("ids"), list)
               for r in records):
        raise DatastoreError(f"{path / ANSWERS_FILE} holds records without a prompt or ids: rebuild the store")
    return records


def read_answers(path: Path, prompts: Sequence[str]) -> Optional[list[dict]]:
    """The kept answers when they answer exactly these requests; None otherwise (unreadable, other requests)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    ok = len(records) == len(prompts) and all(
        isinstance(r, dict) and r.get("prompt") == p and isinstance(r.get("ids"), list)
        and all(isinstance(t, int) and t >= 0 for t in r["ids"]) for r, p in zip(records, prompts))
    return records if ok else None


def shipped_path(model_name: str) -> Path:
    return SHIPPED / f"answers-{safe_file_name(model_name.split('/')[-1])}.jsonl.gz"


def shipped_answers(model_name: str, tokenizer: Any, prompts: Sequence[str]) -> Optional[list[dict]]:
    """The answers shipped for this model (its hub id or local name), when they were made with this very tokenizer
    and answer exactly these requests; None otherwise.  The file's first line names the models and the tokenizer
    fingerprint; each further line is one {"prompt", "ids"} record."""
    path = shipped_path(model_name) if model_name else None
    if path is None or not path.is_file():
        return None
    try:
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
        head = json.loads(lines[0])
        if model_name not in head["models"] or head["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
            return None
        records = [json.loads(line) for line in lines[1:] if line.strip()]
    except (OSError, EOFError, ValueError, KeyError, TypeError, IndexError, DatastoreError):
        return None
    for rec in records:
        rec.setdefault("answer", tokenizer.decode(rec.get("ids") or [], skip_special_tokens=True))
    ok = len(records) == len(prompts) and all(
        isinstance(r, dict) and r.get("prompt") == p and isinstance(r.get("ids"), list)
        and all(isinstance(t, int) and t >= 0 for t in r["ids"]) for r, p in zip(records, prompts))
    return records if ok else None


def write_shipped(model_names: Sequence[str], tokenizer: Any, records: Sequence[dict], out: Path) -> Path:
    """The shipped file of these answers: a header naming the models and the tokenizer, then {"prompt", "ids"}."""
    head = {"models": list(model_names), "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "requests": len(records), "made_at": time.strftime("%Y-%m-%d")}
    lines = [json.dumps(head)] + [json.dumps({"prompt": r["prompt"], "ids": list(r["ids"])}) for r in records]
    write_atomic(out, gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), mtime=0))
    return out


def open_answers_store(path: str | Path, tokenizer: Any) -> TokenDatastore:
    """Open a built general-text store (DatastoreError when there is none or it is broken)."""
    path = Path(path)
    return TokenDatastore.open(path, tokenizer=tokenizer, name=path.name, source=SOURCE)
