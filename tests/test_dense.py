"""The dense source (datastores.dense): exact greedy and exact sampling with its drafts, the neighbours it returns
against a brute-force search, and stores it must refuse (another model's, damaged)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_decode import _chi_square_p, _sample_many, _spread_out_case

from datastores import DatastoreError, DenseStore, assemble_stores, build_dense_store
from datastores.common import SEP
from datastores.dense import chunks, reduce_states, search_index
from rest_core.decode import DecodeConfig, RestDecoder, plain_generate
from rest_core.hidden import dense_layer, layer_count, length_batches, model_fingerprint, sequence_states, state_reader

from conftest import make_tiny_lm

PROMPT = [5, 9, 69_999, 3]


def dense_for(lm, docs, path, dim=16):
    """A dense store of `lm`'s final-norm states over docs ((ids, first) pairs)."""
    layer = layer_count(lm.model)
    return build_dense_store(path, docs, state_reader(lm.model, layer), None,
                             {"name": lm.name, "fingerprint": model_fingerprint(lm.model)}, layer, dim, progress=False)


def own_answers(lm, prompts, n=40):
    """The model's greedy answers to prompts, each read after its prompt (an ID corpus)."""
    docs = []
    for p in prompts:
        out = plain_generate(lm, p, DecodeConfig(max_new_tokens=n, stop_at_eos=False))
        docs.append((list(p) + out.tokens, len(p) - 1))
    return docs


@pytest.fixture(scope="module")
def tiny_dense(tiny_lm, tmp_path_factory):
    rng = np.random.default_rng(0)
    noise = [(rng.integers(0, 70_000, size=30).tolist(), 0) for _ in range(4)]
    docs = own_answers(tiny_lm, [PROMPT, [65_536, 65_537, 12], list(range(100, 140))]) + noise
    return dense_for(tiny_lm, docs, tmp_path_factory.mktemp("dense") / "store")


@pytest.mark.parametrize("prompt", [PROMPT, [7, 65_536, 65_537, 12], [2, 3]])
def test_greedy_with_dense_drafts_equals_plain_greedy(tiny_lm, tiny_dense, prompt):
    plain = plain_generate(tiny_lm, prompt, DecodeConfig(max_new_tokens=40, stop_at_eos=False))
    traces = []
    rest = RestDecoder(tiny_lm, stores=assemble_stores(request=False, dense=tiny_dense)).generate(
        prompt, DecodeConfig(max_new_tokens=40, draft_budget=12, stop_at_eos=False), hook=traces.append)
    assert rest.tokens == plain.tokens
    if prompt == PROMPT:  # its answer is in the corpus: the states are near and the drafts accepted
        assert rest.accepted_by_source.get("dense", 0) >= 20
        assert rest.steps < plain.steps
        # after the first step (whose state, the prompt's, the corpus does not hold) the nearest place is the
        # very one the answer was read at
        near = [t.neighbours["dense"] for t in traces[1:] if "dense" in t.neighbours]
        assert near and all(found[0]["similarity"] > 0.99 for found in near)
        assert all(found[0]["before"] and found[0]["after"] for found in near)  # the text around each place


def test_custom_generate_with_dense_drafts_is_generates_own_output(tiny_lm, tiny_dense):
    from rest_core.hf_generate import rest_generate

    ids = torch.tensor([PROMPT])
    want = tiny_lm.model.generate(ids, max_new_tokens=30, do_sample=False)
    steps = []
    got = tiny_lm.model.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=rest_generate,
                                 datastore=assemble_stores(request=False, dense=tiny_dense), rest_hook=steps.append)
    assert torch.equal(got, want)
    assert len(steps) < 20 and any(s.neighbours.get("dense") for s in steps)


def test_opening_and_searching_a_store_leaves_the_models_threads_alone(tiny_dense):
    """faiss and torch share one OpenMP runtime: the store searches on one thread and gives the count back."""
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        store = DenseStore.open(tiny_dense.path)
        store.neighbours(np.ones(store.mean.shape[0], np.float32), 5)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(was)


@pytest.mark.parametrize("match_next", [False, True])
def test_the_neighbours_are_the_brute_force_nearest(tiny_dense, match_next):
    store = tiny_dense
    store.match_next = match_next
    keys = np.fromfile(store.path / "keys.f16", dtype="<f2").astype(np.float32).reshape(store.tokens.size, -1)
    valid = np.zeros(store.tokens.size, dtype=bool)
    valid[:-2] = (store.tokens[:-2] != SEP) & (store.tokens[1:-1] != SEP) & (store.tokens[2:] != SEP)
    rng = np.random.default_rng(1)
    for _ in range(20):
        state = rng.normal(size=store.mean.shape[0]).astype(np.float32)
        query = reduce_states(state[None], store.mean, store.axes)[0]
        sims = keys @ query
        sims[~valid] = -np.inf
        nearest = np.argsort(-sims, kind="stable")[:store.neighbours_k]
        token = int(store.tokens[nearest[rng.integers(0, 8)] + 1])  # a next token some near position has
        want = [int(p) for p in nearest if store.tokens[p + 1] == token or not match_next][:store.keep]
        got, got_sims = store.neighbours(state, token)
        assert got.tolist() == want
        np.testing.assert_allclose(got_sims, sims[want], atol=1e-4)
    store.match_next = False


