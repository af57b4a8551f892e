"""Token datastores for retrieval-based drafting.

* `TokenDatastore` -- the static on-disk store (token stream + reversed suffix array),
  built once from a corpus by `build_datastore` / ``python -m datastores build``.
* `RequestStore` -- the current request (prompt + answer so far).
* `HistoryStore` -- past answers, optionally persisted.

All three answer ``lookup(context, n_max, n_min, max_matches, continuation_len)`` with
a `Lookup`: the longest context suffix found and the tokens that followed it.
"""
from .build import (build_datastore, build_from_token_documents, cache_dir, reversed_suffix_array,
                    tokenizer_fingerprint)
from .common import SEP, DatastoreError, Lookup
from .dynamic import HistoryStore, RequestStore
from .sources import (DocumentSource, default_python_roots, iter_documents, iter_jsonl,
                      iter_python_sources, iter_text_files)
from .static import TokenDatastore

__all__ = ["SEP", "DatastoreError", "Lookup", "TokenDatastore", "RequestStore", "HistoryStore",
           "build_datastore", "build_from_token_documents", "tokenizer_fingerprint", "reversed_suffix_array", "cache_dir",
           "DocumentSource", "default_python_roots", "iter_documents", "iter_jsonl",
           "iter_python_sources", "iter_text_files"]
