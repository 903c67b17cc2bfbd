"""The front end Prometheus talks to: route by Host, absolute URI or CONNECT, through the tunnel.

Every failure that happens before the response head is answered with 4xx/5xx and a body
that says which node and why (and the same line is logged). A failure after the head has
been sent cannot change the status any more: the client connection is closed so that
the response is visibly broken (short body or missing final chunk), never complete.

The parts: parsing and checking a request (pure: request -> target or refusal) in request.py; selection in
registry.py; here, one request's life from opening a stream to its last byte (with the one retry), recorded in
one :class:`Exchange` that is finished (metrics, the node's last scrape) in exactly one place; the CONNECT relay
in tcprelay.py.

Why this module is long and not split: it is one request's life, from the checks through the stream to the
last byte, meant to be read top to bottom; parsing and checking already live in gateway/request.py and
selection in gateway/registry.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from gateway.auth import FrontAuth
from gateway.pools import Pools
from gateway.registry import AgentSession, NodeEntry, Registry
from gateway.request import (
    Target,
    check_header_block,
    client_key,
    content_length,
    filter_headers,
    header_safe,
    parse_target,
)
from gateway.status import NodeResult
from gateway.tcprelay import relay_tcp
from raven.config import GatewayFront
from raven.errors import RavenError
from raven.lograte import RateLimitedLog
from raven.logsafe import path_for_log
from raven.ops.metrics import GatewayMetrics
from raven.protocol import wire
from raven.protocol.headers import CLIENT_HEADER, COMPRESS_HEADER, DEADLINE_HEADER, FORWARDED, IDEMPOTENT
from raven.refusals import Reason, Refusal, reset_reason
from raven.transport.listener import ConnectionGuard
from raven.transport.session import Stream, StreamReset

log = logging.getLogger("raven.gateway.proxy")

# A request's hop-by-hop headers stay here; so does Expect (the gateway answers 100 Continue itself).
_DROP = FORWARDED | {"host"}
_DROP_WITH_AUTH = _DROP | {"authorization"}

@dataclass(slots=True)
class Exchange:
    """One request's record: what it asked for, where it went, how it ended.

    Filled in as the request goes; finished (counted, remembered, observed) once, by ``Proxy._finish`` in
    ``Proxy.handle``'s ``finally``, whatever way the request ended.
    """

    request: web.BaseRequest
    start: float
    kind: str = "http"
    node: str = "-"
    pool: str = "-"
    target: Target | None = None
    entry: NodeEntry | None = None
    deadline: float = 0.0
    agent: str = ""
    code: str = ""  # the outcome: a status ("200", "404"), "broken-502", "client-gone", "client-stalled", ...
    reason: str = ""
    last_scrape: bool = True  # the node's outcome (status page); not a refusal of the client's own making
    observe: bool = False  # a complete answer (or a refusal): its duration goes into the latency histogram
    sent: int = 0  # request body bytes to the edge
    received: int = 0  # response body bytes from the edge

    def via(self) -> str:
        """``node 'x' (pool 'p') via agent a``: who the failure is about."""
        return f"node {self.node!r} (pool {self.pool!r}) via agent {self.agent}"


@dataclass(slots=True)
class _BodyProgress:
    """How far the client's request body got: a stall there is the client's fault, not the node's."""

    sent: int = 0
    waiting_for_client: bool = False


class _RelayResponse(web.StreamResponse):
    """A streamed response whose head leaves with the first body bytes: one write and one packet, not two.

    aiohttp (3.12 and later) holds the serialized head until the first write when this flag is
    False, as its own ``web.Response`` does; the client sees the head no later than the first chunk.
    """

    _send_headers_immediately = False


# The connection guard's refusals (raven/transport/listener.py) by the label it gives them.
_CONNECTION_REASON = {"over-capacity": Reason.CONNECTION_OVER_CAPACITY, "client-cap": Reason.CONNECTION_CLIENT_CAP}


class _ClientStalled(RavenError):
    """The client read none of its response for write_stall_timeout."""