def _clustered_keys(n=6000, dim=16, seed=3):
    """Unit keys around 60 centres, as a model's states cluster (and queries near them)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(60, dim))
    keys = centres[rng.integers(0, 60, n)] + 0.4 * rng.normal(size=(n, dim))
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    queries = keys[rng.choice(n, 50, replace=False)] + 0.1 * rng.normal(size=(50, dim))
    return keys.astype(np.float32), (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)


def test_a_large_store_is_searched_through_an_inverted_file_that_finds_the_brute_force_nearest():
    import faiss

    keys, queries = _clustered_keys()
    index = search_index(faiss, keys, exact_up_to=1000)
    assert isinstance(index, faiss.IndexIVFFlat) and 8 <= index.nprobe < index.nlist
    exact = np.argsort(-(queries @ keys.T), axis=1, kind="stable")[:, :32]  # (50, 32) brute force
    _, found = index.search(queries, 32)
    recall = np.mean([len(set(a) & set(b)) / 32 for a, b in zip(found.tolist(), exact.tolist())])
    assert recall >= 0.9
    index.nprobe = index.nlist  # every list scanned: the exact search
    sims, found = index.search(queries, 32)
    assert [set(row) for row in found.tolist()] == [set(row) for row in exact.tolist()]
    np.testing.assert_allclose(sims, np.take_along_axis(queries @ keys.T, exact, axis=1), atol=1e-5)
    assert isinstance(search_index(faiss, keys[:1000], exact_up_to=1000), faiss.IndexFlatIP)


def test_a_store_searched_through_an_inverted_file_finds_the_neighbours_brute_force_finds(tiny_dense, monkeypatch):
    monkeypatch.setattr(DenseStore, "exact_up_to", 100)  # the tiny store (a few hundred keys) as a large one
    store = DenseStore.open(tiny_dense.path)
    import faiss

    assert isinstance(store.index, faiss.IndexIVFFlat)
    store.index.nprobe = store.index.nlist
    rng = np.random.default_rng(4)
    for _ in range(10):
        state = rng.normal(size=store.mean.shape[0]).astype(np.float32)
        got, sims = store.neighbours(state, 5)
        want, want_sims = tiny_dense.neighbours(state, 5)
        assert set(got.tolist()) == set(want.tolist())
        np.testing.assert_allclose(np.sort(sims), np.sort(want_sims), atol=1e-5)


@pytest.mark.slow  # about 30 s on 2 cores: thousands of sampled decodes
def test_sampling_with_dense_drafts_matches_the_exact_distribution(tmp_path):
    lm, prompt, sampling, expected = _spread_out_case()
    rng = np.random.default_rng(2)
    docs = [([*prompt, *rng.integers(0, 4, size=12).tolist()], 1) for _ in range(12)]
    dense = dense_for(lm, docs, tmp_path / "store", dim=8)
    runs = 1000
    stores = assemble_stores(request=False, dense=dense)
    drafted = []
    dense.lookup = _counting(dense.lookup, drafted)
    observed = _sample_many(lm, prompt, sampling, None, runs, 3, stores=stores)
    assert sum(drafted) > runs  # dense drafts were in the trees
    assert _chi_square_p(observed, expected, runs) > 1e-3


def _counting(lookup, drafted):
    def wrapped(*args, **kwargs):
        found = lookup(*args, **kwargs)
        drafted.append(found.continuations.shape[0] > 0)
        return found
    return wrapped


def test_a_store_of_another_model_is_refused(tiny_lm, tiny_dense):
    other = make_tiny_lm(seed=1)
    with pytest.raises(DatastoreError, match="hidden states of model .* Rebuild it with this model"):
        DenseStore.open(tiny_dense.path, model_fingerprint=model_fingerprint(other.model))
    with pytest.raises(DatastoreError, match="not of the model decoding now"):
        RestDecoder(other, stores=[tiny_dense]).generate(PROMPT, DecodeConfig(max_new_tokens=4))
    DenseStore.open(tiny_dense.path, model_fingerprint=model_fingerprint(tiny_lm.model))  # its own model: fine


def test_a_damaged_store_is_refused_with_the_fix(tiny_lm, tmp_path):
    store = dense_for(tiny_lm, own_answers(tiny_lm, [PROMPT], n=12), tmp_path / "store")
    keys = store.path / "keys.f16"
    data = bytearray(keys.read_bytes())
    data[10] ^= 0xFF
    keys.write_bytes(bytes(data))
    with pytest.raises(DatastoreError, match="damaged.*rebuild"):
        DenseStore.open(store.path)
    (store.path / "meta.json").write_text("{not json")
    with pytest.raises(DatastoreError, match="damaged"):
        DenseStore.open(store.path)
    with pytest.raises(DatastoreError, match="not a dense store"):
        DenseStore.open(tmp_path / "nowhere")


def test_a_recorded_step_keeps_the_neighbours_and_the_step_through_shows_them(tiny_lm, tiny_dense, tmp_path):
    from rest_core.app.explain import explain_step
    from rest_core.app.replay import suffix_html
    from rest_core.traces.recorder import TraceRecorder
    from rest_core.traces.rows import step_trace

    recorder = TraceRecorder(tmp_path / "trace.sqlite")
    run_id = recorder.start_run(model=tiny_lm.name, tokenizer_name="tiny", stores=["dense"], settings={}, prompt="",
                                prompt_tokens=PROMPT)
    traces = []
    hook = recorder.step_hook(run_id, tiny_lm.tokenizer)
    RestDecoder(tiny_lm, stores=assemble_stores(request=False, dense=tiny_dense)).generate(
        PROMPT, DecodeConfig(max_new_tokens=20, draft_budget=8, stop_at_eos=False),
        hook=lambda t: (traces.append(t), hook(t)))
    index = next(t.step for t in traces[1:] if t.neighbours.get("dense"))
    step = recorder.load_step(run_id, index, mask="torch")
    near = step["neighbours"]["dense"]
    assert [n["position"] for n in near] == [n["position"] for n in traces[index].neighbours["dense"]]
    assert near[0]["similarity"] > 0.99 and near[0]["after_text"] and near[0]["before_text"]
    assert step_trace(step).neighbours == traces[index].neighbours  # the trace round-trips
    html = suffix_html(step, {t: f"<{t}>" for t in step["query"]})
    assert "nearest places" in html and near[0]["after_text"][:6] in html
    assert "where the model's hidden state had been near" in explain_step(step, {"settings": {}})


@pytest.mark.model
def test_the_command_line_builds_a_dense_store_the_decoder_drafts_from(default_lm, tmp_path, capsys):
    from rest_core.cli import main

    text = tmp_path / "notes.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 3 + "Water boils at one hundred degrees.")
    out = tmp_path / "dense"
    assert main(["datastore", "dense", str(out), "--files", str(text), "--dim", "8", "--quiet"]) == 0
    assert "dense store" in capsys.readouterr().out
    store = DenseStore.open(out, tokenizer=default_lm.tokenizer, model_fingerprint=model_fingerprint(default_lm.model))
    assert store.state_layer == dense_layer(default_lm.model) and store.meta["dim"] == 8
    prompt = default_lm.tokenizer("The quick brown fox jumps over the lazy dog. The quick",
                                  add_special_tokens=False)["input_ids"]
    plain = plain_generate(default_lm, prompt, DecodeConfig(max_new_tokens=12, stop_at_eos=False))
    rest = RestDecoder(default_lm, stores=[store]).generate(prompt, DecodeConfig(max_new_tokens=12, draft_budget=8,
                                                                                  stop_at_eos=False))
    assert rest.tokens == plain.tokens
    assert main(["datastore", "dense", str(out), "--files", str(text)]) == 2  # exists: refused without --force
    assert "--force" in capsys.readouterr().err


def test_documents_read_together_have_the_states_of_each_documents_own_pass():
    """Documents of different lengths share padded passes; every position's state is the one a pass over that
    document alone gives (transformers' own hidden states), at a decoder layer's output and at the final norm's."""
    lm = make_tiny_lm(seed=2, layers=3)
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 70_000, size=n).tolist() for n in (1, 2, 5, 17, 18, 40, 41, 3, 0, 39)]
    passes = []
    hook = lm.model.model.register_forward_pre_hook(lambda *args: passes.append(1))
    try:
        for layer in (1, 2, 3):
            with torch.no_grad():
                want = [lm.model.model(input_ids=torch.tensor([d]), output_hidden_states=True).hidden_states[layer][0]
                        .numpy() if d else np.zeros((0, 64), np.float32) for d in docs]
            passes.clear()
            hooked = [dict(m._forward_hooks) for m in lm.model.modules()]  # transformers' own capture hooks
            got = sequence_states(lm.model, docs, layer, batch_tokens=100)
            assert [dict(m._forward_hooks) for m in lm.model.modules()] == hooked  # its own hook removed
            batches = [b for b in length_batches([len(d) for d in docs], 100) if any(docs[i] for i in b)]
            assert len(passes) == len(batches) < len(docs) - 1  # an empty document needs no pass
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.dtype == np.float32
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    finally:
        hook.remove()


