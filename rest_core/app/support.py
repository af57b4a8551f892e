"""What the REST Lab page needs besides its widgets.

* `Engine` -- the models and the built-in datastore, shared by every visitor:
  loaded in the background or on first use, with a status line; one decode at
  a time per model (a lock per model, on top of the page's queue).
* `Session` -- one visitor's own things: a private folder for uploaded files
  and the store built from them, the chat so far, a history store of their own
  answers, and the runs they recorded.
* `chat_turn`, `race` -- a decode as a stream of `View`s for the page: the
  decoder runs in a worker thread and records every step; the page is redrawn
  from the recorded rows (so what is shown is what is stored), throttled.
* `step_view`, `explain_step` -- a recorded step taken apart, in plain words.
* `explore` -- the datastore explorer: longest matching suffix and the tree
  it would draft, without the model.
"""
from __future__ import annotations

import html
import logging
import os
import queue
import re
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import plotly.graph_objects as go

from datastores import DatastoreError, HistoryStore, RequestStore, TokenDatastore, build_datastore, iter_documents
from rest_core.traces import figures
from rest_core.cost import CostModel
from rest_core.decode import DecodeConfig, DecodeResult, PromptError, RestDecoder, plain_generate
from rest_core.model import DEFAULT_MODEL, LoadedModel, ModelLoadError, cache_root, encode_prompt, load_model
from rest_core.traces.recorder import TokenTexts, TraceRecorder
from rest_core.retrieve import RetrieveSettings, query_suffix, retrieve
from rest_core.sampling import Sampling
from rest_core.trace import SOURCES, StepTrace
from rest_core.tree import build_draft_tree

log = logging.getLogger("rest_lab")

MAX_UPLOAD_BYTES = int(os.environ.get("REST_LAB_MAX_UPLOAD_MB", 20)) * 2**20  # per visitor, all files together
MAX_UPLOAD_FILES = 200
MAX_MODELS = int(os.environ.get("REST_LAB_MAX_MODELS", 2))  # models kept in memory at once
FIGURE_INTERVAL_S = 0.25  # at most 4 figure redraws per second while decoding...
FIGURE_SHARE = 0.15  # ...and drawing takes at most this share of the time (it competes with the decode)
STORE_WAIT_S = 3.0  # how long a decode waits for the built-in store before going on without it
TEXT_INTERVAL_S = 0.08  # the streamed answer: at most about 12 updates per second
BUILT_IN, UPLOADED, NO_STATIC = "built-in (Python sources)", "my uploaded files", "none"
USER_ERRORS = (ModelLoadError, PromptError, DatastoreError, ValueError, FileNotFoundError)


class UploadError(ValueError):
    """The uploaded files cannot be used; the message says why."""


class Cancelled(Exception):
    """The visitor stopped the decode (or left the page)."""


def message_of(err: BaseException) -> str:
    """One clear line for the page: the message of a known error, the type of any other."""
    if isinstance(err, USER_ERRORS):
        return str(err)
    log.exception("unexpected error", exc_info=err)
    return f"Something went wrong ({type(err).__name__}: {str(err)[:300]}). The server log has the details."


# ---------------------------------------------------------------- settings

@dataclass
class Settings:
    """Every control of the page, in the order the page passes them."""

    model: str = DEFAULT_MODEL
    mode: str = "chat"  # chat | completion
    static: str = BUILT_IN
    request_store: bool = True
    history_store: bool = False
    max_new_tokens: int = 96
    decoding: str = "greedy"  # greedy | sampling
    temperature: float = 0.7
    top_p: float = 0.95
    seed: Optional[float] = 0
    budget_mode: str = "auto"  # auto | fixed
    budget: int = 16
    n_max: int = 16
    n_min: int = 2
    continuation_len: int = 10

    @property
    def greedy(self) -> bool:
        return self.decoding != "sampling"

    def decode_config(self) -> DecodeConfig:
        sampling = Sampling() if self.greedy else Sampling(
            temperature=float(self.temperature), top_p=float(self.top_p),
            seed=None if self.seed is None or self.seed == "" else int(self.seed))
        cfg = DecodeConfig(max_new_tokens=int(self.max_new_tokens), sampling=sampling,
                           retrieve=RetrieveSettings(int(self.n_max), int(self.n_min), 5000,
                                                     int(self.continuation_len)),
                           draft_budget=None if self.budget_mode == "auto" else int(self.budget))
        cfg.validate()
        return cfg

    def record(self, owner: str) -> dict:
        """What a recorded run keeps about how it was made (owner: the session that made it)."""
        cfg = self.decode_config()
        return {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.sampling.temperature,
                "top_p": cfg.sampling.top_p, "seed": cfg.sampling.seed, "n_max": cfg.retrieve.n_max,
                "n_min": cfg.retrieve.n_min, "max_matches": cfg.retrieve.max_matches,
                "continuation_len": cfg.retrieve.continuation_len, "draft_budget": cfg.draft_budget or "auto",
                "chat": self.mode == "chat", "static": self.static, "request_store": self.request_store,
                "history_store": self.history_store, "app_session": owner}


# ---------------------------------------------------------------- the shared engine

@dataclass
class StoreSlot:
    """The built-in store for one tokenizer: built once, in the background."""

    state: str = "idle"  # idle | building | ready | failed | off
    store: Any = None
    error: str = ""
    started: float = 0.0
    path: Optional[Path] = None  # where it is being built (for progress), when known
    finished: threading.Event = field(default_factory=threading.Event)


@dataclass
class ModelSlot:
    lm: LoadedModel
    cost_factory: Callable[[LoadedModel], Any]
    lock: threading.Lock = field(default_factory=threading.Lock)  # one decode at a time on this model
    static: StoreSlot = field(default_factory=StoreSlot)
    cost: Any = None  # the budget chooser (a CostModel, learns from every step), made on first need
    _cost_lock: threading.Lock = field(default_factory=threading.Lock)

    def chooser(self):
        """The automatic budget's cost model (measured once per machine, then read from the cache)."""
        with self._cost_lock:
            if self.cost is None:
                self.cost = self.cost_factory(self.lm)
            return self.cost

    def plain_ms(self) -> Optional[float]:
        """A one-token forward pass as calibrated, when the cost model exists already."""
        return self.cost.forward_ms(1) if hasattr(self.cost, "forward_ms") else None


def default_store_factory(tokenizer):
    from datastores.builtin import open_default_store

    return open_default_store(tokenizer, progress=True)


