"""connect() and accept() (raven/transport/connect.py) over a scripted aiohttp WebSocket: no sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from raven.errors import RavenError
from raven.protocol import wire
from raven.protocol.errors import HandshakeCode, RemoteProtocolError
from raven.protocol.state import SessionState
from raven.refusals import HandshakeRefused, Reason
from raven.transport.connect import accept, connect
from raven.transport.websocket import TransportError, WebSocketSink, messages

HELLO = wire.Hello("agent-1", "0123456789abcdef", window=4096, max_streams=8, release="0.3.0")
WELCOME = wire.Welcome(2, "gw-0", 2, heartbeat_interval=1.0, heartbeat_timeout=3.0, window=2048, max_streams=4)


class ScriptedWS:
    """The methods connect()/accept() use, answering from a script; what is sent is kept."""

    def __init__(self, *incoming: aiohttp.WSMessage | bytes | None) -> None:
        self.incoming = list(incoming)
        self.sent: list[bytes] = []

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default  # no TCP socket under a script: the session is not paced

    async def _next(self) -> aiohttp.WSMessage | bytes:
        item = self.incoming.pop(0) if self.incoming else None
        if item is None:
            await asyncio.Event().wait()  # the peer says nothing
        assert item is not None
        return item

    async def receive(self) -> aiohttp.WSMessage:
        item = await self._next()
        return aiohttp.WSMessage(aiohttp.WSMsgType.BINARY, item, None) if isinstance(item, bytes) else item

    async def receive_bytes(self) -> bytes:
        item = await self._next()
        if not isinstance(item, bytes):
            raise TypeError(f"Received message {item.type}:{item.data!r} is not bytes")
        return item

    async def close(self) -> None:
        pass


async def test_connect_sends_hello_and_returns_an_open_session_named_after_the_replica() -> None:
    ws = ScriptedWS(wire.encode(WELCOME))
    session, welcome = await connect(WebSocketSink(ws), HELLO, limits=wire.DEFAULT_LIMITS, timeout=5)  # type: ignore[arg-type]
    assert ws.sent == [wire.encode(HELLO)]
    assert welcome == WELCOME and session.name == "gw:gw-0"
    assert session.state is SessionState.OPEN and not session.core.opener
    assert (session.core.local_window, session.core.peer_window) == (4096, 2048)
    await session.close("test over")


async def test_connect_refuses_a_goaway_and_a_closed_connection_with_the_reason() -> None:
    ws = ScriptedWS(wire.encode(wire.GoAway(wire.ResetCode.PROTOCOL, "session cap")))
    with pytest.raises(RemoteProtocolError, match="gateway refused the session: session cap") as info:
        await connect(WebSocketSink(ws), HELLO, limits=wire.DEFAULT_LIMITS, timeout=5)  # type: ignore[arg-type]
    assert info.value.code is HandshakeCode.GOAWAY
    closed = ScriptedWS(aiohttp.WSMessage(aiohttp.WSMsgType.CLOSE, 1000, None))
    with pytest.raises(RemoteProtocolError, match=r"during the handshake \(websocket closed\)") as info:
        await connect(WebSocketSink(closed), HELLO, limits=wire.DEFAULT_LIMITS, timeout=5)  # type: ignore[arg-type]
    assert info.value.code is HandshakeCode.CLOSED


async def test_connect_waits_no_longer_than_its_deadline() -> None:
    with pytest.raises(TimeoutError):
        await connect(WebSocketSink(ScriptedWS()), HELLO, limits=wire.DEFAULT_LIMITS, timeout=0.05)  # type: ignore[arg-type]


async def test_accept_admits_answers_welcome_and_returns_an_open_session_named_after_the_agent() -> None:
    ws = ScriptedWS(wire.encode(HELLO))
    seen: list[wire.Hello] = []
    refusals: list[tuple[RemoteProtocolError | HandshakeRefused, bool]] = []

    def admit(hello: wire.Hello) -> wire.Welcome:
        seen.append(hello)
        return WELCOME

    session, hello = await accept(WebSocketSink(ws), admit, lambda err, answered: refusals.append((err, answered)),  # type: ignore[arg-type]
                                  limits=wire.DEFAULT_LIMITS, timeout=5)
    assert seen == [HELLO] and hello == HELLO and not refusals
    assert ws.sent == [wire.encode(WELCOME)]
    assert session.name == "agent-1/01234567" and session.core.opener and session.state is SessionState.OPEN
    assert session.core.peer_max_streams == 4  # the lower of both sides' stream limits
    await session.close("test over")


async def test_accept_tells_a_refusal_answers_goaway_and_raises() -> None:
    ws = ScriptedWS(wire.encode(HELLO))
    refusals: list[tuple[RemoteProtocolError | HandshakeRefused, bool]] = []

    def admit(hello: wire.Hello) -> wire.Welcome:
        raise HandshakeRefused(Reason.AGENT_SESSION_CAP, "agent-1 already holds 4 sessions", key="agent-1")

    with pytest.raises(HandshakeRefused) as info:
        await accept(WebSocketSink(ws), admit, lambda err, answered: refusals.append((err, answered)),  # type: ignore[arg-type]
                     limits=wire.DEFAULT_LIMITS, timeout=5)
    assert refusals == [(info.value, True)] and info.value.key == "agent-1"
    assert info.value.label == "agent-session-cap"
    assert ws.sent == [wire.encode(wire.GoAway(wire.ResetCode.PROTOCOL, "agent-1 already holds 4 sessions"))]


async def test_accept_refuses_a_first_message_that_is_not_hello() -> None:
    ws = ScriptedWS(wire.encode(wire.Ping(1)))
    refusals: list[tuple[RemoteProtocolError | HandshakeRefused, bool]] = []

    def admit(hello: wire.Hello) -> wire.Welcome:
        raise AssertionError("no HELLO: admit is not asked")

    with pytest.raises(RemoteProtocolError):
        await accept(WebSocketSink(ws), admit, lambda err, answered: refusals.append((err, answered)),  # type: ignore[arg-type]
                     limits=wire.DEFAULT_LIMITS, timeout=5)
    ((err, answered),) = refusals
    assert isinstance(err, RemoteProtocolError) and err.code is HandshakeCode.NO_HELLO and answered
    assert ws.sent == [wire.encode(wire.GoAway(wire.ResetCode.PROTOCOL, err.text))]  # the GOAWAY


@pytest.mark.parametrize("incoming", [None, aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, "hi", None)])
async def test_accept_without_a_binary_hello_in_time_says_nothing_and_tells_why(incoming: Any) -> None:
    ws = ScriptedWS(incoming)
    refusals: list[tuple[RemoteProtocolError | HandshakeRefused, bool]] = []

    def admit(hello: wire.Hello) -> wire.Welcome:
        raise AssertionError("no HELLO: admit is not asked")

    with pytest.raises(RemoteProtocolError):
        await accept(WebSocketSink(ws), admit, lambda err, answered: refusals.append((err, answered)),  # type: ignore[arg-type]
                     limits=wire.DEFAULT_LIMITS, timeout=0.05)
    ((err, answered),) = refusals
    assert not answered and ws.sent == [] and isinstance(err, RemoteProtocolError)
    assert err.code is (HandshakeCode.NO_HELLO if incoming is None else HandshakeCode.BAD_HELLO)


async def test_a_broken_websocket_ends_the_session_as_a_lost_connection() -> None:
    """messages() raises TransportError for what a session does not carry: a RavenError (one hierarchy) and a
    ConnectionError (Tunnel.run ends on it like on any lost connection)."""
    ws = ScriptedWS(wire.encode(WELCOME), aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, "hi", None))
    session, _ = await connect(WebSocketSink(ws), HELLO, limits=wire.DEFAULT_LIMITS, timeout=5)  # type: ignore[arg-type]
    with pytest.raises(TransportError) as info:
        await anext(messages(ws))  # type: ignore[arg-type]
    assert isinstance(info.value, RavenError) and isinstance(info.value, ConnectionError)
    ws.incoming.append(aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, "hi", None))
    await session.run(messages(ws))  # type: ignore[arg-type]
    assert session.closed and session.close_reason == "connection lost: unexpected websocket message type TEXT"
