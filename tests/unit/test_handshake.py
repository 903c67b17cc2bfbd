"""raven/protocol/handshake.py without sockets: HELLO and WELCOME read strictly, the version chosen, and what each
side builds its session with."""

from __future__ import annotations

import pytest

from raven.protocol import handshake, wire
from raven.protocol.handshake import HandshakeRefused

LIMITS = wire.DEFAULT_LIMITS


def test_the_newest_common_version_is_chosen() -> None:
    assert handshake.choose_version((1, 2), (1, 2)) == 2
    assert handshake.choose_version((1,), (1, 2)) == 1
    assert handshake.choose_version((2, 7), (1, 2)) == 2
    with pytest.raises(HandshakeRefused) as info:
        handshake.choose_version((7, 8), (1, 2))
    assert info.value.label == "version" and "7" in info.value.reason


def test_read_hello() -> None:
    hello = wire.Hello("agent-a-1", "s" * 32)
    assert handshake.read_hello(wire.encode(hello), LIMITS) == hello
    with pytest.raises(HandshakeRefused) as info:
        handshake.read_hello(wire.encode(wire.Ping(1)), LIMITS)
    assert info.value.label == "no-hello"
    with pytest.raises(HandshakeRefused) as info:
        handshake.read_hello(b"\xff\x00\x00", LIMITS)
    assert info.value.label == "bad-hello"


def test_read_welcome() -> None:
    welcome = wire.Welcome(2, "gw-0", 2, 5.0, 15.0)
    assert handshake.read_welcome(wire.encode(welcome), LIMITS) == welcome
    with pytest.raises(HandshakeRefused, match="refused the session: full"):
        handshake.read_welcome(wire.encode(wire.GoAway(wire.ResetCode.LIMIT, "full")), LIMITS)
    with pytest.raises(HandshakeRefused, match="expected WELCOME"):
        handshake.read_welcome(wire.encode(wire.Ping(1)), LIMITS)
    with pytest.raises(HandshakeRefused, match="version 9"):
        handshake.read_welcome(wire.encode(wire.Welcome(9, "gw-0", 1, 5.0, 15.0)), LIMITS)
    with pytest.raises(HandshakeRefused, match="bad WELCOME"):
        handshake.read_welcome(b"", LIMITS)


def test_each_side_sees_the_same_numbers_from_its_end() -> None:
    hello = wire.Hello("agent-a-1", "s", (1, 2), window=100_000, max_streams=50)
    welcome = wire.Welcome(2, "gw-0", 1, 5.0, 15.0, window=200_000, max_streams=80)
    gw = handshake.gateway_side(hello, welcome)
    ag = handshake.agent_side(hello, welcome)
    assert (gw.local_window, gw.peer_window) == (ag.peer_window, ag.local_window) == (200_000, 100_000)
    assert gw.peer_max_streams == 50 and ag.local_max_streams == 50
    assert gw.version == ag.version == 2


def test_a_gateway_cannot_make_the_agent_spin_or_flap() -> None:
    hello = wire.Hello("agent-a-1", "s")
    ag = handshake.agent_side(hello, wire.Welcome(2, "gw-0", 1, 0.001, 0.001))
    assert ag.heartbeat_interval == handshake.MIN_HEARTBEAT_INTERVAL
    assert ag.heartbeat_timeout >= 2 * ag.heartbeat_interval