def _store_build_dir(tokenizer) -> Optional[Path]:
    try:
        from datastores.builtin import default_store_path

        return default_store_path(tokenizer)
    except Exception:  # noqa: BLE001 - only used to show progress
        return None


class Engine:
    """Models and the built-in store, shared by all sessions of one server."""

    def __init__(self, lm_factory: Callable[[str], LoadedModel] | None = None,
                 store_factory: Callable[[Any], Any] | None = None,
                 cost_factory: Callable[[LoadedModel], Any] | None = None,
                 recorder: TraceRecorder | None = None):
        self.lm_factory = lm_factory or (lambda name: load_model(name))
        self.store_factory = store_factory or default_store_factory
        self.watch_store_build = store_factory is None
        self.cost_factory = cost_factory or CostModel.for_model
        self.recorder = recorder or TraceRecorder()
        self.models: dict[str, ModelSlot] = {}
        self.loading: dict[str, float] = {}  # model name -> when its load began
        self.load_errors: dict[str, str] = {}
        self._tokenizers: dict[str, Any] = {}
        self._preloading = False
        self._load_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self.workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rest-decode")

    @staticmethod
    def canonical(name: Optional[str]) -> str:
        name = (name or "").strip()
        return DEFAULT_MODEL if name.lower() in ("", "default", DEFAULT_MODEL.lower()) else name

    def model(self, name: Optional[str]) -> ModelSlot:
        """The loaded model (loading it now if needed; raises ModelLoadError with a clear message)."""
        name = self.canonical(name)
        slot = self.models.get(name)
        if slot is not None:
            return slot
        with self._load_lock:  # one load at a time: two visitors asking for the same model share it
            slot = self.models.get(name)
            if slot is not None:
                return slot
            self.loading[name] = time.time()
            try:
                lm = self.lm_factory(name)
            except Exception as err:
                self.load_errors[name] = message_of(err)
                raise
            finally:
                self.loading.pop(name, None)
            self.load_errors.pop(name, None)
            slot = ModelSlot(lm=lm, cost_factory=self.cost_factory)
            while len(self.models) >= MAX_MODELS:  # forget the oldest; a decode holding it keeps it alive
                self.models.pop(next(iter(self.models)))
            self.models[name] = slot
            return slot

    def start_static(self, slot: ModelSlot) -> StoreSlot:
        """Open (or build, the first time on this machine) the built-in store in the background."""
        st = slot.static
        with self._state_lock:
            if st.state != "idle":
                return st
            st.state, st.started = "building", time.time()
            st.path = _store_build_dir(slot.lm.tokenizer) if self.watch_store_build else None

        def build():
            try:
                st.store = self.store_factory(slot.lm.tokenizer)
                st.state = "ready" if st.store is not None else "off"
            except Exception as err:  # noqa: BLE001 - shown on the page
                st.error, st.state = message_of(err), "failed"
            finally:
                st.finished.set()

        threading.Thread(target=build, name="rest-store-build", daemon=True).start()
        return st

    def preload(self) -> Optional[threading.Thread]:
        """Load the default model, then open or build the built-in store, in the background (once)."""
        with self._state_lock:
            if self._preloading:
                return None
            self._preloading = True

        def run():
            try:
                self.start_static(self.model(DEFAULT_MODEL))
            except Exception as err:  # noqa: BLE001 - the status line shows it
                log.warning("preloading the default model failed: %s", message_of(err))

        thread = threading.Thread(target=run, name="rest-preload", daemon=True)
        thread.start()
        return thread

    def store_progress(self, st: StoreSlot) -> str:
        elapsed = time.time() - st.started
        done = ""
        if st.path is not None:
            sizes = [p.stat().st_size for p in st.path.parent.glob(f".{st.path.name}.building-*/tokens.u32")
                     if p.exists()]
            if sizes:
                done = f", {max(sizes) // 4 / 1e6:.1f}M tokens so far"
        return f"{elapsed:.0f} s{done}"

    def status(self) -> str:
        """One line per model: loading / loaded, and the state of its built-in store."""
        lines = []
        for name, since in list(self.loading.items()):
            lines.append(f"Loading model **{name}** ({time.time() - since:.0f} s so far; the very first load "
                         "on a machine converts the offline copy, about 30 s).")
        for name, error in list(self.load_errors.items()):
            if name not in self.models:
                lines.append(f"⚠ Model **{name}** could not be loaded: {error}")
        for name, slot in list(self.models.items()):
            st = slot.static
            store = {
                "idle": "built-in datastore not opened yet",
                "building": "building the built-in datastore from Python sources (first time on this machine "
                            f"only; it takes a few minutes: {self.store_progress(st)}). Until it is ready, "
                            "answers draft from the request and history stores only",
                "ready": f"built-in datastore ready ({getattr(st.store, 'n_tokens', 0):,} tokens)",
                "failed": f"⚠ built-in datastore unavailable: {st.error}",
                "off": "no built-in datastore",
            }[st.state]
            lm = slot.lm
            lines.append(f"✓ Model **{name}** on {lm.device.type} ({str(lm.dtype).split('.')[-1]}); {store}.")
        return "\n\n".join(lines) or "Starting: the model loads on first use."

    def tokenizer_for(self, name: Optional[str]):
        """A tokenizer for replaying a run: the loaded model's, else loaded alone (no weights), else None."""
        name = self.canonical(name)
        if name in self.models:
            return self.models[name].lm.tokenizer
        if name not in self._tokenizers:
            try:
                from rest_core.model import load_tokenizer

                self._tokenizers[name] = load_tokenizer(name)
            except Exception:  # noqa: BLE001 - replay works without one (token ids shown instead)
                self._tokenizers[name] = None
        return self._tokenizers[name]

    def ready(self) -> bool:
        """Nothing is loading or building (the page stops polling the status)."""
        return not self.loading and bool(self.models or self.load_errors) and \
            all(s.static.state != "building" for s in self.models.values())


# ---------------------------------------------------------------- one visitor

def sessions_root() -> Path:
    return cache_root() / "app-sessions"


