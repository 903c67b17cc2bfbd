"""The front end Prometheus talks to: route by Host, absolute URI or CONNECT, through the tunnel.

Every failure that happens before the response head is answered with 4xx/5xx and a body
that says which node and why (and the same line is logged). A failure after the head has
been sent cannot change the status any more: the client connection is closed so that
the response is visibly broken (short body or missing final chunk), never complete.

The parts: parsing a request (pure: request -> target or refusal) in request.py; admission (credentials,
method, port, node, caps and fair shares: may it go, is there room) in admission.py; selection in registry.py;
here, one admitted request's life from opening a stream to its last byte (with the one retry), recorded in one
:class:`~gateway.admission.Exchange` that is finished (metrics, the node's last scrape) in exactly one place,
and every refusal answered in one place; the CONNECT relay in tcprelay.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from gateway.admission import Admission, Exchange
from gateway.auth import FrontAuth
from gateway.avoidance import AVOID_AFTER, PATH_FAULTS
from gateway.pools import Pools
from gateway.registry import AgentSession, Registry
from gateway.request import check_header_block, client_key, content_length, header_safe
from gateway.status import OK_CODES, NodeResult
from gateway.tcprelay import relay_tcp
from raven.config import GatewayFront
from raven.errors import RavenError
from raven.http.call import ServerCall
from raven.http.guard import ConnectionGuard
from raven.lograte import RateLimitedLog
from raven.logsafe import path_for_log
from raven.ops.metrics import GatewayMetrics
from raven.protocol import (
    FORWARDED,
    IDEMPOTENT,
    Open,
    OpenFields,
    filter_headers,
    legacy_headers,
    wire,
)
from raven.refusals import Reason, Refusal, reset_reason
from raven.transport.tunnel import Stream, StreamReset

log = logging.getLogger("raven.gateway.proxy")

# A request's hop-by-hop headers stay here; so does Expect (the gateway answers 100 Continue itself).
_DROP = FORWARDED | {"host", "expect"}
_DROP_WITH_AUTH = _DROP | {"authorization"}

@dataclass(slots=True)
class _BodyProgress:
    """How far the client's request body got: a stall there is the client's fault, not the node's."""

    sent: int = 0
    waiting_for_client: bool = False


# Cached metric children (Proxy._pool_metrics): pools, and (kind, code) pairs per pool, kept at most.
_MAX_CACHED = 1024


@dataclass(slots=True)
class _PoolMetrics:
    latency: Histogram
    to_edge: Counter
    from_edge: Counter
    requests: dict[tuple[str, str], Counter]  # (kind, code) -> raven_gateway_requests_total's child


class _ClientStalled(RavenError):
    """The client read none of its response for write_stall_timeout."""