def test_length_batches_and_chunks_hold_every_document_once_in_their_size():
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 300, size=200).tolist() + [900]
    for cut, size in ((length_batches(lengths, 1024), lambda b: lengths[b[0]] * len(b)),
                      (chunks(lengths, 1024), lambda b: sum(lengths[i] for i in b))):
        assert sorted(i for b in cut for i in b) == list(range(len(lengths)))
        assert all(size(b) <= 1024 or len(b) == 1 for b in cut)
        flat = [lengths[i] for b in cut for i in b]
        assert flat == sorted(flat, reverse=True)  # longest first: a batch's first is its longest
    assert len(length_batches(lengths, 1024)) < 100  # similar lengths share a batch


def test_a_store_built_from_batched_reads_keys_each_position_with_its_own_state(tiny_lm, tmp_path):
    docs = own_answers(tiny_lm, [PROMPT, [65_536, 65_537, 12], list(range(100, 140)), [2, 3]], n=20)
    docs += [(list(range(500, 500 + n)), 1) for n in (5, 60, 7)]
    layer = layer_count(tiny_lm.model)
    calls = []
    read = state_reader(tiny_lm.model, layer)
    store = build_dense_store(tmp_path / "store", docs, lambda batch: calls.append(len(batch)) or read(batch), None,
                              {"name": tiny_lm.name, "fingerprint": model_fingerprint(tiny_lm.model)}, layer, 16,
                              progress=False)
    assert store.tokens.tolist() == [t for ids, first in docs for t in (*ids[first:], SEP)]  # the documents' order
    assert sum(calls) == len(docs) and len(calls) < len(docs)  # read several at a time
    alone = np.concatenate([part for ids, first in docs for part in
                            (sequence_states(tiny_lm.model, [ids], layer)[0][first:], np.zeros((1, 64)))])
    keys = np.fromfile(store.path / "keys.f16", dtype="<f2").astype(np.float32).reshape(store.tokens.size, -1)
    found = store.positions
    np.testing.assert_allclose(keys[found], reduce_states(alone[found], store.mean, store.axes), atol=2e-3)


