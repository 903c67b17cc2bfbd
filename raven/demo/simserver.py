"""The simulated dcgm-exporter's HTTP server: one listener per node, fault modes switched at run time.

``SimExporter`` serves several simulated nodes from one process, one listener per node
(``127.0.0.2:9400``, ``127.0.0.3:9400``, ... -- on Linux all of 127.0.0.0/8 is local).
Bodies (raven/demo/dcgm_page.py) are rendered once per ``refresh`` interval, together
with a gzip copy, so a request costs no rendering. Faults can be injected per node at run
time with ``set_mode``: ``stall``, ``break``, ``cut``, ``slow``, ``refuse``, ``error`` and
back to ``ok``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, Literal, get_args

from aiohttp import web

from raven.demo.dcgm_page import CONTENT_TYPE, REFRESH_SECONDS, NodeModel

__all__ = ["DEFAULT_PORT", "MODES", "Mode", "SimExporter", "SimNode", "default_nodes"]

log = logging.getLogger("raven.simexporter")

DEFAULT_PORT: Final = 9400
SLOW_CHUNK: Final = 1024
SLOW_DELAY: Final = 0.05

Mode = Literal["ok", "stall", "break", "cut", "slow", "refuse", "error"]
MODES: Final[tuple[str, ...]] = get_args(Mode)


@dataclass
class SimNode:
    """One simulated node: its name (the Hostname label) and where it listens."""

    name: str
    host: str
    port: int = DEFAULT_PORT
    gpus: int = 8
    size: int | None = None


def default_nodes(
    count: int, first_host: int = 2, port: int = DEFAULT_PORT, prefix: str = "edge-gpu-"
) -> list[SimNode]:
    """``edge-gpu-1`` on 127.0.0.2, ``edge-gpu-2`` on 127.0.0.3, ... all on ``port``."""
    if count < 0 or first_host < 1 or first_host + count - 1 > 254:
        raise ValueError("loopback hosts must stay within 127.0.0.1 .. 127.0.0.254")
    return [SimNode(f"{prefix}{i + 1}", f"127.0.0.{first_host + i}", port) for i in range(count)]


_HTML: Final = (
    b"<html>\n<head><title>GPU Exporter</title></head>\n<body>\n<h1>GPU Exporter</h1>\n"
    b'<p><a href="./metrics">Metrics</a></p>\n</body>\n</html>\n'
)
_ERROR_BODY: Final = b"simulated dcgm-exporter failure: DCGM is not responding\n"


@lru_cache(maxsize=256)
def _accepts_gzip(accept_encoding: str) -> bool:
    for part in accept_encoding.split(","):
        token, _, params = part.partition(";")
        if token.strip().lower() not in ("gzip", "x-gzip", "*"):
            continue
        quality = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if quality > 0:
            return True
    return False


class _NodeState:
    """Run-time state of one served node."""

    def __init__(self, node: SimNode, processes_per_gpu: int, interval: float, gzip_level: int) -> None:
        self.node = node
        self.model = NodeModel(node.name, node.gpus, processes_per_gpu, target_bytes=node.size, interval=interval)
        self.interval = interval
        self.gzip_level = gzip_level
        self.mode: Mode = "ok"
        self.address: tuple[str, int] = (node.host, node.port)
        self.server: asyncio.Server | None = None
        self.opening: asyncio.Task[None] | None = None  # re-listening after "refuse"
        self.tick: int | None = None
        self.started = 0.0
        self.plain = b""
        self.gzipped = b""
        self.plain_headers = {"Content-Type": CONTENT_TYPE, "Vary": "Accept-Encoding"}
        self.gzip_headers = {**self.plain_headers, "Content-Encoding": "gzip"}

    def bodies(self) -> tuple[bytes, bytes]:
        """(plain, gzip) bodies for now; rendered at most once per interval."""
        now = time.monotonic()
        if self.tick is None:
            self.started = now
        tick = int((now - self.started) // self.interval)
        if tick != self.tick:
            self.plain = self.model.render(tick)
            self.gzipped = gzip.compress(self.plain, compresslevel=self.gzip_level, mtime=0)
            self.tick = tick
        return self.plain, self.gzipped


class SimExporter:
    """Serves simulated dcgm-exporters, one listener per node, with fault injection.

    ``requests[name]`` counts every HTTP request a node received (any path, any mode).
    Faults set with ``set_mode`` apply to ``/metrics``, except ``refuse`` which closes
    the node's listener (and its open connections) altogether.
    """

    def __init__(
        self,
        nodes: Sequence[SimNode],
        *,
        processes_per_gpu: int = 4,
        refresh: float = REFRESH_SECONDS,
        gzip_level: int = 6,
        serve_gzip: bool = True,
    ) -> None:
        names = [node.name for node in nodes]
        self.serve_gzip = serve_gzip  # False: always the plain body, as an exporter that never compresses
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        self._states = {node.name: _NodeState(node, processes_per_gpu, refresh, gzip_level) for node in nodes}
        self._by_address: dict[tuple[str, int], _NodeState] = {}
        self.requests: dict[str, int] = dict.fromkeys(names, 0)
        self._web: web.Server | None = None
        self._closing = asyncio.Event()
        self._started = False
        self._closed = False
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def nodes(self) -> list[SimNode]:
        return [state.node for state in self._states.values()]

    def address(self, name: str) -> tuple[str, int]:
        """Where node ``name`` listens (the real port once started, even if configured as 0)."""
        return self._states[name].address

    def url(self, name: str, path: str = "/metrics") -> str:
        host, port = self.address(name)
        return f"http://{host}:{port}{path}"

    def mode(self, name: str) -> Mode:
        return self._states[name].mode

    def body(self, name: str) -> bytes:
        """The plain body node ``name`` serves right now."""
        return self._states[name].bodies()[0]

    def gzip_body(self, name: str) -> bytes:
        """The gzip body node ``name`` serves right now to clients that accept gzip."""
        return self._states[name].bodies()[1]

    async def start(self) -> None:
        if self._started or self._closed:
            raise RuntimeError("SimExporter can only be started once")
        self._started = True
        self._web = web.Server(self._handle, access_log=None, handler_cancellation=False)
        try:
            for state in self._states.values():
                state.bodies()
                if state.mode != "refuse":
                    await self._listen(state)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop listening, end stalled and slow responses, close every connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        for state in self._states.values():
            self._unlisten(state)
        if self._pending:  # listeners being reopened: they close themselves once open
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._web is not None:
            self._web.pre_shutdown()
            await self._web.shutdown(2.0)
        self._by_address.clear()

    async def __aenter__(self) -> SimExporter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def set_mode(self, name: str, mode: Mode) -> None:
        """Switch node ``name`` to ``mode``; takes effect for the next request.

        ``refuse`` closes the listener at once (connect() fails from now on) and closes
        the node's open connections; leaving ``refuse`` binds the listening socket again
        at once, so connections queue in the backlog until accept() resumes (call it from
        the event loop's thread). Only a "refuse" in the same loop iteration as the "ok"
        before it can be late: the listener then closes as soon as it has started.
        """
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        state = self._states[name]
        previous, state.mode = state.mode, mode
        if not self._started or self._closed or previous == mode:
            return
        if mode == "refuse":
            self._unlisten(state)
            if self._web is not None:
                for conn in self._web.connections:
                    transport = conn.transport
                    if transport is not None and self._sockname(transport) == state.address:
                        conn.force_close()
        elif previous == "refuse" and state.opening is None:
            sock = self._bind(state)
            task = asyncio.get_running_loop().create_task(self._serve(state, sock))
            state.opening = task
            self._pending.add(task)
            task.add_done_callback(self._reopened)
        log.info("%s: mode %s -> %s", name, previous, mode)

    # Listeners -------------------------------------------------------------------

    @staticmethod
    def _sockname(transport: asyncio.BaseTransport) -> tuple[str, int] | None:
        sockname = transport.get_extra_info("sockname")
        if isinstance(sockname, tuple) and len(sockname) >= 2:
            return (str(sockname[0]), int(sockname[1]))
        return None

    def _bind(self, state: _NodeState) -> socket.socket:
        host, port = state.address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        bound = sock.getsockname()
        state.address = (str(bound[0]), int(bound[1]))
        self._by_address[state.address] = state
        return sock

    async def _serve(self, state: _NodeState, sock: socket.socket) -> None:
        """Accept on ``sock``; never cancelled, so the socket always ends up owned or closed."""
        assert self._web is not None
        try:
            server = await asyncio.get_running_loop().create_server(self._web, sock=sock, backlog=1024)
        except BaseException:
            sock.close()
            raise
        finally:
            state.opening = None
        if state.mode == "refuse" or self._closed:
            server.close()  # refused again, or closed, while the listener was starting
            return
        state.server = server

    def _reopened(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("reopening a listener failed: %r", exc)

    async def _listen(self, state: _NodeState) -> None:
        await self._serve(state, self._bind(state))
        log.info("%s: serving http://%s:%d/metrics", state.node.name, *state.address)

    def _unlisten(self, state: _NodeState) -> None:
        if state.server is not None:
            state.server.close()
            state.server = None

    # Requests --------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        transport = request.transport
        address = self._sockname(transport) if transport is not None else None
        state = self._by_address.get(address) if address is not None else None
        if state is None:
            raise web.HTTPNotFound()
        self.requests[state.node.name] += 1
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
        mode = state.mode
        if mode == "refuse":
            if transport is not None:
                transport.abort()
            return web.Response(status=503)
        path = request.path
        if path == "/":
            return web.Response(body=_HTML, content_type="text/html")
        if path != "/metrics":
            raise web.HTTPNotFound()

        plain, gzipped = state.bodies()
        use_gzip = self.serve_gzip and _accepts_gzip(request.headers.get("Accept-Encoding", ""))
        body = gzipped if use_gzip else plain
        headers = state.gzip_headers if use_gzip else state.plain_headers
        if mode == "ok" or (request.method == "HEAD" and mode in ("break", "cut", "slow")):
            return web.Response(body=body, headers=headers)
        if mode == "error":
            return web.Response(status=500, body=_ERROR_BODY, content_type="text/plain")
        if mode == "stall":
            await self._stall(request)
            return web.Response(status=503)
        if mode in ("break", "cut"):  # cut: the head alone, not one body byte
            return await self._break(request, body, headers, len(body) // 2 if mode == "break" else 0)
        return await self._slow(request, body, headers)

    async def _stall(self, request: web.BaseRequest) -> None:
        """Never answer: wait until the exporter closes (or the client goes away)."""
        while not self._closing.is_set():
            transport = request.transport
            if transport is None or transport.is_closing():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), 0.25)
        transport = request.transport
        if transport is not None:
            transport.abort()

    async def _break(
        self, request: web.BaseRequest, body: bytes, headers: dict[str, str], keep: int
    ) -> web.StreamResponse:
        """Full Content-Length, the first ``keep`` bytes of the body, then a reset connection."""
        response = web.StreamResponse(headers=headers)
        response.content_length = len(body)
        with contextlib.suppress(ConnectionError):
            await response.prepare(request)
            if keep:
                await response.write(body[:keep])
            transport = request.transport
            # Let what was written leave before the reset, or abort() would discard it.
            for _ in range(100):
                if transport is None or transport.get_write_buffer_size() == 0:
                    break
                await asyncio.sleep(0.01)
            if keep:
                # and give the client a moment to read it: a reset that overtakes unread data
                # makes many clients (aiohttp among them) drop that data.
                await asyncio.sleep(0.2)
            if transport is not None:
                transport.abort()
        return response

    async def _slow(self, request: web.BaseRequest, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
        """The whole body, SLOW_CHUNK bytes every SLOW_DELAY seconds."""
        response = web.StreamResponse(headers=headers)
        response.content_length = len(body)
        try:
            await response.prepare(request)
            for start in range(0, len(body), SLOW_CHUNK):
                if self._closing.is_set():
                    transport = request.transport
                    if transport is not None:
                        transport.abort()
                    break
                await response.write(body[start : start + SLOW_CHUNK])
                await asyncio.sleep(SLOW_DELAY)
        except ConnectionError:
            pass
        return response

