"""What a front-end handler sees of one request and how it answers, whichever server runs the port.

:class:`ServerCall` is the lean server's request (raven/http/h1server.py) and the aiohttp adapter's
(gateway/aiocall.py) alike: the request line and headers, the body chunk by chunk, and an answer as one
write (:meth:`ServerCall.respond`), or a head with its first body bytes in one write followed by more
(:meth:`ServerCall.send`, :meth:`ServerCall.write`, :meth:`ServerCall.end`). Writes wait while the client does
not read (transport flow control) until ``until`` (``time.monotonic()``), then raise ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from multidict import CIMultiDictProxy

__all__ = ["Feeder", "HeaderList", "ServerCall"]

HeaderList = Sequence[tuple[str, str]]


class Feeder(Protocol):
    """Where a connection's bytes go once a CONNECT took it over (gateway/tcprelay.py)."""

    def feed_data(self, data: bytes) -> object: ...

    def feed_eof(self) -> None: ...


class ServerCall(Protocol):
    @property
    def method(self) -> str: ...

    @property
    def raw_path(self) -> str: ...

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...

    @property
    def version(self) -> tuple[int, int]: ...

    @property
    def remote(self) -> str | None: ...

    @property
    def secure(self) -> bool: ...

    @property
    def body_exists(self) -> bool: ...

    @property
    def transport(self) -> asyncio.Transport | None: ...

    def timeout(self, at: float) -> AbstractAsyncContextManager[object]:
        """A wait that ends with ``TimeoutError`` at ``at`` (``time.monotonic()``)."""
        ...

    async def read(self) -> bytes:
        """The next bytes of the request body (b"" at its end); answers ``Expect: 100-continue`` first."""
        ...

    def respond(self, status: int, headers: HeaderList, body: bytes, close: bool) -> None:
        """A whole answer in one write (``close``: the connection ends after it)."""
        ...

    async def send(self, status: int, reason: str, headers: HeaderList, length: int | None, first: bytes,
                   close: bool, until: float, last: bool = False) -> None:
        """The response head and its first body bytes; ``length`` None: chunked (HTTP/1.1) or to the close;
        ``last``: ``first`` is the whole body (a chunked one may end in the same write)."""
        ...

    async def write(self, chunk: bytes | memoryview, until: float) -> None: ...

    async def end(self, until: float) -> None:
        """The response is complete: its last chunk, and wait until the client took what is buffered."""
        ...

    def abort(self) -> None:
        """Reset the connection: what was sent can never read as a complete response."""
        ...

    def take_over(self, feeder: Feeder) -> None:
        """The connection's bytes from now on go to ``feeder`` (CONNECT), not to the HTTP parser."""
        ...

    async def drained(self) -> None:
        """Return once the connection takes writes again; raise ``ConnectionError`` when it is lost."""
        ...
