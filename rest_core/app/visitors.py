"""Who a visitor is: the client address behind a request, and the sessions one address holds.

A Gradio page names each session by an id the client chooses, so a limit per session alone lets one
client become any number of visitors.  Public mode therefore keys its limits on the client address as
well: on a Hugging Face Space the address the proxy in front of the server forwarded, elsewhere the
connection's.  Which X-Forwarded-For entry to believe: each proxy appends the address it was reached
from, so with `hops` trusted proxies in front of the server the entry `hops` places from the right was
written by the outermost trusted proxy and names the client; everything left of it the client could
have written itself.  An IPv6 address counts by its /64 network (one subscriber's block).

The server side of a session is bounded the same way: `Visitors` keeps, per address, the sessions it
used most recently and names the ones past `per_address` to forget (`forget_sessions` drops them from
Gradio's state holder, with their delete callbacks: the visitor's folder goes too).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

UNKNOWN = "unknown"  # no address at all (a request made inside the server)
SWEEP_S = 60.0  # idle sessions are looked for at most this often
_TAG_KEY = secrets.token_bytes(16)  # per process: a recorded tag cannot be turned back into an address


def address_key(host: Optional[str]) -> str:
    """The address a limit counts by: an IPv4 address as it is, an IPv6 address by its /64 network, anything
    else (a name) as given, cut to 64 characters."""
    host = (host or "").strip().strip("[]")
    if not host:
        return UNKNOWN
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def forwarded_entries(values: Iterable[str]) -> list[str]:
    """Every X-Forwarded-For entry, in order, over all the header's lines (a port after an IPv4 address or a
    bracketed IPv6 address is dropped)."""
    entries = []
    for value in values:
        for item in str(value).split(","):
            item = item.strip()
            if item.startswith("[") and "]" in item:
                item = item[1:item.index("]")]
            elif item.count(":") == 1:
                item = item.split(":")[0]
            if item:
                entries.append(item)
    return entries


def client_address(peer: Optional[str], forwarded: Sequence[str], hops: int) -> str:
    """The client's address: with `hops` trusted proxies, the X-Forwarded-For entry `hops` places from the right
    (a request that passed fewer proxies than that counts by its peer, the proxy itself); with none, the peer."""
    entries = forwarded_entries(forwarded)
    if hops > 0 and len(entries) >= hops:
        return address_key(entries[-hops])
    return address_key(peer)


def request_address(request: Any, hops: int) -> str:
    """`client_address` of a gr.Request (or anything with .client.host and .headers); UNKNOWN without one."""
    if request is None:
        return UNKNOWN
    try:
        client = getattr(request, "client", None)
        peer = getattr(client, "host", None) if client is not None else None
        headers = getattr(request, "headers", None) or {}
        values = headers.getlist("x-forwarded-for") if hasattr(headers, "getlist") else \
            [v for k, v in dict(headers).items() if str(k).lower() == "x-forwarded-for"]
    except (AttributeError, TypeError, ValueError):
        return UNKNOWN
    return client_address(peer, values, hops)


def scope_address(scope: Mapping[str, Any], hops: int) -> str:
    """`client_address` of an ASGI request scope (the upload guard's)."""
    client = scope.get("client") or (None, None)
    values = [v.decode("latin-1") for k, v in scope.get("headers") or [] if k.lower() == b"x-forwarded-for"]
    return client_address(client[0], values, hops)


def address_tag(address: str) -> str:
    """What a recorded run keeps of its visitor's address: a keyed hash (the key lives in this process only, so
    the trace store never holds an address, and a tag means nothing after a restart)."""
    return "a" + hmac.new(_TAG_KEY, address.encode("utf-8", "replace"), hashlib.sha256).hexdigest()[:16]


class Visitors:
    """The sessions each address used, most recent last: at most `per_address` per address (the least recently
    used ones past that are named to be forgotten), none idle longer than `idle_s`."""

    def __init__(self, per_address: int, idle_s: float):
        self.per_address, self.idle_s = max(1, per_address), idle_s
        self._lock = threading.Lock()
        self._by_address: dict[str, OrderedDict[str, float]] = {}
        self._address_of: dict[str, str] = {}
        self.forgotten = 0  # sessions named to be forgotten so far
        self._swept = time.monotonic()

    def admit(self, address: str, session_id: str) -> list[str]:
        """Session `session_id` of `address` made a request now: the sessions to forget because of it (this
        address's least recently used past `per_address`, and every session idle longer than `idle_s`)."""
        now = time.monotonic()
        with self._lock:
            moved = self._address_of.get(session_id)
            if moved is not None and moved != address:  # a visitor whose address changed counts where it is now
                self._drop(moved, session_id)
            sessions = self._by_address.setdefault(address, OrderedDict())
            sessions[session_id] = now
            sessions.move_to_end(session_id)
            self._address_of[session_id] = address
            gone = list(sessions)[:max(0, len(sessions) - self.per_address)]
            for sid in gone:
                self._drop(address, sid)
            if now - self._swept > SWEEP_S:
                gone += self._idle(now)
            self.forgotten += len(gone)
            return gone

    def _idle(self, now: float) -> list[str]:
        """Forget every session idle longer than idle_s (whatever its address); their ids."""
        self._swept = now
        idle = [(address, sid) for address, sessions in self._by_address.items()
                for sid, seen in sessions.items() if now - seen > self.idle_s]
        for address, sid in idle:
            self._drop(address, sid)
        return [sid for _, sid in idle]

    def _drop(self, address: str, session_id: str) -> None:
        sessions = self._by_address.get(address)
        if sessions is not None:
            sessions.pop(session_id, None)
            if not sessions:
                del self._by_address[address]
        self._address_of.pop(session_id, None)

    def held(self, address: str) -> int:
        """How many sessions this address holds now."""
        with self._lock:
            return len(self._by_address.get(address, ()))


def forget_sessions(holder: Any, session_ids: Iterable[str]) -> int:
    """Drop these sessions from Gradio's state holder (gradio 6: `Blocks.state_holder`, a StateHolder): their
    gr.State delete callbacks run (the visitor's folder goes) and the holder forgets their stored page state.
    A later request of such a session starts it afresh.  Returns how many were held."""
    if holder is None:
        return 0
    dropped = 0
    for sid in session_ids:
        if sid not in holder:
            continue
        holder.delete_state(sid)  # runs the delete callbacks
        with holder.lock:
            holder.session_data.pop(sid, None)
            holder.time_last_used.pop(sid, None)
        dropped += 1
    return dropped
