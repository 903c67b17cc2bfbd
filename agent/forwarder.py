"""Serve streams opened by the gateway: check them, dial the node, relay both ways.

The agent checks every stream again before it dials: the node must be one of its own
(the address comes from its inventory, never from the gateway) and the port allowed.
HTTP streams use a keep-alive connection pool; bodies pass through unchanged (no
decompression). TCP streams (CONNECT) are relayed byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import aiohttp

from raven import wire
from raven.aio import cancel_and_wait
from raven.metrics import AgentMetrics
from raven.mux import Stream, StreamReset

log = logging.getLogger("raven.agent.forwarder")

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)
DEADLINE_HEADER = "x-raven-timeout-ms"


def _response_headers(raw: tuple[tuple[bytes, bytes], ...]) -> wire.Headers:
    out = []
    for name_b, value_b in raw:
        name = name_b.decode("latin-1")
        if name.lower() in HOP_BY_HOP:
            continue
        out.append((name, value_b.decode("latin-1")))
    return tuple(out)


class Forwarder:
    def __init__(
        self,
        nodes: Callable[[], dict[str, str]],
        allowed_ports: frozenset[int],
        metrics: AgentMetrics,
        connect_timeout: float,
        default_timeout: float,
        connections_per_node: int,
        draining: Callable[[], bool],
        pool: str = "",
    ) -> None:
        self.pool = pool
        self.nodes = nodes
        self.allowed_ports = allowed_ports
        self.metrics = metrics
        self.connect_timeout = connect_timeout
        self.default_timeout = default_timeout
        self.draining = draining
        self.tasks: set[asyncio.Task[None]] = set()
        self.idle = asyncio.Event()
        self.idle.set()
        self._client: aiohttp.ClientSession | None = None
        self._connections_per_node = connections_per_node

    def _http(self) -> aiohttp.ClientSession:
        if self._client is None:
            connector = aiohttp.TCPConnector(
                limit=0,
                limit_per_host=self._connections_per_node,
                keepalive_timeout=30,
                ttl_dns_cache=30,
            )
            self._client = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Accept", "Content-Type"),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._client

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._client is not None:
            await self._client.close()
            self._client = None

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
            self._refuse(stream, wire.ResetCode.DRAINING, "agent is draining", "draining")
            return
        address = self.nodes().get(frame.node)
        if address is None:
            self._refuse(stream, wire.ResetCode.REFUSED, f"node {frame.node!r} is not served by this agent", "node")
            return
        if frame.port not in self.allowed_ports:
            self._refuse(
                stream, wire.ResetCode.REFUSED, f"port {frame.port} is not allowed on this agent", "port"
            )
            return
        coro = self._serve_http(stream, address) if frame.kind == wire.StreamKind.HTTP else self._serve_tcp(
            stream, address
        )
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        self.idle.clear()
        self.metrics.streams.inc()
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not self.tasks:
            self.idle.set()
        self.metrics.streams.dec()
        if not task.cancelled() and task.exception() is not None:
            log.error("stream handler failed: %r", task.exception())

    def _refuse(self, stream: Stream, code: wire.ResetCode, reason: str, label: str) -> None:
        log.warning("refused stream for %s:%d (pool %s): %s", stream.open.node, stream.open.port, self.pool, reason)
        self.metrics.refused.labels(label).inc()
        stream.reset(code, reason)

    # ------------------------------------------------------------ HTTP

    def _deadline(self, headers: wire.Headers) -> tuple[float, wire.Headers]:
        timeout = self.default_timeout
        kept = []
        for name, value in headers:
            if name.lower() == DEADLINE_HEADER:
                with contextlib.suppress(ValueError):
                    timeout = min(timeout, max(0.001, int(value) / 1000))
                continue
            kept.append((name, value))
        return timeout, tuple(kept)

    async def _request_body(self, stream: Stream) -> AsyncIterator[bytes]:
        while chunk := await stream.read():
            self.metrics.bytes.labels("to_node").inc(len(chunk))
            yield bytes(chunk)

    async def _serve_http(self, stream: Stream, address: str) -> None:
        frame = stream.open
        timeout, headers = self._deadline(frame.headers)
        url = f"http://{_url_host(address)}:{frame.port}{frame.target}"
        start = time.monotonic()
        code = "error"
        try:
            async with asyncio.timeout(timeout):
                try:
                    resp = await self._http().request(
                        frame.method,
                        url,
                        headers=list(headers),
                        data=None if frame.fin else self._request_body(stream),
                        allow_redirects=False,
                        compress=None,
                    )
                except aiohttp.ClientConnectorError as exc:
                    code = "connect-failed"
                    stream.reset(wire.ResetCode.CONNECT_FAILED, f"cannot connect to {frame.node} ({address}:"
                                 f"{frame.port}): {exc.os_error.strerror or exc.os_error}")
                    return
                except (aiohttp.ClientError, ConnectionError) as exc:
                    code = "connect-failed"
                    stream.reset(wire.ResetCode.CONNECT_FAILED,
                                 f"request to {frame.node} ({address}:{frame.port}) failed: {_safe(exc)}")
                    return
                try:
                    code = str(resp.status)
                    stream.send_head(resp.status, resp.reason or "", _response_headers(resp.raw_headers))
                    sent = chunks = 0
                    length = resp.content_length if frame.method != "HEAD" else None
                    try:
                        async for chunk in resp.content.iter_any():
                            sent += len(chunk)
                            chunks += 1
                            # The chunk that completes a known length carries FIN: one frame less.
                            await stream.write(chunk, end=length is not None and sent >= length)
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, ConnectionError) as exc:
                        code = "broken"
                        log.warning("response from %s broke after %d bytes: %s", frame.node, sent, _safe(exc))
                        stream.reset(wire.ResetCode.UPSTREAM_BROKEN,
                                     f"response from {frame.node} broke after {sent} bytes: {_safe(exc)}")
                        return
                    stream.end()
                    self.metrics.bytes.labels("from_node").inc(sent)
                    log.debug("%s %s: %d bytes from %s in %d reads", frame.method, frame.target, sent, frame.node,
                              chunks)
                finally:
                    resp.release()
        except TimeoutError:
            code = "timeout"
            stream.reset(wire.ResetCode.TIMEOUT, f"node {frame.node} did not answer within {timeout:.1f}s")
        except StreamReset as exc:
            code = "cancelled"
            log.info("stream to %s ended by the gateway: %s", frame.node, exc.reason)
        except asyncio.CancelledError:
            stream.reset(wire.ResetCode.CANCEL, "agent shutting down")
            raise
        except Exception as exc:
            code = "internal"
            log.exception("forwarding to %s failed", frame.node)
            stream.reset(wire.ResetCode.INTERNAL, f"agent error: {_safe(exc)}")
        finally:
            stream.close()
            self.metrics.requests.labels(frame.node, "http", code).inc()
            self.metrics.latency.labels(frame.node).observe(time.monotonic() - start)

    # ------------------------------------------------------------ TCP

    async def _serve_tcp(self, stream: Stream, address: str) -> None:
        frame = stream.open
        code = "error"
        writer: asyncio.StreamWriter | None = None
        try:
            try:
                async with asyncio.timeout(self.connect_timeout):
                    reader, writer = await asyncio.open_connection(address, frame.port)
            except (OSError, TimeoutError) as exc:
                code = "connect-failed"
                why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or _safe(exc))
                stream.reset(wire.ResetCode.CONNECT_FAILED,
                             f"cannot connect to {frame.node} ({address}:{frame.port}): {why}")
                return
            stream.send_head(200, "Connection established", ())
            code = "200"
            await _pump(stream, reader, writer)
        except StreamReset as exc:
            log.info("tcp stream to %s ended: %s", frame.node, exc.reason)
        except asyncio.CancelledError:
            stream.reset(wire.ResetCode.CANCEL, "agent shutting down")
            raise
        finally:
            stream.close()
            self.metrics.requests.labels(frame.node, "tcp", code).inc()
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


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _safe(exc: BaseException) -> str:
    """An error for a log line or a peer: its type and message, never the request (headers hold tokens)."""
    text = str(exc).split("\n", 1)[0]
    if isinstance(exc, aiohttp.ClientResponseError):
        text = f"{exc.status} {exc.message}"
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
