"""The model's probabilities in every step: computed from the verify pass, stored, read back, drawn;
a split character labelled by its bytes; old trace files without these columns still open."""
from __future__ import annotations

import random
import sqlite3

import pytest
import torch
from test_recorder import FakeTokenizer, make_trace, record_run

from datastores import assemble_stores
from rest_core.decode import DecodeConfig, RestDecoder, plain_generate
from rest_core.sampling import Sampling, draw_uniform, next_token_probs
from rest_core.traces import figures
from rest_core.traces.recorder import TraceRecorder
from rest_core.traces.rows import ADDED_NODE_COLUMNS, TokenTexts
from rest_core.traces.tokens import readable, token_label

from conftest import make_tiny_lm
from oracle import BruteForceStore

PROMPT = [5, 9, 11, 5, 9, 11, 5, 9]


@pytest.fixture(scope="module")
def small_lm():
    return make_tiny_lm(vocab_size=600, seed=3)


def _decoder(lm, plain_tokens):
    store = BruteForceStore(PROMPT + plain_tokens + [(t + 1) % 600 for t in plain_tokens[:5]])
    return RestDecoder(lm, stores=assemble_stores(static=store, request=True))


def test_greedy_step_probabilities_are_the_models(small_lm):
    plain = plain_generate(small_lm, PROMPT, DecodeConfig(max_new_tokens=24, stop_at_eos=False))
    traces = []
    cfg = DecodeConfig(max_new_tokens=24, draft_budget=8, stop_at_eos=False)
    out = _decoder(small_lm, plain.tokens).generate(PROMPT, cfg, hook=traces.append)
    assert out.tokens == plain.tokens  # recording the probabilities changes nothing
    assert any(t.accepted_drafts for t in traces)
    # the first step's root distribution is the model's next-token distribution after the prompt
    with torch.inference_mode():
        logits = small_lm.model(torch.tensor([PROMPT])).logits[0, -1]
    want = logits.float().softmax(-1).topk(5)
    assert traces[0].top_tokens[0] == want.indices.tolist()
    assert traces[0].top_probs[0] == pytest.approx(want.values.tolist(), abs=1e-5)
    for t in traces:
        q = len(t.tree_tokens)
        assert len(t.draft_probs) == len(t.choice_probs) == len(t.top_tokens) == q and t.draft_probs[0] is None
        assert t.uniforms == {}
        for i in range(q):
            assert t.top_tokens[i][0] == t.model_choices[i]  # greedy: the choice is the likeliest token
            assert t.choice_probs[i] == pytest.approx(t.top_probs[i][0])
            assert t.top_probs[i] == sorted(t.top_probs[i], reverse=True) and sum(t.top_probs[i]) <= 1 + 1e-6
        for node in t.accepted_nodes[1:]:  # an accepted token is its parent's choice: same probability
            assert t.draft_probs[node] == pytest.approx(t.choice_probs[t.tree_parents[node]])
        for node in range(1, q):
            assert 0.0 <= t.draft_probs[node] <= t.top_probs[t.tree_parents[node]][0] + 1e-7


def test_sampled_steps_record_the_uniforms_the_generator_gave(small_lm):
    sampling = Sampling(temperature=0.9, top_p=0.95, seed=7)
    cfg = DecodeConfig(max_new_tokens=30, draft_budget=8, sampling=sampling, stop_at_eos=False)
    plain = plain_generate(small_lm, PROMPT, cfg)
    traces = []
    out = _decoder(small_lm, plain.tokens).generate(PROMPT, cfg, hook=traces.append)
    assert out.tokens == plain.tokens  # same seed, same sample: storing the draws consumes nothing extra
    gen = sampling.generator(small_lm.device)
    assert any(t.draft_size for t in traces)
    for t in traces:
        assert sorted(t.uniforms) == sorted(t.accepted_nodes)  # one draw per visited node, none elsewhere
        for node in t.accepted_nodes:  # in the order the walk drew them
            assert t.uniforms[node] == draw_uniform(gen)
        # the stored distribution is the processed (temperature / top-p) one the token was drawn from
        assert t.choice_probs[t.accepted_nodes[-1]] > 0


def test_sampling_distribution_matches_next_token_probs(small_lm):
    sampling = Sampling(temperature=0.7, top_k=20, seed=1)
    cfg = DecodeConfig(max_new_tokens=1, draft_budget=0, sampling=sampling)
    traces = []
    RestDecoder(small_lm).generate(PROMPT, cfg, hook=traces.append)
    with torch.inference_mode():
        logits = small_lm.model(torch.tensor([PROMPT])).logits[0, -1]
    want = next_token_probs(logits, sampling).topk(5)
    assert traces[0].top_probs[0] == pytest.approx(want.values.tolist(), abs=1e-5)


