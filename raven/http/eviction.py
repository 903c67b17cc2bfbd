"""Which connection a full listener closes to make room for a new one (the ops listeners: probes and scrapes).

A listener whose clients need no credentials cannot tell an attacker from a kubelet by what it sends. With
only caps, whoever fills the listener first keeps it: held keep-alive connections from enough addresses make
every new connection, the kubelet's probes included, get a refusal. So a full listener that evicts takes a
connection away to admit the new one, chosen so that a client holding few (a kubelet opens one connection per
probe, a Prometheus holds one) is the last to lose one:

- a connection being answered is never taken. The ones taken first *wait*: one owing its request head for
  longer than ``grace`` (a local client's head follows its connect within milliseconds: such a head is
  overdue), then one idle between requests (a keep-alive connection);
- it is taken from the client holding the most connections (more than one): its oldest overdue head, else its
  connection idle longest; when that client has none, from any client: the oldest overdue head, else the
  connection idle longest. Failing those, only heads on their way are left: the heaviest client's oldest, else
  the oldest of all. A new probe's connection is the newest there, so it is taken only if a listener's worth of
  connections from as many addresses arrives before its head does (a flood of new connections at the rate the
  process accepts them is not something a listener can outlast: the NetworkPolicy bounds who can send it);
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

__all__ = ["Evictable", "Eviction"]


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
        if not self._count:
            return None
        floor = self.holds(client)
        count = self._count
        heaviest = max(count, key=count.__getitem__)
        if count[heaviest] < floor:
            return None
        stale = now - self.grace
        # The client holding the most: its oldest overdue head, else its connection idle longest (when every
        # client holds one, none is heavier: the order over all decides).
        if count[heaviest] > 1:
            for conn, since in self._head_of.get(heaviest, {}).items():
                if since <= stale:
                    return conn
                break
            for conn in self._idle_of.get(heaviest, ()):
                return conn
        # Any client holding at least the newcomer's count: the oldest overdue head, the connection idle longest.
        for conn, since in self._head.items():
            if since > stale:
                break
            if count[conn.client] >= floor:
                return conn
        for conn in self._idle:
            if count[conn.client] >= floor:
                return conn
        # Only heads on their way are left: the heaviest client's oldest (a burst of new connections from a few
        # addresses must not take a probe's), else the oldest of all.
        if count[heaviest] > 1:
            for conn in self._head_of.get(heaviest, ()):
                return conn
        for conn in self._head:
            if count[conn.client] >= floor:
                return conn
        return None