@pytest.mark.model
def test_a_chat_from_the_command_line_does_not_wait_for_a_dense_build(default_lm, tmp_path, monkeypatch, capsys):
    """`--dense auto` in a chat drafts without the dense store while it is not built (and says how to build it);
    a benchmark builds it."""
    import argparse

    from rest_core.cli_args import dense_for

    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path / "cache"))  # no dense store there
    args = argparse.Namespace(dense="auto")
    assert dense_for(args, default_lm, chat=True, build=False) is None
    assert "datastore dense" in capsys.readouterr().err
    assert dense_for(args, default_lm, chat=False) is None  # completion: no dense store asked for
    assert not list((tmp_path / "cache").glob("stores/dense-*"))


def test_a_state_reader_that_loses_a_document_or_a_row_is_refused(tmp_path):
    docs = [(list(range(10, 20)), 0), (list(range(30, 36)), 1)]
    model = {"name": "x", "fingerprint": "f"}
    short = lambda batch: [np.zeros((len(d), 4), np.float32) for d in batch][:-1]
    with pytest.raises(DatastoreError, match="returned 1 arrays for 2 documents"):
        build_dense_store(tmp_path / "a", docs, short, None, model, 1, 2, progress=False)
    cut = lambda batch: [np.zeros((len(d) - 1, 4), np.float32) for d in batch]
    with pytest.raises(DatastoreError, match="rows for a document of 10 tokens"):
        build_dense_store(tmp_path / "b", docs, cut, None, model, 1, 2, progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_index_tool_compares_the_stores_index_with_the_exact_search(tiny_lm, tiny_dense, monkeypatch):
    """tools/dense_index.py on the tiny model: decode-time states, the store's inverted file against the exact
    search over the same keys; with every list scanned it finds exactly what the exact search finds."""
    from conftest import tool

    dense_index = tool("dense_index")
    states = dense_index.decode_states(tiny_lm, tiny_dense, [PROMPT, [2, 3]], 12)
    assert states.shape == (24, tiny_lm.model.config.hidden_size)
    monkeypatch.setattr(DenseStore, "exact_up_to", 100)
    store = DenseStore.open(tiny_dense.path)
    store.index.nprobe = store.index.nlist
    got = dense_index.measure(store, states)
    assert got["index"] == "IndexIVFFlat" and got["queries"] == 24 and got["recall"] == 1.0
    assert got["index_ms"][0] > 0 and got["neighbours_exact_ms"][0] > 0
    flat = dense_index.measure(tiny_dense, states)
    assert flat["index"] == "IndexFlatIP" and flat["recall"] == 1.0