@dataclass
class Session:
    """One visitor's own state: their folder, chat, history store and runs."""

    id: str
    chat: list[dict] = field(default_factory=list)  # what the chatbot shows
    history: list[dict] = field(default_factory=list)  # the same turns as plain text (for the chat template)
    answers: dict[str, list[list[int]]] = field(default_factory=dict)  # model -> this visitor's past answers
    upload_files: list[str] = field(default_factory=list)
    upload_model: Optional[str] = None  # the model whose tokenizer built the upload store
    run_ids: list[int] = field(default_factory=list)

    @staticmethod
    def ensure(state: Optional["Session"], request: Any = None) -> "Session":
        if isinstance(state, Session):
            return state
        sid = getattr(request, "session_hash", None) or uuid.uuid4().hex
        return Session(id=re.sub(r"[^A-Za-z0-9_-]", "", sid)[:64] or uuid.uuid4().hex)

    @property
    def folder(self) -> Path:
        return sessions_root() / self.id

    @property
    def files_dir(self) -> Path:
        return self.folder / "files"

    @property
    def store_dir(self) -> Path:
        return self.folder / "store"

    def discard(self) -> None:
        """Remove the visitor's folder (their uploads and the store built from them)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def history_store(self, model: str, cfg: DecodeConfig) -> HistoryStore:
        store = HistoryStore(n_max=cfg.retrieve.n_max, n_min=cfg.retrieve.n_min, max_tokens=200_000)
        for answer in self.answers.get(model, []):
            store.add(answer)
        return store

    def clear_chat(self) -> None:
        self.chat, self.history = [], []


def discard_session(state: Any) -> None:
    """gr.State delete callback: a visitor's folder goes when their session ends."""
    if isinstance(state, Session):
        state.discard()


def prune_sessions(max_age_s: float = 24 * 3600) -> None:
    """Remove session folders left by a previous server (older than a day)."""
    root = sessions_root()
    if not root.is_dir():
        return
    now = time.time()
    for d in root.iterdir():
        try:
            if now - d.stat().st_mtime > max_age_s:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


# ---------------------------------------------------------------- uploads

def _safe_name(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]", "_", Path(name).name).lstrip(".")[:100] or "file"
    candidate, k = base, 1
    while candidate in taken:
        candidate, k = f"{k}-{base}", k + 1
    taken.add(candidate)
    return candidate


def save_uploads(session: Session, paths: list[str], upload_root: Optional[Path] = None) -> list[tuple[str, str]]:
    """Check the uploaded files (text, 20 MB in all) and copy them into the visitor's own folder.

    `upload_root`: where the server keeps uploads; a path outside it is refused.
    Returns (name, text) per file. Nothing outside the visitor's folder is read again.
    """
    paths = [p for p in (paths or []) if p]
    if not paths:
        raise UploadError("No files uploaded: add one or more text or code files first.")
    if upload_root is not None:
        root = Path(upload_root).resolve()
        for p in paths:
            if not Path(p).resolve().is_relative_to(root):
                raise UploadError(f"Refused {Path(p).name!r}: not an uploaded file.")
    if len(paths) > MAX_UPLOAD_FILES:
        raise UploadError(f"{len(paths)} files uploaded; at most {MAX_UPLOAD_FILES} are accepted.")
    sizes = []
    for p in paths:
        try:
            sizes.append(Path(p).stat().st_size)
        except OSError:
            raise UploadError(f"The upload {Path(p).name!r} could not be read; upload it again.") from None
    total = sum(sizes)
    if total > MAX_UPLOAD_BYTES:
        raise UploadError(f"The uploads hold {total / 2**20:.1f} MB; at most {MAX_UPLOAD_BYTES / 2**20:.0f} MB "
                          "in all are accepted. Upload fewer or smaller files.")
    docs, skipped = [], []
    for p in paths:
        data = Path(p).read_bytes()
        try:
            if b"\x00" in data[:8192]:
                raise UnicodeDecodeError("utf-8", b"", 0, 1, "binary")
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(Path(p).name)
            continue
        if text.strip():
            docs.append((Path(p).name, text))
        else:
            skipped.append(Path(p).name)
    if not docs:
        raise UploadError("None of the uploads is usable text (UTF-8, not empty, not binary): "
                          f"{', '.join(skipped[:5])}. Upload text or code files (.txt, .md, .py, ...).")
    shutil.rmtree(session.folder, ignore_errors=True)
    session.files_dir.mkdir(parents=True, exist_ok=True)
    taken: set[str] = set()
    saved = []
    for name, text in docs:
        target = (session.files_dir / _safe_name(name, taken)).resolve()
        if not target.is_relative_to(session.files_dir.resolve()):  # a name can never leave the folder
            raise UploadError(f"Refused the file name {name!r}.")
        target.write_text(text, encoding="utf-8")
        saved.append((target.name, text))
    session.upload_files = [n for n, _ in saved]
    session.upload_model = None
    if skipped:
        log.info("session %s: skipped uploads %s", session.id, skipped)
    return saved


def build_upload_store(session: Session, docs: list[tuple[str, str]], slot: ModelSlot,
                       progress: bool = True) -> TokenDatastore:
    """The visitor's own static store, built from their files with the model's tokenizer."""
    store = build_datastore(session.store_dir, slot.lm.tokenizer, iter_documents(docs, kind="uploads"),
                            progress=progress, overwrite=True)
    session.upload_model = slot.lm.name
    return store


def upload_summary(session: Session, store: TokenDatastore) -> str:
    names = ", ".join(session.upload_files[:8]) + (" …" if len(session.upload_files) > 8 else "")
    return (f"✓ Your datastore: {store.n_tokens:,} tokens from {len(session.upload_files)} file(s) ({names}), "
            f"built for {session.upload_model}. Choose “{UPLOADED}” as the datastore to draft from it.")


def open_upload_store(session: Session, slot: ModelSlot) -> TokenDatastore:
    if not session.upload_files or not (session.store_dir / "meta.json").is_file():
        raise DatastoreError("No uploaded datastore yet: upload text or code files and press “Build my datastore”.")
    if session.upload_model != slot.lm.name:
        raise DatastoreError(f"Your datastore was built for {session.upload_model}, not {slot.lm.name}: "
                             "press “Build my datastore” again for this model.")
    return TokenDatastore.open(session.store_dir, tokenizer=slot.lm.tokenizer)


# ---------------------------------------------------------------- decoding, streamed

@dataclass
class View:
    """What one redraw of the page changes (None: leave it as it is)."""

    chat: Optional[list] = None
    tree: Optional[go.Figure] = None
    mask: Optional[go.Figure] = None
    speed: Optional[go.Figure] = None
    metrics: Optional[str] = None
    notice: Optional[str] = None  # the error / notice box ("" clears it)
    warning: Optional[str] = None  # also shown as a toast
    plain: Optional[str] = None  # race: the plain decode's text
    rest: Optional[str] = None  # race: REST's coloured text
    run_id: Optional[int] = None  # set once a run is recorded
    done: bool = False


