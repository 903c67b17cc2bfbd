"""aiohttp does a tunnel's HTTP Upgrade on both sides (its checks, the 101, the client's certificate and headers,
as before); from then on the connection's bytes are a :class:`raven.transport.wslink.WsLink`'s.

This is the one module that reaches into aiohttp's WebSocket classes, at the point where aiohttp itself puts its
reader on the connection (``protocol.set_parser``):

- the gateway: :class:`TunnelResponse` is aiohttp's ``WebSocketResponse`` whose ``_post_start`` (where aiohttp
  installs its reader, right after writing the 101) installs the link instead, so every byte after the 101 is
  the link's, even one a client sent too early; its ``close`` (which aiohttp also calls when the handler
  returns) is the link's close handshake.
- the agent: :func:`take_over` puts the link on the connection of a ``ClientWebSocketResponse`` that
  ``ws_connect`` just returned (aiohttp's ``set_parser`` on its protocol may be called again). A gateway sends
  nothing before the agent's HELLO; a frame one sent along with its 101 went to aiohttp's reader, and the
  handshake then fails on its deadline. Closing the aiohttp response afterwards releases its connection.

What of aiohttp's is not public, all of it checked by tests/integration/test_wslink.py and every tunnel test:
``WebSocketResponse._post_start`` (its ``_ws_protocol``, ``_set_closed``; its ``_writer`` is left unset, so
``prepared`` is the link's), the server protocol's ``set_parser``, ``_upgraded``, ``_parser`` (its HTTP parser,
dropped once the connection is upgraded) and ``_messages`` (its request queue, replaced by an empty one that
makes a deque only when used), ``ClientWebSocketResponse._response``, the client protocol's ``set_parser`` and the
protocols' ``_drain_helper`` (the wait for ``resume_writing``, as aiohttp's own writer waits).

Masking uses aiohttp's compiled XOR (``websocket_mask``; ~5 µs for 50 KiB against ~130 µs in pure Python).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web

from raven.protocol import wsframe
from raven.transport.wslink import WsLink


def _compiled_masker() -> wsframe.Masker:
    try:
        from aiohttp._websocket.helpers import websocket_mask
    except ImportError:  # pragma: no cover - aiohttp moved it: the pure one is correct, only slower
        return wsframe.mask_python
    return websocket_mask


MASKER: wsframe.Masker = _compiled_masker()


class TunnelResponse(web.WebSocketResponse):
    """The gateway's side of the Upgrade (see the module's docstring); :attr:`link` is set by ``prepare``."""

    def __init__(self, *, max_message: int, drain_timeout: float = 60.0) -> None:
        super().__init__(compress=False, autoping=False)
        self._max_message = max_message
        self._drain_timeout = drain_timeout
        self.link: WsLink | None = None

    @property
    def prepared(self) -> bool:
        return self.link is not None

    def _post_start(self, request: web.BaseRequest, protocol: str | None, writer: Any) -> None:
        # aiohttp's WebSocket writer (``writer``) is not kept: the link writes every frame, and the writer with
        # its task set was half a kilobyte per session. ``prepared`` says so from the link instead.
        self._ws_protocol = protocol
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("connection lost during the upgrade")
        self.link = WsLink(request.protocol, transport, client=False,
                           max_message=self._max_message, masker=MASKER, drain_timeout=self._drain_timeout)
        handler = request.protocol
        handler.set_parser(self.link)  # type: ignore[arg-type]
        handler.keep_alive(False)
        if handler._upgraded:
            # aiohttp reads no further request on an upgraded connection: its HTTP parser (llhttp and the
            # buffers of the request it parsed, about 4 KiB) is let go now rather than kept for the session's
            # life, as aiohttp itself does when the connection is lost.
            handler._parser = None
            if not handler._messages:
                # Nor is a request queued there: its queue (a deque, 760 bytes however empty) gives way to one
                # that holds nothing until something is put in it.
                handler._messages = _UpgradedQueue()  # type: ignore[assignment]

    async def close(self, *, code: int = wsframe.CLOSE_NORMAL, message: bytes = b"", drain: bool = True) -> bool:
        if self._closed:
            return False
        self._set_closed()
        if self.link is not None:
            await self.link.close(code, message.decode("utf-8", "replace"))
        return True


class _UpgradedQueue:
    """aiohttp's queue of parsed requests on a connection that no longer parses any (see ``_post_start``): empty,
    and a deque only if something is ever put in it (what aiohttp calls on its queue: append, popleft, len)."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: deque[Any] | None = None

    def append(self, item: Any) -> None:
        if self._items is None:
            self._items = deque()
        self._items.append(item)

    def popleft(self) -> Any:
        if not self._items:
            raise IndexError("pop from an empty queue")
        return self._items.popleft()

    def clear(self) -> None:
        self._items = None

    def __len__(self) -> int:
        return len(self._items) if self._items is not None else 0

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items or ())


def take_over(ws: aiohttp.ClientWebSocketResponse, *, max_message: int, drain_timeout: float = 60.0) -> WsLink:
    """The agent's side: the connection under ``ws`` is the returned link's from now on."""
    conn = ws._response.connection
    if conn is None or conn.protocol is None or conn.transport is None:
        raise ConnectionResetError("connection lost during the upgrade")
    link = WsLink(conn.protocol, conn.transport, client=True, max_message=max_message,
                  masker=MASKER, drain_timeout=drain_timeout)
    conn.protocol.set_parser(link, None)
    return link
