"""Colours of the trace figures and pages: Okabe-Ito (safe for the common
colour-vision deficiencies), one fixed colour per known source and a stable
fallback colour for any other source name.

The draft source "model" (the model's own recycled predictions) is yellow; the bonus
token (the one the model adds itself at the end of each step) is reddish purple."""
from __future__ import annotations

import zlib
from collections.abc import Iterable

from rest_core.phases import PHASES

BLUE, ORANGE, GREEN, VERMILLION, PURPLE, SKY, YELLOW, GREY = (
    "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#7F7F7F")
INDIGO = "#332288"  # from Paul Tol's colour-blind-safe "muted" set: apart from the static store's blue in a tint
TEAL = "#44AA99"  # the same set's teal: the dense source (neighbours of the model's hidden state)
SOURCE_COLOURS = {"static": BLUE, "answers": INDIGO, "request": ORANGE, "history": GREEN, "model": YELLOW,
                  "dense": TEAL, "": GREY}  # "" = root
# Any other source: sky (the Okabe-Ito colour left), then Paul Tol's colour-blind-safe "muted" set.
FALLBACK_COLOURS = (SKY, "#882255", "#999933", "#CC6677", "#AA4499")
PHASE_COLOURS = dict(zip(PHASES, (BLUE, ORANGE, SKY, GREEN, PURPLE)))
ACCEPTED = VERMILLION  # the accepted path
BONUS = PURPLE  # the token the model adds itself at the end of each step (not a draft source)
FONT = dict(family="DejaVu Sans, Arial, sans-serif", size=16, color="#222")


def source_color(source: str) -> str:
    """The CSS colour of a source: fixed for the known ones, otherwise a fallback colour
    chosen by a hash of the name (the same in every process and on every page)."""
    if source in SOURCE_COLOURS:
        return SOURCE_COLOURS[source]
    return FALLBACK_COLOURS[zlib.crc32(source.encode("utf-8")) % len(FALLBACK_COLOURS)]


def source_order(sources: Iterable[str]) -> list[str]:
    """Distinct source names for a legend: the root (""), the known sources, then the rest by name."""
    present = set(sources)
    known = [s for s in SOURCE_COLOURS if s in present]
    return sorted(known, key=lambda s: s != "") + sorted(present - set(SOURCE_COLOURS))


def tint(colour: str, alpha: float) -> str:
    """A '#RRGGBB' colour as a translucent rgba() background."""
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha:g})"


# A second cue beside colour, for readers who cannot tell the colours apart (and for print):
# a marker shape per source in the draft tree, a fill pattern per source in bar charts.
SOURCE_MARKERS = {"": "circle", "static": "circle", "answers": "pentagon", "request": "square", "history": "diamond",
                  "model": "triangle-up", "dense": "star"}
FALLBACK_MARKERS = ("hexagon", "cross", "x", "triangle-down", "hourglass")
SOURCE_PATTERNS = {"": "", "static": "", "answers": "-", "request": "/", "history": "x", "model": ".", "dense": "+"}
FALLBACK_PATTERNS = ("\\", "|")


def source_marker(source: str) -> str:
    """The plotly marker symbol of a source's draft nodes: fixed for the known ones, else by name hash."""
    if source in SOURCE_MARKERS:
        return SOURCE_MARKERS[source]
    return FALLBACK_MARKERS[zlib.crc32(source.encode("utf-8")) % len(FALLBACK_MARKERS)]


def source_pattern(source: str) -> str:
    """The plotly bar pattern of a source ("" = solid): fixed for the known ones, else by name hash."""
    if source in SOURCE_PATTERNS:
        return SOURCE_PATTERNS[source]
    return FALLBACK_PATTERNS[zlib.crc32(source.encode("utf-8")) % len(FALLBACK_PATTERNS)]
