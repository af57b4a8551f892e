"""Decodes take turns: one runs at a time, the others wait in line, first come first served.

On a public server a visitor holds at most one place in line (a second decode while the first
waits or runs is refused with a message), one client address at most `per_address` places
whatever the sessions it opens, and the line itself is bounded, so no visitor can fill it and
everyone ahead of a newcomer is someone else: the line is fair by construction.  Everything
that runs or loads a model takes a place: decodes, the datastore explorer, building a store
from uploads, a step run again.
A waiting handler polls `Ticket.wait` and tells its visitor how many decodes are ahead.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional


class Busy(ValueError):
    """The decode cannot join the line now; the message says why and what to do."""


class Ticket:
    """One place in line; `leave` (always, in a finally) gives it up, running or not."""

    def __init__(self, turns: Turns, number: int, owner: str, address: str = ""):
        self.turns, self.number, self.owner, self.address = turns, number, owner, address
        self.joined = time.monotonic()
        self.started: Optional[float] = None  # when its turn came

    def ahead(self) -> int:
        """How many decodes run or wait before this one."""
        return self.turns.ahead(self)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for this ticket's turn; True once it has come."""
        return self.turns.wait(self, timeout_s)

    def leave(self) -> None:
        self.turns.leave(self)


class Turns:
    """The line of decodes (one runs; `max_waiting` may wait; `one_each`: one place per visitor; `per_address`:
    places per client address)."""

    def __init__(self, max_waiting: Optional[int] = None, one_each: bool = False, per_address: Optional[int] = None):
        self.max_waiting, self.one_each, self.per_address = max_waiting, one_each, per_address
        self._line: list[Ticket] = []  # the first one runs
        self._cond = threading.Condition()
        self._numbers = itertools.count(1)
        self.longest_wait_s = 0.0  # the longest any ticket waited for its turn (reported by the load test)
        self.most_per_address = 0  # the most places one address held at once (reported by the load test)
        self.served = 0

    def join(self, owner: str, address: str = "") -> Ticket:
        """A place at the end of the line (Busy when this visitor has one already, its address has
        `per_address`, or the line is full)."""
        with self._cond:
            if self.one_each and any(t.owner == owner for t in self._line):
                raise Busy("You already have a decode or another turn in the line (a look-up, a store build) running "
                           "or waiting: wait for it to finish, or press Stop first.")
            if self.per_address is not None and sum(t.address == address for t in self._line) >= self.per_address:
                raise Busy(f"Your network address already has {self.per_address} decodes running or waiting (every "
                           "page open from one address counts together): wait for one of them to finish.")
            if self.max_waiting is not None and len(self._line) > self.max_waiting:
                raise Busy(f"The server is busy: {len(self._line) - 1} decodes are waiting. Try again in a "
                           "minute.")
            ticket = Ticket(self, next(self._numbers), owner, address)
            self._line.append(ticket)
            self.most_per_address = max(self.most_per_address, sum(t.address == address for t in self._line))
            return ticket

    def ahead(self, ticket: Ticket) -> int:
        with self._cond:
            return self._line.index(ticket) if ticket in self._line else 0

    def wait(self, ticket: Ticket, timeout_s: float) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self._line and self._line[0] is ticket, timeout=timeout_s):
                return False
            if ticket.started is None:
                ticket.started = time.monotonic()
                self.longest_wait_s = max(self.longest_wait_s, ticket.started - ticket.joined)
                self.served += 1
            return True

    def leave(self, ticket: Ticket) -> None:
        with self._cond:
            if ticket in self._line:
                self._line.remove(ticket)
                self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._line)


TURN_GAP_S = 0.02  # between two chunks of background work: time for a decode that waits to take the model


@contextmanager
def between_decodes(lock: threading.Lock) -> Iterator[None]:
    """Hold a model's `lock` for one chunk of background work (the dense store's build), letting a decode that
    waits for the model go first: one released by the last chunk takes the lock during the gap."""
    time.sleep(TURN_GAP_S)
    while lock.locked():
        time.sleep(0.05)
    with lock:
        yield
