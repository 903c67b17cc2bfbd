"""raven/protocol/handshake.py without sockets: HELLO and WELCOME read strictly, the version chosen, and what each
side builds its session with."""

from __future__ import annotations

import pytest

from raven.protocol import handshake, wire
from raven.protocol.handshake import HandshakeRefused
from raven.refusals import Reason, Refusal, Where

LIMITS = wire.DEFAULT_LIMITS


def test_the_newest_common_version_is_chosen() -> None:
    assert handshake.choose_version((1, 2), (1, 2)) == 2
    assert handshake.choose_version((1,), (1, 2)) == 1
    assert handshake.choose_version((2, 7), (1, 2)) == 2
    with pytest.raises(HandshakeRefused) as info:
        handshake.choose_version((7, 8), (1, 2))
    assert info.value.reason is Reason.VERSION and info.value.label == "version" and "7" in info.value.text


def test_read_hello() -> None:
    hello = wire.Hello("agent-a-1", "s" * 32)
    assert handshake.read_hello(wire.encode(hello), LIMITS) == hello
    with pytest.raises(HandshakeRefused) as info:
        handshake.read_hello(wire.encode(wire.Ping(1)), LIMITS)
    assert info.value.reason is Reason.NO_HELLO and info.value.label == "no-hello"
    with pytest.raises(HandshakeRefused) as info:
        handshake.read_hello(b"\xff\x00\x00", LIMITS)
    assert info.value.reason is Reason.BAD_HELLO and info.value.label == "bad-hello"


def test_read_welcome() -> None:
    welcome = wire.Welcome(2, "gw-0", 2, 5.0, 15.0)
    assert handshake.read_welcome(wire.encode(welcome), LIMITS) == welcome
    cases = [
        (wire.encode(wire.GoAway(wire.ResetCode.LIMIT, "full")), Reason.GATEWAY_REFUSED, "refused the session: full"),
        (wire.encode(wire.Ping(1)), Reason.NO_WELCOME, "expected WELCOME"),
        (wire.encode(wire.Welcome(9, "gw-0", 1, 5.0, 15.0)), Reason.WELCOME_VERSION, "version 9"),
        (b"", Reason.BAD_WELCOME, "bad WELCOME"),
    ]
    for message, reason, words in cases:
        with pytest.raises(HandshakeRefused, match=words) as info:
            handshake.read_welcome(message, LIMITS)
        assert info.value.reason is reason and info.value.reason.where is Where.SESSION


def test_a_refusal_is_labelled_by_its_code_never_its_text() -> None:
    """The counter's label is the reason's: text that reads like another label (the old ``split(":")``
    derivation would have counted ``session-cap`` here) does not change it."""
    err = HandshakeRefused(Reason.AGENT_VERSION, "session-cap: agent a runs release 0.1.0", key="a")
    assert isinstance(err, Refusal)
    assert (err.label, err.status, err.text, str(err)) == ("agent-version", 400, err.text, err.text)
    assert (err.key, err.answered) == ("a", True)
    assert "AGENT_VERSION" in repr(err)
    # A GOAWAY from the gateway carries whatever text it chose: the agent's code is still GATEWAY_REFUSED.
    with pytest.raises(HandshakeRefused) as info:
        handshake.read_welcome(wire.encode(wire.GoAway(wire.ResetCode.PROTOCOL, "version: x")), LIMITS)
    assert info.value.reason is Reason.GATEWAY_REFUSED and info.value.label == "goaway"


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
