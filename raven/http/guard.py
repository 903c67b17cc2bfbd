"""The connection guard: deadlines per connection phase and caps per client, for listeners that face hostile clients.

aiohttp's server has one timer, the keep-alive timeout, and no cap on connections. A client that opens a few
thousand connections and sends half a request head (or nothing) holds them until that timer fires, and when the
process runs out of descriptors every listener fails. A :class:`ConnectionGuard` wraps each connection's
protocol (raven/http/listener.py's :class:`~raven.http.listener.GuardedSite` installs it) and keeps
the accounts:

- a connection is *unproven* from its accept until the handler vouches for it (:meth:`ConnectionGuard.vouch`:
  the front end does so for a request that passed the credentials check), and *proven* after. Unproven
  connections are few and short-lived for a real client (one request head's time), so they have small caps:
  ``max_unproven_per_client`` per address and ``max_unproven`` in all; a connection beyond them is refused at
  once (a canned ``503`` and a close, counted). Proven connections are what Prometheus holds, one keep-alive
  connection per target, so their cap per address is derived from the fleet (``proven_cap``, given by the
  service) and never lower than ``max_per_client``; ``max_connections`` bounds proven and unproven together;
- a connection admitted while ``max_connections`` are held is *over the cap*: it stays within the unproven
  caps and its first request is answered ``503`` (naming the node, so that the refusal shows per node) and the
  connection closed; a listener with ``evict_grace`` (the ops listeners, whose handler never vouches) instead
  closes a waiting connection of the client holding the most to admit it (raven/http/eviction.py);
- a new connection must deliver a complete request head within ``head_timeout``; after a response, the next
  request's first byte must come within ``idle_timeout`` (keep-alive; ``head_timeout`` for an unproven
  connection, which has sent nothing but failed requests) and its complete head within ``head_timeout`` of
  that byte; a connection that misses a deadline is closed (``408`` for a started head);
- an idle keep-alive connection (at ``idle_timeout``, or by :meth:`ConnectionGuard.drain`) is closed only when
  nothing of a next request has arrived (raven/http/quiet.py); else that request is served (while
  draining, with ``Connection: close``) rather than reset;
- TLS listeners get ``head_timeout`` as the TLS handshake deadline too;
- a close waits for what is still buffered to be sent, and a client that reads nothing (its window stays
  zero) would keep a closed connection, its slot and its descriptor for ever: at every expiry of the timer a
  connection with bytes still buffered that the client took none of since the last one is aborted (a reset),
  whatever its phase, and a close is always followed by the timer, so that it finishes or is aborted.

While a request is being handled the guard's timers are off: the handler's own deadlines (body, response,
write stall) apply. The handler tells the guard with :meth:`ConnectionGuard.request_started` and
:meth:`ConnectionGuard.request_finished` (raven/http/listener.py's
:func:`~raven.http.listener.guarded_handler` and ``guard_middleware`` do it).

The guard's counts (unauthenticated and authenticated connections per client, the over-capacity ones, the
drain) and the per-connection protocol that moves a connection between them are one state kept in step, so
they live together here; the read buffer all guarded connections share is raven/http/readbuffer.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, cast

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol

from raven.http.clock import Clock
from raven.http.eviction import Eviction
from raven.http.quiet import parked, unread_bytes
from raven.http.readbuffer import READ_BUFFER, read_buffer
from raven.lograte import RateLimitedLog

__all__ = ["GROWTH_STEP", "READ_BUFFER", "ConnectionGuard", "GuardLimits", "Handler", "OnConnection"]

log = logging.getLogger("raven.http.guard")

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class OnConnection(Protocol):
    """A request as the guard sees it: which connection it came on (aiohttp's, or raven/http/call.py's)."""

    @property
    def transport(self) -> asyncio.Transport | None: ...


@dataclass(frozen=True, slots=True)
class GuardLimits:
    head_timeout: float = 10.0
    idle_timeout: float = 120.0
    max_connections: int = 8192  # proven and unproven together
    max_per_client: int = 2048  # proven connections from one address (at least; see ConnectionGuard.proven_cap)
    max_unproven: int | None = None  # None: max_connections (a listener whose handler never vouches)
    max_unproven_per_client: int | None = None  # None: max_per_client
    # None: a full listener refuses a new connection. A number: it closes a waiting connection of the client
    # holding the most to admit it (raven/http/eviction.py; a head owed longer than this is overdue).
    evict_grace: float | None = None

    def __post_init__(self) -> None:
        if self.evict_grace is not None and self.max_unproven is not None:
            raise ValueError("evict_grace is for listeners whose handler never vouches (max_unproven None)")

    @property
    def unproven_total(self) -> int:
        return self.max_connections if self.max_unproven is None else self.max_unproven

    @property
    def unproven_per_client(self) -> int:
        return self.max_per_client if self.max_unproven_per_client is None else self.max_unproven_per_client


def _canned(status: str, reason: str) -> bytes:
    body = f"raven: {reason}\n".encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\nX-Raven-Error: {reason}\r\n\r\n"
    ).encode() + body


_IDLE, _HEAD, _BUSY = 0, 1, 2

GROWTH_STEP = 256  # authenticated connections: ConnectionGuard.on_grown is called at most every this many
_RECHECK = 0.02  # seconds: an idle connection whose next request has begun to arrive is looked at again


class _GuardedProtocol(asyncio.BufferedProtocol):
    """Wraps aiohttp's per-connection protocol: counts it, times its phases, passes everything else through.

    It takes the connection's bytes as a buffered protocol (into a buffer shared per thread, see
    :class:`_ReadBuffer`) and hands aiohttp's protocol a copy with ``data_received``.
    """

    __slots__ = ("_admitted", "_buffered", "_client", "_evicted", "_guard", "_inner", "_over", "_phase",
                 "_preadmitted", "_proven", "_settle_by", "_transport", "clock")

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol, client: str | None = None,
                 over: bool = False) -> None:
        self._guard = guard
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        # A client given here was counted at the TCP accept already (TLS: before its handshake).
        self._preadmitted = client is not None
        self._client = client or "?"
        self._phase = _HEAD
        # Every deadline of the connection, the guard's and the handler's (raven/http/h1server.py): one timer.
        self.clock = Clock(asyncio.get_running_loop())
        self._admitted = False
        self._proven = False
        self._over = over  # admitted beyond max_connections: its first request is refused
        self._buffered = 0  # bytes still to send at the last expiry (0: none): the client's progress since
        self._settle_by = 0.0  # idle, its next request arriving: closed anyway at this loop time (0: not set)
        self._evicted = False  # closed to make room for another: released from the counts then

    @property
    def client(self) -> str:
        return self._client

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self._transport = transport
        if not self._preadmitted:
            peer = transport.get_extra_info("peername")
            self._client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            refusal, self._over = self._guard.admit(self._client)
            if refusal is not None:
                transport.write(_canned("503 Service Unavailable", refusal))
                transport.close()
                return
        self._admitted = True
        self._guard._conns[transport] = self
        if self._guard._eviction is not None:
            self._guard._eviction.add(self, asyncio.get_running_loop().time())
        self._arm(self._guard.limits.head_timeout)  # a new connection owes a complete head
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if self._phase == _IDLE:  # the first byte of the next request: its head has a deadline now
            self._phase = _HEAD
            self._settle_by = 0.0
            self._arm(self._guard.limits.head_timeout)
            self._waiting(head=True)
        self._inner.data_received(data)

    def get_buffer(self, sizehint: int) -> memoryview:
        return read_buffer.view

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(read_buffer.view[:nbytes].tobytes())

    def eof_received(self) -> bool | None:
        if not self._admitted:
            return None
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.clock.close()
        if not self._admitted:
            return
        self._admitted = False
        if not self._evicted:  # an evicted connection was released when it was chosen
            self._guard.release(self._client, self._transport, self._proven, self._over)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    async def drained(self) -> None:
        """Return once the transport accepts writes again (the client read); raise if the connection is lost.

        The write flow control is aiohttp's protocol's (its drain helper, which its own writers wait on): this
        wrapper passes pause and resume through and keeps no waiters of its own."""
        try:
            if self._admitted:
                await cast(BaseProtocol, self._inner)._drain_helper()
        except ConnectionError:
            pass  # lost meanwhile: said below
        if not self._admitted:
            raise ConnectionResetError("client connection lost")

    # ---------------------------------------------------------------- phases

    def _arm(self, delay: float) -> None:
        self.clock.after(delay, self._expired)

    def busy(self) -> None:
        self._phase = _BUSY
        self._buffered = 0
        self._settle_by = 0.0
        if self._guard._eviction is not None and not self._evicted:
            self._guard._eviction.busy(self)
        self.clock.clear()

    def idle(self, owes_head: bool = False) -> None:
        """The request was answered; ``owes_head``: the next one has begun to arrive (pipelined)."""
        if self._phase == _BUSY and self._admitted and owes_head:
            self._phase = _HEAD
            self._arm(self._guard.limits.head_timeout)
            self._waiting(head=True)
        elif self._phase == _BUSY and self._admitted:
            self._phase = _IDLE
            limits = self._guard.limits
            # An unproven connection has sent only failed requests: it may not sit idle for long.
            self._arm(limits.idle_timeout if self._proven else min(limits.idle_timeout, limits.head_timeout))
            self._waiting(head=False)

    def _waiting(self, head: bool) -> None:  # it waits for a request head now, or idles
        if self._guard._eviction is not None and not self._evicted:
            self._guard._eviction.waiting(self, asyncio.get_running_loop().time(), head)

    def _expired(self) -> None:
        transport = self._transport
        if transport is None:
            return
        head_timeout = self._guard.limits.head_timeout
        buffered = transport.get_write_buffer_size()
        if buffered and (self._buffered == 0 or buffered < self._buffered):
            # An answer is still going out and the client took some of it since the last look (or this is the
            # first): look again, a close now would wait for the same bytes.
            self._buffered = buffered
            self._arm(head_timeout)
            return
        if buffered:
            # The client took nothing for a whole period: a close would never finish (it waits for these
            # bytes); a reset frees the connection now.
            self._guard.refused("write-stall", self._client,
                                f"read none of the {buffered} bytes still to send for {head_timeout:g}s")
            transport.abort()
            return
        self._buffered = 0
        if transport.is_closing():
            return  # closing with nothing left to send: its end is on the way
        if self._phase == _HEAD:
            self._guard.refused("head-timeout", self._client, f"no complete request head within {head_timeout:g}s")
            transport.write(_canned("408 Request Timeout", f"no complete request head within {head_timeout:g}s"))
            transport.close()
            self._arm(head_timeout)  # the 408 may not go out: a client that reads nothing is reset then
        elif self._phase == _IDLE:
            self.end_keepalive()  # keep-alive over: an ordinary close, not an error

    def end_keepalive(self) -> bool:
        """Close this idle connection if quiet (raven/http/quiet.py), else look again in a moment (its bytes
        move it to its head's deadline, aiohttp's request to :meth:`busy`; closed anyway after a head's time)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return False
        if unread_bytes(transport) or not parked(self._inner):
            now = asyncio.get_running_loop().time()
            if not self._settle_by:
                self._settle_by = now + self._guard.limits.head_timeout
            if now < self._settle_by:
                self._arm(_RECHECK)
                return False
        transport.close()
        return True


class ConnectionGuard:
    """Counts a listener's connections per client address and runs their head and idle deadlines."""

    def __init__(
        self,
        name: str,
        limits: GuardLimits,
        on_refused: Callable[[str], None] | None = None,
        proven_cap: Callable[[], int] | None = None,
        on_grown: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.limits = limits
        self.on_refused = on_refused
        # Proven connections one address may hold: at least limits.max_per_client; the service derives more
        # from the fleet (a Prometheus holds one keep-alive connection per target).
        self.proven_cap = proven_cap
        self._unproven: dict[str, int] = {}  # client address -> unproven connections (over-the-cap ones too)
        self._proven: dict[str, int] = {}  # client address -> proven connections
        self._unproven_total = 0
        self._over_total = 0
        self._conns: dict[asyncio.BaseTransport, _GuardedProtocol] = {}
        self._eviction = Eviction(limits.evict_grace) if limits.evict_grace is not None else None
        self._log = RateLimitedLog(log)
        self.draining = False
        self._empty_waiters: list[asyncio.Future[None]] = []
        # Called when the authenticated connections grew by a step (GROWTH_STEP, or an eighth) since the last
        # call: their objects are long-lived state, which the service freezes out of the collector's way
        # (raven.ops.gcpause.settle_soon); otherwise every full collection walks all of them.
        self.on_grown = on_grown
        self._grown_from = 0

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def unproven(self) -> int:
        return self._unproven_total

    def per_client_cap(self) -> int:
        derived = self.proven_cap() if self.proven_cap is not None else 0
        return max(self.limits.max_per_client, derived)

    def wrap(
        self, factory: Callable[[], asyncio.Protocol], client: str | None = None, over: bool = False
    ) -> Callable[[], asyncio.BufferedProtocol]:
        def make() -> asyncio.BufferedProtocol:
            return _GuardedProtocol(self, factory(), client, over)

        return make

    def admit(self, client: str) -> tuple[str | None, bool]:
        """Count a new connection as unproven: (refusal or None, whether it is over max_connections)."""
        limits = self.limits
        held = self._unproven.get(client, 0)
        if held >= limits.unproven_per_client:
            self.refused("client-connections", client,
                          f"client {client} holds {held} unauthenticated connections to {self.name} "
                          f"(limit {limits.unproven_per_client} per client)")
            return "too many connections from this address", False
        if self._eviction is not None and (self._unproven_total >= limits.unproven_total
                                           or len(self._conns) - self._over_total >= limits.max_connections):
            self._make_room(self._eviction, client)  # if it cannot, the checks below refuse the newcomer
        if self._unproven_total >= limits.unproven_total:
            self.refused("too-many-connections", client,
                          f"{self.name} holds {self._unproven_total} unauthenticated connections "
                          f"(limit {limits.unproven_total})")
            return "too many connections; try again later", False
        over = len(self._conns) - self._over_total >= limits.max_connections
        if over and limits.max_unproven is None:  # a listener that never vouches: refused here and now
            self.refused("too-many-connections", client,
                          f"{self.name} holds {len(self._conns)} connections (limit {limits.max_connections})")
            return "too many connections; try again later", False
        self._unproven[client] = held + 1
        self._unproven_total += 1
        self._over_total += over
        return None, over

    def _make_room(self, eviction: Eviction, client: str) -> None:
        """The listener is full: close a waiting connection of the client holding the most, if there is one."""
        victim = eviction.victim(client, asyncio.get_running_loop().time())
        if not isinstance(victim, _GuardedProtocol) or victim._transport is None:
            return
        transport = victim._transport
        self.refused("evicted", victim._client, f"evicted to admit one from {client}: the listener is full "
                     f"({self.limits.max_connections}) and {victim._client} holds {eviction.holds(victim._client)}")
        victim._evicted = True
        self.release(victim._client, transport, victim._proven, victim._over)
        if victim._phase == _IDLE and not transport.get_write_buffer_size():
            transport.close()  # an idle keep-alive connection: an ordinary close
        else:
            transport.abort()  # its head is overdue, or it reads nothing of an answer: a close would wait

    def release(self, client: str, transport: asyncio.BaseTransport | None, proven: bool = False,
                 over: bool = False) -> None:
        """A connection counted by :meth:`admit` ended (``transport`` None: before its protocol came up)."""
        if transport is not None:
            conn = self._conns.pop(transport, None)
            if conn is not None and self._eviction is not None:
                self._eviction.remove(conn)
        counts = self._proven if proven else self._unproven
        held = counts.get(client, 0) - 1
        if held > 0:
            counts[client] = held
        else:
            counts.pop(client, None)
        if not proven:
            self._unproven_total -= 1
        self._over_total -= over
        self._grown_from = min(self._grown_from, len(self._conns) - self._unproven_total)
        if not self._conns:
            waiters, self._empty_waiters = self._empty_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def drain(self) -> int:
        """Close every keep-alive connection that waits for its next request, quiet; returns how many closed.

        A connection in the middle of a request is left alone, and so is an idle one whose next request has
        begun to arrive (:meth:`_GuardedProtocol.end_keepalive`): the caller answers with ``Connection: close``.
        """
        self.draining = True
        closed = 0
        for conn in list(self._conns.values()):
            if conn._phase == _IDLE:
                closed += conn.end_keepalive()
        return closed

    async def wait_empty(self) -> None:
        """Return once the listener holds no connection (the caller bounds the wait)."""
        while self._conns:
            fut = asyncio.get_running_loop().create_future()
            self._empty_waiters.append(fut)
            await fut

    def vouch(self, request: OnConnection) -> tuple[str, str] | None:
        """The handler vouches for ``request``'s connection (it presented valid credentials): make it proven.

        Returns None when the connection is proven (or not guarded here), else why it may not be served, as
        (label, reason): ``over-capacity`` (admitted while ``max_connections`` were held) or ``client-cap`` (its
        address already holds its cap of proven connections). The handler then refuses the request and closes
        the connection.
        """
        conn = self._conns.get(request.transport) if request.transport is not None else None
        if conn is None or conn._proven:
            return None
        client = conn._client
        if conn._over:
            return "over-capacity", (f"the gateway's front end holds {len(self._conns) - self._over_total} "
                                     f"connections (front.max_connections {self.limits.max_connections})")
        held, cap = self._proven.get(client, 0), self.per_client_cap()
        if held >= cap:
            return "client-cap", (f"this client address holds {held} authenticated connections (limit {cap}: "
                                  "front.max_connections_per_client, or more for the registered targets)")
        conn._proven = True
        self._proven[client] = held + 1
        left = self._unproven.get(client, 0) - 1
        if left > 0:
            self._unproven[client] = left
        else:
            self._unproven.pop(client, None)
        self._unproven_total -= 1
        if self.on_grown is not None:
            proven = len(self._conns) - self._unproven_total
            if proven - self._grown_from >= max(GROWTH_STEP, self._grown_from // 8):
                self._grown_from = proven
                self.on_grown()
        return None

    def connection(self, transport: asyncio.BaseTransport) -> _GuardedProtocol | None:
        return self._conns.get(transport)

    def proven(self, request: OnConnection) -> bool:
        conn = self._conns.get(request.transport) if request.transport is not None else None
        return conn is None or conn._proven

    def refused(self, label: str, client: str, why: str) -> None:
        """Count a refused connection under ``label`` and log it (rate-limited per client and label)."""
        if self.on_refused is not None:
            self.on_refused(label)
        self._log.warning(client, label, "%s: connection from %s closed: %s", self.name, client, why)

    def accept_failed(self, exc: OSError) -> None:
        """The accept loop could not take a connection (out of descriptors, or reset before the accept)."""
        self._log.warning("accept", "accept", "%s: accept failed: %s", self.name, exc)

    async def drained(self, request: OnConnection) -> None:
        """Wait until ``request``'s connection can take more writes (for connections taken over, e.g. CONNECT)."""
        conn = self._conns.get(request.transport) if request.transport is not None else None
        if conn is not None:
            await conn.drained()

    def request_started(self, request: OnConnection) -> None:
        conn = self._conns.get(request.transport) if request.transport is not None else None
        if conn is not None:
            conn.busy()

    def request_finished(self, request: OnConnection) -> None:
        conn = self._conns.get(request.transport) if request.transport is not None else None
        if conn is not None:
            conn.idle()
