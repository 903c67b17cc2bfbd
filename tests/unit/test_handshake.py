"""raven/protocol/handshake.py without sockets: HELLO and WELCOME read strictly with the core's own codes, the
version chosen, and each side's half of the handshake on the one connection that then carries the streams."""

from __future__ import annotations

import pytest

from raven.protocol import handshake, wire
from raven.protocol.errors import HandshakeCode, LocalProtocolError, RemoteProtocolError
from raven.protocol.handshake import ClientConnection, ServerConnection
from raven.protocol.state import SessionState
from tests.support.memsession import core_pair

LIMITS = wire.DEFAULT_LIMITS
S = SessionState


def test_the_newest_common_version_is_chosen() -> None:
    assert handshake.choose_version((1, 2), (1, 2)) == 2
    assert handshake.choose_version((1,), (1, 2)) == 1
    assert handshake.choose_version((2, 7), (1, 2)) == 2
    with pytest.raises(RemoteProtocolError) as info:
        handshake.choose_version((7, 8), (1, 2))
    assert info.value.code is HandshakeCode.VERSION and "7" in info.value.text


def test_read_hello() -> None:
    hello = wire.Hello("agent-a-1", "s" * 32)
    assert handshake.read_hello(wire.encode(hello), LIMITS) == hello
    with pytest.raises(RemoteProtocolError) as info:
        handshake.read_hello(wire.encode(wire.Ping(1)), LIMITS)
    assert info.value.code is HandshakeCode.NO_HELLO
    with pytest.raises(RemoteProtocolError) as info:
        handshake.read_hello(b"\xff\x00\x00", LIMITS)
    assert info.value.code is HandshakeCode.BAD_HELLO


def test_read_welcome() -> None:
    welcome = wire.Welcome(2, "gw-0", 2, 5.0, 15.0)
    assert handshake.read_welcome(wire.encode(welcome), LIMITS) == welcome
    cases = [
        (wire.encode(wire.GoAway(wire.ResetCode.LIMIT, "full")), HandshakeCode.GOAWAY, "refused the session: full"),
        (wire.encode(wire.Ping(1)), HandshakeCode.UNEXPECTED_FRAME, "expected WELCOME"),
        (wire.encode(wire.Welcome(9, "gw-0", 1, 5.0, 15.0)), HandshakeCode.WELCOME_VERSION, "version 9"),
        (b"", HandshakeCode.BAD_WELCOME, "bad WELCOME"),
    ]
    for message, code, words in cases:
        with pytest.raises(RemoteProtocolError, match=words) as info:
            handshake.read_welcome(message, LIMITS)
        assert info.value.code is code


def test_a_code_is_what_code_reads_never_the_text() -> None:
    # A GOAWAY from the gateway carries whatever text it chose: the agent's code is still GOAWAY.
    with pytest.raises(RemoteProtocolError) as info:
        handshake.read_welcome(wire.encode(wire.GoAway(wire.ResetCode.PROTOCOL, "version: x")), LIMITS)
    assert info.value.code is HandshakeCode.GOAWAY and str(info.value) == info.value.text
    assert "GOAWAY" in repr(info.value)


def test_each_side_sees_the_same_numbers_from_its_end() -> None:
    ag = ClientConnection(wire.Hello("agent-a-1", "s", (1, 2), window=100_000, max_streams=50))
    gw = ServerConnection(LIMITS)
    gw.receive_hello(ag.data_to_send()[0])
    gw.accept(wire.Welcome(2, "gw-0", 1, 5.0, 15.0, window=200_000, max_streams=80), 0.0)
    ag.receive_welcome(gw.data_to_send()[0], 0.0)
    assert (gw.local_window, gw.peer_window) == (ag.peer_window, ag.local_window) == (200_000, 100_000)
    assert gw.peer_max_streams == 50 and ag.local_max_streams == 50 and ag.peer_max_streams == 80
    assert gw.version == ag.version == 2 and gw.opener and not ag.opener


def test_a_gateway_cannot_make_the_agent_spin_or_flap() -> None:
    _, ag = core_pair(heartbeat=(0.001, 0.001))
    assert ag.heartbeat_interval == handshake.MIN_HEARTBEAT_INTERVAL
    assert ag.heartbeat_timeout >= 2 * ag.heartbeat_interval


def test_one_connection_runs_from_hello_to_closed() -> None:
    """The object the handshake starts is the one that carries the streams and is closed: no hand-over."""
    ag = ClientConnection(wire.Hello("agent-1", "s1"))
    gw = ServerConnection(LIMITS)
    states = [(gw.state, ag.state)]
    gw.receive_hello(ag.data_to_send()[0])
    gw.accept(wire.Welcome(3, "gw-0", 1, 5.0, 15.0), 0.0)
    ag.receive_welcome(gw.data_to_send()[0], 0.0)
    states.append((gw.state, ag.state))
    sid = gw.open_stream(wire.Open(0, wire.StreamKind.HTTP, "edge-1", 9100, "GET", "/metrics", (), True))
    for m in gw.data_to_send():
        ag.receive(m, 0.0)
    assert ag.alive(sid)
    ag.close()
    gw.close()
    states.append((gw.state, ag.state))
    assert states == [(S.HANDSHAKE, S.HANDSHAKE), (S.OPEN, S.OPEN), (S.CLOSED, S.CLOSED)]


def test_the_local_side_giving_up_on_the_handshake_closes_it_and_sends_nothing() -> None:
    """(HANDSHAKE, CLOSE): no WELCOME in time, the agent closes: CLOSED, nothing sent, the HELLO aside."""
    ag = ClientConnection(wire.Hello("agent-1", "s1"))
    assert len(ag.data_to_send()) == 1  # the HELLO
    assert ag.close(reason="no WELCOME in time") == []
    assert ag.state is S.CLOSED and ag.ended_from is S.HANDSHAKE and ag.closed
    assert ag.close_reason == "no WELCOME in time" and ag.data_to_send() == []
    with pytest.raises(LocalProtocolError):
        ag.receive_welcome(wire.encode(wire.Welcome(3, "gw-0", 1, 5.0, 15.0)), 0.0)  # over: nothing more is read


def test_a_message_before_the_handshake_is_over_is_the_callers_bug() -> None:
    gw = ServerConnection(LIMITS)
    with pytest.raises(LocalProtocolError, match="handshake is not over"):
        gw.receive(wire.encode(wire.Ping(1)), 0.0)
    assert gw.state is S.HANDSHAKE  # still waiting for its HELLO