class Proxy:
    def __init__(
        self,
        cfg: GatewayFront,
        registry: Registry,
        metrics: GatewayMetrics,
        draining: Callable[[], bool],
        guard: ConnectionGuard,
        settled: Callable[[], bool] = lambda: True,
        auth: FrontAuth | None = None,
        pools: Pools | None = None,
    ) -> None:
        self.registry = registry
        self.pools = pools
        self.metrics = metrics
        self.configure(cfg)
        self.node_streams: dict[str, int] = {}
        self.client_streams: dict[tuple[str, str], int] = {}  # (client address, node) -> streams in flight
        self.connect_tunnels: dict[str, int] = {}  # client address -> CONNECT tunnels open
        self.connect_total = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.draining = draining
        self.guard = guard
        self.settled = settled
        self.last: dict[str, NodeResult] = {}  # registered node -> its latest request's outcome (status page)
        self.auth = auth or FrontAuth(None)
        self._log = RateLimitedLog(log)

    # ------------------------------------------------------------ entry point

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        ex = Exchange(request, time.monotonic())
        try:
            # Credentials first: nothing about nodes, ports or methods is revealed to a client without them.
            proxy_mode = request.method == "CONNECT" or request.raw_path.startswith(("http://", "https://"))
            denied = self.auth.check(lambda name: request.headers.getall(name, []), proxy_mode)
            if denied is not None:
                raise denied
            self._check_method(request)
            target = ex.target = parse_target(request)
            ex.kind = target.kind.name.lower()
            ex.node = target.node
            if target.port not in self.allowed_ports:
                allowed = ", ".join(str(p) for p in sorted(self.allowed_ports))
                raise Refusal(Reason.PORT, f"port {target.port} of node {target.node!r} is not allowed (allowed: "
                                           f"{allowed})")
            found = self.registry.lookup(target.node)
            self._vouch(ex, found.entry)
            if self.pools is not None:  # never proxy to a pool Prometheus reaches itself (gateway/pools.py)
                self.pools.check_proxied(target.node, found.entry)
            if found.entry is None:
                if not self.settled():
                    # A replica that just started does not know every node yet: "try again", not "no such node".
                    raise Refusal(Reason.NOT_SETTLED, f"node {target.node!r} is not registered here yet: this gateway "
                                  "replica is starting and its agents are still connecting", {"Retry-After": "2"})
                raise Refusal(Reason.UNKNOWN_NODE, found.reason)
            ex.entry = found.entry
            ex.pool = found.entry.pool
            if found.reason:
                raise Refusal(Reason.UNAVAILABLE, found.reason)
            ex.deadline = ex.start + self._timeout(request)
            if target.kind == wire.StreamKind.TCP:
                return await self._connect(ex)
            return await self._http(ex)
        except Refusal as ref:
            return self._refuse(ex, ref)
        except asyncio.CancelledError:
            if not ex.code:
                ex.code, ex.reason = "cancelled", "the client left (or the gateway stopped) while waiting for the node"
            raise
        finally:
            self._finish(ex)

    def _vouch(self, ex: Exchange, entry: NodeEntry | None) -> None:
        """The request passed the credentials check: its connection is an authenticated one from now on, unless
        it is beyond a connection cap; then it is refused here, where the node is known (status page, metric)."""
        over = self.guard.vouch(ex.request)
        if over is None:
            return
        label, why = over
        ex.pool = entry.pool if entry is not None else "-"
        self.metrics.connection_refusals.labels(ex.pool, label).inc()
        raise Refusal(_CONNECTION_REASON.get(label, Reason.UNAVAILABLE), f"connection for node {ex.node!r} refused: "
                      f"{why}", {"Retry-After": "5"})

    def configure(self, cfg: GatewayFront) -> None:
        """Take the front end's settings (at start, and on a configuration reload: for requests from now on)."""
        self.cfg = cfg
        self.allowed_ports = frozenset(cfg.allowed_ports)
        self.allowed_methods = frozenset(cfg.allowed_methods)
        self.allow_header = ", ".join([*cfg.allowed_methods, *(["CONNECT"] if cfg.allow_connect else [])])
        self.client_cap = max(1, int(cfg.client_share * cfg.max_streams_per_node))

    def _finish(self, ex: Exchange) -> None:
        """The one place a request's outcome is counted: its metrics, and for a registered node its last scrape."""
        if not ex.code:
            return  # ended before it was answered in any way (cannot happen but by a bug): nothing to count
        self.metrics.requests.labels(ex.pool, ex.kind, ex.code).inc()
        if ex.observe:
            self.metrics.latency.labels(ex.pool).observe(time.monotonic() - ex.start)
        if ex.sent:
            self.metrics.bytes.labels(ex.pool, "to_edge").inc(ex.sent)
        if ex.received:
            self.metrics.bytes.labels(ex.pool, "from_edge").inc(ex.received)
        if ex.last_scrape and ex.node in self.registry.nodes:
            self.last[ex.node] = NodeResult(time.time(), ex.code, ex.reason[:300])
        if len(self.last) > len(self.registry.nodes) + 1024:  # nodes that left: forget them
            for name in [n for n in self.last if n not in self.registry.nodes]:
                del self.last[name]

    def _check_method(self, request: web.BaseRequest) -> None:
        method = request.method
        if (self.cfg.allow_connect if method == "CONNECT" else method in self.allowed_methods):
            return
        raise Refusal(Reason.METHOD, f"method {method[:20]} is not allowed here (allowed: {self.allow_header})",
                      {"Allow": self.allow_header})

    def _timeout(self, request: web.BaseRequest) -> float:
        timeout = self.cfg.request_timeout
        asked = request.headers.get("X-Prometheus-Scrape-Timeout-Seconds")
        if asked:
            try:
                value = float(asked)
            except ValueError:
                value = 0.0
            if 0 < value < timeout:
                timeout = value
        return timeout

    def _refuse(self, ex: Exchange, ref: Refusal) -> web.Response:
        request = ex.request
        label = ref.label
        # One line per client and reason a minute (with a count of the rest): a client cannot grow the log.
        self._log.warning(request.remote or "?", label, "%s %s from %s -> %d (node %s, pool %s): %s",
                          request.method[:20], path_for_log(request.raw_path), request.remote, ref.status, ex.node,
                          ex.pool, ref.text)
        ex.code, ex.reason, ex.observe = str(ref.status), ref.text, True
        ex.last_scrape = ref.status >= 500  # a refusal of the client's own making (4xx) says nothing about the node
        self.metrics.front_refused.labels(label).inc()
        response = web.Response(
            status=ref.status,
            text=f"raven: {ref.text}\n",
            headers={**ref.headers, "X-Raven-Error": header_safe(ref.text)},
        )
        if not self.guard.proven(request):  # sent nothing but refused requests: it does not stay
            response.force_close()
        return response

    # ------------------------------------------------------------ opening a stream, with one retry

    def _claim(self, node: str, client: str) -> None:
        """Take one of the node's slots for ``client``: no client holds more than its share of a node."""
        n = self.node_streams.get(node, 0)
        if n >= self.cfg.max_streams_per_node:
            raise Refusal(Reason.NODE_BUSY, f"node {node!r} already has {n} requests in flight (limit)")
        key = (client, node)
        mine = self.client_streams.get(key, 0)
        if mine >= self.client_cap:
            raise Refusal(Reason.CLIENT_SHARE, f"this client already has {mine} requests in flight to node "
                               f"{node!r} (limit {self.client_cap} per client and node)")
        self.node_streams[node] = n + 1
        self.client_streams[key] = mine + 1
        self.idle.clear()

    def _unclaim(self, node: str, client: str) -> None:
        key = (client, node)
        mine = self.client_streams.get(key, 1) - 1
        if mine <= 0:
            self.client_streams.pop(key, None)
        else:
            self.client_streams[key] = mine
        n = self.node_streams.get(node, 1) - 1
        if n <= 0:
            self.node_streams.pop(node, None)
            if not self.node_streams:
                self.idle.set()
        else:
            self.node_streams[node] = n

    async def _open(self, ex: Exchange, open_frame: wire.Open, retryable: bool) -> tuple[Stream, wire.Head]:
        """Select an agent, open the stream, send the body, wait for the head; once more on another agent when
        ``retryable`` and the first failed before its head."""
        target, entry, request, deadline = ex.target, ex.entry, ex.request, ex.deadline
        assert target is not None and entry is not None
        body = open_frame.kind == wire.StreamKind.HTTP and not open_frame.fin  # CONNECT relays its bytes later
        tried: list[AgentSession] = []
        last: Refusal | None = None
        for attempt in (1, 2):
            chosen = self.registry.select(entry, tried)
            if chosen is None:
                if last is not None:
                    raise last
                reason = f"pool {entry.pool!r} has no usable agent for node {target.node!r}"
                if entry.sessions:
                    reason += " (all draining or closed)"
                raise Refusal(Reason.UNAVAILABLE, reason)
            tried.append(chosen)
            ex.agent = chosen.agent
            try:
                stream = chosen.session.open_stream(open_frame)
            except StreamReset as exc:
                last = Refusal(Reason.UNAVAILABLE, f"node {target.node!r} (pool {entry.pool!r}) via agent "
                                                   f"{chosen.agent}: {exc.reason}")
                continue
            except (ValueError, wire.ProtocolError) as exc:
                raise Refusal(Reason.BAD_REQUEST, f"request cannot be carried: {exc}") from None
            self.metrics.streams.inc()
            progress = _BodyProgress()
            try:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                async with asyncio.timeout(remaining):
                    if body:
                        async with asyncio.timeout(self.cfg.body_timeout):
                            await self._send_body(request, stream, progress)
                    head = await stream.head()
                return stream, head
            except TimeoutError:
                if progress.waiting_for_client:
                    stream.reset(wire.ResetCode.CANCEL, "the client stopped sending its request body")
                    raise Refusal(Reason.BODY_TIMEOUT, f"the client sent {progress.sent} bytes of its request body for "
                                  f"node {target.node!r} and did not finish it in time") from None
                stream.reset(wire.ResetCode.TIMEOUT, "gateway deadline passed before the response head")
                raise Refusal(
                    Reason.TIMEOUT,
                    f"node {target.node!r} (pool {entry.pool!r}, agent {chosen.agent}) sent no response head "
                    f"within {self._timeout(request):.1f}s",
                ) from None
            except StreamReset as exc:
                stream.close()
                last = Refusal(
                    reset_reason(exc.code),
                    f"node {target.node!r} (pool {entry.pool!r}) via agent {chosen.agent}: {exc.reason}",
                )
                if attempt == 1 and retryable and self.registry.has_alternative(entry, tried):
                    self._log.info(chosen.agent, "retry", "retrying %s on another agent of pool %r: %s", target.node,
                                   entry.pool, exc.reason)
                    self.metrics.retries.labels(entry.pool).inc()
                    continue
                raise last from None
            except BaseException:
                stream.close()
                raise
            finally:
                ex.sent += progress.sent  # every attempt's request body bytes, whatever became of it
        assert last is not None
        raise last

    async def _send_body(self, request: web.BaseRequest, stream: Stream, progress: _BodyProgress) -> None:
        if request.headers.get("Expect", "").lower() == "100-continue" and request.writer is not None:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while True:
            progress.waiting_for_client = True
            chunk = await request.content.readany()
            progress.waiting_for_client = False
            if not chunk:
                break
            await stream.write(chunk)
            progress.sent += len(chunk)
        stream.end()

    # ------------------------------------------------------------ HTTP

    async def _http(self, ex: Exchange) -> web.StreamResponse:
        request, target = ex.request, ex.target
        assert target is not None
        client = request.remote or "?"
        # In proxy mode the client's own Authorization is for the node and passes through.
        proxy_mode = request.raw_path.startswith("http")
        # Host-header mode with credentials: the bearer token is for the gateway, never for the node.
        drop = _DROP_WITH_AUTH if self.auth.enabled and not proxy_mode else _DROP
        headers = filter_headers(request.headers.items(), drop)
        remaining_ms = max(1, int((ex.deadline - time.monotonic()) * 1000))
        headers = (
            ("Host", f"{target.node}:{target.port}"), *headers,
            ("X-Forwarded-For", client), ("X-Forwarded-Proto", "https" if request.secure else "http"),
            (DEADLINE_HEADER, str(remaining_ms)), (CLIENT_HEADER, client_key(client)),
        )
        if self.pools is not None and not self.pools.compress(ex.pool):
            headers = (*headers, (COMPRESS_HEADER, "0"))  # this pool's uplink is free: the agent sends as is
        check_header_block(headers, wire.DEFAULT_LIMITS)
        has_body = request.body_exists
        open_frame = wire.Open(
            0, wire.StreamKind.HTTP, target.node, target.port, request.method, target.path, headers, not has_body
        )
        self._claim(target.node, client)
        try:
            stream, head = await self._open(ex, open_frame, request.method in IDEMPOTENT and not has_body)
            try:
                return await self._relay_response(ex, stream, head)
            finally:
                stream.close()
        finally:
            self._unclaim(target.node, client)

    async def _relay_response(self, ex: Exchange, stream: Stream, head: wire.Head) -> web.StreamResponse:
        request, target = ex.request, ex.target
        assert target is not None
        if not 200 <= head.status <= 599:  # agents refuse interim and odd statuses; one that sends them is broken
            stream.reset(wire.ResetCode.PROTOCOL, f"status {head.status} is not a final HTTP status")
            raise Refusal(Reason.UPSTREAM, f"{ex.via()}: the agent sent status {head.status}, not a final HTTP status")
        resp = _RelayResponse(status=head.status, reason=head.reason or None)
        out_headers: CIMultiDict[str] = CIMultiDict(filter_headers(head.headers))
        length = content_length(out_headers.get("Content-Length"))
        resp.headers.extend(out_headers)
        resp.headers["X-Raven-Agent"] = ex.agent
        no_body = request.method == "HEAD" or head.status in (204, 304)
        if length is not None:
            resp.content_length = length
        elif request.version >= (1, 1) and not no_body:
            resp.enable_chunked_encoding()
        # Wait for the first body bytes before anything goes to the client: a response that breaks
        # before its body still becomes a clean 502/504 that says why, and the head leaves together
        # with the first bytes.
        first: bytes | memoryview = b""
        if not no_body:
            try:
                async with asyncio.timeout_at(self._loop_deadline(ex.deadline)):
                    first = await stream.read()
            except TimeoutError:
                stream.reset(wire.ResetCode.TIMEOUT, "gateway deadline passed before the response body")
                raise Refusal(Reason.TIMEOUT, f"node {target.node!r} (pool {ex.pool!r}, agent {ex.agent}) sent "
                                   f"no response body within {self._timeout(request):.1f}s") from None
            except StreamReset as exc:
                raise Refusal(reset_reason(exc.code), f"{ex.via()}: {exc.reason}") from None
            if not first and length:
                raise Refusal(Reason.UPSTREAM, f"{ex.via()}: the body ended after 0 of {length} bytes")
        if self.draining():
            resp.force_close()  # "Connection: close": a draining replica sends keep-alive clients elsewhere
        await resp.prepare(request)
        received = 0
        try:
            async with asyncio.timeout_at(self._loop_deadline(ex.deadline)):
                # Without a body, still wait for the FIN (normally already here) so the stream ends cleanly.
                chunk = await stream.read() if no_body else first
                while chunk:
                    received += len(chunk)
                    ex.received = received
                    await self._write(resp, chunk)
                    chunk = await stream.read()
            if length is not None and not no_body and received != length:
                raise StreamReset(wire.ResetCode.UPSTREAM_BROKEN,
                                  f"body ended after {received} of {length} bytes", remote=True)
        except (StreamReset, TimeoutError) as exc:
            why = exc.reason if isinstance(exc, StreamReset) else "deadline passed mid-body"
            self._log.warning(
                ex.agent, "broken", "%s %s: response from node %r (pool %r, agent %s) broke after %d bytes: %s; "
                "closing the client connection so the response is not taken as complete",
                request.method, path_for_log(target.path), target.node, ex.pool, ex.agent, received, why,
            )
            self._abort(request)
            code = "504" if isinstance(exc, TimeoutError) else "502"
            ex.code, ex.reason = f"broken-{code}", f"response broke after {received} bytes: {why}"
            return resp
        except ConnectionError:
            stream.reset(wire.ResetCode.CANCEL, "client went away")
            ex.code, ex.reason = "client-gone", "the client left mid-response"
            return resp
        except _ClientStalled:
            stream.reset(wire.ResetCode.CANCEL, "the client stopped reading the response")
            self._log.warning(request.remote or "?", "client-stalled",
                              "%s %s: client %s read none of the response from node %r for %.0fs after %d bytes: "
                              "stream reset, connection closed", request.method, path_for_log(target.path),
                              request.remote, target.node, self.cfg.write_stall_timeout, received)
            self._abort(request)
            ex.code, ex.reason = "client-stalled", "the client stopped reading"
            self.metrics.front_refused.labels(Reason.WRITE_STALL.label).inc()
            return resp
        try:
            await resp.write_eof()
        except ConnectionError:
            ex.code, ex.reason = "client-gone", "the client left before the end of the response"
            return resp
        ex.code, ex.observe = str(head.status), True
        return resp

    async def _write(self, resp: web.StreamResponse, chunk: bytes | memoryview) -> None:
        """Write to the client; one that reads nothing for write_stall_timeout is given up on."""
        try:
            async with asyncio.timeout(self.cfg.write_stall_timeout):
                await resp.write(chunk)
        except TimeoutError:
            raise _ClientStalled from None

    @staticmethod
    def _loop_deadline(deadline: float) -> float:
        return asyncio.get_running_loop().time() + (deadline - time.monotonic())

    @staticmethod
    def _abort(request: web.BaseRequest) -> None:
        """Reset the client connection: a broken response must never read as complete.

        A plain close would end an HTTP/1.0 body (delimited by the close) as if it were whole;
        SO_LINGER 0 turns the close into a TCP RST for every client.
        """
        transport = request.transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()

    # ------------------------------------------------------------ CONNECT

    async def _connect(self, ex: Exchange) -> web.StreamResponse:
        request, target = ex.request, ex.target
        assert target is not None
        client = request.remote or "?"
        if self.connect_total >= self.cfg.max_connect_tunnels:
            raise Refusal(Reason.CONNECT_CAP, f"{self.connect_total} CONNECT tunnels are open (limit "
                          f"{self.cfg.max_connect_tunnels})")
        mine = self.connect_tunnels.get(client, 0)
        if mine >= self.cfg.max_connect_per_client:
            raise Refusal(Reason.CONNECT_CLIENT_CAP, f"this client has {mine} CONNECT tunnels open (limit "
                          f"{self.cfg.max_connect_per_client})")
        open_frame = wire.Open(0, wire.StreamKind.TCP, target.node, target.port,
                               headers=((CLIENT_HEADER, client_key(client)),))
        self._claim(target.node, client)
        self.connect_tunnels[client] = mine + 1
        self.connect_total += 1
        try:
            stream, head = await self._open(ex, open_frame, True)
            try:
                if head.status != 200:
                    raise Refusal(Reason.UPSTREAM, f"agent {ex.agent} could not open {target.node}:{target.port}")
                transport = request.transport
                if transport is None:
                    ex.code, ex.reason = "client-gone", "the client left before the tunnel opened"
                    return web.Response(status=499)
                transport.write(b"HTTP/1.1 200 Connection established\r\nX-Raven-Agent: " +
                                ex.agent.encode("ascii", "replace") + b"\r\n\r\n")
                self._log.info(client, "connect", "CONNECT %s:%d from %s via agent %s (pool %s)", target.node,
                               target.port, client, ex.agent, ex.pool)
                ex.code = "200"  # the tunnel is open: however the relay ends, the request is counted as such
                ex.sent, ex.received = await relay_tcp(request, stream, self.cfg.connect_idle_timeout, self.guard,
                                                        self.cfg.write_stall_timeout)
                ex.code, ex.observe = "200", True
                transport.close()
                return web.Response(status=200)
            finally:
                stream.close()
        finally:
            self._unclaim(target.node, client)
            self.connect_total -= 1
            left = self.connect_tunnels.get(client, 1) - 1
            if left > 0:
                self.connect_tunnels[client] = left
            else:
                self.connect_tunnels.pop(client, None)


