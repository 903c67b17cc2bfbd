"""The front end on aiohttp's server (``front.server: aiohttp``): one aiohttp request as a
:class:`~raven.http.call.ServerCall`, so the gateway's request logic (gateway/proxy.py) runs on either server.

:func:`aiohttp_handler` turns the proxy's handler into aiohttp's (the answer the call made is what it returns).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from multidict import CIMultiDictProxy

from raven.aio import reset_connection
from raven.http.call import Feeder, HeaderList, ServerCall
from raven.http.guard import ConnectionGuard

__all__ = ["AiohttpCall", "aiohttp_handler"]


class _RelayResponse(web.StreamResponse):
    """A streamed response whose head leaves with the first body bytes: one write and one packet, not two.

    aiohttp (3.12 and later) holds the serialized head until the first write when this flag is
    False, as its own ``web.Response`` does; the client sees the head no later than the first chunk.
    """

    _send_headers_immediately = False


class AiohttpCall:
    """One aiohttp request, and the answer made to it (``response``)."""

    __slots__ = ("_guard", "close", "request", "response")

    def __init__(self, request: web.BaseRequest, guard: ConnectionGuard | None = None) -> None:
        self.request = request
        self._guard = guard
        self.response: web.StreamResponse | None = None
        self.close = False

    @property
    def method(self) -> str:
        return self.request.method

    @property
    def raw_path(self) -> str:
        return self.request.raw_path

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self.request.headers

    @property
    def version(self) -> tuple[int, int]:
        return (self.request.version.major, self.request.version.minor)

    @property
    def remote(self) -> str | None:
        return self.request.remote

    @property
    def secure(self) -> bool:
        return self.request.secure

    @property
    def body_exists(self) -> bool:
        return self.request.body_exists

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.request.transport

    def timeout(self, at: float) -> asyncio.Timeout:
        return asyncio.timeout(max(0.0, at - time.monotonic()))

    async def read(self) -> bytes:
        request = self.request
        if request.headers.get("Expect", "").lower() == "100-continue" and request.writer is not None \
                and not getattr(request, "_raven_continued", False):
            request._raven_continued = True  # type: ignore[attr-defined]
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return await request.content.readany()

    def respond(self, status: int, headers: HeaderList, body: bytes, close: bool) -> None:
        response = self.response = web.Response(status=status, body=body, headers=dict(headers))
        if close or self.close:
            response.force_close()

    async def send(self, status: int, reason: str, headers: HeaderList, length: int | None, first: bytes,
                   close: bool, until: float, last: bool = False) -> None:
        resp = self.response = _RelayResponse(status=status, reason=reason or None)
        for name, value in headers:
            resp.headers.add(name, value)
        no_body = self.method == "HEAD" or status in (204, 304)
        if length is not None:
            resp.content_length = length
        elif self.request.version >= (1, 1) and not no_body:
            resp.enable_chunked_encoding()
        if close or self.close:
            resp.force_close()
        await resp.prepare(self.request)
        if first:
            await self.write(first, until)

    async def write(self, chunk: bytes | memoryview, until: float) -> None:
        assert self.response is not None
        async with self.timeout(until):
            await self.response.write(chunk)

    async def end(self, until: float) -> None:
        # The end waits for the client to take what is still buffered (aiohttp drains here whatever was written
        # before): the same deadline as any write.
        assert self.response is not None
        async with self.timeout(until):
            await self.response.write_eof()

    def abort(self) -> None:
        if self.request.transport is not None:
            reset_connection(self.request.transport)

    def take_over(self, feeder: Feeder) -> None:
        self.request.protocol.set_parser(feeder)  # type: ignore[arg-type]

    async def drained(self) -> None:
        if self._guard is not None:
            await self._guard.drained(self.request)


def aiohttp_handler(handle: Callable[[ServerCall], Awaitable[None]], guard: ConnectionGuard,
                    draining: Callable[[], bool]) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """aiohttp's handler for the proxy's ``handle``: while draining every answer closes its connection."""

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        call = AiohttpCall(request, guard)
        call.close = draining()
        await handle(call)
        response = call.response
        if response is None:
            response = web.Response(status=200)  # CONNECT: the connection was taken over (nothing more is sent)
        elif draining():
            response.force_close()  # not prepared yet: "Connection: close" in its head; else a close after it
        return response

    return handler
