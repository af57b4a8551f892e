"""The space uploads take on a public server, and the guard in front of the page's upload route.

The page's upload route (Gradio's) stores whatever a request carries in its cache before any
handler runs.  `UploadGuard` (ASGI middleware, given to launch) refuses a request larger than one
visitor's allowance, or one that would take every upload past the server's total, before a byte
is stored; Gradio's cache is emptied of old files on a timer (Blocks' delete_cache), visitors'
folders by `sweep` when they have been idle too long.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rest_core.app.policy import Policy
from rest_core.app.session import prune_sessions, sessions_root
from rest_core.app.settings import UploadError

MULTIPART_SLACK = 2**20  # headers and boundaries around the files of one upload request


def folder_bytes(roots: Sequence[Path]) -> int:
    """Bytes of every file under these folders (missing ones count 0)."""
    total = 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    pass
    return total


def sweep(policy: Policy) -> None:
    """Remove visitors' folders idle longer than the policy allows (public servers only)."""
    if policy.public:
        prune_sessions(max_age_s=policy.session_idle_s)


def check_room(policy: Policy, upload_cache: Path, incoming: int) -> None:
    """Refuse (UploadError) files that would take every visitor's uploads past the server's total."""
    if not policy.public:
        return
    sweep(policy)
    used = folder_bytes([sessions_root(), Path(upload_cache)])
    if used + incoming > policy.max_upload_total_bytes:
        raise UploadError("The server's space for uploaded files is full right now. Try again later, or draft "
                          "from the built-in datastore.")


class UploadGuard:
    """ASGI middleware: POSTs to the upload route are refused (413 / 507, with a message) when larger
    than one visitor's allowance or than the room left for uploads; a body without a length is counted
    as it arrives and cut off past the allowance."""

    def __init__(self, app: Any, policy: Policy, roots: Callable[[], Sequence[Path]]):
        self.app, self.policy, self.roots = app, policy, roots
        self._used, self._measured = 0, 0.0

    def used(self) -> int:
        if time.monotonic() - self._measured > 5.0:  # walking the folders costs: at most every 5 s
            self._used, self._measured = folder_bytes(self.roots()), time.monotonic()
        return self._used

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope["path"].rstrip("/").endswith(
                "/upload"):
            await self.app(scope, receive, send)
            return
        allowance = self.policy.max_upload_bytes + MULTIPART_SLACK
        headers = dict(scope.get("headers") or [])
        try:
            length = int(headers.get(b"content-length", b"-1"))
        except ValueError:
            length = -1
        if length > allowance:
            await _refuse(send, 413, f"Upload refused: {length / 2**20:.1f} MB in one request; at most "
                                     f"{self.policy.max_upload_bytes / 2**20:.0f} MB are accepted.")
            return
        if self.used() + max(length, 0) > self.policy.max_upload_total_bytes:
            await _refuse(send, 507, "Upload refused: the server's space for uploaded files is full right now. "
                                     "Try again later.")
            return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > allowance:
                raise UploadError("upload larger than its allowance")  # ends the request, stores nothing more
            return message

        self._measured = 0.0  # measure again after this upload
        await self.app(scope, counted, send)


async def _refuse(send: Callable, status: int, text: str) -> None:
    body = text.encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
