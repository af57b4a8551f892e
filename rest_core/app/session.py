"""One visitor's own things: their folder of uploads and the store built from it, the chat so
far, their past answers (the history store drafts from them), their table of the model's own
predictions (the "model" source) and the runs they recorded.

Folders live under the cache folder (REST_LAB_CACHE), in app-sessions/<session id>; a
visitor's folder goes when their session ends, and `prune_sessions` removes any a previous
server left behind.
"""
from __future__ import annotations

import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from datastores import (
    DatastoreError,
    HistoryStore,
    RecycleStore,
    TokenDatastore,
    TooManyTokens,
    build_datastore,
    cache_dir,
    iter_documents,
)
from rest_core.app.engine import ModelSlot
from rest_core.app.policy import Policy, markdown_text
from rest_core.app.settings import UPLOADED, UploadError, log
from rest_core.decode import DecodeConfig

HISTORY_TOKENS = 200_000  # a visitor's history store keeps at most this many tokens of past answers


def sessions_root() -> Path:
    return cache_dir() / "app-sessions"


@dataclass
class Session:
    """One visitor's own state: their folder, chat, history store and runs."""

    id: str
    chat: list[dict] = field(default_factory=list)  # what the chatbot shows
    history: list[dict] = field(default_factory=list)  # the same turns as plain text (for the chat template)
    answers: dict[str, list[np.ndarray]] = field(default_factory=dict)  # model -> this visitor's past answers
    recycled: dict[str, RecycleStore] = field(default_factory=dict)  # model -> this visitor's successor table
    upload_files: list[str] = field(default_factory=list)
    upload_model: Optional[str] = None  # the model whose tokenizer built the upload store
    run_ids: list[int] = field(default_factory=list)
    address: str = ""  # the client address of its latest request (rest_core.app.visitors)

    @staticmethod
    def ensure(state: Optional[Session], request: Any = None) -> Session:
        """The visitor's session: the one in the page's state, else a new one named after the request."""
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
        """A history store of this visitor's past answers with `model` (kept in memory only)."""
        store = HistoryStore(n_max=cfg.retrieve.n_max, n_min=cfg.retrieve.n_min, max_tokens=HISTORY_TOKENS)
        for answer in self.answers.get(model, []):
            store.add(answer)
        return store

    def recycle_store(self, slot: ModelSlot) -> RecycleStore:
        """This visitor's table of the model's own predictions (source "model"), one per model.

        It starts as the table command-line and benchmark runs keep for this model (shared with every other
        visitor until this one's first decode writes to it: copy on write) and learns from this visitor's
        decodes only; it is never saved, so a visitor's drafts never come from another visitor's text."""
        store = self.recycled.get(slot.lm.name)
        if store is None:
            store = self.recycled[slot.lm.name] = slot.recycle_fork()
        return store

    def remember(self, model: str, tokens: list[int]) -> None:
        """Keep an answer for this visitor's history store (the newest HISTORY_TOKENS tokens of answers)."""
        kept = self.answers.setdefault(model, [])
        kept.append(np.asarray(tokens, dtype=np.int32))
        while len(kept) > 1 and sum(map(len, kept)) > HISTORY_TOKENS:
            kept.pop(0)

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


def _check_uploads(paths: list[str], upload_root: Optional[Path], policy: Policy) -> None:
    """Refuse no files, files from outside the server's uploads, too many or too large files."""
    if not paths:
        raise UploadError("No files uploaded: add one or more text or code files first.")
    if upload_root is not None:
        root = Path(upload_root).resolve()
        for p in paths:
            if not Path(p).resolve().is_relative_to(root):
                raise UploadError(f"Refused {Path(p).name!r}: not an uploaded file.")
    if len(paths) > policy.max_upload_files:
        raise UploadError(f"{len(paths)} files uploaded; at most {policy.max_upload_files} are accepted.")
    sizes = []
    for p in paths:
        try:
            sizes.append(Path(p).stat().st_size)
        except OSError:
            raise UploadError(f"The upload {Path(p).name!r} could not be read; upload it again.") from None
    total = sum(sizes)
    if total > policy.max_upload_bytes:
        raise UploadError(f"The uploads hold {total / 2**20:.1f} MB; at most {policy.max_upload_bytes / 2**20:.0f} MB "
                          "in all are accepted. Upload fewer or smaller files.")


def upload_bytes(paths: list[str]) -> int:
    """Bytes of these files together (missing ones count 0): what copying them into a visitor's folder adds."""
    total = 0
    for p in paths:
        try:
            total += Path(p).stat().st_size
        except OSError:
            pass
    return total


def _read_texts(paths: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(name, text) of every usable upload (UTF-8, not empty, not binary), and the names skipped."""
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
    return docs, skipped


def save_uploads(session: Session, paths: list[str], upload_root: Optional[Path] = None,
                 policy: Optional[Policy] = None) -> list[tuple[str, str]]:
    """Check the uploaded files (text; the policy's count and size, 200 files and 20 MB in all by default) and
    copy them into the visitor's own folder.

    `upload_root`: where the server keeps uploads; a path outside it is refused.
    Returns (name, text) per file. Nothing outside the visitor's folder is read again.
    """
    paths = [p for p in (paths or []) if p]
    _check_uploads(paths, upload_root, policy or Policy())
    docs, skipped = _read_texts(paths)
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


def build_upload_store(session: Session, docs: list[tuple[str, str]], tokenizer: Any, model: str,
                       max_tokens: Optional[int] = None, progress: bool = True) -> TokenDatastore:
    """The visitor's own static store, built from their files with the tokenizer of `model` (its canonical name);
    past `max_tokens` tokens the build stops and is refused (UploadError)."""
    try:
        store = build_datastore(session.store_dir, tokenizer, iter_documents(docs, kind="uploads"), progress=progress,
                                overwrite=True, max_tokens=max_tokens, refuse_past=max_tokens is not None)
    except TooManyTokens:
        raise UploadError(f"Your files hold more than {max_tokens:,} tokens; this server builds a store of at most "
                          f"{max_tokens:,} tokens from uploads. Upload fewer or smaller files.") from None
    session.upload_model = model
    return store


def upload_summary(session: Session, store: TokenDatastore) -> str:
    """The upload box's line once the visitor's store is built (Markdown: the file names are shown as they are)."""
    names = ", ".join(session.upload_files[:8]) + (" …" if len(session.upload_files) > 8 else "")
    return (f"✓ Your datastore: {store.n_tokens:,} tokens from {len(session.upload_files)} file(s) "
            f"({markdown_text(names, 400)}), built for {markdown_text(session.upload_model or '')}. Choose "
            f"“{UPLOADED}” as the datastore to draft from it.")


def open_upload_store(session: Session, slot: ModelSlot, model: str) -> TokenDatastore:
    """The visitor's store built from their files, for `model` (its canonical name; `slot` holds it)."""
    if not session.upload_files or not (session.store_dir / "meta.json").is_file():
        raise DatastoreError("No uploaded datastore yet: upload text or code files and press “Build my datastore”.")
    if session.upload_model != model:
        raise DatastoreError(f"Your datastore was built for {session.upload_model}, not {model}: "
                             "press “Build my datastore” again for this model.")
    # one label for every visitor's uploads: runs never show a server path, and the learned
    # acceptance of uploaded text is shared rather than kept per visitor
    return TokenDatastore.open(session.store_dir, tokenizer=slot.lm.tokenizer, name="uploaded")
