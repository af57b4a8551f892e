"""The offline default model (SmolLM2-135M-Instruct) with the default Python-source store."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import rest_core.model as model_mod
from datastores import DatastoreError, assemble_stores, build_from_token_documents
from datastores.builtin import open_static_store
from rest_core.decode import DecodeConfig, RestDecoder, plain_generate
from rest_core.model import ModelLoadError, encode_prompt, load_model

pytestmark = pytest.mark.model

CODE_PROMPTS = [
    "def fibonacci(n):",
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same forwards and backwards."""\n',
    "import os\n\n\ndef list_python_files(root):\n",
]
CHAT_PROMPTS = ["Write a Python function that returns the squares of a list of numbers."]


@pytest.mark.parametrize("text,chat", [(p, False) for p in CODE_PROMPTS] + [(p, True) for p in CHAT_PROMPTS])
def test_greedy_rest_is_identical_to_plain_on_the_default_model(default_lm, default_store, text, chat):
    prompt = encode_prompt(default_lm.tokenizer, text, chat=chat)
    cfg = DecodeConfig(max_new_tokens=48, draft_budget=12)
    plain = plain_generate(default_lm, prompt, cfg)
    rest = RestDecoder(default_lm, stores=assemble_stores(static=default_store)).generate(prompt, cfg)
    assert rest.tokens == plain.tokens
    assert rest.steps <= plain.steps


def test_default_store_drafts_python(default_lm, default_store):
    prompt = encode_prompt(default_lm.tokenizer, "def fibonacci(n):")
    res = RestDecoder(default_lm, stores=assemble_stores(static=default_store)).generate(
        prompt, DecodeConfig(max_new_tokens=64, draft_budget=16))
    assert res.mean_accepted > 1.5
    assert default_store.n_tokens > 1_000_000
    assert default_store.label == f"static:{default_store.path.name}"  # runs never show a server path


def test_cli_generate_check_json(default_lm, default_store):
    out = subprocess.run([sys.executable, "-m", "rest_core", "generate", "--prompt", "def fibonacci(n):",
                          "--max-new-tokens", "64", "--check", "--json", "--budget", "16"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["identical"] is True
    assert report["new_tokens"] == 64 and report["steps"] < 64
    assert report["mean_accepted"] == pytest.approx(report["new_tokens"] / report["steps"], abs=1e-3)
    for key in ("text", "wall_s", "plain_wall_s", "speedup", "phase_ms"):
        assert key in report


def test_cli_reports_bad_input_clearly():
    out = subprocess.run([sys.executable, "-m", "rest_core", "generate", "--prompt", "   "],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "empty" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "rest_core", "generate", "--prompt", "x", "--top-p", "0",
                          "--temperature", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "top_p" in out.stderr and "Traceback" not in out.stderr


def test_unknown_model_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(model_mod, "hub_reachable", lambda timeout_s=3.0: False)  # as on a machine with no hub
    with pytest.raises(ModelLoadError, match="What to do") as err:
        load_model("no-such-org/no-such-model-xyz")
    assert "cannot be reached" in str(err.value)  # the quick check answered: no long network retries
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="local folder"):
        load_model(str(empty))


def test_mismatched_store_is_refused(default_lm, tmp_path):
    path = tmp_path / "other"
    build_from_token_documents(path, [[1, 2, 3, 4]], tokenizer_info={"name": "other", "fingerprint": "f" * 64,
                                                                     "vocab_size": 10})
    with pytest.raises(DatastoreError):
        open_static_store(str(path), default_lm.tokenizer)
