"""Which stores a decode drafts from, assembled in one place.

`assemble_stores` is the only function that puts a decode's stores together (their
order is the order the draft tree merges them in); `open_static_store` and
`open_history` turn command-line / settings specs into stores.

The default static store is Python source every machine has offline: the
running interpreter's standard library, then the installed packages, tokenized
with the model's tokenizer.  It is built on first use (with a progress bar),
cached outside the repository under a name that carries the tokenizer's
fingerprint, and guarded by a lock so two processes never build it at once.
"""
from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from datastores.answers import (
    Generate,
    answer_documents,
    answers_store_path,
    build_answers_store,
    open_answers_store,
    read_kept_answers,
)
from datastores.build import build_datastore
from datastores.common import DatastoreError, Store
from datastores.dense import DEFAULT_DIM, DenseStore, States, build_dense_store
from datastores.dynamic import HistoryStore, RequestStore
from datastores.fingerprint import tokenizer_fingerprint
from datastores.recycle import RecycleStore
from datastores.sources import iter_python_sources, site_packages_roots, stdlib_root
from datastores.static import TokenDatastore
from rest_base.files import cache_dir, safe_file_name

DEFAULT_STORE_TOKENS = int(os.environ.get("REST_LAB_DEFAULT_STORE_TOKENS", 50_000_000))
WARM_SHARE = 0.25  # a store is warmed at open when its files take at most this share of the available memory


def available_memory() -> Optional[int]:
    """Bytes of memory the system could give without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def warmed(store: TokenDatastore) -> TokenDatastore:
    """Start touching the store's pages in the background (`TokenDatastore.warm`) where they fit in memory.

    Where the store's files are not in the system's page cache (the first use after a boot, a Space's cold
    start, memory pressure) every lookup that reaches a page no lookup read before waits for the disk: in a
    decode the Python store's lookups took median 388 / mean 962 us that way and 174 / 190 us warmed (chat, 8
    prompts, the files evicted before each run); once the files are cached the two are the same.  Warming
    reads the files in order in a background thread instead.  A store bigger than WARM_SHARE of the available
    memory (where that is known) is left to fault its pages in as lookups reach them."""
    free = available_memory()
    if free is None or store.mapped_bytes() <= WARM_SHARE * free:
        store.warm(background=True)
    return store


def default_store_path(tokenizer: Any) -> Path:
    return cache_dir() / "stores" / f"python-{tokenizer_fingerprint(tokenizer)[:12]}"


@contextmanager
def _build_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # a second process waits, then opens what the first built
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def open_default_store(tokenizer: Any, progress: bool = True, max_tokens: Optional[int] = None) -> TokenDatastore:
    """Open (building on first use) the Python-source store for this tokenizer, warmed (`warmed`).

    Labelled by its folder's name (``static:python-<fingerprint>``), never by a server path."""
    return warmed(_open_or_build_default(tokenizer, progress, max_tokens))


def _open_or_build_default(tokenizer: Any, progress: bool, max_tokens: Optional[int]) -> TokenDatastore:
    path = default_store_path(tokenizer)
    try:
        return TokenDatastore.open(path, tokenizer=tokenizer, name=path.name)
    except DatastoreError:
        pass
    with _build_lock(path):
        try:  # another process may have finished it while we waited
            return TokenDatastore.open(path, tokenizer=tokenizer, name=path.name)
        except DatastoreError:
            pass
        roots = [stdlib_root(), *site_packages_roots()]
        print(f"Building the default datastore at {path} from Python sources in {len(roots)} folders "
              f"(once; up to {max_tokens or DEFAULT_STORE_TOKENS:,} tokens)...", flush=True)
        build_datastore(path, tokenizer, iter_python_sources(roots), progress=progress,
                        max_tokens=max_tokens or DEFAULT_STORE_TOKENS, overwrite=True)
        return TokenDatastore.open(path, tokenizer=tokenizer, name=path.name)


def open_static_store(spec: Optional[str], tokenizer: Any, progress: bool = True) -> Optional[TokenDatastore]:
    """'default' (or None): the built-in store; 'none': no static store; anything else: a store folder."""
    if spec is None or spec == "default":
        return open_default_store(tokenizer, progress=progress)
    if spec == "none":
        return None
    return warmed(TokenDatastore.open(spec, tokenizer=tokenizer))


def open_answers(spec: Optional[str], model_name: str, tokenizer: Any, generate: Optional[Generate] = None,
                 progress: bool = True) -> Optional[TokenDatastore]:
    """The general-text store (the model's own answers to varied requests; drafts named "answers").

    'default': the built-in one for this model, built on first use when `generate` is given (else a
    DatastoreError says how to build it); 'none'/None: off; anything else: a store folder.  Warmed (`warmed`)."""
    if spec in (None, "none"):
        return None
    return warmed(_open_or_build_answers(spec, model_name, tokenizer, generate, progress))


def _open_or_build_answers(spec: str, model_name: str, tokenizer: Any, generate: Optional[Generate],
                           progress: bool) -> TokenDatastore:
    if spec != "default":
        return open_answers_store(spec, tokenizer)
    path = answers_store_path(model_name, tokenizer)
    try:
        return open_answers_store(path, tokenizer)
    except DatastoreError:
        pass
    with _build_lock(path):  # from kept or shipped answers in a second; else the model answers (needs `generate`)
        try:
            return open_answers_store(path, tokenizer)
        except DatastoreError:
            return build_answers_store(path, tokenizer, generate, progress=progress, model_name=model_name)


