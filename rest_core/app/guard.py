"""The space uploads take on a public server, and the guard in front of the page's upload route.

The page's upload route (Gradio's) stores whatever a request carries in its cache before any handler
runs.  `UploadGuard` (ASGI middleware, given to launch) therefore reserves a request's bytes in the
`UploadLedger` before a byte is stored, under the ledger's lock, so requests sent together cannot all
pass one figure: past one visitor's allowance it answers 413, past the room left for every upload 507,
past what one client address may upload within the idle time 429, each with a message.  A body without
a length is counted as it arrives and cut off past the allowance.  The number of files is known once
the route has stored them: a request past the files allowed (per visitor, per address, in all) has them
removed again and is refused the same way.

The ledger's figure is what a walk of the upload folders measured (in a worker thread, never on the
event loop, at most every MEASURE_S), plus what was stored since that walk began, plus what requests in
flight reserved, so it can only overstate the space in use, never understate it.  Gradio's cache is
emptied of old files on a timer (Blocks' delete_cache), visitors' folders by `sweep` when they have
been idle too long; the next walk sees the room they leave.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import anyio

from rest_core.app.policy import Policy
from rest_core.app.session import prune_sessions
from rest_core.app.settings import UploadError
from rest_core.app.visitors import scope_address

MULTIPART_SLACK = 2**20  # headers and boundaries around the files of one upload request
MEASURE_S = 5.0  # the upload folders are walked again at most this often


class Refused(UploadError):
    """An upload the server has no room for; `status` is the HTTP status that says so."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def folder_usage(roots: Sequence[Path]) -> tuple[int, int]:
    """(bytes, files) of everything under these folders (missing ones count 0)."""
    total = files = 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                    files += 1
                except OSError:
                    pass
    return total, files


def sweep(policy: Policy) -> None:
    """Remove visitors' folders idle longer than the policy allows (public servers only)."""
    if policy.public:
        prune_sessions(max_age_s=policy.session_idle_s)


@dataclass
class Reservation:
    address: str
    nbytes: int
    entry: Optional[list] = None  # [time, bytes, files] in its address's uploads (None: a copy into a visitor's
    # folder, which counts against the server's room only)


