"""Both ends of the tunnel's handshake over a WebSocket, for both services: :func:`connect` (the agent) and
:func:`accept` (the gateway). Each drives the sans-I/O handshake (raven/protocol/handshake.py) and returns a
ready :class:`raven.transport.tunnel.Tunnel`, not yet running: the caller attaches its handlers, then awaits
``session.run(messages(ws))``. Every wait has the handshake's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import aiohttp
from aiohttp import web

from raven.protocol import wire
from raven.protocol.handshake import ClientHandshake, HandshakeRefused, ServerHandshake
from raven.refusals import Reason
from raven.transport.tunnel import Tunnel
from raven.transport.websocket import WebSocketSink

GOAWAY_SEND_TIMEOUT = 2.0  # seconds: a refusal's GOAWAY is sent best effort


async def connect(ws: aiohttp.ClientWebSocketResponse, hello: wire.Hello, *, limits: wire.Limits,
                  timeout: float) -> tuple[Tunnel, wire.Welcome]:
    """The agent's side: send HELLO, read WELCOME within ``timeout``; the session is named after the replica.

    Raises :class:`HandshakeRefused` (a GOAWAY, a bad answer, the connection closed) or ``TimeoutError``.
    """
    hs = ClientHandshake(hello, limits)
    async with asyncio.timeout(timeout):
        for message in hs.data_to_send():
            await ws.send_bytes(message)
        msg = await ws.receive()
    if msg.type != aiohttp.WSMsgType.BINARY:
        raise hs.fail(HandshakeRefused(Reason.HANDSHAKE_CLOSED,
                                       f"gateway closed the tunnel during the handshake ({msg.type.name})"))
    session_core, welcome = hs.receive_welcome(msg.data, asyncio.get_running_loop().time())
    sock = ws.get_extra_info("socket")  # the tunnel's TCP socket: paced (raven/transport/pacer.py)
    return Tunnel(WebSocketSink(ws), session_core, name=f"gw:{welcome.replica}", sock=sock), welcome


async def accept(ws: web.WebSocketResponse, admit: Callable[[wire.Hello], wire.Welcome],
                 refused: Callable[[HandshakeRefused], None], *, limits: wire.Limits,
                 timeout: float) -> tuple[Tunnel, wire.Hello]:
    """The gateway's side: read HELLO within ``timeout``, ask ``admit`` (the gateway's policy: it returns the
    WELCOME or raises :class:`HandshakeRefused`), answer WELCOME; the session is named after the agent.

    A refusal is told to ``refused`` (log, metric), answered with GOAWAY (best effort) and raised; a HELLO that
    never came is told and raised unanswered.
    """
    hs = ServerHandshake(limits)
    try:
        async with asyncio.timeout(timeout):
            msg = await ws.receive_bytes()
    except TimeoutError:
        err = hs.fail(HandshakeRefused(Reason.NO_HELLO, f"no HELLO within {timeout:.0f}s", answered=False))
        refused(err)
        raise err from None
    except (TypeError, ConnectionError) as exc:
        err = hs.fail(HandshakeRefused(Reason.BAD_HELLO, f"bad first message: {exc}", answered=False))
        refused(err)
        raise err from None
    try:
        hello = hs.receive_hello(msg)
        welcome = admit(hello)
    except HandshakeRefused as err:
        hs.refuse(err)
        refused(err)
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(GOAWAY_SEND_TIMEOUT):
                for message in hs.data_to_send():
                    await ws.send_bytes(message)
        raise
    session_core = hs.accept(welcome, asyncio.get_running_loop().time())
    for message in hs.data_to_send():
        await ws.send_bytes(message)
    return Tunnel(WebSocketSink(ws), session_core, name=f"{hello.agent}/{hello.session[:8]}",
                   sock=ws.get_extra_info("socket")), hello
