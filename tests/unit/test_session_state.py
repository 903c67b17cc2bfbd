"""The session's life as a table (raven/protocol/state.py), and the core, the handshake and the control
dispatcher moving along it: no sockets."""

from __future__ import annotations

import itertools

import pytest

from raven.protocol import wire
from raven.protocol.connection import Connection
from raven.protocol.control import ControlDispatcher
from raven.protocol.errors import HandshakeCode, LocalProtocolError, RemoteProtocolError
from raven.protocol.events import EndCause, SessionEnded
from raven.protocol.handshake import ClientConnection, ServerConnection
from raven.protocol.state import (
    LIVE,
    OVER,
    SESSION_TRANSITIONS,
    SessionEvent,
    SessionState,
    SessionStateError,
    next_state,
)
from tests.support.memsession import core_pair

S, E = SessionState, SessionEvent

LEGAL = [
    (S.HANDSHAKE, E.AGREED, S.OPEN),
    (S.HANDSHAKE, E.END, S.ENDED),
    (S.HANDSHAKE, E.CLOSE, S.CLOSED),
    (S.OPEN, E.PEER_DRAIN, S.DRAINING),
    (S.OPEN, E.END, S.ENDED),
    (S.OPEN, E.CLOSE, S.CLOSED),
    (S.DRAINING, E.PEER_DRAIN, S.DRAINING),
    (S.DRAINING, E.END, S.ENDED),
    (S.DRAINING, E.CLOSE, S.CLOSED),
    (S.ENDED, E.CLOSE, S.CLOSED),
]


@pytest.mark.parametrize(("state", "event", "after"), LEGAL)
def test_every_legal_transition(state: SessionState, event: SessionEvent, after: SessionState) -> None:
    assert next_state(state, event) is after


def test_the_table_is_exactly_the_legal_transitions() -> None:
    assert {(s, e): a for s, e, a in LEGAL} == SESSION_TRANSITIONS


ILLEGAL = [(s, e) for s, e in itertools.product(SessionState, SessionEvent) if (s, e) not in SESSION_TRANSITIONS]


@pytest.mark.parametrize(("state", "event"), ILLEGAL)
def test_every_illegal_transition_is_refused_with_a_clear_error(state: SessionState, event: SessionEvent) -> None:
    with pytest.raises(SessionStateError) as info:
        next_state(state, event)
    assert info.value.state is state and info.value.event is event
    assert str(info.value) == f"session is {state.value}: {event.value} is not allowed there"


def test_closed_is_final_and_nothing_returns_to_the_handshake() -> None:
    assert not [e for e in SessionEvent if (S.CLOSED, e) in SESSION_TRANSITIONS]
    assert S.HANDSHAKE not in SESSION_TRANSITIONS.values()
    assert LIVE.isdisjoint(OVER)


def _core(opener: bool) -> Connection:
    return core_pair(1024, 4, version=1)[0 if opener else 1]


def state(machine: Connection) -> SessionState:
    """Read afresh (a call, so that a type checker does not keep an earlier comparison's narrowing)."""
    return machine.state


def test_the_core_moves_along_the_table_drain_then_end_then_close() -> None:
    gw = _core(True)
    assert gw.state is S.OPEN and gw.usable and not gw.closed
    gw.receive(wire.encode(wire.Drain("agent stopping")), 1.0)  # version 1: one frame per message
    assert state(gw) is S.DRAINING and gw.peer_draining and not gw.usable and not gw.closed
    events = gw.receive(wire.encode(wire.GoAway(0, "bye")), 2.0)
    assert isinstance(events[-1], SessionEnded) and events[-1].cause is EndCause.GOAWAY
    assert state(gw) is S.ENDED and gw.closed and gw.peer_draining  # it ended while the peer drained
    assert gw.close() == [] and state(gw) is S.CLOSED
    assert gw.close() == [] and state(gw) is S.CLOSED  # idempotent


def test_a_local_abort_ends_the_protocol_and_aborts_streams_without_goaway() -> None:
    gw = _core(True)
    sid = gw.open_stream(wire.Open(0, wire.StreamKind.HTTP, "edge-1", 9400, "GET", "/m", (), True))
    gw.data_to_send()
    events = gw.abort("peer not reading")
    assert gw.state is S.ENDED and not gw.alive(sid) and not gw.peer_draining
    assert isinstance(events[-1], SessionEnded) and events[-1].reason == "peer not reading"
    assert events[-1].cause is EndCause.ABORTED
    assert gw.data_to_send() == [] and gw.abort("again") == []


