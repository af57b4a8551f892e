"""A token's text as a label: visible whitespace, cut to fit, safe in plotly's HTML-like labels,
and readable even when the token holds only part of a character.

A byte-level tokenizer can split one character over several tokens (an emoji, a CJK
character, a dash): decoded alone each piece is the replacement character `�`, which
tells a reader nothing.  `token_label` gives the piece's bytes instead, as `‹F0 9F›`,
keeping the readable part of the token as text (`␣‹F0 9F›` for a space and two bytes).
"""
from __future__ import annotations

import html
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Optional

REPLACEMENT = "\ufffd"
_SPM_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_STRAY = re.compile("[\udc80-\udcff]+")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in character of every byte in byte-level BPE vocabularies (GPT-2's scheme:
    printable Latin-1 bytes stand for themselves, the other bytes for the characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_bytes(tokenizer: Any, token_id: int) -> Optional[bytes]:
    """The raw bytes a token stands for, when the tokenizer's vocabulary says (byte-level BPE pieces,
    SentencePiece byte fallback `<0xNN>`); None otherwise."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None:
        return None
    try:
        piece = convert(int(token_id))
    except Exception:  # an id the tokenizer does not know
        return None
    if not isinstance(piece, str) or not piece:
        return None
    found = _SPM_BYTE.match(piece)
    if found:
        return bytes([int(found.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if all(ch in alphabet for ch in piece):
        return bytes(alphabet[ch] for ch in piece)
    return None


def readable(raw: bytes) -> str:
    """Bytes as text: valid UTF-8 decoded, every run of bytes that is not a whole character as `‹E2 80›`."""
    text = raw.decode("utf-8", errors="surrogateescape")  # a stray byte b becomes the lone surrogate U+DC00 + b
    return _STRAY.sub(lambda m: "‹" + " ".join(f"{ord(c) - 0xDC00:02X}" for c in m.group()) + "›", text)


def token_label(tokenizer: Any, token_id: int, text: str) -> str:
    """`text` (the token decoded alone), with a split character's bytes shown in place of `�`."""
    if REPLACEMENT not in text:
        return text
    raw = token_bytes(tokenizer, token_id)
    if raw is None:
        return text
    shown = readable(raw)
    return shown if "‹" in shown else text  # the token really holds U+FFFD: keep it


def show_token(text: str) -> str:
    """A token's text made visible: spaces, newlines and tabs get a glyph."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍") or "∅"


def label(text: str) -> str:
    """Token text safe inside plotly's HTML-like labels."""
    return html.escape(show_token(text), quote=False)


def short_label(text: str, limit: int) -> str:
    """A token's visible text cut to `limit` characters (… marks the cut), safe inside plotly's labels."""
    shown = show_token(text)
    if len(shown) > limit:
        shown = shown[:max(1, limit - 1)] + "…"
    return html.escape(shown, quote=False)


def label_room(depths: Sequence[int], extra_units: float, plot_px: float = 560.0, char_px: float = 7.5,
               marker_px: float = 26.0) -> int:
    """How many characters a node's label may take beside it before it reaches the next depth's nodes
    (markers `marker_px` wide), for a tree `max(depths) + extra_units` depth units wide drawn in at least
    `plot_px` pixels (2..14)."""
    unit_px = plot_px / (max(depths, default=0) + extra_units)
    return int(max(2, min(14, (unit_px - marker_px) // char_px)))


def prob_text(p: Optional[float]) -> str:
    """A probability as a page shows it: two decimals, or two significant digits below 0.01."""
    if p is None:
        return "?"
    return f"{p:.2f}" if p >= 0.01 or p == 0 else f"{p:.1e}"