class UploadLedger:
    """The bytes and files every upload holds on a public server: measured, stored since, and reserved."""

    def __init__(self, policy: Policy, roots: Callable[[], Sequence[Path]]):
        self.policy, self.roots = policy, roots
        self._lock = threading.Lock()
        self.measured = (0, 0)  # (bytes, files) the latest walk found
        self.measured_at = -1.0  # monotonic time of the latest walk's start (-1: never)
        self.since = [0, 0]  # bytes, files stored since the latest walk began
        self.reserved = 0  # bytes reserved by requests in flight
        self._walking = False
        self._by_address: dict[str, deque] = {}  # address -> (time, bytes, files) of its uploads and reservations

    # -- the figure
    def used(self) -> tuple[int, int]:
        """(bytes, files) counted as in use now (reservations included)."""
        with self._lock:
            return self.measured[0] + self.since[0] + self.reserved, self.measured[1] + self.since[1]

    def measure(self) -> None:
        """Walk the upload folders (blocking: run it in a worker thread) and take what it finds as the figure."""
        with self._lock:
            if self._walking:
                return
            self._walking, started, before = True, time.monotonic(), list(self.since)
        try:
            found = folder_usage(self.roots())
        finally:
            with self._lock:
                self._walking = False
        with self._lock:
            self.measured, self.measured_at = found, started
            self.since = [self.since[0] - before[0], self.since[1] - before[1]]  # stored during the walk: kept

    async def refresh(self) -> None:
        """Walk the folders again when the figure is older than MEASURE_S, off the event loop: the first time
        waited for, later in the background (the figure meanwhile only overstates the space in use)."""
        if self.measured_at >= 0 and time.monotonic() - self.measured_at < MEASURE_S:
            return
        if self.measured_at < 0:
            await anyio.to_thread.run_sync(self.measure)
        else:
            threading.Thread(target=self.measure, name="rest-upload-measure", daemon=True).start()

    # -- reserving and settling
    def reserve(self, address: str, nbytes: int, per_address: bool = True) -> Reservation:
        """Reserve `nbytes` for a request of `address` (Refused, with its status and message, when there is no
        room: 507 for the server, 429 for this address)."""
        policy, now, entry = self.policy, time.monotonic(), None
        with self._lock:
            used = self.measured[0] + self.since[0] + self.reserved
            if used + nbytes > policy.max_upload_total_bytes:
                raise Refused(507, "Upload refused: the server's space for uploaded files is full right now. Try "
                                   "again later, or draft from the built-in datastore.")
            if per_address:
                mine, _ = self._address_use(address, now)
                if mine + nbytes > policy.max_upload_address_bytes:
                    raise Refused(429, f"Upload refused: your network address has uploaded "
                                       f"{mine / 2**20:.0f} MB in the last {self._window() / 60:.0f} minutes; at "
                                       f"most {policy.max_upload_address_bytes / 2**20:.0f} MB are accepted. Try "
                                       "again later.")
                entry = [now, nbytes, 0]
                self._by_address.setdefault(address, deque()).append(entry)
            self.reserved += nbytes
            return Reservation(address, nbytes, entry)

    def settle(self, r: Reservation, nbytes: int, files: int) -> None:
        """The request stored `nbytes` in `files` files (Refused, the reservation given up, when an upload's files
        are more than allowed: the caller removes them).  A copy into a visitor's folder is only counted."""
        with self._lock:
            self.reserved -= r.nbytes
            if r.entry is not None:
                r.entry[1] = 0
                refusal = self._too_many(r.address, files)
                if refusal is not None:
                    raise refusal
                r.entry[1], r.entry[2] = nbytes, files
            self.since[0] += nbytes
            self.since[1] += files

    def _too_many(self, address: str, files: int) -> Optional[Refused]:
        """Why an upload of `files` files from `address` is refused (None: it is not)."""
        policy = self.policy
        if files > policy.max_upload_files:
            return Refused(413, f"Upload refused: {files} files in one request; at most {policy.max_upload_files} "
                                "are accepted.")
        if self.measured[1] + self.since[1] + files > policy.max_upload_total_files:
            return Refused(507, "Upload refused: the server holds as many uploaded files as it can right now. Try "
                                "again later.")
        if self._address_use(address, time.monotonic())[1] + files > policy.max_upload_address_files:
            return Refused(429, f"Upload refused: your network address has uploaded too many files in the last "
                                f"{self._window() / 60:.0f} minutes (at most {policy.max_upload_address_files}). "
                                "Try again later.")
        return None

    def release(self, r: Reservation) -> None:
        """The request stored nothing: its reservation is given back."""
        with self._lock:
            self.reserved -= r.nbytes
            if r.entry is not None:
                r.entry[1] = 0

    def _window(self) -> float:
        return max(600.0, float(self.policy.session_idle_s))

    def _address_use(self, address: str, now: float) -> tuple[int, int]:
        """(bytes, files) this address uploaded or reserved within the window (older entries forgotten)."""
        entries = self._by_address.get(address)
        if not entries:
            return 0, 0
        while entries and now - entries[0][0] > self._window():
            entries.popleft()
        if not entries:
            del self._by_address[address]
            return 0, 0
        return sum(e[1] for e in entries), sum(e[2] for e in entries)


