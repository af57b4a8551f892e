"""REST drafting inside vLLM (rest_core.vllm.RestProposer), run in .venv-vllm (test.sh makes it: scripts/setup.sh
--vllm).  Every vLLM run is a subprocess of that environment; these tests only check what comes out."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from datastores import build_from_token_documents
from rest_core.serving.launch import vllm_env, vllm_python
from rest_core.serving.load import BATCHES, DRAFTS, StepCost

from conftest import ROOT, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.model]
SPEC = '{"method": "custom_class", "model": "rest_core.vllm.RestProposer", "num_speculative_tokens": 8}'


@pytest.fixture(scope="module")
def env(default_store, tmp_path_factory):
    """The vLLM environment's settings, with a step-cost table where drafts are nearly free (these tests check
    exactness and plumbing, so the drafter must draft) and the default static store already built."""
    folder = tmp_path_factory.mktemp("vllm")
    cost = StepCost(BATCHES, DRAFTS, tuple(tuple(50.0 + 0.1 * b * k for k in DRAFTS) for b in BATCHES))
    (folder / "cost.json").write_text(json.dumps(cost.to_json()))
    python = vllm_python()
    env = vllm_env(python)
    env.update(REST_LAB_STEP_COST=str(folder / "cost.json"), REST_LAB_ANSWERS="none", REST_LAB_STORE="default",
               REST_LAB_PROPOSE_LOG=str(folder / "propose.json"))
    return python, env, folder


def test_rest_drafting_keeps_plain_vllm_greedy_outputs_at_batch_1_and_8(env, default_lm):
    python, environment, folder = env
    out = folder / "outputs.json"
    subprocess.run([str(python), str(ROOT / "tests" / "vllm_check.py"), default_lm.source, str(out)],
                   env=environment, cwd=str(ROOT), check=True, timeout=900)
    got = json.loads(out.read_text())
    for batch in ("1", "8"):
        assert got["rest"][batch] == got["plain"][batch], f"outputs differ at batch {batch}"
    assert got["accepted"] > 0  # REST's drafts were accepted: the outputs came through drafting
    # the drafter inside the engine reported its own time and the engine's between its calls
    report = got["report"]
    assert report["steps"] >= 16 and report["drafting_steps"] > 0 and report["accepted"] > 0
    assert 0 < report["propose_ms"] and 0 < report["timed_steps"] <= report["steps"]
    assert report["engine_ms"] / report["timed_steps"] > report["propose_ms"] / report["steps"]
    # steps in which no request had a draft (each prompt's first, at least) were sampled on vLLM's plain path
    assert 0 < report["plain_sampled"] < report["steps"]


def test_chat_requests_draft_from_a_dense_store_read_at_the_served_model_s_own_layer(env, default_lm, tmp_path):
    """A dense store of the model's own answers to the chat prompts (built here with transformers) and no other
    store: the proposer reads the served model's layer in every pass, searches the store with it where the
    request's own tokens give no draft, and the engine accepts its drafts; the outputs stay plain vLLM's."""
    from datastores import build_dense_store
    from rest_core.bench.suites import load_suite
    from rest_core.hidden import default_dense_layer, layer_count, model_fingerprint, state_reader
    from rest_core.model import generate_batch
    from rest_core.serving.config import rest_lab_model_name

    python, environment, folder = env
    prompts = [list(p.ids) for p in load_suite("chat", default_lm.tokenizer, 8)]  # vllm_check.py's chat prompts
    answers = [generate_batch(default_lm, [p], 48)[0] for p in prompts]
    layer = default_dense_layer(layer_count(default_lm.model))
    model = {"name": rest_lab_model_name(default_lm.source), "fingerprint": model_fingerprint(default_lm.model)}
    build_dense_store(tmp_path / "dense", [(p + a, len(p)) for p, a in zip(prompts, answers)],
                      state_reader(default_lm.model, layer), default_lm.tokenizer, model, layer, 16, progress=False)
    out = tmp_path / "outputs.json"
    only_dense = {**environment, "REST_LAB_DENSE": str(tmp_path / "dense"), "REST_LAB_STORE": "none",
                  "REST_LAB_HISTORY": "0", "REST_LAB_PREDICTIONS": "none",
                  "REST_LAB_PROPOSE_LOG": str(tmp_path / "propose.json")}
    subprocess.run([str(python), str(ROOT / "tests" / "vllm_check.py"), default_lm.source, str(out), "chat"],
                   env=only_dense, cwd=str(ROOT), check=True, timeout=900)
    got = json.loads(out.read_text())
    for batch in ("1", "8"):
        assert got["rest"][batch] == got["plain"][batch], f"outputs differ at batch {batch}"
    report = got["report"]
    assert report["dense_lookups"] > 0 and report["dense_drafted"] > 0
    # the state read for each request is the one that predicted its newest token: its own answer's place is found
    # and what followed there is kept (86% in a run on a Zen 5); a row off by one would draft the newest token again
    assert report["dense_accepted"] > 0.5 * report["dense_drafted"]


def test_a_store_of_another_tokenizer_stops_the_engine_at_start_up(env, default_lm, tmp_path):
    python, environment, _ = env
    store = tmp_path / "other"
    build_from_token_documents(store, [[5, 6, 7, 8]] * 4,
                               tokenizer_info={"name": "other-tokenizer", "fingerprint": "0" * 64, "vocab_size": 100})
    script = ("from vllm import LLM\n"
              "if __name__ == '__main__':\n"
              f"    LLM({default_lm.source!r}, speculative_config={SPEC}, enforce_eager=True, max_model_len=512)\n")
    run = subprocess.run([str(python), "-c", script], env={**environment, "REST_LAB_STORE": str(store)},
                         cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    assert "was built with tokenizer 'other-tokenizer'" in run.stdout + run.stderr


def _get(url: str, data: bytes | None = None) -> bytes:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


def test_the_server_answers_a_completion_with_rest_drafting(env, default_lm):
    python, environment, _ = env
    port = free_port()
    server = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", default_lm.source,
                               "--speculative-config", SPEC, "--host", "127.0.0.1", "--port", str(port),
                               "--max-model-len", "1024", "--enforce-eager", "--dtype", "float32"],
                              env=environment, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, "the server stopped while starting"
            try:
                _get(base + "/health")
                break
            except OSError:
                assert time.time() < deadline, "the server did not come up in 10 minutes"
                time.sleep(2)
        prompt = ("def add(a, b):\n    return a + b\n\n\ndef add_three(a, b, c):\n    return a + b + c\n\n\n"
                  "def add_four(")
        body = json.dumps({"model": default_lm.source, "prompt": prompt, "max_tokens": 48, "temperature": 0})
        answer = json.loads(_get(base + "/v1/completions", body.encode()))
        assert answer["choices"][0]["text"].strip()
        metrics = _get(base + "/metrics").decode()
        accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
        assert accepted and sum(accepted) > 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
