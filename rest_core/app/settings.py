"""The page's settings, its limits and how an error reads on the page."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from datastores import DatastoreError
from rest_core.decode import DecodeConfig, PromptError
from rest_core.model import DEFAULT_MODEL, ModelLoadError
from rest_core.retrieve import MAX_MATCHES, RetrieveSettings
from rest_core.sampling import Sampling

log = logging.getLogger("rest_lab")

MAX_UPLOAD_BYTES = int(os.environ.get("REST_LAB_MAX_UPLOAD_MB", 20)) * 2**20  # per visitor, all files together
MAX_UPLOAD_FILES = 200
MAX_MODELS = int(os.environ.get("REST_LAB_MAX_MODELS", 2))  # models kept in memory at once
# While a decode runs, the live view competes with it for the cores: drawing the figures (here, then in the
# browser, on the same machine when the page is local) slowed a local chat's tree passes up to 3x.  So the
# figures are redrawn at most every FIGURE_INTERVAL_S and the text every TEXT_INTERVAL_S, each spaced further
# so that what it costs the decode, as measured (app/pacing.py), stays within FIGURE_SHARE and TEXT_SHARE of the
# time (together 5%); the steps timed while a redraw is built, sent and drawn (DRAW_SETTLE_S after figures are
# sent, TEXT_SETTLE_S after text) teach the cost curve nothing; the full figures come when the answer is done.
FIGURE_INTERVAL_S = 2.0
FIGURE_SHARE = 0.03
DRAW_SETTLE_S = 1.0
TEXT_SHARE = 0.02
TEXT_SETTLE_S = 0.15
STORE_WAIT_S = 3.0  # how long a decode waits for the built-in store before going on without it
STORE_RETRY_S = 60.0  # a failed built-in store build is tried again this long after it failed
TEXT_INTERVAL_S = 0.25  # the streamed answer: at most 4 updates per second (each re-renders the answer)
BUILT_IN, UPLOADED, NO_STATIC = "built-in (Python sources)", "my uploaded files", "none"
# when the general-text store (the model's own answers to varied requests) drafts
ANSWERS_CHAT, ANSWERS_ALWAYS, ANSWERS_NEVER = "with chat prompts", "always", "never"
USER_ERRORS = (ModelLoadError, PromptError, DatastoreError, ValueError, FileNotFoundError)


class UploadError(ValueError):
    """The uploaded files cannot be used; the message says why."""


class Cancelled(Exception):
    """The visitor stopped the decode (or left the page)."""


def assets_dir() -> Path:
    """The page's stylesheet, texts, script and example run: assets/ of a checkout, or the copy an installed
    package carries (rest_core/app/assets)."""
    checkout = Path(__file__).resolve().parents[2] / "assets"
    return checkout if (checkout / "app.css").is_file() else Path(__file__).resolve().parent / "assets"


def message_of(err: BaseException) -> str:
    """One clear line for the page: the message of a known error, the type of any other (paths under
    the server's home folder shown from ~)."""
    if isinstance(err, USER_ERRORS):
        return _from_home(str(err))
    log.exception("unexpected error", exc_info=err)
    return _from_home(f"Something went wrong ({type(err).__name__}: {str(err)[:300]}). The server log has the "
                      "details.")


def _from_home(text: str) -> str:
    home = str(Path.home())
    return text.replace(home + os.sep, "~" + os.sep) if len(home) > 1 else text


@dataclass
class Settings:
    """Every control of the page, by name (the page's controls carry the same names)."""

    model: str = DEFAULT_MODEL
    mode: str = "chat"  # chat | completion
    static: str = BUILT_IN
    answers: str = ANSWERS_CHAT
    request_store: bool = True
    history_store: bool = True  # the visitor's own earlier answers (never another visitor's)
    model_drafts: bool = True  # the model's own predictions (recycled tokens), learned per visitor
    max_new_tokens: int = 96
    decoding: str = "greedy"  # greedy | sampling
    temperature: float = 0.7
    top_p: float = 0.95
    seed: Optional[float] = 0
    budget_mode: str = "auto"  # auto | fixed
    budget: int = 16
    n_max: int = 16
    n_min: int = 2
    continuation_len: int = 24

    @property
    def use_answers(self) -> bool:
        """The prompt format decides: the general-text store drafts chat answers (or always, or never)."""
        return self.answers == ANSWERS_ALWAYS or (self.answers == ANSWERS_CHAT and self.mode == "chat")

    @property
    def greedy(self) -> bool:
        return self.decoding != "sampling"

    def retrieve_settings(self) -> RetrieveSettings:
        return RetrieveSettings(int(self.n_max), int(self.n_min), MAX_MATCHES, int(self.continuation_len))

    def decode_config(self) -> DecodeConfig:
        """The decoder's configuration (ValueError with a clear message when a value has no meaning)."""
        sampling = Sampling() if self.greedy else Sampling(
            temperature=float(self.temperature), top_p=float(self.top_p),
            seed=None if self.seed is None or self.seed == "" else int(self.seed))
        cfg = DecodeConfig(max_new_tokens=int(self.max_new_tokens), sampling=sampling,
                           retrieve=self.retrieve_settings(),
                           draft_budget=None if self.budget_mode == "auto" else int(self.budget))
        cfg.validate()
        return cfg

    def record(self, owner: str, address: str = "") -> dict:
        """What a recorded run keeps about how it was made (owner: the session that made it; address: a tag of
        its client address, rest_core.app.visitors.address_tag, left out when empty)."""
        return {**self.decode_config().settings(), "chat": self.mode == "chat", "static": self.static,
                "answers": self.use_answers, "request_store": self.request_store, "history_store": self.history_store,
                "model_drafts": self.model_drafts, "app_session": owner,
                **({"app_address": address} if address else {})}


SETTING_NAMES = tuple(f.name for f in fields(Settings))


def settings_from(values: dict) -> Settings:
    """Settings from the page's controls, keyed by setting name."""
    return Settings(**{name: values[name] for name in SETTING_NAMES})
