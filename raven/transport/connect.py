"""Both ends of the tunnel's handshake over a WebSocket, for both services: :func:`connect` (the agent) and
:func:`accept` (the gateway). Each drives its side of the one sans-I/O connection (raven/protocol/handshake.py:
HANDSHAKE to OPEN) over a :class:`Channel` (the services': raven/transport/wslink.py's link, on the connection
aiohttp upgraded) and returns it ready in a :class:`raven.transport.tunnel.Tunnel` whose sink is that channel, not
yet running: the caller attaches its handlers, then awaits ``link.serve(session)``. Every wait has the
handshake's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Protocol

from raven.protocol import wire
from raven.protocol.errors import HandshakeCode, RemoteProtocolError
from raven.protocol.handshake import ClientConnection, ServerConnection
from raven.refusals import HandshakeRefused
from raven.transport.tunnel import Tunnel

GOAWAY_SEND_TIMEOUT = 2.0  # seconds: a refusal's GOAWAY is sent best effort


class Channel(Protocol):
    """Binary messages both ways (a WsLink, or raven/transport/websocket.py's WebSocketSink over aiohttp's)."""

    async def send(self, message: bytes) -> None: ...

    async def send_many(self, messages: list[bytes]) -> None: ...

    async def receive(self) -> bytes: ...  # raises ConnectionError once the connection has ended

    async def close(self) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


async def connect(ws: Channel, hello: wire.Hello, *, limits: wire.Limits,
                  timeout: float) -> tuple[Tunnel, wire.Welcome]:
    """The agent's side: send HELLO, read WELCOME within ``timeout``; the session is named after the replica.

    Raises :class:`RemoteProtocolError` (a GOAWAY, a bad answer, the connection closed) or ``TimeoutError``.
    """
    conn = ClientConnection(hello, limits)
    try:
        async with asyncio.timeout(timeout):
            await ws.send_many(conn.data_to_send())
            try:
                msg = await ws.receive()
            except ConnectionError as exc:
                err = RemoteProtocolError(HandshakeCode.CLOSED, f"gateway closed the tunnel during the handshake "
                                                                f"({exc})")
                conn.fail(err.text)
                raise err from None
    except RemoteProtocolError:
        raise
    except BaseException as exc:  # no WELCOME in time, or the agent stops: it gives up on the handshake
        conn.close(reason=f"handshake abandoned: {type(exc).__name__}")
        raise
    welcome = conn.receive_welcome(msg, asyncio.get_running_loop().time())
    sock = ws.get_extra_info("socket")  # the tunnel's TCP socket: paced (raven/transport/pacer.py)
    return Tunnel(ws, conn, name=f"gw:{welcome.replica}", sock=sock), welcome


async def accept(ws: Channel, admit: Callable[[wire.Hello], wire.Welcome],
                 refused: Callable[[RemoteProtocolError | HandshakeRefused, bool], None], *, limits: wire.Limits,
                 timeout: float) -> tuple[Tunnel, wire.Hello]:
    """The gateway's side: read HELLO within ``timeout``, ask ``admit`` (the gateway's policy: it returns the
    WELCOME or raises :class:`HandshakeRefused`), answer WELCOME; the session is named after the agent.

    A refusal (the core's :class:`RemoteProtocolError` or the policy's) is told to ``refused`` with True (log,
    metric), answered with GOAWAY (best effort) and raised; a HELLO that never came is told with False and raised
    unanswered.
    """
    conn = ServerConnection(limits)
    try:
        async with asyncio.timeout(timeout):
            msg = await ws.receive()
    except TimeoutError:
        err = RemoteProtocolError(HandshakeCode.NO_HELLO, f"no HELLO within {timeout:.0f}s")
        conn.fail(err.text)
        refused(err, False)
        raise err from None
    except ConnectionError as exc:
        err = RemoteProtocolError(HandshakeCode.BAD_HELLO, f"bad first message: {exc}")
        conn.fail(err.text)
        refused(err, False)
        raise err from None
    try:
        hello = conn.receive_hello(msg)
        welcome = admit(hello)
    except (RemoteProtocolError, HandshakeRefused) as refusal:
        conn.refuse(refusal.text)
        refused(refusal, True)
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(GOAWAY_SEND_TIMEOUT):
                await ws.send_many(conn.data_to_send())
        raise
    conn.accept(welcome, asyncio.get_running_loop().time())
    await ws.send_many(conn.data_to_send())
    return Tunnel(ws, conn, name=f"{hello.agent}/{hello.session[:8]}",
                   sock=ws.get_extra_info("socket")), hello
