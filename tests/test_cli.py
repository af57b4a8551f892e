"""The command line's wiring and the model loader's process hygiene."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from datastores import HistoryStore, RecycleStore, assemble_stores
from rest_core.cli import save_learned
from rest_core.cost import GRID, CostModel
from rest_core.decode import DecodeConfig, RestDecoder
from rest_core.model import ATTENTION, load_network

from conftest import REAL_CACHE, make_tiny_lm

ROOT = Path(__file__).resolve().parents[1]


def test_a_broken_benchmark_import_is_an_error_not_a_missing_command():
    code = ("import sys; sys.modules['rest_core.bench.cli'] = None\n"
            "try:\n    import rest_core.cli\nexcept ImportError as e:\n    print('IMPORT-ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "IMPORT-ERROR" in out.stdout, out.stdout + out.stderr


def test_cli_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "rest_core", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    for command in ("generate", "bench", "traces", "datastore", "tune"):
        assert command in out.stdout


@pytest.mark.slow
def test_tune_measures_visibly_once_then_reads_what_it_kept(tmp_path):
    """`python -m rest_core tune`: the first run says it times the kernels, with how long it took and where the
    choice is kept, and prints the choice and the cost curve; the next run reads the choice back; --again times
    it anew.  A model's load tells the same when it has to measure (load_model's `report`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_tiny_lm(vocab_size=300).model.save_pretrained(tmp_path / "m")
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "m")
    env = {**os.environ, "REST_LAB_CACHE": str(tmp_path / "cache")}
    if (REAL_CACHE / "native").is_dir():  # the compiled kernels are shared: only the choices are new here
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / "native").symlink_to(REAL_CACHE / "native")

    def tune(*extra):
        out = subprocess.run([sys.executable, "-m", "rest_core", "tune", "--model", str(tmp_path / "m"), *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return out

    first = tune()
    assert "timing 5 linear kernels" in first.stderr and "linear kernels measured in" in first.stderr
    assert "Linear kernels (measured now in" in first.stdout and "Forward-pass cost curve" in first.stdout
    assert list((tmp_path / "cache" / "kernels").glob("*.json"))
    second = tune()
    assert "timing" not in second.stderr and "Linear kernels (read from" in second.stdout
    again = tune("--again")
    assert "timing 5 linear kernels" in again.stderr and "Linear kernels (measured now in" in again.stdout


def test_loading_a_model_sets_no_process_wide_switch_and_keeps_the_numbers(tmp_path):
    tiny = make_tiny_lm(vocab_size=300)
    tiny.model.save_pretrained(tmp_path / "m")
    os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)
    net = load_network(str(tmp_path / "m"), torch.float32).eval()
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ
    assert net.config._attn_implementation == ATTENTION
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    q = 3
    mask = torch.zeros((1, 1, q, ids.shape[1]))
    mask[0, 0, 1, -1] = torch.finfo(torch.float32).min  # a tree mask: node 1 does not see node 2
    mask[0, 0, 0, -2:] = torch.finfo(torch.float32).min
    with torch.inference_mode():
        prefix = ids[:, :3]
        ref_kw = dict(input_ids=ids[:, 3:], position_ids=torch.tensor([[3, 4, 4]]), attention_mask=mask)
        ours = net(input_ids=prefix, use_cache=True)
        got = net(**ref_kw, past_key_values=ours.past_key_values).logits
        tiny_out = tiny.model(input_ids=prefix, use_cache=True)
        want = tiny.model(**ref_kw, past_key_values=tiny_out.past_key_values).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_save_learned_keeps_persisted_stores_and_statistics(tiny_lm, tmp_path):
    recycled = RecycleStore(tiny_lm.vocab_size, path=tmp_path / "model.npz")
    history = HistoryStore(path=tmp_path / "history.npz")
    chooser = CostModel(times_ms=np.linspace(10.0, 40.0, len(GRID)), stats_path=tmp_path / "acc.json")
    dec = RestDecoder(tiny_lm, stores=assemble_stores(history=history, model=recycled), budget_chooser=chooser)
    dec.generate([5, 6, 7], DecodeConfig(max_new_tokens=6))
    assert not any(tmp_path.iterdir())  # the decoder itself writes nothing
    save_learned(dec)
    assert {p.name for p in tmp_path.iterdir()} == {"model.npz", "history.npz", "acc.json"}
    assert RecycleStore(tiny_lm.vocab_size, path=tmp_path / "model.npz").known == recycled.known > 0