class UploadGuard:
    """ASGI middleware: POSTs to the upload route reserve their size in the ledger first, and are refused (413 /
    429 / 507, with a message) when larger than one visitor's allowance or than the room left; a body without a
    length is counted as it arrives and cut off past the allowance; the files of a request past the number
    allowed are removed and the request refused."""

    def __init__(self, app: Any, ledger: UploadLedger):
        self.app, self.ledger = app, ledger

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope["path"].rstrip("/").endswith(
                "/upload"):
            await self.app(scope, receive, send)
            return
        policy = self.ledger.policy
        allowance = policy.max_upload_bytes + MULTIPART_SLACK
        length = _content_length(scope)
        if length > allowance:
            await _refuse(send, 413, f"Upload refused: {length / 2**20:.1f} MB in one request; at most "
                                     f"{policy.max_upload_bytes / 2**20:.0f} MB are accepted.")
            return
        await self.ledger.refresh()
        try:
            reservation = self.ledger.reserve(scope_address(scope, policy.trusted_proxies),
                                              length if length >= 0 else allowance)
        except Refused as refusal:
            await _refuse(send, refusal.status, str(refusal))
            return
        await self._stored(scope, receive, send, reservation, allowance)

    async def _stored(self, scope: dict, receive: Callable, send: Callable, reservation: Reservation,
                      allowance: int) -> None:
        """Let the route store the request, then settle its reservation with what it stored."""
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > allowance:
                raise UploadError("upload larger than its allowance")  # ends the request, stores nothing more
            return message

        held = HeldResponse(send)
        try:
            await self.app(scope, counted, held.send)
        except BaseException:
            self.ledger.release(reservation)
            raise
        if held.status != 200:
            self.ledger.release(reservation)
            return
        paths = held.paths()
        try:
            self.ledger.settle(reservation, seen, len(paths))
        except Refused as refusal:
            await anyio.to_thread.run_sync(_remove, paths)
            await _refuse(send, refusal.status, str(refusal))
            return
        await held.flush()


class HeldResponse:
    """The upload route's answer: held back when it succeeded (until the guard has counted its files), passed
    on as it comes otherwise."""

    def __init__(self, send: Callable):
        self._send, self.status, self._held, self._body = send, 0, [], b""

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        if self.status != 200:
            await self._send(message)
            return
        self._held.append(message)
        self._body += message.get("body", b"")

    def paths(self) -> list[str]:
        """The stored files' paths the route answered with."""
        try:
            answer = json.loads(self._body or b"[]")
        except ValueError:
            return []
        return [p for p in answer if isinstance(p, str)] if isinstance(answer, list) else []

    async def flush(self) -> None:
        for message in self._held:
            await self._send(message)


def _content_length(scope: dict) -> int:
    headers = dict(scope.get("headers") or [])
    try:
        return int(headers.get(b"content-length", b"-1"))
    except ValueError:
        return -1


def _remove(paths: list[str]) -> None:
    """Remove stored files (and the folder the route made for each, when it is left empty)."""
    for p in paths:
        try:
            os.unlink(p)
            os.rmdir(os.path.dirname(p))
        except OSError:
            pass


async def _refuse(send: Callable, status: int, text: str) -> None:
    body = text.encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


URL_REFUSED = ("A web address is not accepted as a file on this server: upload the file itself (Gradio would "
               "otherwise download whatever the address holds).")


def refuse_url_files(component: Any) -> None:
    """Make a file input of the page refuse a web address given in place of a file (a client of the API may
    send one): Gradio downloads http(s) paths of a file input into its cache, with no size limit and past
    the upload route and its guard, before any handler runs.  The input's move of each path into the cache
    (gradio 6: Block.async_move_resource_to_block_cache, and its blocking twin) refuses such a path first."""
    from gradio.exceptions import Error

    def refused(path: Any) -> bool:
        return isinstance(path, str) and path.strip().lower().startswith(("http://", "https://"))

    moves = component.async_move_resource_to_block_cache, component.move_resource_to_block_cache

    async def async_move(path: Any) -> Any:
        if refused(path):
            raise Error(URL_REFUSED, print_exception=False)
        return await moves[0](path)

    def move(path: Any) -> Any:
        if refused(path):
            raise Error(URL_REFUSED, print_exception=False)
        return moves[1](path)

    component.async_move_resource_to_block_cache, component.move_resource_to_block_cache = async_move, move