def test_handshake_agent_and_gateway_agree_on_one_connection_each() -> None:
    client = ClientConnection(wire.Hello("agent-1", "s1", window=4096, max_streams=8))
    server = ServerConnection(wire.DEFAULT_LIMITS)
    assert client.state is S.HANDSHAKE and server.state is S.HANDSHAKE
    assert not client.usable and not server.usable and not client.closed
    (hello_message,) = client.data_to_send()
    hello = server.receive_hello(hello_message)
    assert hello.agent == "agent-1"
    welcome = wire.Welcome(2, "gw-0", 1, heartbeat_interval=1.0, heartbeat_timeout=3.0, window=2048, max_streams=4)
    server.accept(welcome, now=10.0)
    (welcome_message,) = server.data_to_send()
    assert welcome_message == wire.encode(welcome)  # the wire is the frame itself, as before
    got = client.receive_welcome(welcome_message, now=10.0)
    assert got == welcome and state(server) is S.OPEN and state(client) is S.OPEN
    assert (server.local_window, server.peer_window, server.peer_max_streams) == (2048, 4096, 4)
    assert (client.local_window, client.peer_window, client.local_max_streams) == (4096, 2048, 8)
    assert server.batched and client.batched and server.next_deadline() == 11.0
    with pytest.raises(LocalProtocolError):
        server.accept(welcome, now=11.0)  # the handshake is over
    with pytest.raises(LocalProtocolError):
        server.fail("late")  # OPEN: a handshake failure is no longer a move it has


def test_a_refused_handshake_answers_goaway_and_ends() -> None:
    server = ServerConnection(wire.DEFAULT_LIMITS)
    server.receive_hello(wire.encode(wire.Hello("agent-1", "s1")))
    server.refuse("session cap")
    assert state(server) is S.ENDED and server.ended_from is S.HANDSHAKE and server.close_reason == "session cap"
    (goaway,) = server.data_to_send()
    assert goaway == wire.encode(wire.GoAway(wire.ResetCode.PROTOCOL, "session cap"))
    client = ClientConnection(wire.Hello("agent-1", "s1"))
    with pytest.raises(RemoteProtocolError, match="gateway refused the session: session cap") as info:
        client.receive_welcome(goaway, now=0.0)
    assert info.value.code is HandshakeCode.GOAWAY
    assert state(client) is S.ENDED
    with pytest.raises(LocalProtocolError):
        client.fail("closed")  # ENDED already: no second end
    assert client.close() == [] and state(client) is S.CLOSED


def test_a_first_message_that_is_not_hello_is_refused() -> None:
    server = ServerConnection(wire.DEFAULT_LIMITS)
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_hello(wire.encode(wire.Ping(1)))
    assert info.value.code is HandshakeCode.NO_HELLO
    with pytest.raises(LocalProtocolError):
        ServerConnection(wire.DEFAULT_LIMITS).accept(wire.Welcome(2, "gw", 1, 1.0, 3.0), now=0.0)  # no HELLO yet


HELLO = wire.encode(wire.Hello("agent-1", "s1", (1,)))


def _in(at: SessionState) -> ServerConnection:
    """A gateway connection brought to ``at`` by what really moves one."""
    conn = ServerConnection(wire.DEFAULT_LIMITS)
    if at is S.HANDSHAKE:
        return conn
    conn.receive_hello(HELLO)
    conn.accept(wire.Welcome(1, "gw-0", 1, 5.0, 15.0), 0.0)
    conn.data_to_send()
    if at is S.DRAINING:
        conn.receive(wire.encode(wire.Drain("stopping")), 0.0)
    elif at is S.ENDED:
        conn.abort("peer not reading")
    assert conn.state is at
    return conn


def _take(conn: ServerConnection, event: SessionEvent) -> None:
    """``event`` as the connection's own methods and messages cause it."""
    if event is E.AGREED:
        conn.receive_hello(HELLO)
        conn.accept(wire.Welcome(1, "gw-0", 1, 5.0, 15.0), 0.0)
    elif event is E.PEER_DRAIN:
        conn.receive(wire.encode(wire.Drain("stopping")), 0.0)
    elif event is E.END:
        if conn.state is S.HANDSHAKE:
            conn.refuse("session cap")
        else:
            conn.receive(wire.encode(wire.GoAway(0, "bye")), 0.0)
    else:
        conn.close()


@pytest.mark.parametrize(("at", "event", "after"), LEGAL)
def test_every_row_of_the_table_is_taken_by_the_connection(at: SessionState, event: SessionEvent,
                                                           after: SessionState) -> None:
    """No row is there for the picture only: the one connection object takes each through its own methods."""
    conn = _in(at)
    _take(conn, event)
    assert conn.state is after


def test_the_control_dispatcher_routes_by_type_and_tells_the_rest_to_unexpected() -> None:
    seen: list[tuple[str, str]] = []
    table: ControlDispatcher[str] = ControlDispatcher(
        lambda ctx, f: seen.append((ctx, "unexpected " + type(f).__name__)))
    table.on(wire.Drain, lambda ctx, f: seen.append((ctx, f.reason)))
    table.dispatch("s1", wire.Drain("stopping"))
    table.dispatch("s2", wire.Hello("a", "b"))
    assert seen == [("s1", "stopping"), ("s2", "unexpected Hello")]
    with pytest.raises(ValueError, match="Drain already has a handler"):
        table.on(wire.Drain, lambda ctx, f: None)
