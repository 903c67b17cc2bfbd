"""Which connection a full listener closes to make room for a new one (the ops listeners: probes and scrapes).

A listener whose clients need no credentials cannot tell an attacker from a kubelet by what it sends. With
only caps, whoever fills the listener first keeps it: held keep-alive connections from enough addresses make
every new connection, the kubelet's probes included, get a refusal. So a full listener that evicts takes a
connection away to admit the new one, chosen so that a client holding few (a kubelet opens one connection per
probe, a Prometheus holds one) is the last to lose one:

- a connection being answered is never taken. The ones taken first *wait*: one owing its request head for
  longer than ``grace`` (a local client's head follows its connect within milliseconds: such a head is
  overdue), then one idle between requests (a keep-alive connection), then a head on its way;
- a client holding more than ``FEW`` connections gives first, whatever its connections wait for: the one of
  those holding the most, its oldest overdue head, else its connection idle longest, else its oldest head on
  its way. So 9 addresses x 64 connections that only ever send heads slowly lose theirs, not Prometheus's one
  idle keep-alive connection. When no client holds more than ``FEW``, the order over all decides: the oldest
  overdue head, else the connection idle longest, else the oldest head on its way. A new probe's connection is
  the newest there, so it is taken only if a listener's worth of connections from as many addresses arrives
  before its head does (a flood of new connections at the rate the process accepts them is not something a
  listener can outlast: the NetworkPolicy bounds who can send it);
- no connection is taken from a client that holds fewer than the newcomer's own: an address holding many
  cannot displace one holding few. Many addresses holding one each (an IPv6 prefix) displace each other, and
  a Prometheus's idle connection among them; never a probe's connection that is being answered or whose head
  is on its way while there is an older one to take.

Closing an idle keep-alive connection loses nothing: an HTTP client sends its next request on a new connection
(Go's client, so Prometheus's, and aiohttp's also resend an idempotent request that met the close).

This module keeps the order (oldest first, per client and over all) and picks; the guard
(raven/http/guard.py) tells it when a connection arrives, changes phase and ends, and closes the victim.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

__all__ = ["FEW", "Evictable", "Eviction"]

FEW = 4
"""The most connections a legitimate ops client holds at once: a kubelet's concurrent probes (startup, liveness,
readiness), a Prometheus's keep-alive connection per job. A client holding more is taken from first."""


class Evictable(Hashable, Protocol):
    """What the eviction needs to know of a connection: its client's address."""

    @property
    def client(self) -> str: ...


class Eviction:
    """One listener's connections: how many each client holds, and which wait, in the order they started to.

    Idle connections (waiting for their next request) and connections owing a request head are kept apart,
    each oldest first, per client and over all (a dict's insertion order); a connection being answered is in
    neither. The guard calls :meth:`add` when a connection comes up (it owes its first head), :meth:`waiting`
    when it goes idle or a head begins, :meth:`busy` when a request is being answered, :meth:`remove` at its
    end.
    """

    __slots__ = ("_count", "_head", "_head_of", "_idle", "_idle_of", "grace")

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._count: dict[str, int] = {}
        self._idle: dict[Evictable, None] = {}
        self._head: dict[Evictable, float] = {}  # -> when it started to owe its head
        self._idle_of: dict[str, dict[Evictable, None]] = {}
        self._head_of: dict[str, dict[Evictable, float]] = {}

    def __len__(self) -> int:
        return sum(self._count.values())

    def holds(self, client: str) -> int:
        return self._count.get(client, 0)

    def add(self, conn: Evictable, now: float) -> None:
        self._count[conn.client] = self._count.get(conn.client, 0) + 1
        self._put(conn, now, head=True)

    def waiting(self, conn: Evictable, now: float, head: bool) -> None:
        self.busy(conn)
        self._put(conn, now, head)

    def busy(self, conn: Evictable) -> None:
        client = conn.client
        if self._idle.pop(conn, 0) is None:
            own = self._idle_of[client]
            del own[conn]
            if not own:
                del self._idle_of[client]
        elif self._head.pop(conn, None) is not None:
            owed = self._head_of[client]
            del owed[conn]
            if not owed:
                del self._head_of[client]

    def remove(self, conn: Evictable) -> None:
        self.busy(conn)
        client = conn.client
        left = self._count.get(client, 0) - 1
        if left > 0:
            self._count[client] = left
        else:
            self._count.pop(client, None)

    def _put(self, conn: Evictable, now: float, head: bool) -> None:
        if head:
            self._head[conn] = now
            self._head_of.setdefault(conn.client, {})[conn] = now
        else:
            self._idle[conn] = None
            self._idle_of.setdefault(conn.client, {})[conn] = None

    def victim(self, client: str, now: float) -> Evictable | None:
        """The connection to close so that a new one from ``client`` fits, or None (the newcomer is refused)."""
        heads, idle, count = self._head_of, self._idle_of, self._count
        heaviest = max((c for c in count if c in heads or c in idle), key=count.__getitem__, default=None)
        if heaviest is None:
            return None
        floor = self.holds(client)
        if count[heaviest] < floor:
            return None
        stale = now - self.grace
        # A client holding more than a legitimate one does gives first, whatever its connections wait for: its
        # oldest overdue head, else its connection idle longest, else its oldest head on its way. No one holding
        # few (an idle Prometheus) loses a connection while such a client has one that is not being answered.
        if count[heaviest] > FEW:
            for conn, since in self._head_of.get(heaviest, {}).items():
                if since <= stale:
                    return conn
                break
            for conn in self._idle_of.get(heaviest, ()):
                return conn
            for conn in self._head_of.get(heaviest, ()):
                return conn
        # Among clients holding few each (and at least the newcomer's count): the oldest overdue head, the
        # connection idle longest, the oldest head on its way.
        for conn, since in self._head.items():
            if since > stale:
                break
            if count[conn.client] >= floor:
                return conn
        for conn in self._idle:
            if count[conn.client] >= floor:
                return conn
        for conn in self._head:
            if count[conn.client] >= floor:
                return conn
        return None