def test_probabilities_round_trip_and_show_in_hover_and_note(tmp_path):
    rec = TraceRecorder(tmp_path / "t.sqlite")
    t = make_trace(random.Random(5), n_nodes=9, accept_p=0.6)
    run = record_run(rec, [t])
    step = rec.load_step(run, 0)
    last = t.accepted_nodes[-1]
    assert step["nodes"][last]["top_tokens"] == t.top_tokens[last]
    assert step["nodes"][last]["top_texts"] == [FakeTokenizer().decode([x]) for x in t.top_tokens[last]]
    fig = figures.draft_tree_figure(step)
    note = fig.layout.annotations[0].text
    assert note.endswith(f"model: {figures.show_token(step['bonus_text'])} {figures.prob_text(t.choice_probs[last])}")
    hovers = [h for d in fig.data if d.mode == "markers+text" and d.customdata is not None
              for n, h in zip(d.customdata, d.hovertext) if n == last]
    assert "the model's likeliest next tokens: " in hovers[0]
    assert figures.prob_text(t.top_probs[last][1]) in hovers[0]
    rec.close()


def test_a_trace_file_from_before_the_probabilities_opens_and_replays(tmp_path):
    path = tmp_path / "old.sqlite"
    rec = TraceRecorder(path)
    t = make_trace(random.Random(2), n_nodes=6)
    run = record_run(rec, [t])
    rec.close()
    with sqlite3.connect(path) as conn:  # the file as an older version wrote it
        for column in ADDED_NODE_COLUMNS:
            conn.execute(f"ALTER TABLE draft_nodes DROP COLUMN {column}")
    rec = TraceRecorder(path)
    back = rec.load_trace(run, 0)
    assert back.tree_tokens == t.tree_tokens and back.draft_probs == [] and back.uniforms == {}
    step = rec.load_step(run, 0)
    assert step["nodes"][1]["prob"] is None
    figures.draft_tree_figure(step)  # draws without probabilities
    assert "draft: " in figures.disagreement_note(step) or "model: " in figures.disagreement_note(step)
    new_run = record_run(rec, [t])  # and new runs in the same file keep them
    assert rec.load_trace(new_run, 0).top_probs == t.top_probs
    rec.close()


@pytest.mark.model
def test_a_character_split_across_tokens_shows_its_bytes():
    from rest_core.model import load_tokenizer

    tok = load_tokenizer()
    ids = tok("ok \U0001F600 中 \ufffd", add_special_tokens=False)["input_ids"]
    texts = TokenTexts(tok)
    labels = [texts.label(i) for i in ids]
    assert "".join(tok.decode([i]) for i in ids).count("\ufffd") >= 2  # the emoji is split
    assert not any("\ufffd" in lab and "‹" in lab for lab in labels)
    assert any("‹F0 9F" in lab for lab in labels)  # the emoji's first bytes
    assert "中" in "".join(labels) and "\ufffd" in "".join(labels)  # whole characters (U+FFFD too) stay text
    assert readable(b"a\xe2\x80") == "a‹E2 80›" and readable("é".encode()) == "é"
    assert token_label(None, 1, "x\ufffd") == "x\ufffd"  # no tokenizer: nothing to show instead


def test_long_labels_are_cut_to_the_room_beside_a_node():
    assert figures.short_label("a_very_long_identifier", 6) == "a_ver…"
    assert figures.short_label(' "<&', 10) == '␣"&lt;&amp;'
    assert figures.label_room([0, 1, 2], 2.6) > figures.label_room(list(range(12)), 2.6) >= 2


def test_the_sampling_check_shows_the_exact_rule_exact_and_the_biased_rule_biased(tmp_path):
    from scipy.stats import chisquare

    from rest_core.traces import probs

    rec = TraceRecorder(tmp_path / "t.sqlite")
    t = make_trace(random.Random(4), n_nodes=8)
    step = rec.load_step(record_run(rec, [t]), 0)
    node = max(range(len(t.tree_tokens)), key=lambda i: sum(p == i for p in t.tree_parents))  # most children
    check = probs.sampling_check(step, node, draws=4000, seed=3)
    assert check["drafted"] and abs(sum(check["p"]) - 1) < 1e-9
    expected = [p * 4000 for p in check["p"]]
    assert chisquare([f * 4000 for f in check["exact"]], expected).pvalue > 1e-3
    assert chisquare([f * 4000 for f in check["biased"]], expected).pvalue < 1e-6
    drafted_mass = sum(check["p"][i] for i in check["drafted"])
    assert sum(check["biased"][i] for i in check["drafted"]) > drafted_mass + 0.03  # drafts favoured
    fig = probs.sampling_check_figure(check)
    assert [d.name for d in fig.data][:2] == ["the model's probability", "committed by REST's rule (exact)"]
    bars = probs.node_probs_figure(step, node)
    assert list(bars.data[0].x) == pytest.approx(check["p"])
    rec.close()
