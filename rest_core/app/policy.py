"""Public mode: what a visitor of an open server may ask for, and how much.

A server is public on a Hugging Face Space (SPACE_ID is set), when it is bound to an
address other than loopback (GRADIO_SERVER_NAME), or when REST_LAB_PUBLIC=1 says so
(REST_LAB_PUBLIC=0 keeps it private).  A public server loads only the models its operator
named (the default, REST_LAB_MODEL and REST_LAB_MODELS), never a folder or hub id a visitor
typed; it caps prompts, new tokens, uploads, queued decodes and recorded runs.  A private
server (127.0.0.1, one trusted user) keeps only the limits of the page's own controls.

Every limit is read once, from the environment, into one `Policy` the handlers consult.
"""
from __future__ import annotations

import html
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional

from rest_core.app.settings import (
    ANSWERS_ALWAYS,
    ANSWERS_CHAT,
    ANSWERS_NEVER,
    BUILT_IN,
    MAX_UPLOAD_BYTES,
    NO_STATIC,
    UPLOADED,
    Settings,
    log,
)
from rest_core.model import DEFAULT_MODEL, ModelLoadError

LOOPBACK = ("", "127.0.0.1", "localhost", "::1")
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# (low, high) of each numeric control, as the page's sliders have them
RANGES: dict[str, tuple[float, float]] = {
    "max_new_tokens": (1, 512), "temperature": (0.05, 2.0), "top_p": (0.05, 1.0), "budget": (0, 64),
    "n_max": (1, 32), "n_min": (1, 8), "continuation_len": (1, 32)}
CHOICES: dict[str, tuple[str, ...]] = {
    "mode": ("chat", "completion"), "static": (BUILT_IN, UPLOADED, NO_STATIC),
    "answers": (ANSWERS_CHAT, ANSWERS_ALWAYS, ANSWERS_NEVER), "decoding": ("greedy", "sampling"),
    "budget_mode": ("auto", "fixed")}
FLAGS = ("request_store", "history_store", "model_drafts")
WHOLE = ("max_new_tokens", "budget", "n_max", "n_min", "continuation_len")


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = int(float(raw))
    except ValueError:
        log.warning("%s=%r is not a number; using %d", name, raw, default)
        return default
    return max(0, value)


def public_reason(env: Mapping[str, str]) -> str:
    """Why this server is public ("" when it is private)."""
    flag = (env.get("REST_LAB_PUBLIC") or "").strip().lower()
    if flag in OFF:
        return ""
    if flag in ON:
        return "REST_LAB_PUBLIC is set"
    if env.get("SPACE_ID"):
        return "it runs on a Hugging Face Space"
    host = (env.get("GRADIO_SERVER_NAME") or "").strip().lower()
    if host not in LOOPBACK and not host.startswith("127."):
        return f"it listens on {host}"
    return ""