class Proxy:
    """One request's life after admission (gateway/admission.py): the stream, the one retry, the relay, the
    outcome."""

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
        self.auth = auth or FrontAuth(None)
        self.admission = Admission(cfg, registry, metrics, guard, settled, self.auth, pools)
        self.cfg = cfg
        self.draining = draining
        self.guard = guard
        self.last: dict[str, NodeResult] = {}  # registered node -> its latest request's outcome (status page)
        # The nodes of ``last`` whose latest request failed: the status counts them without a walk of ``last``.
        self.failing: dict[str, NodeResult] = {}
        self._log = RateLimitedLog(log)
        self._per_pool: dict[str, _PoolMetrics] = {}  # pool -> its metric children (see _pool_metrics)

    @property
    def idle(self) -> asyncio.Event:
        """Set while no request is in flight."""
        return self.admission.idle

    def configure(self, cfg: GatewayFront) -> None:
        """Take the front end's settings (at start, and on a configuration reload: for requests from now on)."""
        self.cfg = cfg
        self.admission.configure(cfg)

    # ------------------------------------------------------------ entry point

    async def handle(self, request: ServerCall) -> None:
        """Answer one front-end request (on the lean server, raven/http/h1server.py, or aiohttp's)."""
        ex = Exchange(request, time.monotonic())
        try:
            self.admission.check(ex)
            if ex.kind == "tcp":
                await self._connect(ex)
            else:
                await self._http(ex)
        except Refusal as ref:
            self._refuse(ex, ref)
        except asyncio.CancelledError:
            if not ex.code:
                ex.code, ex.reason = "cancelled", "the client left (or the gateway stopped) while waiting for the node"
            raise
        finally:
            self._finish(ex)

    def _finish(self, ex: Exchange) -> None:
        """The one place a request's outcome is counted: its metrics, and for a registered node its last scrape."""
        if not ex.code:
            return  # ended before it was answered in any way (cannot happen but by a bug): nothing to count
        per_pool = self._per_pool.get(ex.pool)
        if per_pool is None:
            per_pool = self._pool_metrics(ex.pool)
        counter = per_pool.requests.get((ex.kind, ex.code))
        if counter is None:
            if len(per_pool.requests) >= _MAX_CACHED:
                per_pool.requests.clear()
            counter = per_pool.requests[ex.kind, ex.code] = self.metrics.requests.labels(ex.pool, ex.kind, ex.code)
        counter.inc()
        if ex.observe:
            per_pool.latency.observe(time.monotonic() - ex.start)
        if ex.sent:
            per_pool.to_edge.inc(ex.sent)
        if ex.received:
            per_pool.from_edge.inc(ex.received)
        if ex.last_scrape and ex.node in self.registry.nodes:
            result = self.last[ex.node] = NodeResult(time.time(), ex.code, ex.reason[:300])
            if ex.code in OK_CODES:
                self.failing.pop(ex.node, None)
            else:
                self.failing[ex.node] = result
        if len(self.last) > len(self.registry.nodes) + 1024:  # nodes that left: forget them
            for name in [n for n in self.last if n not in self.registry.nodes]:
                del self.last[name]
                self.failing.pop(name, None)

    def _pool_metrics(self, pool: str) -> _PoolMetrics:
        """The pool's metric children, looked up once (prometheus-client's ``labels()`` costs microseconds a call,
        several per request otherwise). The same children prometheus-client holds anyway; bounded all the same."""
        if len(self._per_pool) >= _MAX_CACHED:
            self._per_pool.clear()
        m = self.metrics
        found = self._per_pool[pool] = _PoolMetrics(
            m.latency.labels(pool), m.bytes.labels(pool, "to_edge"), m.bytes.labels(pool, "from_edge"), {})
        return found

    def _refuse(self, ex: Exchange, ref: Refusal) -> None:
        request = ex.request
        label = ref.label
        # One line per client and reason a minute (with a count of the rest): a client cannot grow the log.
        self._log.warning(request.remote or "?", label, "%s %s from %s -> %d (node %s, pool %s): %s",
                          request.method[:20], path_for_log(request.raw_path), request.remote, ref.status, ex.node,
                          ex.pool, ref.text)
        ex.code, ex.reason, ex.observe = str(ref.status), ref.text, True
        ex.last_scrape = ref.status >= 500  # a refusal of the client's own making (4xx) says nothing about the node
        self.metrics.front_refused.labels(label).inc()
        headers = (("Content-Type", "text/plain; charset=utf-8"), *ref.headers.items(),
                   ("X-Raven-Error", header_safe(ref.text)))
        # A connection that sent nothing but refused requests does not stay.
        request.respond(ref.status, headers, f"raven: {ref.text}\n".encode(), not self.guard.proven(request))

    # ------------------------------------------------------------ opening a stream, with one retry

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
            except (ValueError, wire.ProtocolError) as bad:
                raise Refusal(Reason.BAD_REQUEST, f"request cannot be carried: {bad}") from None
            self.metrics.streams.inc()
            progress = _BodyProgress()
            asked = 0.0  # when the agent had the whole request and the wait for the node's answer began
            try:
                if deadline.left() <= 0:
                    raise TimeoutError
                # One deadline per wait (the connection's one timer): the body's, then the node's answer's.
                if body:
                    async with request.timeout(min(deadline.at, time.monotonic() + self.cfg.body_timeout)):
                        await self._send_body(request, stream, progress)
                asked = time.monotonic()
                async with request.timeout(deadline.at):
                    head = await stream.head()
                self.registry.avoidance.succeeded(target.node, chosen.agent)
                return stream, head
            except TimeoutError:
                if progress.waiting_for_client:
                    stream.reset(wire.ResetCode.CANCEL, "the client stopped sending its request body")
                    raise Refusal(Reason.BODY_TIMEOUT, f"the client sent {progress.sent} bytes of its request body for "
                                  f"node {target.node!r} and did not finish it in time") from None
                stream.reset(wire.ResetCode.TIMEOUT, "gateway deadline passed before the response head")
                if asked and time.monotonic() - asked >= AVOID_AFTER:  # not a budget spent before it was asked,
                    self._avoid(target.node, entry.pool, chosen.agent, "no response head in time")  # nor a tiny one
                raise Refusal(
                    Reason.TIMEOUT,
                    f"node {target.node!r} (pool {entry.pool!r}, agent {chosen.agent}) sent no response head "
                    f"within {deadline.budget:.1f}s",
                ) from None
            except StreamReset as exc:
                stream.close()
                if exc.code in PATH_FAULTS:
                    self._avoid(target.node, entry.pool, chosen.agent, exc.reason)
                last = Refusal(
                    reset_reason(exc.code),
                    f"node {target.node!r} (pool {entry.pool!r}) via agent {chosen.agent}: {exc.reason}",
                )
                if not (attempt == 1 and retryable and self.registry.has_alternative(entry, tried)):
                    raise last from None
                # On to the next attempt (no ``continue`` here: mypyc does not compile one inside try/finally).
                self._log.info(chosen.agent, "retry", "retrying %s on another agent of pool %r: %s", target.node,
                               entry.pool, exc.reason)
                self.metrics.retries.labels(entry.pool).inc()
            except BaseException:
                stream.close()
                raise
            finally:
                ex.sent += progress.sent  # every attempt's request body bytes, whatever became of it
        assert last is not None
        raise last

    def _avoid(self, node: str, pool: str, agent: str, why: str) -> None:
        hold = self.registry.avoidance.failed(node, agent)
        self._log.warning(agent, "avoid", "node %s (pool %r) failed through agent %s (%s): its requests go to another "
                          "agent of the pool for %.0fs where one can take them", node, pool, agent, why, hold)

    async def _send_body(self, request: ServerCall, stream: Stream, progress: _BodyProgress) -> None:
        try:
            while True:
                progress.waiting_for_client = True
                chunk = await request.read()  # answers "Expect: 100-continue" first
                progress.waiting_for_client = False
                if not chunk:
                    break
                await stream.write(chunk)
                progress.sent += len(chunk)
            stream.end()
        except StreamReset:
            # The node answered before it read the whole body, and the agent said "stop sending" after relaying
            # the answer: the answer stands (what the client has not sent is left unread; the server then ends
            # the connection, since the next request could not be told from it).
            if not stream.answered:
                raise

    # ------------------------------------------------------------ HTTP

    async def _http(self, ex: Exchange) -> None:
        request, target = ex.request, ex.target
        assert target is not None
        client = request.remote or "?"
        # In proxy mode the client's own Authorization is for the node and passes through.
        proxy_mode = request.raw_path.startswith("http")
        # Host-header mode with credentials: the bearer token is for the gateway, never for the node.
        drop = _DROP_WITH_AUTH if self.auth.enabled and not proxy_mode else _DROP
        headers = filter_headers(request.headers.items(), drop)
        headers = (
            ("Host", f"{target.node}:{target.port}"), *headers,
            ("X-Forwarded-For", client), ("X-Forwarded-Proto", "https" if request.secure else "http"),
        )
        # The request's terms: OPEN's fields from protocol version 3, x-raven-* headers to an older agent (the
        # session of the agent chosen writes them so, raven/protocol/terms.py).
        fields = OpenFields(
            deadline_ms=ex.deadline.ms(),
            client=client_key(client),
            uplink_free=self.pools is not None and not self.pools.compress(ex.pool),  # the agent sends as is
        )
        check_header_block((*headers, *legacy_headers(fields)), wire.DEFAULT_LIMITS)  # fits either way
        has_body = request.body_exists
        open_frame = Open(0, wire.StreamKind.HTTP, target.node, target.port, request.method, target.path, headers,
                          not has_body, fields)
        self.admission.claim(target.node, client)
        try:
            stream, head = await self._open(ex, open_frame, request.method in IDEMPOTENT and not has_body)
            try:
                await self._relay_response(ex, stream, head)
            finally:
                stream.close()
        finally:
            self.admission.unclaim(target.node, client)

    async def _relay_response(self, ex: Exchange, stream: Stream, head: wire.Head) -> None:
        request, target = ex.request, ex.target
        assert target is not None
        if not 200 <= head.status <= 599:  # agents refuse interim and odd statuses; one that sends them is broken
            stream.reset(wire.ResetCode.PROTOCOL, f"status {head.status} is not a final HTTP status")
            raise Refusal(Reason.UPSTREAM, f"{ex.via()}: the agent sent status {head.status}, not a final HTTP status")
        headers = filter_headers(head.headers)
        length = content_length(next((v for n, v in headers if n.lower() == "content-length"), None))
        out = [(n, v) for n, v in headers if n.lower() != "content-length"]  # the server frames the body
        out.append(("X-Raven-Agent", header_safe(ex.agent)))  # checked at the handshake; never raw in a header
        no_body = request.method == "HEAD" or head.status in (204, 304)
        # Wait for the first body bytes before anything goes to the client: a response that breaks
        # before its body still becomes a clean 502/504 that says why, and the head leaves together
        # with the first bytes, in one write.
        first: bytes | memoryview = b""
        if not no_body:
            try:
                if stream.readable:  # usually so: HEAD, DATA and FIN of a page come in one message; no timer then
                    first = await stream.read()
                else:
                    async with request.timeout(ex.deadline.at):
                        first = await stream.read()
            except TimeoutError:
                stream.reset(wire.ResetCode.TIMEOUT, "gateway deadline passed before the response body")
                raise Refusal(Reason.TIMEOUT, f"node {target.node!r} (pool {ex.pool!r}, agent {ex.agent}) sent "
                                   f"no response body within {ex.deadline.budget:.1f}s") from None
            except StreamReset as exc:
                raise Refusal(reset_reason(exc.code), f"{ex.via()}: {exc.reason}") from None
            if not first and length:
                raise Refusal(Reason.UPSTREAM, f"{ex.via()}: the body ended after 0 of {length} bytes")
        # A chunked page that is all here already (its FIN came with it, as usual) goes out with its last chunk
        # in the same write as its head and body, not in a write of its own.
        ahead: bytes | memoryview | None = None
        if first and length is None and stream.readable:
            try:
                ahead = await stream.read()
            except StreamReset as exc:
                raise Refusal(reset_reason(exc.code), f"{ex.via()}: {exc.reason}") from None
        received = len(first)
        ex.received = received
        try:
            # "Connection: close" while draining: a draining replica sends keep-alive clients elsewhere.
            await request.send(head.status, head.reason, out, length, bytes(first), self.draining(),
                               self._until(ex), last=ahead == b"")
            # Without a body, still wait for the FIN (normally already here) so the stream ends cleanly.
            chunk = ahead if ahead is not None else await self._read(ex, stream) if no_body or first else b""
            while chunk:
                received += len(chunk)
                ex.received = received
                await request.write(chunk, self._until(ex))
                chunk = await self._read(ex, stream)
            if length is not None and not no_body and received != length:
                raise StreamReset(wire.ResetCode.UPSTREAM_BROKEN,
                                  f"body ended after {received} of {length} bytes", remote=True)
        except (StreamReset, TimeoutError) as broke:
            if isinstance(broke, TimeoutError) and ex.deadline.left() > 0:  # a write's stall, not the deadline
                self._stalled(ex, stream, received)
                return
            why = broke.reason if isinstance(broke, StreamReset) else "deadline passed mid-body"
            self._log.warning(
                ex.agent, "broken", "%s %s: response from node %r (pool %r, agent %s) broke after %d bytes: %s; "
                "closing the client connection so the response is not taken as complete",
                request.method, path_for_log(target.path), target.node, ex.pool, ex.agent, received, why,
            )
            request.abort()
            code = "504" if isinstance(broke, TimeoutError) else "502"
            ex.code, ex.reason = f"broken-{code}", f"response broke after {received} bytes: {why}"
            return
        except ConnectionError:
            stream.reset(wire.ResetCode.CANCEL, "client went away")
            ex.code, ex.reason = "client-gone", "the client left mid-response"
            return
        try:
            # The end of the response waits for the client to take what is still buffered: the same deadline as
            # any write, so a client that stops reading just before the end cannot hold the stream and its
            # node's slot for ever.
            await request.end(time.monotonic() + self.cfg.write_stall_timeout)
        except ConnectionError:
            ex.code, ex.reason = "client-gone", "the client left before the end of the response"
            return
        except TimeoutError:
            self._stalled(ex, stream, received)
            return
        ex.code, ex.observe = str(head.status), True

    def _until(self, ex: Exchange) -> float:
        """How long a write may wait for the client: write_stall_timeout, within the request's deadline."""
        return min(ex.deadline.at, time.monotonic() + self.cfg.write_stall_timeout)

    @staticmethod
    async def _read(ex: Exchange, stream: Stream) -> bytes | memoryview:
        if stream.readable:  # already here: no timer
            return await stream.read()
        async with ex.request.timeout(ex.deadline.at):
            return await stream.read()

    def _stalled(self, ex: Exchange, stream: Stream, received: int) -> None:
        """The client read none of its response for write_stall_timeout: reset the stream, close the connection."""
        request, target = ex.request, ex.target
        assert target is not None
        stream.reset(wire.ResetCode.CANCEL, "the client stopped reading the response")
        self._log.warning(request.remote or "?", "client-stalled",
                          "%s %s: client %s read none of the response from node %r for %.0fs after %d bytes: "
                          "stream reset, connection closed", request.method, path_for_log(target.path),
                          request.remote, target.node, self.cfg.write_stall_timeout, received)
        request.abort()  # a reset: a broken response must never read as complete
        ex.code, ex.reason = "client-stalled", "the client stopped reading"
        self.metrics.front_refused.labels(Reason.WRITE_STALL.label).inc()

    # ------------------------------------------------------------ CONNECT

    async def _connect(self, ex: Exchange) -> None:
        request, target = ex.request, ex.target
        assert target is not None
        client = request.remote or "?"
        open_frame = Open(0, wire.StreamKind.TCP, target.node, target.port,
                          fields=OpenFields(client=client_key(client)))
        self.admission.open_tunnel(client)
        try:
            self.admission.claim(target.node, client)
        except Refusal:
            self.admission.close_tunnel(client)
            raise
        try:
            stream, head = await self._open(ex, open_frame, True)
            try:
                if head.status != 200:
                    raise Refusal(Reason.UPSTREAM, f"agent {ex.agent} could not open {target.node}:{target.port}")
                transport = request.transport
                if transport is None:
                    ex.code, ex.reason = "client-gone", "the client left before the tunnel opened"
                    return
                transport.write(b"HTTP/1.1 200 Connection established\r\nX-Raven-Agent: " +
                                header_safe(ex.agent).encode("ascii") + b"\r\n\r\n")
                self._log.info(client, "connect", "CONNECT %s:%d from %s via agent %s (pool %s)", target.node,
                               target.port, client, ex.agent, ex.pool)
                ex.code = "200"  # the tunnel is open: however the relay ends, the request is counted as such
                ex.sent, ex.received = await relay_tcp(request, stream, self.cfg.connect_idle_timeout,
                                                        self.cfg.write_stall_timeout)
                ex.code, ex.observe = "200", True
                if transport.get_write_buffer_size():
                    request.abort()  # the client stopped reading: a close would wait for it for ever
                else:
                    transport.close()
            finally:
                stream.close()
        finally:
            self.admission.unclaim(target.node, client)
            self.admission.close_tunnel(client)