def dense_store_path(model_name: str, tokenizer: Any, layer: int, dim: int = DEFAULT_DIM) -> Path:
    """The built-in dense store of a model: its answers' hidden states at `layer`, reduced to `dim`."""
    return (cache_dir() / "stores" /
            f"dense-{safe_file_name(model_name)}-{tokenizer_fingerprint(tokenizer)[:12]}-h{layer}-d{dim}")


def open_dense(spec: Optional[str], model_name: str, tokenizer: Any, model_fingerprint: str, layer: int,
               states: Optional[States] = None, dim: int = DEFAULT_DIM, progress: bool = True) -> Optional[DenseStore]:
    """The dense store (drafts named "dense"): 'default' -- the built-in one over the general-text store's answers,
    built on first use (about two minutes on 2 idle cores) when `states` (token ids -> hidden states at `layer`) is
    given; 'none'/None: off; anything else: a store folder.  A store of another model is refused."""
    if spec in (None, "none"):
        return None
    if spec != "default":
        return DenseStore.open(spec, tokenizer=tokenizer, model_fingerprint=model_fingerprint)
    path = dense_store_path(model_name, tokenizer, layer, dim)
    try:
        return DenseStore.open(path, tokenizer=tokenizer, model_fingerprint=model_fingerprint)
    except DatastoreError:
        if states is None:
            raise DatastoreError(f"the dense store for {model_name} is not built yet: `python -m rest_core datastore "
                                 f"dense {path}` builds it (about two minutes on 2 cores, once)") from None
    with _build_lock(path):
        try:
            return DenseStore.open(path, tokenizer=tokenizer, model_fingerprint=model_fingerprint)
        except DatastoreError:
            pass
        docs = answer_documents(tokenizer, read_kept_answers(answers_store_path(model_name, tokenizer)))
        if progress:
            print(f"Building the dense store at {path}: the model reads its {len(docs)} answers once...", flush=True)
        model = {"name": model_name, "fingerprint": model_fingerprint}
        return build_dense_store(path, docs, states, tokenizer, model, layer, dim, progress=progress,
                                 corpus="the general-text store's answers")


def default_history_path(tokenizer: Any) -> Path:
    return cache_dir() / "history" / f"history-{tokenizer_fingerprint(tokenizer)[:12]}.npz"


def open_history(spec: Optional[str], tokenizer: Any, n_max: int = 16, n_min: int = 2) -> Optional[HistoryStore]:
    """'default': the persisted history of past answers for this tokenizer; 'none'/None: off; else a file.

    Indexed for suffixes of n_min..n_max tokens (a later request with other lengths re-indexes it)."""
    if spec in (None, "none"):
        return None
    path = default_history_path(tokenizer) if spec == "default" else Path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    return HistoryStore(path=path, n_max=n_max, n_min=n_min)


def default_recycle_path(model_name: str, tokenizer: Any) -> Path:
    return cache_dir() / "recycle" / f"{safe_file_name(model_name)}-{tokenizer_fingerprint(tokenizer)[:12]}.npz"


def open_recycle(spec: Optional[str], tokenizer: Any, vocab_size: int, model_name: str,
                 repair: bool = True) -> Optional[RecycleStore]:
    """The model's own predictions as a draft source: 'default' (kept per model and tokenizer between
    runs), 'session' (in memory, starting empty), 'none'/None: off; anything else: a table file.  A default
    table that cannot be read is started afresh, or with `repair` False left as it is (DatastoreError)."""
    if spec in (None, "none"):
        return None
    if spec == "session":
        return RecycleStore(vocab_size)
    path = default_recycle_path(model_name, tokenizer) if spec == "default" else Path(spec)
    try:
        return RecycleStore(vocab_size, path=path)
    except DatastoreError:
        if spec != "default" or not repair:
            raise
        path.unlink(missing_ok=True)  # the built-in table is only a cache: start it afresh
        return RecycleStore(vocab_size, path=path)


def assemble_stores(static: Optional[Store] = None, request: bool = True, history: Optional[Store] = None,
                    model: Optional[Store] = None, extra: Sequence[Store] = (), n_max: int = 16,
                    n_min: int = 2, answers: Optional[Store] = None, dense: Optional[Store] = None) -> list[Store]:
    """A decode's stores in merge order: static, answers (the general-text store), request (prompt +
    answer so far), history, the model's own predictions (recycled tokens), the dense store (neighbours of the
    model's hidden state), then any others.

    Each source name may appear once: the draft tree, the cost model and the traces tell drafts
    apart by it."""
    stores: list[Store] = [s for s in (static, answers) if s is not None]
    if request:
        stores.append(RequestStore(n_max=n_max, n_min=n_min))
    stores.extend(s for s in (history, model, dense, *extra) if s is not None)
    names = [s.source for s in stores]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DatastoreError(f"two stores share the source name {dup[0]!r}; give each store its own source name")
    return stores


def store_labels(stores: Sequence[Store]) -> list[str]:
    """How runs and reports name a decode's stores (static:PATH, request, history:PATH, ...)."""
    return [s.label for s in stores]
