"""Small pieces of HTML the page shows: a token's text, a chat bubble, the origin legend.

The chat renders Markdown, where a line break inside raw HTML would end the HTML block
(and four spaces after it start a code block): everything here stays on one line.
"""
from __future__ import annotations

import html

from rest_core.traces import figures
from rest_core.traces.origins import one_line

__all__ = ["one_line", "origin_legend_html", "plain_answer_html", "token_html", "user_bubble"]


def token_html(text: str) -> str:
    """A token's text, its spaces and line breaks made visible, escaped for HTML."""
    return html.escape(figures.show_token(text))


def user_bubble(message: str) -> dict:
    """The visitor's message as a chat message."""
    return {"role": "user", "content": f'<div class="rest-user">{one_line(message)}</div>'}


def plain_answer_html(text: str) -> str:
    """Streamed text not yet tinted by origin (the race's REST side while it runs)."""
    return f'<div class="rest-answer">{one_line(text)}</div>'


def origin_legend_html() -> str:
    """What the tints of the answer mean: one key per known origin, then any other store."""
    keys = [f'<span class="origin-key" style="background:{colour}">{html.escape(what)}</span>'
            for colour, what in figures.ORIGIN_STYLES.values()]
    keys.append('<span class="origin-key">other stores: a tint of their own'
                "</span>")
    keys.append('<span class="origin-key">│ a new step starts</span>')
    return f'<div class="origin-legend">{"".join(keys)}</div>'