@dataclass(frozen=True)
class Policy:
    """What visitors may ask for: models, sizes, counts.  `public` switches the limits on."""

    public: bool = False
    reason: str = ""  # why it is public, for the log and the page
    models: tuple[str, ...] = (DEFAULT_MODEL,)  # the models a public server offers
    max_prompt_chars: int = 4000  # a prompt or explorer context
    max_new_tokens: int = 256
    max_upload_bytes: int = MAX_UPLOAD_BYTES  # one visitor's files together
    max_upload_total_bytes: int = 500 * 2**20  # every visitor's files and the page's upload cache together
    session_idle_s: float = 3600.0  # a visitor's folder is removed after this long untouched
    max_waiting: int = 12  # decodes waiting for their turn (a visitor has one at a time)
    max_runs_per_visitor: int = 30  # recorded runs kept per visitor (oldest pruned)
    max_runs: int = 2000  # recorded runs kept in all
    max_trace_bytes: int = 1024 * 2**20  # the trace store's size
    queue_size: int = 256  # requests of every kind waiting in the page's queue

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> Policy:
        """The policy the environment sets (see the README's "Public mode" for every variable)."""
        env = os.environ if env is None else env
        reason = public_reason(env)
        named = [env.get("REST_LAB_MODEL") or "", *(env.get("REST_LAB_MODELS") or "").split(",")]
        models = tuple(dict.fromkeys([DEFAULT_MODEL, *(m.strip() for m in named if m.strip())]))
        mb = 2**20
        base = cls()
        return cls(public=bool(reason), reason=reason, models=models,
                   max_prompt_chars=_env_int(env, "REST_LAB_MAX_PROMPT_CHARS", base.max_prompt_chars),
                   max_new_tokens=_env_int(env, "REST_LAB_MAX_NEW_TOKENS", base.max_new_tokens),
                   max_upload_bytes=MAX_UPLOAD_BYTES,
                   max_upload_total_bytes=_env_int(env, "REST_LAB_MAX_UPLOAD_TOTAL_MB", 500) * mb,
                   session_idle_s=60.0 * _env_int(env, "REST_LAB_SESSION_IDLE_MIN", 60),
                   max_waiting=max(1, _env_int(env, "REST_LAB_MAX_WAITING", base.max_waiting)),
                   max_runs_per_visitor=max(1, _env_int(env, "REST_LAB_MAX_RUNS_PER_VISITOR",
                                                        base.max_runs_per_visitor)),
                   max_runs=max(1, _env_int(env, "REST_LAB_MAX_RUNS", base.max_runs)),
                   max_trace_bytes=max(1, _env_int(env, "REST_LAB_MAX_TRACE_MB", 1024)) * mb,
                   queue_size=max(16, _env_int(env, "REST_LAB_QUEUE_SIZE", base.queue_size)))

    def with_public(self, public: bool = True) -> Policy:
        """The same limits, public or private (tests; build_demo's `public`)."""
        return replace(self, public=public, reason=self.reason or ("asked for" if public else ""))

    # -- what a visitor asks for
    def offers(self, name: str) -> bool:
        """May this (canonical) model be loaded for a visitor?"""
        return not self.public or name in self.models

    def check_model(self, name: str) -> None:
        """Refuse, on a public server, a model its operator did not name (never echoing what was typed)."""
        if not self.offers(name):
            raise ModelLoadError(f"This public server offers these models only: {', '.join(self.models)}. "
                                 "Choose one of them (run REST Lab on your own machine to try any other).")

    def check_text(self, text: Any, what: str = "The prompt") -> str:
        """A prompt or context as text, refused when it is not text or (public) too long."""
        if text is None:
            return ""
        if not isinstance(text, str):
            raise ValueError(f"{what} must be text, not {type(text).__name__}.")
        if self.public and len(text) > self.max_prompt_chars:
            raise ValueError(f"{what} has {len(text):,} characters; this public server accepts at most "
                             f"{self.max_prompt_chars:,}. Shorten it.")
        return text

    def check_settings(self, settings: Settings) -> Settings:
        """The settings with every value of the right type and within the page's ranges (ValueError naming
        the setting otherwise); on a public server max_new_tokens is capped too."""
        values = dict(vars(settings))
        for name, options in CHOICES.items():
            if values[name] not in options:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}.")
        for name in FLAGS:
            if not isinstance(values[name], (bool, int)) or values[name] not in (0, 1):
                raise ValueError(f"{name} must be true or false.")
            values[name] = bool(values[name])
        for name, (low, high) in RANGES.items():
            values[name] = _number(name, values[name], low, high, whole=name in WHOLE)
        if values["seed"] not in (None, ""):
            values["seed"] = _number("seed", values["seed"], 0, 2**63 - 1, whole=True)
        if not isinstance(values["model"], (str, type(None))) or len(values["model"] or "") > 300:
            raise ValueError("model must be a model name of at most 300 characters.")
        if self.public and values["max_new_tokens"] > self.max_new_tokens:
            raise ValueError(f"max_new_tokens is {values['max_new_tokens']}; this public server decodes at most "
                             f"{self.max_new_tokens} new tokens per answer.")
        return Settings(**values)


def _number(name: str, value: Any, low: float, high: float, whole: bool) -> Any:
    """A number of a setting, checked: its type, whether it is whole, its range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number between {low:g} and {high:g}, not {str(value)[:40]!r}.")
    if whole and float(value) != int(value):
        raise ValueError(f"{name} must be a whole number, not {value}.")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low:g} and {high:g}, not {value:g}.")
    return int(value) if whole else float(value)


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def markdown_text(text: str, limit: int = 120) -> str:
    """Text shown inside Markdown as it is (no markup, no HTML), cut to `limit` characters."""
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return _MD_SPECIAL.sub(r"\\\1", html.escape(text, quote=False))
