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
    MAX_UPLOAD_FILES,
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


# Policy field -> (environment variable, the unit it is given in, its smallest value); README: Public mode
LIMITS: dict[str, tuple[str, int, int]] = {
    "max_prompt_chars": ("REST_LAB_MAX_PROMPT_CHARS", 1, 0),
    "max_new_tokens": ("REST_LAB_MAX_NEW_TOKENS", 1, 0),
    "max_chat_tokens": ("REST_LAB_MAX_CHAT_TOKENS", 1, 64),
    "max_upload_bytes": ("REST_LAB_MAX_UPLOAD_MB", 2**20, 1),
    "max_upload_files": ("REST_LAB_MAX_UPLOAD_FILES", 1, 1),
    "max_upload_address_bytes": ("REST_LAB_MAX_UPLOAD_ADDRESS_MB", 2**20, 1),
    "max_upload_address_files": ("REST_LAB_MAX_UPLOAD_ADDRESS_FILES", 1, 1),
    "max_upload_total_bytes": ("REST_LAB_MAX_UPLOAD_TOTAL_MB", 2**20, 0),
    "max_upload_total_files": ("REST_LAB_MAX_UPLOAD_TOTAL_FILES", 1, 1),
    "max_upload_tokens": ("REST_LAB_MAX_UPLOAD_TOKENS", 1, 1000),
    "session_idle_s": ("REST_LAB_SESSION_IDLE_MIN", 60, 1),
    "max_sessions": ("REST_LAB_MAX_SESSIONS", 1, 16),
    "max_sessions_per_address": ("REST_LAB_MAX_SESSIONS_PER_ADDRESS", 1, 1),
    "max_session_tables": ("REST_LAB_MAX_SESSION_TABLES", 1, 1),
    "max_waiting": ("REST_LAB_MAX_WAITING", 1, 1),
    "max_waiting_per_address": ("REST_LAB_MAX_WAITING_PER_ADDRESS", 1, 1),
    "max_runs_per_visitor": ("REST_LAB_MAX_RUNS_PER_VISITOR", 1, 1),
    "max_runs_per_address": ("REST_LAB_MAX_RUNS_PER_ADDRESS", 1, 1),
    "max_runs": ("REST_LAB_MAX_RUNS", 1, 1),
    "max_trace_bytes": ("REST_LAB_MAX_TRACE_MB", 2**20, 1),
    "queue_size": ("REST_LAB_QUEUE_SIZE", 1, 16),
}


@dataclass(frozen=True)
class Policy:
    """What visitors may ask for: models, sizes, counts.  `public` switches the limits on.

    A visitor is a session of the page; the limits marked "per address" hold for every session of one
    client address together (rest_core.app.visitors: the address a trusted proxy forwards, else the
    connection's), so a client cannot become many visitors by choosing session ids."""

    public: bool = False
    reason: str = ""  # why it is public, for the log and the page
    models: tuple[str, ...] = (DEFAULT_MODEL,)  # the models a public server offers
    trusted_proxies: int = 0  # proxies in front of the server whose X-Forwarded-For entries are believed
    max_prompt_chars: int = 4000  # a prompt or explorer context
    max_new_tokens: int = 256
    max_chat_tokens: int = 2048  # a chat prompt with its earlier turns (the oldest turns are dropped past it)
    max_upload_bytes: int = MAX_UPLOAD_BYTES  # one visitor's files together (one upload request at most this)
    max_upload_files: int = MAX_UPLOAD_FILES  # files of one visitor's store (and of one upload request)
    max_upload_address_bytes: int = 40 * 2**20  # uploaded by one address within session_idle_s
    max_upload_address_files: int = 400  # files uploaded by one address within session_idle_s
    max_upload_total_bytes: int = 500 * 2**20  # every visitor's files and the page's upload cache together
    max_upload_total_files: int = 10_000  # files in those folders together
    max_upload_tokens: int = 2_000_000  # tokens of one visitor's uploaded store
    session_idle_s: float = 3600.0  # a visitor's state and folder are removed after this long untouched
    max_sessions: int = 500  # sessions whose state the server keeps (the least recently used goes first)
    max_sessions_per_address: int = 32  # per address (that address's least recently used goes first)
    max_session_tables: int = 16  # visitors' own tables of the model's predictions (the rest share one)
    max_waiting: int = 12  # decodes waiting for their turn (a visitor has one at a time)
    max_waiting_per_address: int = 2  # decodes running or waiting per address
    max_runs_per_visitor: int = 30  # recorded runs kept per visitor (oldest pruned)
    max_runs_per_address: int = 100  # recorded runs kept per address (oldest pruned)
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
        base = cls()
        limits = {name: max(low, _env_int(env, var, int(getattr(base, name)) // unit)) * unit
                  for name, (var, unit, low) in LIMITS.items()}
        # on a Space one proxy stands in front of the server and appends the address it was reached from
        hops = _env_int(env, "REST_LAB_TRUSTED_PROXIES", 1 if env.get("SPACE_ID") else 0)
        return cls(public=bool(reason), reason=reason, models=models, trusted_proxies=hops, **limits)

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


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~#@!])")
_AUTOLINK = re.compile(r"(?i)(www)\.|:(?=//)")  # what starts a link without any markup: www. and scheme://


def markdown_escape(text: str) -> str:
    """HTML (escaped already, or none) read by Markdown as it is: the characters that start emphasis, a link, an
    image or a heading escaped, bare web addresses kept from turning into links."""
    text = _MD_SPECIAL.sub(r"\\\1", text)
    return _AUTOLINK.sub(lambda m: f"{m.group(1)}\\." if m.group(1) else "\\:", text)


def markdown_safe(text: str) -> str:
    """Text shown inside Markdown as it is, on one line: no emphasis, link, image, heading or HTML (line breaks
    made spaces so that nothing starts a block)."""
    return markdown_escape(html.escape(" ".join(str(text).splitlines()), quote=False))


def markdown_text(text: str, limit: int = 120) -> str:
    """Text shown inside Markdown as it is (`markdown_safe`), on one line, cut to `limit` characters."""
    text = " ".join(str(text).split())
    return markdown_safe(text if len(text) <= limit else text[: limit - 1] + "…")
