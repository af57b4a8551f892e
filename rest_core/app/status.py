"""The status line: each model loading or loaded, and the state of its built-in, general-text and dense stores
(Markdown; every name and error in it shown as it is, never as markup)."""
from __future__ import annotations

import time
from typing import Any

from rest_core.app.policy import markdown_text
from rest_core.app.settings import STORE_RETRY_S


def store_progress(st: Any) -> str:
    """How long a store build has run, and the tokens it has written so far when that can be seen."""
    elapsed = time.time() - st.started
    done = ""
    if st.path is not None:
        sizes = [p.stat().st_size for p in st.path.parent.glob(f".{st.path.name}.building-*/tokens.u32")
                 if p.exists()]
        if sizes:
            done = f", {max(sizes) // 4 / 1e6:.1f}M tokens so far"
    return f"{elapsed:.0f} s{done}"


def _store_line(st: Any) -> str:
    return {
        "idle": "built-in datastore not opened yet",
        "building": "building the built-in datastore from Python sources (first time on this machine "
                    f"only; it takes a few minutes: {store_progress(st)}). Until it is ready, "
                    "answers draft from the request and history stores only",
        "ready": f"built-in datastore ready ({getattr(st.store, 'n_tokens', 0):,} tokens)",
        "failed": f"⚠ built-in datastore unavailable ({markdown_text(st.error, 200)}); tried again after "
                  f"{STORE_RETRY_S:.0f} s",
        "off": "no built-in datastore",
    }[st.state]


def _answers_line(st: Any) -> str:
    return {
        "idle": "",
        "building": f"the general-text store is being built: the model answers {st.total or 'a few hundred'} "
                    f"requests, once on this machine ({st.done} so far; it pauses while you decode)",
        "ready": f"general-text store ready ({getattr(st.store, 'n_tokens', 0):,} tokens of the model's answers)",
        "failed": f"⚠ general-text store unavailable ({markdown_text(st.error, 200)})",
        "off": "",
    }[st.state]


def _dense_line(st: Any) -> str:
    if st.state == "ready":
        return f"dense store ready ({len(st.store):,} positions of the model's hidden states)"
    if st.state == "failed":
        return f"⚠ dense store unavailable ({markdown_text(st.error, 200)})"
    return ("the dense store is being built: the model reads its answers once, stepping aside while you decode "
            "(answers draft without it until then)") if st.state == "building" else ""


def status_text(engine: Any) -> str:
    """One line per model of an Engine: loading / loaded, and the state of its built-in store."""
    lines = []
    for name, since in list(engine.loading.items()):
        lines.append(f"Loading model **{markdown_text(name)}** ({time.time() - since:.0f} s so far; the very "
                     "first load on a machine converts the offline copy, about 30 s).")
    for name, error in list(engine.load_errors.items()):
        if name not in engine.models and engine.policy.offers(name):
            lines.append(f"⚠ Model **{markdown_text(name)}** could not be loaded: {markdown_text(error, 300)}")
    for name, slot in list(engine.models.items()):
        lm = slot.lm
        lines.append(f"✓ Model **{markdown_text(name)}** on {lm.device.type} ({str(lm.dtype).split('.')[-1]}); "
                     f"{_store_line(slot.static)}" +
                     (f"; {line}" if (line := _answers_line(slot.answers)) else "") +
                     (f"; {line}." if (line := _dense_line(slot.dense)) else "."))
    if engine.trace_notice:
        lines.append(engine.trace_notice)
    return "\n\n".join(lines) or "Starting: the model loads on first use."
