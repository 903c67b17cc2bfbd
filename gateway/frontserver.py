"""The front port's HTTP server: the lean one (raven/http/h1server.py, the default) or aiohttp's
(``front.server: aiohttp``), either running the proxy's handler (gateway/proxy.py) behind the connection guard.

The lean server answers a request in fewer steps: no request object, URL or response object of aiohttp's, one
timer per connection, the head and the first body bytes in one write (docs/performance.md, issue 31).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.aiocall import aiohttp_handler
from raven.config import GatewayFront
from raven.http import parsererrors
from raven.http.call import ServerCall
from raven.http.guard import ConnectionGuard
from raven.http.h1server import LeanCall, LeanServer
from raven.http.listener import LeanRunner, guarded_handler

__all__ = ["HEAD_BLOCK_FACTOR", "front_server"]

HEAD_BLOCK_FACTOR = 8
"""A request head may take this many times ``front.max_header_bytes`` in all (each line at most that): beyond
it the lean server answers 431 without reading on. The wire's own bound (64 KiB per OPEN) is checked after."""


def front_server(cfg: GatewayFront, guard: ConnectionGuard, handle: Callable[[ServerCall], Awaitable[None]],
                 draining: Callable[[], bool]) -> web.BaseRunner:
    """The runner for the front port's sites (raven/http/listener.py's ``GuardedSite``)."""
    if cfg.server == "aiohttp":
        server = web.Server(
            guarded_handler(guard, aiohttp_handler(handle, guard, draining)),
            logger=parsererrors.install("raven.gateway.http"),
            max_line_size=cfg.max_header_bytes,
            max_field_size=cfg.max_header_bytes,
            handler_cancellation=True,
            # A backstop only: the guard closes idle connections at front.idle_timeout.
            keepalive_timeout=cfg.idle_timeout + cfg.head_timeout,
        )
        return web.ServerRunner(server, access_log=None, shutdown_timeout=2.0)

    async def lean_handle(call: LeanCall) -> None:
        if draining():
            call.close = True  # "Connection: close": a draining replica sends keep-alive clients elsewhere
        await handle(call)
        if draining():
            call.close = True  # a close after the answer

    lean = LeanServer(lean_handle, guard, cfg.max_header_bytes, HEAD_BLOCK_FACTOR * cfg.max_header_bytes,
                      parsererrors.MalformedLines())
    return LeanRunner(lean, shutdown_timeout=2.0)
