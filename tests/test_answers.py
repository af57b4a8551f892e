"""The general-text store: the model's own answers to varied requests, drafted under the source "answers"."""
from __future__ import annotations

import json

import pytest

from datastores import (
    DatastoreError,
    TokenDatastore,
    answers,
    assemble_stores,
    build_from_token_documents,
    open_answers,
)
from datastores.answer_prompts import answer_prompts
from datastores.answers import (
    ANSWERS_FILE,
    answers_store_path,
    assistant_header,
    build_answers_store,
    end_of_turn,
    shipped_answers,
    write_shipped,
)
from rest_core.bench.suites import chat_prompts
from rest_core.decode import DecodeConfig, RestDecoder, plain_generate
from rest_core.model import DEFAULT_HUB_ID, DEFAULT_MODEL, encode_prompt, generate_batch

REQUESTS = ["Write a haiku about tea.", "What is 12 times 7?", "Name three colours of the rainbow."]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path / "cache"))


def test_the_request_set_is_varied_fixed_and_apart_from_the_benchmark():
    first, again = answer_prompts(), answer_prompts()
    assert first == again, "the same requests in the same order on every call"
    assert len(first) == len(set(first)) >= 400
    suite = {text for _, text, _ in chat_prompts()}
    assert not suite & set(first), "no benchmark prompt is among the store's requests"
    kinds = ("Write", "Pretend you are", "Solve for x", "Extract", "Python", "Explain")
    assert all(any(k in p for p in first) for k in kinds)


def test_batched_answers_of_one_request_equal_plain_greedy_decoding(default_lm):
    ids = encode_prompt(default_lm.tokenizer, REQUESTS[0], chat=True)
    calls = []
    [answer] = generate_batch(default_lm, [ids], 12, between_steps=lambda: calls.append(1))
    assert answer == plain_generate(default_lm, ids, DecodeConfig(max_new_tokens=12)).tokens[:len(answer)]
    assert len(answer) == 12 or answer[-1] in default_lm.eos_token_ids
    assert len(calls) == len(answer), "the build can step aside after every token"


def test_the_store_holds_each_answer_as_it_appears_in_a_chat(default_lm, tmp_path):
    tok = default_lm.tokenizer
    calls = []

    def generate(batch, max_new):
        calls.append(len(batch))
        return generate_batch(default_lm, batch, max_new)

    path = tmp_path / "answers"
    store = build_answers_store(path, tok, generate, prompts=REQUESTS, batch=2, max_new_tokens=10, progress=False)
    assert calls == [2, 1], "requests answered in batches"
    assert store.source == "answers" and store.label == f"answers:{path.name}" and store.n_docs == 3
    records = [json.loads(line) for line in (path / ANSWERS_FILE).read_text().splitlines()]
    assert [r["prompt"] for r in records] == REQUESTS
    header, eot = assistant_header(tok), end_of_turn(tok)
    assert tok.decode(header).strip().endswith("assistant")
    stream = store._tokens.tolist()
    for r in records:
        doc = header + r["ids"] + ([] if r["ids"][-1:] == eot else eot)
        assert any(stream[i:i + len(doc)] == doc for i in range(len(stream))), "answer stored with header and end"
        assert r["answer"] == tok.decode(r["ids"], skip_special_tokens=True)
    # the start of an answer is drafted from the header, as at a chat's first step
    look = store.lookup(header, n_max=len(header), n_min=2, continuation_len=4)
    assert look.source == "answers" and look.matched_len == len(header)
    firsts = {tuple(r["ids"][:4]) for r in records}
    assert {tuple(row[:4]) for row in look.continuations.tolist()} <= firsts | {tuple(r["ids"][:len(r["ids"])])
                                                                                 for r in records}

    def refuse(batch, max_new):
        raise AssertionError("kept answers are reused, not generated again")
    again = build_answers_store(path, tok, refuse, prompts=REQUESTS, max_new_tokens=10, progress=False)
    assert again.n_tokens == store.n_tokens


def test_open_answers_names_what_is_missing_and_builds_once(default_lm, tmp_path, monkeypatch):
    monkeypatch.setattr(answers, "SHIPPED", tmp_path / "nothing-shipped")
    tok = default_lm.tokenizer
    assert open_answers("none", default_lm.name, tok) is None
    with pytest.raises(DatastoreError, match="not built yet"):
        open_answers("default", default_lm.name, tok)
    with pytest.raises(DatastoreError, match="does not exist"):
        open_answers(str(tmp_path / "nowhere"), default_lm.name, tok)
    seen = []

    def generate(batch, max_new):
        seen.append(len(batch))
        return [[int(tok.eos_token_id)] for _ in batch]  # every answer ends at once: a quick build
    store = open_answers("default", default_lm.name, tok, generate=generate, progress=False)
    assert sum(seen) == len(answer_prompts()) and store.n_docs == len(answer_prompts())
    assert store.path == answers_store_path(default_lm.name, tok)
    assert open_answers("default", default_lm.name, tok).n_tokens == store.n_tokens  # opened, not rebuilt
    assert sum(seen) == len(answer_prompts())


