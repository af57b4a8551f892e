"""Which tokenizer a store belongs to: a fingerprint of its vocabulary, and the check on open."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from datastores.common import DatastoreError


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Stable sha256 over the vocabulary (token -> id) and the special tokens.

    Two tokenizers with the same fingerprint map text to the same ids for all practical
    purposes; the fingerprint does not depend on the tokenizer's class or load path.
    """
    try:
        vocab = tokenizer.get_vocab()
    except Exception as exc:  # any tokenizer-side failure is the same problem
        raise DatastoreError(f"cannot read the tokenizer's vocabulary ({exc}); pass a Hugging Face "
                             "tokenizer (it must have get_vocab())") from None
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    specials = getattr(tokenizer, "all_special_tokens", None) or []
    h.update(b"\x00special\x00")
    for tok in sorted(set(map(str, specials))):
        h.update(f"{tok}\t{vocab.get(tok, -1)}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def check_tokenizer(meta: dict, tokenizer: Any, path: Path) -> None:
    """Refuse a tokenizer other than the one the store was built with."""
    fp = tokenizer_fingerprint(tokenizer)
    built = meta["tokenizer"]
    if fp != built.get("fingerprint"):
        raise DatastoreError(
            f"{path} was built with tokenizer {built.get('name')!r} "
            f"(fingerprint {str(built.get('fingerprint'))[:12]}), "
            f"not with the given {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} "
            f"(fingerprint {fp[:12]}); token ids would not mean the same words. Rebuild it for this tokenizer "
            f"with `python -m rest_core datastore build {path} --tokenizer NAME_OR_PATH ...`")