def stream_in_thread(engine: Engine, work: Callable[[Callable[[Any], None]], Any],
                     wait_s: float = 1.0) -> Iterator[list]:
    """Run work(emit) on a worker; yield lists of what it emitted (empty list: still running).

    The generator's return value is work's; its exception is re-raised here.  When
    the consumer stops (the visitor pressed Stop or left), the next emit raises
    Cancelled in the worker, which ends the decode after the current step.
    """
    inbox: queue.Queue = queue.Queue()
    stop = threading.Event()

    def emit(item):
        if stop.is_set():
            raise Cancelled()
        inbox.put(("item", item))

    def main():
        try:
            inbox.put(("done", work(emit)))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            inbox.put(("error", err))

    engine.workers.submit(main)
    try:
        while True:
            try:
                kind, value = inbox.get(timeout=wait_s)
            except queue.Empty:
                yield []
                continue
            batch = []
            while True:
                if kind == "done":
                    if batch:
                        yield batch
                    return value
                if kind == "error":
                    raise value
                batch.append(value)
                try:
                    kind, value = inbox.get_nowait()
                except queue.Empty:
                    break
            yield batch
    finally:
        stop.set()


def special_texts(tokenizer) -> frozenset:
    return frozenset(getattr(tokenizer, "all_special_tokens", None) or ())


def best_step(steps: list[dict]) -> int:
    """The step to show when a run is over: the one that accepted most drafts (latest on ties)."""
    return max(steps, key=lambda s: (s["accepted_len"], s["step"]))["step"]


def fit(fig: go.Figure, height: Optional[int] = None) -> go.Figure:
    """Let a stored-size figure follow its container's width."""
    fig.update_layout(width=None, autosize=True, **({"height": height} if height else {}))
    return fig


def compact(fig: go.Figure, height: int, bottom: int = 70) -> go.Figure:
    """A figure sized for the live side panel: smaller fonts and margins."""
    fig.update_layout(width=None, autosize=True, height=height, font=dict(size=12),
                      title=dict(font=dict(size=16)), margin=dict(l=40, r=20, t=56, b=bottom))
    fig.update_annotations(font_size=12)
    return fig


def panel(fig: go.Figure, height: int) -> go.Figure:
    """A stored-size figure for a half-width panel."""
    fig = compact(fig, height, bottom=120)
    fig.update_layout(font=dict(size=13), legend=dict(y=-0.22, font=dict(size=12)))
    return fig


def live_figures(rec: TraceRecorder, run_id: int, steps: list[dict], step_no: int,
                 run: Optional[dict] = None) -> tuple[go.Figure, go.Figure, go.Figure]:
    """Draft tree and tree mask of one stored step, and the run's speed so far, for the side panel."""
    step = rec.load_step(run_id, step_no)
    tree = compact(figures.draft_tree_figure(step), 520, bottom=110)
    tree.update_layout(legend=dict(y=-0.28, font=dict(size=11)))
    mask = compact(figures.mask_heatmap(step), 420, bottom=110)
    speed = compact(figures.speed_figure(steps, run), 360, bottom=110)
    speed.update_layout(legend=dict(y=-0.35, font=dict(size=11)))
    return tree, mask, speed


LEGEND_HTML = "".join(
    f'<span class="origin-key" style="background:{colour}">{html.escape(what)}</span>'
    for colour, what in figures.ORIGIN_STYLES.values()) + '<span class="origin-key">│ a new step starts</span>'


def one_line(text: str) -> str:
    """Text escaped for HTML on a single line: the chat renders Markdown, where a line break inside
    raw HTML would end the HTML block (and four spaces after it start a code block)."""
    return html.escape(text).replace("\r", "").replace("\n", "&#10;")


def origin_spans(steps: list[dict], hide: frozenset = frozenset()) -> str:
    """The answer so far, each token tinted by where it came from (hover: step and origin);
    `hide`: token texts left out (the end-of-sequence marker)."""
    out, previous = [], None
    for step, origin, text in figures.token_origins(steps):
        if text in hide:
            continue
        colour, what = figures.ORIGIN_STYLES.get(origin, ("rgba(240,228,66,0.5)", f"accepted draft, {origin}"))
        edge = "border-left:1px solid rgba(0,0,0,0.35);" if step != previous else ""
        previous = step
        out.append(f'<span style="background:{colour};{edge}" title="step {step}: {html.escape(what)}">'
                   f'{one_line(text)}</span>')
    return f'<div class="rest-answer">{"".join(out)}</div>'


def _step_ms(step: dict) -> float:
    return sum(step.get(f"t_{p}_ms") or 0.0 for p in ("retrieve", "tree", "forward", "verify", "commit"))


