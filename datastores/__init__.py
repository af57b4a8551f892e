"""Token datastores for retrieval-based drafting.

* `Store` -- the seam: a ``source`` name and ``lookup(...)`` answering with a `Lookup`
  (the longest context suffix found and the tokens that followed); `StoreBase` gives
  the no-op request lifecycle (``begin`` / ``extend`` / ``end``).
* `TokenDatastore` -- the static on-disk store (token stream + reversed suffix array),
  built once from a corpus by `build_datastore` / ``python -m rest_core datastore build``.
* `RequestStore` -- the current request (prompt + answer so far).
* `HistoryStore` -- past answers, optionally persisted.
* `RecycleStore` -- the model's own predictions (source "model"): each token's top-k
  successors from the last verify pass that saw it, drafted as a tree (recycled tokens).
* The general-text store (`open_answers`, `datastores.answers`) -- the model's own answers
  to a varied set of chat requests, a token store whose drafts are named "answers".
* `DenseStore` -- the model's hidden states over a corpus (the general-text store's answers by default),
  searched by nearest neighbour; drafts named "dense" (`open_dense`, `datastores.dense`).
* `assemble_stores` -- the one place a decode's stores are put together; the built-in
  Python store (`open_default_store`) and history (`open_history`) live beside it.
"""
from datastores.answers import answers_store_path, build_answers_store
from datastores.build import TooManyTokens, build_datastore, build_from_token_documents, reversed_suffix_array
from datastores.builtin import (
    assemble_stores,
    default_history_path,
    default_recycle_path,
    default_store_path,
    dense_store_path,
    open_answers,
    open_default_store,
    open_dense,
    open_history,
    open_recycle,
    open_static_store,
    store_labels,
)
from datastores.common import SEP, DatastoreError, Lookup, Store, StoreBase, cache_dir
from datastores.dense import DenseStore, build_dense_store
from datastores.dynamic import HistoryStore, RequestStore
from datastores.fingerprint import check_tokenizer, tokenizer_fingerprint
from datastores.recycle import RecycleStore
from datastores.sources import (
    DocumentSource,
    default_python_roots,
    iter_documents,
    iter_jsonl,
    iter_python_sources,
    iter_text_files,
)
from datastores.static import TokenDatastore

__all__ = [
    "SEP",
    "DatastoreError",
    "DenseStore",
    "DocumentSource",
    "HistoryStore",
    "Lookup",
    "RecycleStore",
    "RequestStore",
    "Store",
    "StoreBase",
    "TokenDatastore",
    "TooManyTokens",
    "answers_store_path",
    "assemble_stores",
    "build_answers_store",
    "build_datastore",
    "build_dense_store",
    "build_from_token_documents",
    "cache_dir",
    "check_tokenizer",
    "default_history_path",
    "default_python_roots",
    "default_recycle_path",
    "default_store_path",
    "dense_store_path",
    "iter_documents",
    "iter_jsonl",
    "iter_python_sources",
    "iter_text_files",
    "open_answers",
    "open_default_store",
    "open_dense",
    "open_history",
    "open_recycle",
    "open_static_store",
    "reversed_suffix_array",
    "store_labels",
    "tokenizer_fingerprint",
]
