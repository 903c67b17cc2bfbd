"""Serve streams opened by the gateway: check them, dial the node, relay both ways.

The agent checks every stream again before it dials (agent/checks.py): the node must be one of
its own (the address comes from its inventory, never from the gateway), the port and method
allowed, the target origin-form. A node's upstream connections are shared fairly between the
gateway's clients (agent/fairslots.py). HTTP streams use a keep-alive connection pool; bodies
pass through unchanged (no decompression), but for the agent's gzip of an uncompressed response for a
client that accepts it (agent/compress.py). TCP streams (CONNECT) are relayed byte for byte.
A RESET from the gateway aborts the upstream request at once, on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

from agent import compress
from agent.checks import Policy, Request, check_open
from agent.fairslots import Abandoned, FairSlots, QueueFull
from agent.upstream import (
    IDLE_TIMEOUT,
    MAX_CONNECTIONS,
    ConnectFailed,
    PoolFull,
    Response,
    ResponseBroken,
    UpstreamError,
    UpstreamPool,
)
from raven.aio import cancel_and_wait
from raven.deadline import Deadline
from raven.lograte import RateLimitedLog
from raven.ops.metrics import AgentMetrics
from raven.protocol import filter_headers, wire
from raven.refusals import Reason, Refusal
from raven.transport.tunnel import Stream, StreamReset

log = logging.getLogger("raven.agent.forwarder")


def _response_headers(raw: list[tuple[bytes, bytes]]) -> wire.Headers:
    """The node's response headers as the HEAD carries them: raven.protocol's one filter (no hop-by-hop, none a
    Connection header names, none of Raven's own)."""
    return filter_headers([(name.decode("latin-1"), value.decode("latin-1")) for name, value in raw])


class Forwarder:
    compress_mode: compress.Mode = "auto"  # gzip before the uplink (agent/compress.py); set from the agent's config
    # Told of every relayed request answered 200: (OPEN, its deadline, its client key); agent/outage.py learns from it.
    on_answered: Callable[[wire.Open, Deadline, str], None] | None = None

    def __init__(
        self,
        nodes: Callable[[], dict[str, str]],
        policy: Policy,
        metrics: AgentMetrics,
        connect_timeout: float,
        connections_per_node: int,
        draining: Callable[[], bool],
        pool: str = "",
        client_share: float = 0.5,
        idle_timeout: float = IDLE_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        on_grown: Callable[[], None] | None = None,
    ) -> None:
        self.pool = pool
        self.nodes = nodes
        self.policy = policy
        self.metrics = metrics
        self.connect_timeout = connect_timeout
        self.draining = draining
        self.tasks: set[asyncio.Task[None]] = set()
        self.idle = asyncio.Event()
        self.idle.set()
        # Keep-alive connections to the nodes: idle ones per node are bounded by its slots, which bound the busy
        # ones; all of them together by max_connections, and idle ones close after idle_timeout (agent/upstream.py).
        self._upstream = UpstreamPool(connect_timeout, max_idle=connections_per_node, idle_timeout=idle_timeout,
                                      max_connections=max_connections, on_wait=metrics.upstream_waits.inc,
                                      on_grown=on_grown)
        up = self._upstream
        metrics.upstream_open.set_function(lambda: up.open_connections)
        metrics.upstream_idle.set_function(lambda: up.idle_total)
        metrics.upstream_limit.set_function(lambda: up.max_connections)
        self._connections_per_node = connections_per_node
        self._per_client = max(1, int(client_share * connections_per_node))
        self._slots: dict[str, FairSlots] = {}  # node -> its upstream slots (dropped when idle)
        self._log = RateLimitedLog(log)
        # prometheus-client's labels() costs microseconds a call: the children every scrape counts, looked up once
        # (requests by (kind, code): the codes are Raven's few and the node's statuses, as many as the metric's own
        # children).
        self._to_node = metrics.bytes.labels("to_node")
        self._from_node = metrics.bytes.labels("from_node")
        self._to_gateway = metrics.bytes.labels("to_gateway")
        self._requests: dict[tuple[str, str], Counter] = {}

    @property
    def upstream(self) -> UpstreamPool:
        """The keep-alive pool to the nodes (agent/outage.py scrapes through it too, within its cap)."""
        return self._upstream

    def configure(self, policy: Policy, connect_timeout: float, connections_per_node: int,
                  client_share: float, idle_timeout: float = IDLE_TIMEOUT, max_connections: int = MAX_CONNECTIONS
                  ) -> None:
        """New settings (a configuration reload): streams opened from now on get them; slots resize in place."""
        self.policy = policy
        self.connect_timeout = connect_timeout
        self._connections_per_node = connections_per_node
        self._per_client = max(1, int(client_share * connections_per_node))
        self._upstream.connect_timeout = connect_timeout
        self._upstream.max_idle = connections_per_node
        self._upstream.idle_timeout = idle_timeout
        self._upstream.max_connections = max_connections
        for slots in self._slots.values():
            slots.resize(connections_per_node, self._per_client)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(BaseException):
                await task
        await self._upstream.close()

    async def wait_idle(self, grace: float) -> bool:
        """Wait until no stream is being served, up to ``grace`` seconds."""
        try:
            async with asyncio.timeout(grace):
                await self.idle.wait()
        except TimeoutError:
            pass
        return not self.tasks

    # ------------------------------------------------------------ entry point (called by the session)

    def on_open(self, stream: Stream) -> None:
        frame = stream.open
        if self.draining():
            self._refuse(stream, Refusal(Reason.AGENT_DRAINING, "agent is draining"))
            return
        loop = asyncio.get_running_loop()
        try:
            req = check_open(frame, self.nodes().get(frame.node), self.policy)
        except Refusal as refused:
            self._refuse(stream, refused)
            return
        serve = self._serve_http if frame.kind == wire.StreamKind.HTTP else self._serve_tcp
        task = loop.create_task(self._in_slot(stream, req, serve))
        self.tasks.add(task)
        self.idle.clear()
        self.metrics.streams.inc()
        # A RESET from the gateway (its client left, its deadline passed) cancels the work at once,
        # wherever it waits: for a slot, a connection, the response head, or the node's body.
        stream.on_finished(lambda s: self._cancel_on_reset(s, task))
        task.add_done_callback(self._done)

    def _cancel_on_reset(self, stream: Stream, task: asyncio.Task[None]) -> None:
        err = stream.reset_error
        if err is None or task.done():
            return
        if err.remote:
            # Its client left: others of the node's queue may be leaving with it, their RESETs still on the way.
            slots = self._slots.get(stream.open.node)
            if slots is not None:
                slots.settle()
        task.cancel()

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not self.tasks:
            self.idle.set()
        self.metrics.streams.dec()
        if not task.cancelled() and task.exception() is not None:
            log.error("stream handler failed: %r", task.exception())

    def _count(self, kind: str, code: str) -> None:
        child = self._requests.get((kind, code))
        if child is None:
            child = self._requests[kind, code] = self.metrics.requests.labels(kind, code)
        child.inc()

    def _refuse(self, stream: Stream, refused: Refusal) -> None:
        frame = stream.open
        self._log.warning(f"{frame.node}:{refused.label}", refused.label, "refused stream for %s:%d (pool %s): %s",
                          frame.node, frame.port, self.pool, refused.text)
        self.metrics.refused.labels(refused.label).inc()
        stream.reset(refused.reset_code, refused.text)

    async def _in_slot(
        self, stream: Stream, req: Request, serve: Callable[[Stream, Request], Awaitable[None]]
    ) -> None:
        """Serve ``stream`` once one of its node's upstream slots is free for this client (fair queue)."""
        node = stream.open.node
        slots = self._slots.get(node)
        if slots is None:
            slots = self._slots[node] = FairSlots(self._connections_per_node, self._per_client,
                                                  max_waiting=4 * self._connections_per_node)
        try:
            try:
                if not slots.try_acquire(req.client):  # the common case takes a free slot without a timer
                    async with req.deadline.timeout():
                        await slots.acquire(req.client, gone=lambda: stream.finished)
            except Abandoned:
                self._gone(stream)  # reset while it waited: dropped from the queue, never dialled
                return
            except QueueFull as exc:
                self._refuse(stream, Refusal(Reason.AGENT_QUEUE_FULL, f"node {node} is busy: {exc}"))
                return
            except TimeoutError:
                self._refuse(stream, Refusal(Reason.AGENT_QUEUE_TIMEOUT, f"waited {req.deadline.budget:.1f}s for a "
                                             f"connection to node {node}"))
                return
            except asyncio.CancelledError:
                if stream.finished:
                    self._gone(stream)  # reset while it waited: out of the queue, never dialled
                else:
                    self._cancelled(stream)
                raise
            try:
                # A RESET that came with the OPEN, or in the loop turn that freed this slot, is known here before
                # its callback has cancelled this task: the node is not dialled for a request nobody waits for.
                if stream.finished:
                    self._gone(stream)
                    return
                await serve(stream, req)
            finally:
                slots.release(req.client)
        finally:
            stream.close()
            if slots.idle and self._slots.get(node) is slots:
                slots.close()
                del self._slots[node]

    def _gone(self, stream: Stream) -> None:
        """The stream ended (its client left) before it had a slot: counted, never dialled."""
        frame = stream.open
        err = stream.reset_error
        log.debug("stream to %s ended by the gateway before it was served: %s", frame.node,
                  "closed" if err is None else err.reason)
        kind = "http" if frame.kind == wire.StreamKind.HTTP else "tcp"
        self._count(kind, "abandoned")

    def _cancelled(self, stream: Stream) -> None:
        """The serving task was cancelled: by a RESET from the gateway, or because the agent stops."""
        err = stream.reset_error
        if err is None:
            stream.reset(wire.ResetCode.CANCEL, "agent shutting down")
        else:
            self._log.info(stream.open.node, "gateway-reset", "stream to %s ended by the gateway: %s", stream.open.node,
                           err.reason)

    # ------------------------------------------------------------ HTTP

    async def _serve_http(self, stream: Stream, req: Request) -> None:
        frame = stream.open
        start = time.monotonic()
        code = "error"
        resp: Response | None = None
        try:
            # The deadline the slot wait already spent from, not a fresh one: the agent answers within the
            # gateway's budget however long the request queued for its node.
            async with req.deadline.timeout():
                try:
                    resp = await self._upstream.request(
                        req.address,
                        frame.port,
                        frame.method,
                        req.url.raw_path_qs,
                        req.headers,
                        None if frame.fin else RequestBody(stream, self._to_node),
                    )
                except ConnectFailed as failed:
                    code = "connect-failed"
                    why = "timed out" if failed.os_error is None else _os_reason(failed.os_error, req.address)
                    self._log.warning(frame.node, "connect", "cannot connect to node %s at %s:%d: %s", frame.node,
                                      req.address, frame.port, why)
                    stream.reset(wire.ResetCode.CONNECT_FAILED,
                                 f"cannot connect to node {frame.node} port {frame.port}: {why}")
                    return
                except PoolFull as full:
                    code = "upstream-cap"
                    self._log.warning("upstream-cap", "upstream-cap", "request to node %s waits for no connection: %s",
                                      frame.node, full)
                    stream.reset(wire.ResetCode.LIMIT, f"agent cannot reach node {frame.node} now: {full}")
                    return
                except (UpstreamError, ConnectionError) as unanswered:
                    code = "connect-failed"
                    self._log.warning(frame.node, "request", "request to node %s at %s:%d failed: %s", frame.node,
                                      req.address, frame.port, _safe(unanswered))
                    stream.reset(wire.ResetCode.CONNECT_FAILED, f"request to node {frame.node} port {frame.port} "
                                 f"failed: {_safe(unanswered, req.address)}")
                    return
                odd = _odd_status(resp.status)
                if odd:
                    code = "bad-status"
                    stream.reset(wire.ResetCode.UPSTREAM_BROKEN, f"node {frame.node} {odd}")
                    return
                code = str(resp.status)
                gz, head = compress.plan(self.compress_mode, frame.method, resp.status, req.headers,
                                         _response_headers(resp.headers), req.uplink_free)
                stream.send_head(resp.status, resp.reason, head)
                sent = chunks = 0
                try:
                    while True:
                        chunk, last = await resp.read()
                        if chunk:
                            sent += len(chunk)
                            chunks += 1
                        if gz is not None:
                            chunk = gz.feed(chunk, last)
                            if not chunk and not last:
                                continue  # held by the compressor until its next flush
                        # The last piece carries FIN: one frame less.
                        await stream.write(chunk, end=last)
                        if last:
                            break
                except (ResponseBroken, ConnectionError) as broken:
                    code = "broken"
                    self._log.warning(frame.node, "broken", "response from %s broke after %d bytes: %s", frame.node,
                                      sent, _safe(broken))
                    stream.reset(wire.ResetCode.UPSTREAM_BROKEN,
                                 f"response from {frame.node} broke after {sent} bytes: {_safe(broken, req.address)}")
                    return
                stream.end()
                if resp.status == 200 and self.on_answered is not None:
                    self.on_answered(frame, req.deadline, req.client)
                self._from_node.inc(sent)
                self._to_gateway.inc(sent if gz is None else gz.wire)
                log.debug("%s %s: %d bytes from %s in %d reads", frame.method, frame.target, sent, frame.node, chunks)
        except TimeoutError:
            code = "timeout"
            stream.reset(wire.ResetCode.TIMEOUT,
                         f"node {frame.node} did not answer within {req.deadline.budget:.1f}s")
        except StreamReset as reset:
            code = "cancelled"
            self._log.info(frame.node, "gateway-reset", "stream to %s ended by the gateway: %s", frame.node,
                           reset.reason)
        except asyncio.CancelledError:
            code = "cancelled"
            self._cancelled(stream)
            raise
        except Exception as exc:
            code = "internal"
            log.exception("forwarding to %s failed", frame.node)
            stream.reset(wire.ResetCode.INTERNAL, f"agent error: {_safe(exc, req.address)}")
        finally:
            if resp is not None:
                # Back to the pool only when complete with keep-alive semantics; otherwise closed.
                resp.release()
            self._count("http", code)
            self.metrics.latency.observe(time.monotonic() - start)

    # ------------------------------------------------------------ TCP

    async def _serve_tcp(self, stream: Stream, req: Request) -> None:
        """Relay raw TCP; the connection holds one of the agent's upstream slots (the cap counts it)."""
        try:
            async with self._upstream.slot():
                await self._relay_tcp(stream, req)
        except PoolFull as exc:
            self._count("tcp", "upstream-cap")
            stream.reset(wire.ResetCode.LIMIT, f"agent cannot reach node {stream.open.node} now: {exc}")

    async def _relay_tcp(self, stream: Stream, req: Request) -> None:
        frame = stream.open
        address = req.address
        code = "error"
        writer: asyncio.StreamWriter | None = None
        try:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    reader, writer = await asyncio.open_connection(address, frame.port)
            except (OSError, TimeoutError) as failed:
                code = "connect-failed"
                why = "timed out" if isinstance(failed, TimeoutError) else _os_reason(failed, address)
                self._log.warning(frame.node, "connect", "cannot connect to node %s at %s:%d: %s", frame.node,
                                  address, frame.port, why)
                stream.reset(wire.ResetCode.CONNECT_FAILED,
                             f"cannot connect to node {frame.node} port {frame.port}: {why}")
                return
            stream.send_head(200, "Connection established", ())
            code = "200"
            await _pump(stream, reader, writer)
        except StreamReset as reset:
            self._log.info(frame.node, "tcp-reset", "tcp stream to %s ended: %s", frame.node, reset.reason)
        except asyncio.CancelledError:
            self._cancelled(stream)
            raise
        finally:
            self._count("tcp", code)
            if writer is not None:
                writer.close()
                try:
                    # A node that stopped reading keeps unsent bytes buffered and the close pending.
                    async with asyncio.timeout(self.connect_timeout):
                        await writer.wait_closed()
                except asyncio.CancelledError:
                    writer.transport.abort()
                    raise
                except Exception:  # timed out, or the connection was already broken
                    writer.transport.abort()


class RequestBody:
    """A stream's request body as the upstream client sends it on (``async for``), chunk by chunk, each counted in
    ``counted`` (bytes to the node); it ends at the gateway's FIN and raises StreamReset at its RESET. A class
    rather than an async generator, which mypyc does not compile."""

    def __init__(self, stream: Stream, counted: Counter) -> None:
        self._stream = stream
        self._counted = counted

    def __aiter__(self) -> RequestBody:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._stream.read()
        if not chunk:
            raise StopAsyncIteration
        self._counted.inc(len(chunk))
        return bytes(chunk)


async def _pump(stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    async def node_to_tunnel() -> None:
        while data := await reader.read(64 * 1024):
            await stream.write(data)
        stream.end()

    async def tunnel_to_node() -> None:
        while chunk := await stream.read():
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    t1 = asyncio.ensure_future(node_to_tunnel())
    t2 = asyncio.ensure_future(tunnel_to_node())
    # A RESET from the gateway wakes neither pump when the node has stopped reading or
    # sending: the stream's end is a third thing to wait for.
    t3 = asyncio.ensure_future(stream.wait_finished())
    tasks = (t1, t2, t3)
    try:
        pending: set[asyncio.Future[None]] = {t1, t2}
        while pending:
            done, _ = await asyncio.wait({*pending, t3}, return_when=asyncio.FIRST_COMPLETED)
            for task in done & {t1, t2}:
                exc = task.exception()
                if exc is not None:
                    if isinstance(exc, ConnectionError | OSError):
                        stream.reset(wire.ResetCode.UPSTREAM_BROKEN, f"connection to node broke: {_safe(exc)}")
                        return
                    raise exc
            pending -= done
            if t3 in done:
                return
    finally:
        await cancel_and_wait(tasks)


def _safe(exc: BaseException, address: str = "") -> str:
    """An error for a log line or a peer: its type and message, never the request (headers hold tokens).

    With ``address``, that internal address is masked (the text goes to the gateway and its clients).
    """
    text = str(exc).split("\n", 1)[0]
    if address:
        text = text.replace(address, "<node>")
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _os_reason(err: OSError, address: str) -> str:
    """Why a connection failed, without the node's internal address ("Connection refused")."""
    if err.errno:
        return os.strerror(err.errno)
    return _safe(err, address)


def _odd_status(status: int) -> str:
    """Why a final status from a node cannot be passed on ("" when it can).

    The upstream client skips interim 1xx responses itself (agent/upstream.py); what reaches here as final is refused
    when it is a 1xx (101 Switching Protocols, never asked for: the agent forwards no Upgrade) or outside
    100-599, since a client would take it as a final answer and hang.
    """
    if status == 101:
        return "answered 101 Switching Protocols without an upgrade request"
    if 100 <= status < 200:
        return f"answered interim status {status} as a final response"
    if not 200 <= status <= 599:
        return f"answered status {status}, outside 100-599"
    return ""