def test_a_store_without_chat_template_is_refused_with_the_reason(tmp_path):
    class NoTemplate:
        chat_template = None

        def get_vocab(self):
            return {"a": 0}
    with pytest.raises(DatastoreError, match="no chat template"):
        build_answers_store(tmp_path / "x", NoTemplate(), lambda b, n: [], prompts=["hi"], progress=False)


def test_two_token_stores_draft_side_by_side_under_their_own_names(tiny_lm, tmp_path):
    """The Python store and the general-text store merge into one tree; the traces tell them apart."""
    prompt = [5, 6, 7, 5, 6]
    cont = plain_generate(tiny_lm, prompt, DecodeConfig(max_new_tokens=12)).tokens
    info = {"name": "tiny", "fingerprint": None, "vocab_size": 70_000}
    static = build_from_token_documents(tmp_path / "s", [[1, 2, 3, 4]], tokenizer_info=info)
    build_from_token_documents(tmp_path / "a", [prompt + cont], tokenizer_info=info)
    answers = TokenDatastore.open(tmp_path / "a", name="a", source="answers")
    stores = assemble_stores(static=static, answers=answers, request=True)
    assert [s.source for s in stores] == ["static", "answers", "request"]
    res = RestDecoder(tiny_lm, stores=stores).generate(prompt, DecodeConfig(max_new_tokens=12, draft_budget=8))
    assert res.tokens == cont, "greedy output unchanged"
    assert res.accepted_by_source.get("answers", 0) > 0
    with pytest.raises(DatastoreError, match="share the source name"):  # a second "static" is refused
        assemble_stores(static=static, answers=TokenDatastore.open(tmp_path / "a"), request=False)


class WordTokenizer:
    """Just a vocabulary: what a fingerprint and a decode need."""

    def __init__(self, words):
        self.vocab = {w: i for i, w in enumerate(words)}

    def get_vocab(self):
        return dict(self.vocab)

    def decode(self, ids, skip_special_tokens=False):
        names = {i: w for w, i in self.vocab.items()}
        return " ".join(names[i] for i in ids)


def test_shipped_answers_count_only_for_their_models_tokenizer_and_requests(tmp_path, monkeypatch):
    monkeypatch.setattr(answers, "SHIPPED", tmp_path)
    tok, other = WordTokenizer(["a", "b", "c"]), WordTokenizer(["a", "b", "d"])
    records = [{"prompt": "p1", "ids": [0, 1]}, {"prompt": "p2", "ids": [2]}]
    write_shipped(["m", "org/m"], tok, records, answers.shipped_path("m"))
    got = shipped_answers("m", tok, ["p1", "p2"])
    assert [r["ids"] for r in got] == [[0, 1], [2]] and got[0]["answer"] == "a b"
    assert shipped_answers("org/m", tok, ["p1", "p2"]) is not None  # the hub id finds the same file
    assert shipped_answers("m", other, ["p1", "p2"]) is None  # another tokenizer: its ids mean other text
    assert shipped_answers("m", tok, ["p1", "p3"]) is None  # other requests
    assert shipped_answers("n", tok, ["p1", "p2"]) is None  # another model
    answers.shipped_path("m").write_bytes(b"not gzip")
    assert shipped_answers("m", tok, ["p1", "p2"]) is None  # damaged: ignored, the model answers instead


@pytest.mark.model
def test_the_default_models_answers_ship_and_index_without_the_model(default_lm, tmp_path):
    """The shipped answers fit the default tokenizer and today's requests (editing answer_prompts.py without
    scripts/ship_answers.py fails here), and a fresh cache indexes them without generating anything."""
    tok = default_lm.tokenizer
    assert shipped_answers(DEFAULT_HUB_ID, tok, answer_prompts()) is not None
    store = open_answers("default", DEFAULT_MODEL, tok, generate=None, progress=False)
    assert store.n_docs == len(answer_prompts()) and store.n_tokens > 50_000
    kept = [json.loads(line) for line in (store.path / ANSWERS_FILE).read_text().splitlines()]
    assert [r["prompt"] for r in kept] == answer_prompts()
