"""Shared fixtures: a tiny randomly initialised model (fast, exact in fp32) and the default model."""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from datastores.builtin import open_default_store
from rest_core.model import LoadedModel, load_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


# The quick tier (./test.sh --fast) leaves these out; a test that needs what they name carries the marker, by
# hand or, for the fixtures below, from the fixture it asks for.
SLOW_TIERS = ("model", "browser", "server", "package", "slow", "vllm")
FIXTURE_TIERS = {"default_lm": "model", "default_store": "model", "served": "server"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in sorted({FIXTURE_TIERS[f] for f in item.fixturenames if f in FIXTURE_TIERS}):
            item.add_marker(name)


@pytest.fixture(autouse=True)
def _quick_tier_has_no_default_model(monkeypatch):
    """In the quick tier (REST_LAB_FAST_TESTS=1, set by ./test.sh --fast) loading the default model fails at
    once, naming the marker the test lacks, instead of converting it (minutes on a fresh machine)."""
    if os.environ.get("REST_LAB_FAST_TESTS") == "1":
        def refuse() -> str:
            raise RuntimeError("this test loads the default model: mark it @pytest.mark.model (the quick tier, "
                               "./test.sh --fast, leaves such tests out)")
        monkeypatch.setattr("rest_core.model.ensure_default_model", refuse)


REAL_CACHE = Path(os.environ.get("REST_LAB_CACHE") or Path.home() / ".cache" / "rest-lab").expanduser()


def private_cache(cache: Path) -> str:
    """A cache folder for a page under test (trace store, session folders, cost statistics) instead of
    the real one; the converted default model and the linear-kernel choice are shared with the real cache
    when the model is there already."""
    cache.mkdir(parents=True, exist_ok=True)
    if (REAL_CACHE / "models").is_dir():
        (cache / "models").symlink_to(REAL_CACHE / "models")
        # the linear-kernel choice is measured once per machine, not per test
        (REAL_CACHE / "kernels").mkdir(exist_ok=True)
        (cache / "kernels").symlink_to(REAL_CACHE / "kernels")
    return str(cache)


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """For the tests of one module: the page's cache (trace store, session folders, cost statistics) and
    Gradio's upload folder in temporary folders, never the real ones (modules ask for it with
    `pytestmark = pytest.mark.usefixtures("module_cache")`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REST_LAB_CACHE", private_cache(tmp_path_factory.mktemp("cache")))
        mp.setenv("GRADIO_TEMP_DIR", str(tmp_path_factory.mktemp("gradio")))
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_values(outputs: list) -> list:
    """Per output of a streamed API call, the last value that was not an 'unchanged' marker."""
    last = [None] * len(outputs[0])
    for out in outputs:
        for i, value in enumerate(out):
            if not (isinstance(value, dict) and value.get("__type__") == "update" and "value" not in value):
                last[i] = value
    return last


CHROMIUM = Path("/usr/bin/chromium")


@contextmanager
def chromium_page(url: str, timeout_ms: int = 120_000):
    """Debian's Chromium (headless, no background network) on the page at `url`, once its prompt box is there."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(timeout_ms)
        page.goto(url)
        page.wait_for_selector("#prompt textarea")
        yield page
        browser.close()


class TinyTokenizer:
    """Just enough of a tokenizer for the decoder and a store build: ids <-> 't<id>' words (a batch of texts
    too); `chat()` gives one with a chat template (each message: id 1, its words, id 2)."""

    def __init__(self, vocab_size: int, eos_token_id: int):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.chat_template = None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids if not (skip_special_tokens and i == self.eos_token_id))

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        if isinstance(text, list):
            return {"input_ids": [self(t)["input_ids"] for t in text]}
        return {"input_ids": [int(w[1:]) for w in text.split()]}

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.vocab_size)}

    def chat(self):
        chatty = TinyTokenizer(self.vocab_size, self.eos_token_id)
        chatty.chat_template = "tiny"
        return chatty

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        ids = [t for m in messages for t in [1, *self(m["content"])["input_ids"], 2]]
        return ids + [1] if add_generation_prompt else ids


def no_chooser(lm, stores, kind):
    """A budget-chooser factory for app tests that fix the draft budget: no cost model at all."""
    return None


def load_module(path: Path, name: str):
    """A file that is not part of a package (a script, the Hub folder's generate.py), loaded as a module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # what dataclasses look their module up in
    spec.loader.exec_module(module)
    return module


def tool(name: str):
    """tools/<name>.py (a measurement tool) as a module."""
    return load_module(ROOT / "tools" / f"{name}.py", name)


def make_tiny_lm(vocab_size: int = 70_000, seed: int = 0, layers: int = 2, eos_token_id: int = 0,
                 max_positions: int = 512):
    """A LlamaConfig model with grouped-query attention and a vocabulary over 65,535 by default."""


    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         eos_token_id=eos_token_id, bos_token_id=1, pad_token_id=eos_token_id,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy paths repeat and drafts get accepted
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = eos_token_id
    return LoadedModel(model=model, tokenizer=TinyTokenizer(vocab_size, eos_token_id), name="tiny-random",
                       source="random", device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_lm():
    return make_tiny_lm()


@pytest.fixture(scope="session")
def default_lm():
    return load_model()


@pytest.fixture(scope="session")
def default_store(default_lm):
    return open_default_store(default_lm.tokenizer)