def plain_estimate_ms(steps: list[dict], calibrated_ms: Optional[float]) -> tuple[Optional[float], str]:
    """Time per token of plain decoding, estimated: the median time of this run's draft-free steps
    (one token per pass, same load, same context), else the one-token pass calibrated on this machine."""
    free = sorted(_step_ms(s) for s in steps if s["draft_size"] == 0 and s.get("t_forward_ms"))
    if len(free) >= 3:
        return free[len(free) // 2], f"the median of this run's {len(free)} draft-free steps"
    if calibrated_ms:
        return calibrated_ms, "the one-token forward pass calibrated on this machine"
    return None, ""


def metrics_html(steps: list[dict], elapsed_s: float, plain_ms: Optional[float] = None,
                 state: str = "running") -> str:
    """Running figures: tokens per forward pass, tokens/s and the estimated speedup."""
    tokens = sum(len(s["new_tokens"]) for s in steps)
    passes = len(steps)
    drafted = sum(figures.step_counts(s)[0] for s in steps)
    per_pass = tokens / passes if passes else 0.0
    rate = tokens / elapsed_s if elapsed_s > 0 else 0.0
    cells = [("tokens", f"{tokens}"), ("forward passes", f"{passes}"), ("tokens / pass", f"{per_pass:.2f}"),
             ("from drafts", f"{100 * drafted / tokens:.0f}%" if tokens else "–"), ("tokens / s", f"{rate:.1f}")]
    note = ""
    per_token, how = plain_estimate_ms(steps, plain_ms)
    rest_ms = sum(_step_ms(s) for s in steps)
    if per_token and rest_ms:
        cells.append(("speedup (est.)", f"{tokens * per_token / rest_ms:.2f}×"))
        note = (f'<div class="metric-note">Speedup estimated against plain decoding at {per_token:.0f} ms per '
                f"token ({how}), decoding time only; the Race tab measures it.</div>")
    body = "".join(f'<div class="metric"><div class="metric-v">{v}</div><div class="metric-k">{k}</div></div>'
                   for k, v in cells)
    return f'<div class="metrics" data-state="{state}">{body}</div>{note}'


def _static_for(engine: Engine, slot: ModelSlot, session: Session, settings: Settings) -> tuple[Any, str]:
    """(static store or None, a notice for the page)."""
    if settings.static == NO_STATIC:
        return None, ""
    if settings.static == UPLOADED:
        return open_upload_store(session, slot), ""
    st = engine.start_static(slot)
    st.finished.wait(STORE_WAIT_S)  # opening a built store takes milliseconds; a first build, minutes
    if st.state == "ready":
        return st.store, ""
    if st.state == "building":
        return None, ("The built-in datastore is still being built (first time on this machine: a few minutes, "
                      f"{engine.store_progress(st)}); this answer drafts from the request and history stores only.")
    if st.state == "failed":
        return None, f"The built-in datastore is unavailable ({st.error}); drafting from the other stores only."
    return None, ""


def _decoder(engine, slot, session, settings, cfg) -> tuple[RestDecoder, list[str], str]:
    static, notice = _static_for(engine, slot, session, settings)
    history = session.history_store(slot.lm.name, cfg) if settings.history_store else None
    decoder = RestDecoder(slot.lm, static_store=static, history_store=history,
                          use_request_store=settings.request_store,
                          budget_chooser=slot.chooser() if cfg.draft_budget is None else None)
    names = ([f"static:{static.path.name}"] if static is not None else []) + \
            (["request"] if settings.request_store else []) + (["history"] if history is not None else [])
    return decoder, names, notice


def _start_run(engine, slot, settings, session, prompt_text, prompt_ids, stores) -> int:
    run_id = engine.recorder.start_run(
        model=slot.lm.name, tokenizer_name=str(getattr(slot.lm.tokenizer, "name_or_path", slot.lm.name)),
        stores=stores, settings=settings.record(session.id), prompt=prompt_text, prompt_tokens=list(prompt_ids))
    session.run_ids.append(run_id)
    return run_id


def _rest_work(engine, slot, decoder, cfg, prompt_ids, run_id, defer_recording: bool = False):
    """The worker side of a REST decode: record every step, tell the page, finish the run."""
    def work(emit):
        with slot.lock:
            hook = engine.recorder.step_hook(run_id, slot.lm.tokenizer)
            traces: list[StepTrace] = []
            started = time.perf_counter()
            emit(("started", started))
            steps = decoder.stream(prompt_ids, cfg)
            try:
                while True:
                    try:
                        trace = next(steps)
                    except StopIteration as finished:
                        result: DecodeResult = finished.value
                        break
                    if defer_recording:  # the race times REST alone; steps are stored right after
                        traces.append(trace)
                        emit(("tokens", trace.new_tokens))
                    else:
                        hook(trace)
                        emit(("step", trace.step))
                for trace in traces:
                    hook(trace)
            except BaseException as err:
                status = "stopped" if isinstance(err, Cancelled) else "failed"
                engine.recorder.finish_run(run_id, status=status, error=message_of(err) if status == "failed"
                                           else "stopped by the visitor")
                raise
            engine.recorder.finish_run(run_id, output=result.text, new_tokens=result.new_tokens,
                                       steps=result.steps, wall_s=result.wall_s,
                                       mean_accepted=result.mean_accepted, status="done")
            return result
    return work


def _prompt(slot: ModelSlot, settings: Settings, message: str, history: list[dict]) -> list[int]:
    if not (message or "").strip():
        raise PromptError("The prompt is empty: type a question (chat) or some text or code to continue "
                          "(completion).")
    chat = settings.mode == "chat"
    if chat and not getattr(slot.lm.tokenizer, "chat_template", None):
        raise PromptError(f"{slot.lm.name} has no chat template: switch the prompt format to completion.")
    return encode_prompt(slot.lm.tokenizer, message, chat=chat, history=history if chat else None)


def _user_bubble(message: str) -> dict:
    return {"role": "user", "content": f'<div class="rest-user">{one_line(message)}</div>'}


def chat_turn(engine: Engine, session: Session, settings: Settings, message: str) -> Iterator[View]:
    """One chat (or completion) turn: the answer streamed with live figures, every step recorded."""
    message = message or ""
    if not message.strip():
        err = "The prompt is empty: type a question (chat) or some text or code to continue (completion)."
        yield View(notice=err, warning=err, done=True)
        return
    if settings.mode != "chat":
        session.clear_chat()  # completions are independent: no earlier turns
    chat = session.chat + [_user_bubble(message), {"role": "assistant", "content": "…"}]
    try:
        cfg = settings.decode_config()
        name = engine.canonical(settings.model)
        if name not in engine.models:
            chat[-1]["content"] = f"Loading {html.escape(name)} (once; the first load on a machine takes longer)…"
            yield View(chat=chat, notice="")
        slot = engine.model(name)
        prompt_ids = _prompt(slot, settings, message, session.history)
        if cfg.draft_budget is None and slot.cost is None:
            chat[-1]["content"] = "Measuring this machine's forward-pass cost for the automatic budget (once)…"
            yield View(chat=chat, notice="")
        decoder, stores, notice = _decoder(engine, slot, session, settings, cfg)
    except Exception as err:  # noqa: BLE001 - every failure becomes a message in the page
        text = message_of(err)
        chat[-1]["content"] = f"⚠ {html.escape(text)}"
        yield View(chat=chat, notice=text, warning=text, done=True)
        return
    chat[-1]["content"] = "thinking…"
    yield View(chat=chat, notice=notice, warning=notice or None)

    run_id = _start_run(engine, slot, settings, session, message, prompt_ids, stores)
    rec = engine.recorder
    plain_ms = slot.plain_ms()
    hide = special_texts(slot.lm.tokenizer)
    last_text = last_fig = 0.0
    fig_interval = FIGURE_INTERVAL_S
    latest, started = -1, None
    steps: list[dict] = []
    stream = stream_in_thread(engine, _rest_work(engine, slot, decoder, cfg, prompt_ids, run_id))
    try:
        while True:
            try:
                batch = next(stream)
            except StopIteration as finished:
                result: DecodeResult = finished.value
                break
            for kind, value in batch:
                if kind == "started":
                    started = value
                elif kind == "step":
                    latest = value
            if latest < 0 or latest + 1 == len(steps):
                continue
            now = time.perf_counter()
            if now - last_text < TEXT_INTERVAL_S:
                continue
            steps = rec.load_steps(run_id)
            chat[-1]["content"] = origin_spans(steps, hide)
            view = View(chat=chat, metrics=metrics_html(steps, now - started, plain_ms))
            last_text = now
            if now - last_fig < fig_interval:
                yield view
                continue
            view.tree, view.mask, view.speed = live_figures(rec, run_id, steps, steps[-1]["step"])
            yield view
            last_fig = time.perf_counter()  # drawing and sending done: slow machines redraw less often
            fig_interval = max(FIGURE_INTERVAL_S, (last_fig - now) / FIGURE_SHARE)
    except Exception as err:  # noqa: BLE001
        text = message_of(err)
        steps = rec.load_steps(run_id)
        chat[-1]["content"] = (origin_spans(steps, hide) if steps else "") + f"<p>⚠ {html.escape(text)}</p>"
        session.chat = chat
        yield View(chat=chat, notice=text, warning=text, run_id=run_id, done=True)
        return
    finally:
        stream.close()

    steps = rec.load_steps(run_id)
    run = rec.get_run(run_id)
    chat[-1]["content"] = origin_spans(steps, hide)
    session.chat = chat
    if settings.mode == "chat":
        session.history = session.history + [{"role": "user", "content": message},
                                             {"role": "assistant", "content": result.text}]
    session.answers.setdefault(slot.lm.name, []).append(list(result.tokens))
    view = View(chat=chat, metrics=metrics_html(steps, result.wall_s, plain_ms, state="done"), run_id=run_id,
                done=True)
    if steps:  # the run is over: show its most telling step (the one that accepted most drafts)
        view.tree, view.mask, view.speed = live_figures(rec, run_id, steps, best_step(steps), run)
    yield view


def race(engine: Engine, session: Session, settings: Settings, message: str) -> Iterator[View]:
    """The same prompt decoded plainly, then with REST, each measured alone; speedup and exactness check."""
    try:
        cfg = settings.decode_config()
        name = engine.canonical(settings.model)
        if name not in engine.models:
            yield View(plain=f"Loading {name}…", rest="", notice="")
        slot = engine.model(name)
        prompt_ids = _prompt(slot, settings, message, [])
        decoder, stores, notice = _decoder(engine, slot, session, settings, cfg)
    except Exception as err:  # noqa: BLE001
        text = message_of(err)
        yield View(notice=text, warning=text, plain="", rest="", done=True)
        return
    tok = slot.lm.tokenizer
    yield View(plain="warming up…", rest="waiting for the plain decode to finish…", notice=notice,
               warning=notice or None, metrics="")

    def plain_work(emit):
        with slot.lock:
            plain_generate(slot.lm, prompt_ids, DecodeConfig(max_new_tokens=1))  # warm-up, not timed
            emit(("started", time.perf_counter()))
            return plain_generate(slot.lm, prompt_ids, cfg, on_token=lambda t: emit(("token", t)))

    plain_ids: list[int] = []
    last = 0.0
    try:
        stream = stream_in_thread(engine, plain_work)
        while True:
            try:
                batch = next(stream)
            except StopIteration as finished:
                plain: DecodeResult = finished.value
                break
            plain_ids += [v for k, v in batch if k == "token"]
            if batch and time.perf_counter() - last >= TEXT_INTERVAL_S:
                last = time.perf_counter()
                yield View(plain=tok.decode(plain_ids, skip_special_tokens=True))
        yield View(plain=plain.text, rest="REST decoding…")

        run_id = _start_run(engine, slot, settings, session, message, prompt_ids, stores)
        rest_ids: list[int] = []
        stream = stream_in_thread(engine, _rest_work(engine, slot, decoder, cfg, prompt_ids, run_id,
                                                     defer_recording=True))
        while True:
            try:
                batch = next(stream)
            except StopIteration as finished:
                rest: DecodeResult = finished.value
                break
            for kind, value in batch:
                if kind == "tokens":
                    rest_ids += value
            if batch and time.perf_counter() - last >= TEXT_INTERVAL_S:
                last = time.perf_counter()
                text = one_line(tok.decode(rest_ids, skip_special_tokens=True))
                yield View(rest=f'<div class="rest-answer">{text}</div>')
    except Exception as err:  # noqa: BLE001
        text = message_of(err)
        yield View(notice=text, warning=text, done=True)
        return

    speedup = plain.wall_s / rest.wall_s if rest.wall_s else 0.0
    identical = plain.tokens == rest.tokens
    comparison = {"plain_wall_s": plain.wall_s, "plain_tokens_per_s": plain.tokens_per_s, "speedup": speedup,
                  "identical": identical if (settings.greedy or cfg.sampling.seed is not None) else None}
    engine.recorder.finish_run(run_id, status="done", comparison=comparison)
    steps = engine.recorder.load_steps(run_id)
    run = engine.recorder.get_run(run_id)
    yield View(rest=origin_spans(steps, special_texts(tok)),
               metrics=race_verdict(plain, rest, settings, cfg, slot, prompt_ids),
               speed=compact(figures.speed_figure(steps, run), 440, bottom=110), run_id=run_id, done=True)


def race_verdict(plain: DecodeResult, rest: DecodeResult, settings: Settings, cfg: DecodeConfig,
                 slot: ModelSlot, prompt_ids: list[int]) -> str:
    speedup = plain.wall_s / rest.wall_s if rest.wall_s else 0.0
    identical = plain.tokens == rest.tokens
    if settings.greedy:
        check = ("✓ Greedy outputs are identical, token for token." if identical else
                 "✗ Greedy outputs differ. " + _difference(slot, prompt_ids, plain.tokens, rest.tokens))
    elif cfg.sampling.seed is not None:
        check = ("✓ Same seed, same sample." if identical else
                 "Same seed, different samples: REST samples from exactly the same distribution, but a "
                 "draw can land differently when logits differ in the last bits. "
                 + _difference(slot, prompt_ids, plain.tokens, rest.tokens))
    else:
        check = "Sampling without a seed: outputs are not expected to match; fix a seed to compare them."
    return (f'<div class="verdict"><div class="verdict-big">{speedup:.2f}× {"faster" if speedup >= 1 else "(slower)"}'
            f"</div><div>plain: {plain.new_tokens} tokens in {plain.wall_s:.2f} s "
            f"({plain.tokens_per_s:.1f} tokens/s, {plain.steps} forward passes) · REST: {rest.new_tokens} tokens in "
            f"{rest.wall_s:.2f} s ({rest.tokens_per_s:.1f} tokens/s, {rest.steps} forward passes, "
            f"{rest.mean_accepted:.2f} tokens per pass)</div><div>{check}</div>"
            '<div class="metric-note">Measured one after the other on the same machine, each alone (after one '
            "untimed warm-up pass), prefill included. REST's time includes building each step's trace; the "
            "steps are written to the trace store after its clock stops.</div></div>")


def _difference(slot: ModelSlot, prompt_ids, plain_tokens, rest_tokens) -> str:
    from rest_core.cli import first_difference

    try:
        d = first_difference(slot.lm, prompt_ids, plain_tokens, rest_tokens)
    except Exception:  # noqa: BLE001 - the explanation is optional
        return ""
    if "logit_gap" not in d:
        return f"One output stops early, at token {d['first_difference']}."
    return (f"First difference at token {d['first_difference']}; the model's logit gap between the two "
            f"tokens there is {d['logit_gap']:.2e} (a near-tie, decided by rounding).")


# ---------------------------------------------------------------- runs, replayed

def visible_runs(recorder: TraceRecorder, session: Session, limit: int = 500) -> list[dict]:
    """This visitor's runs, and runs recorded outside the page (the command line); never another visitor's."""
    out = []
    for run in recorder.list_runs(limit=limit):
        owner = (run.get("settings") or {}).get("app_session")
        if owner == session.id or (owner is None and run["id"] not in session.run_ids):
            out.append(run)
    return out


def run_label(run: dict) -> str:
    prompt = (run.get("prompt") or "").replace("\n", " ")
    prompt = prompt if len(prompt) <= 48 else prompt[:47] + "…"
    extra = f", {run['speedup']:.2f}×" if run.get("speedup") else ""
    mine = "" if (run.get("settings") or {}).get("app_session") else " [command line]"
    return f"#{run['id']} {run['status']}: {run.get('steps') or 0} steps{extra}: {prompt}{mine}"


def run_choices(recorder: TraceRecorder, session: Session) -> list[tuple[str, int]]:
    return [(run_label(r), int(r["id"])) for r in visible_runs(recorder, session)]


def run_table(recorder: TraceRecorder, session: Session) -> list[list]:
    rows = []
    for r in visible_runs(recorder, session):
        per_pass = (r["new_tokens"] / r["steps"]) if r.get("steps") else None
        rate = (r["new_tokens"] / r["wall_s"]) if r.get("wall_s") else None
        rows.append([r["id"], (r["started_at"] or "")[:19].replace("T", " "), r["status"], r.get("model"),
                     (r.get("prompt") or "")[:60], r.get("new_tokens"), r.get("steps"),
                     None if per_pass is None else round(per_pass, 2), None if rate is None else round(rate, 1),
                     None if r.get("speedup") is None else round(r["speedup"], 2),
                     {1: "yes", 0: "no"}.get(r.get("identical"), "")])
    return rows


RUN_TABLE_HEADERS = ["run", "started (UTC)", "status", "model", "prompt", "tokens", "steps", "tokens/pass",
                     "tokens/s", "speedup", "identical"]


def open_run(recorder: TraceRecorder, session: Session, run_id) -> tuple[dict, list[dict]]:
    """A run this visitor may see, and its steps (KeyError with a clear message otherwise)."""
    if run_id in (None, ""):
        raise KeyError("Choose a run first (decode something in the Chat or Race tab to record one).")
    run_id = int(run_id)
    if run_id not in {r["id"] for r in visible_runs(recorder, session)}:
        raise KeyError(f"There is no run {run_id} among your runs.")
    return recorder.get_run(run_id), recorder.load_steps(run_id)


class TextsOfRun(dict):
    """Token id -> text for a recorded run: what was stored, else the tokenizer's when there is one."""

    def __init__(self, steps_detail: list[dict], tokenizer: Any = None):
        super().__init__()
        self.tokenizer = TokenTexts(tokenizer) if tokenizer is not None else None
        for s in steps_detail:
            for tok, text in zip(s.get("new_tokens", []), s.get("new_texts", [])):
                self[int(tok)] = text
            for n in s.get("nodes", []):
                self[int(n["token_id"])] = n["token_text"]

    def __missing__(self, token_id: int) -> str:
        if self.tokenizer is not None:
            try:
                return self.tokenizer[token_id]
            except Exception:  # noqa: BLE001 - an id this tokenizer does not know
                pass
        return f"⟨{token_id}⟩"


def _tok(text: str) -> str:
    return html.escape(figures.show_token(text))


def explain_step(step: dict, run: dict) -> str:
    """One paragraph, in plain words, of what happened at a recorded step."""
    nodes = step["nodes"]
    by_source: dict[str, list[dict]] = {}
    for b in step["branches"]:
        by_source.setdefault(b["source"], []).append(b)
    parts = []
    for source in SOURCES:
        m = (step.get("matched_len") or {}).get(source)
        if m is None:
            continue
        found = by_source.get(source, [])
        if m:
            total = sum(b["count"] for b in found)
            parts.append(f"the {source} store matched the last {m} tokens and offered {total} continuation"
                         f"{'s' if total != 1 else ''} ({len(found)} distinct)")
        else:
            parts.append(f"the {source} store found no match")
    lookup = ("; ".join(parts) + ".") if parts else "No store was searched."
    lookup = lookup[0].upper() + lookup[1:]
    drafted = step["draft_size"]
    root = nodes[0]["token_text"]
    budget = (run.get("settings") or {}).get("draft_budget", "auto")
    budget_text = "chosen by the cost model" if budget in ("auto", None) else f"at most {budget}"
    fwd = step.get("t_forward_ms")
    fwd_text = f" ({fwd:.0f} ms)" if fwd else ""
    accepted_nodes = [n for n in nodes if n["accepted"]][1:]
    path = "".join(n["token_text"] for n in accepted_nodes)
    last, offered, model_text = figures.disagreement(step)
    if drafted == 0:
        tree_text = ("With nothing to draft, the step was an ordinary one: a single forward pass produced one "
                     f"token, “{_tok(step['bonus_text'])}”.")
    else:
        origin = ", ".join(sorted(set(step.get("accepted_sources") or [])))
        agree = (f"The model agreed with the first {len(accepted_nodes)} drafted token"
                 f"{'s' if len(accepted_nodes) != 1 else ''} (“{_tok(path)}”, drafted by the {origin} store)"
                 if accepted_nodes else "The model agreed with none of the drafted tokens")
        stop = (f"then, where the draft offered {', '.join('“' + _tok(t) + '”' for t in offered)}, it chose "
                f"“{_tok(model_text)}” instead" if offered else
                f"then the draft ran out and the model added “{_tok(model_text)}”")
        tree_text = (f"These were merged into a draft tree of {drafted} tokens (budget {budget_text}) hanging "
                     f"from the last committed token “{_tok(root)}”, and the model checked every branch in one "
                     f"forward pass over {drafted + 1} tokens{fwd_text}, each attending only to the prefix and "
                     f"its own ancestors. {agree}; {stop}: that bonus token comes from the model itself.")
    committed = len(step["new_tokens"])
    return (f"**Step {step['step']}.** The context ends with “{_tok(step.get('query_text', ''))}”. {lookup} "
            f"{tree_text} The step committed {committed} token{'s' if committed != 1 else ''} for one forward "
            f"pass{' (plain decoding: one)' if committed > 1 else ''}.")


def suffix_html(step: dict, texts: dict) -> str:
    """The query suffix, its matched tail underlined per store."""
    query = step["query"]
    cells = [_tok(texts[int(t)]) for t in query]
    rows = [f'<div class="suffix-row"><b>context tail</b> {"".join(f"<span class=q>{c}</span>" for c in cells)}'
            "</div>"]
    for source, m in (step.get("matched_len") or {}).items():
        colour = figures.SOURCE_COLOURS.get(source, "#999")
        matched = f"background:{colour}33;border-bottom:3px solid {colour}"
        spans = "".join(f'<span class="q" style="{matched if i >= len(cells) - m else "opacity:.35"}">{c}</span>'
                        for i, c in enumerate(cells))
        rows.append(f'<div class="suffix-row"><b>{html.escape(source)}</b> matched {m} token{"s" if m != 1 else ""}'
                    f" {spans}</div>")
    return f'<div class="suffix">{"".join(rows)}</div>'


def step_view(recorder: TraceRecorder, run: dict, index: int, tokenizer: Any = None) -> dict:
    """Everything the step-through panel shows for one step of a run (tokenizer: optional,
    for the texts of prompt tokens, which the trace stores as ids only)."""
    step = recorder.load_step(run["id"], index)
    texts = TextsOfRun([step] + [s for s in recorder.load_steps(run["id"]) if s["step"] <= index], tokenizer)
    step["query_text"] = "".join(texts[int(t)] for t in step["query"][-8:])
    branches = [[b["source"], figures.show_token(b["text"]), b["count"]] for b in step["branches"][:60]]
    choices = [[n["node"], n["depth"], figures.show_token(n["token_text"]), n["source"] or "root",
                round(n["score"] or 0.0, 3), figures.show_token(n["model_choice_text"]),
                "✓" if n["accepted"] else ""] for n in step["nodes"]]
    accepted = [n for n in step["nodes"] if n["accepted"]][1:]
    path = "".join(f'<span class="acc">{_tok(n["token_text"])}</span>' for n in accepted)
    tree = figures.draft_tree_figure(step)
    path_html = (f'<div class="path">accepted path: {path or "<i>no draft token</i>"} + bonus '
                 f'<span class="bonus">{_tok(step["bonus_text"])}</span> → committed '
                 f'{len(step["new_tokens"])} token(s)</div>')
    return {"step": step, "suffix": suffix_html(step, texts), "branches": branches, "choices": choices,
            "path": path_html, "explanation": explain_step(step, run),
            "tree": panel(tree, min(1400, max(480, int(tree.layout.height or 480)))),
            "mask": panel(figures.mask_heatmap(step), 560)}


BRANCH_HEADERS = ["store", "continuation", "count"]
CHOICE_HEADERS = ["node", "depth", "draft token", "drafted by", "score", "model's next token", "accepted"]


# ---------------------------------------------------------------- the datastore explorer

def explore(engine: Engine, session: Session, settings: Settings, context: str, budget: int) -> dict:
    """The longest suffix of `context` each chosen store holds, and the tree it would draft."""
    if not (context or "").strip():
        raise PromptError("Type a context to look up (for example the start of a line of Python code).")
    slot = engine.model(settings.model)
    ids = slot.lm.tokenizer(context, add_special_tokens=False)["input_ids"]
    rs = RetrieveSettings(int(settings.n_max), int(settings.n_min), 5000, int(settings.continuation_len))
    rs.validate()
    stores, notes = [], []
    static, notice = _static_for(engine, slot, session, settings)
    if notice:
        notes.append(notice)
    if static is not None:
        stores.append(static)
    if settings.request_store and len(ids) > 1:
        # the context itself, as the request store would see it (its newest token has nothing after it)
        stores.append(RequestStore(ids, n_max=rs.n_max, n_min=rs.n_min))
    if settings.history_store:
        stores.append(session.history_store(slot.lm.name, DecodeConfig(retrieve=rs)))
    if not stores:
        raise DatastoreError("No store is switched on: choose a datastore or turn on the request store.")
    query = query_suffix(ids, rs)
    lookups = retrieve(query, stores, rs)
    tree = build_draft_tree(int(ids[-1]), lookups, int(budget))
    texts = TokenTexts(slot.lm.tokenizer)
    step = {"query": [int(t) for t in query], "matched_len": {lk.source: lk.matched_len for lk in lookups}}
    rows = []
    for lk in lookups:
        if lk.continuations.shape[0] == 0:
            continue
        uniq, counts = np.unique(lk.continuations, axis=0, return_counts=True)
        for k in np.argsort(-counts, kind="stable")[:25]:
            toks = [int(t) for t in uniq[k] if t >= 0]
            rows.append([lk.source, figures.show_token(texts.join(toks)), int(counts[k])])
    nodes = [{"node": i, "parent": int(tree.parents[i]), "depth": int(tree.depths[i]),
              "token_text": texts[int(tree.tokens[i])], "score": float(tree.scores[i]), "source": tree.sources[i]}
             for i in range(len(tree))]
    summary = " · ".join(
        f"**{lk.source}**: longest suffix {lk.matched_len} token{'s' if lk.matched_len != 1 else ''}, "
        f"{lk.total_matches:,} occurrence{'s' if lk.total_matches != 1 else ''}" for lk in lookups)
    summary += f" · draft tree: **{tree.draft_size}** tokens (budget {int(budget)})"
    if notes:
        summary += "\n\n" + " ".join(notes)
    return {"suffix": suffix_html(step, texts), "summary": summary, "continuations": rows,
            "tree": panel(figures.continuation_tree_figure(nodes), max(400, 26 * sum(
                1 for i in range(len(tree)) if i not in set(tree.parents.tolist())) + 180))}
