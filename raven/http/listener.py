"""Listening sockets that hold against hostile clients: the accept loop, and the process's descriptor budget.

:class:`GuardedSite` is an aiohttp site whose connections go through a :class:`ConnectionGuard`
(raven/http/guard.py: the caps per client and in total, the head and idle deadlines). With TLS it runs its
own accept loop, so that a connection is counted from its TCP accept and its handshake has a deadline.
:func:`descriptor_budget` raises the open-files limit and says how many descriptors the listeners may use.
:func:`guarded_handler` and :func:`guard_middleware` tell the guard when each request starts and ends.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Any

from aiohttp import web
from aiohttp.web_runner import BaseRunner, BaseSite

from raven.http.guard import ConnectionGuard, Handler
from raven.http.h1server import LeanServer

log = logging.getLogger("raven.http.listener")


class GuardedSite(BaseSite):
    """A TCP site whose connections pass through ``guard`` (and, with TLS, whose handshakes have a deadline).

    With TLS the site accepts connections itself: a connection is counted against the caps from its TCP
    accept, so that peers which never finish their handshake are bounded too, and is handed to the event
    loop's TLS (``connect_accepted_socket``) only once admitted.
    """

    __slots__ = ("_accept", "_guard", "_handshakes", "_host", "_port", "_reuse_address", "_sock")

    def __init__(
        self,
        runner: BaseRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        *,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 1024,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host = host
        self._port = port
        self._guard = guard
        self._sock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        if self._ssl_context is None:
            self._server = await loop.create_server(
                self._guard.wrap(server), self._host, self._port, backlog=self._backlog, reuse_address=True
            )
            return
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        self._sock = socket.create_server((self._host, self._port), family=family, backlog=self._backlog)
        self._sock.setblocking(False)
        self._accept = loop.create_task(self._accept_loop(self._sock, self._ssl_context), name=f"accept {self.name}")

    async def _accept_loop(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        loop = asyncio.get_running_loop()
        guard = self._guard
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except OSError as exc:  # out of descriptors (EMFILE), or a connection reset before the accept
                guard.accept_failed(exc)
                await asyncio.sleep(0.05)
                continue
            client = str(addr[0]) if isinstance(addr, tuple) and addr else "?"
            refusal, over = guard.admit(client)
            if refusal is not None:
                conn.close()  # no TLS yet, nothing to say: the refusal is counted and logged
                continue
            task = loop.create_task(self._handshake(conn, client, context, over))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: socket.socket, client: str, context: ssl.SSLContext, over: bool) -> None:
        server = self._runner.server
        assert server is not None
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                self._guard.wrap(server, client, over), conn, ssl=context,
                ssl_handshake_timeout=self._guard.limits.head_timeout,
            )
        except BaseException as exc:
            conn.close()
            self._guard.release(client, None, False, over)  # its protocol never came up: released here
            if isinstance(exc, TimeoutError | ConnectionAbortedError):
                self._guard.refused("head-timeout", client, f"no TLS handshake within "
                                     f"{self._guard.limits.head_timeout:g}s")
            if not isinstance(exc, Exception):
                raise  # cancelled (the site stops)

    async def stop_accepting(self) -> None:
        """Take no new connection (the port refuses them); the connections open go on until they end.

        TLS handshakes not finished yet are abandoned: such a client has sent no request.
        """
        if self._server is not None:
            self._server.close()
        await self.stop()

    async def stop(self) -> None:
        tasks = [t for t in (self._accept, *self._handshakes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._accept = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        await super().stop()


class LeanRunner(BaseRunner):
    """Runs a :class:`~raven.http.h1server.LeanServer` on :class:`GuardedSite` s, as aiohttp's ServerRunner runs
    its ``Server`` (the sites ask the runner for the protocol factory; cleanup closes the connections)."""

    __slots__ = ("_lean",)

    def __init__(self, server: LeanServer, shutdown_timeout: float) -> None:
        super().__init__(shutdown_timeout=shutdown_timeout)
        self._lean = server

    async def shutdown(self) -> None:
        pass  # the server's own shutdown (called by cleanup) ends the requests and connections

    async def _make_server(self) -> web.Server:
        return self._lean  # type: ignore[return-value]  # the same three methods: __call__, pre_shutdown, shutdown

    async def _cleanup_server(self) -> None:
        pass


def descriptor_budget(reserve: int) -> int:
    """Raise the soft open-files limit to the hard one; return how many descriptors remain beyond ``reserve``."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            target = hard if hard != resource.RLIM_INFINITY else 1 << 20
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    except (ImportError, ValueError, OSError) as exc:
        log.warning("could not raise the open-files limit: %s", exc)
        return 1 << 30
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(64, soft - reserve)


def guarded_handler(guard: ConnectionGuard, handler: Handler) -> Handler:
    """A low-level ``web.Server`` handler that tells the guard when each request starts and ends."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        guard.request_started(request)
        try:
            return await handler(request)
        finally:
            guard.request_finished(request)

    return handle


def guard_middleware(guard: ConnectionGuard) -> Any:
    """The same for a ``web.Application`` (tunnel and ops listeners)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await guarded_handler(guard, handler)(request)

    return middleware

