"""The session handshake, sans I/O: HELLO (agent) and WELCOME (gateway), the version both speak, and what a
session is then built with on either side (the same numbers, seen from each end). :class:`ClientHandshake` and
:class:`ServerHandshake` drive the exchange and hand over a ready core session; raven/transport/connect.py runs
them over a WebSocket for both services.

The gateway's own admission rules (certificate names, caps, rates) are gateway policy and live in
gateway/tunnel.py; this module only reads and checks the two messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raven.protocol import wire
from raven.protocol.connection import Connection, LocalProtocolError
from raven.protocol.state import SessionEvent, SessionState, next_state
from raven.refusals import Reason, Refusal


class HandshakeRefused(Refusal):
    """The handshake cannot start a session: ``reason`` is the code (a :class:`Reason` of ``Where.HANDSHAKE`` on
    the gateway, ``Where.SESSION`` on the agent; the metric's label is ``reason.label``), ``text`` says why for
    people (it is logged and, on the gateway, sent in GOAWAY). ``key`` is whom the log line is rate-limited by
    (empty: the peer's address); ``answered``: False when the exchange broke before anything could be said."""

    def __init__(self, reason: Reason, text: str, *, key: str = "", answered: bool = True) -> None:
        super().__init__(reason, text)
        self.key = key
        self.answered = answered

    def __repr__(self) -> str:
        return f"HandshakeRefused({self.reason.name}, {self.text!r})"


@dataclass(frozen=True, slots=True)
class Agreement:
    """What one side builds its session with after the handshake."""

    version: int
    local_window: int
    peer_window: int
    local_max_streams: int
    peer_max_streams: int
    heartbeat_interval: float
    heartbeat_timeout: float


def choose_version(offered: Sequence[int], supported: Sequence[int] = wire.SUPPORTED_VERSIONS) -> int:
    """The newest version both sides speak. Raises :class:`HandshakeRefused`."""
    common = set(offered) & set(supported)
    if not common:
        raise HandshakeRefused(
            Reason.VERSION, f"no common protocol version: agent speaks {list(offered)}, gateway {list(supported)}"
        )
    return max(common)


def read_hello(message: bytes | bytearray | memoryview, limits: wire.Limits) -> wire.Hello:
    """The gateway reads the first message of a session. Raises :class:`HandshakeRefused`."""
    try:
        frame = wire.decode(message, limits)
    except wire.ProtocolError as err:
        raise HandshakeRefused(Reason.BAD_HELLO, f"bad HELLO: {err.reason}") from None
    if not isinstance(frame, wire.Hello):
        raise HandshakeRefused(Reason.NO_HELLO, "first frame must be HELLO")
    return frame


def read_welcome(message: bytes | bytearray | memoryview, limits: wire.Limits,
                 supported: Sequence[int] = wire.SUPPORTED_VERSIONS) -> wire.Welcome:
    """The agent reads the gateway's answer to HELLO. Raises :class:`HandshakeRefused`."""
    try:
        frame = wire.decode(message, limits)
    except wire.ProtocolError as err:
        raise HandshakeRefused(Reason.BAD_WELCOME, f"bad WELCOME: {err.reason}") from None
    if isinstance(frame, wire.GoAway):
        raise HandshakeRefused(Reason.GATEWAY_REFUSED, f"gateway refused the session: {frame.reason}")
    if not isinstance(frame, wire.Welcome):
        raise HandshakeRefused(Reason.NO_WELCOME, f"expected WELCOME, got {type(frame).__name__}")
    if frame.version not in supported:
        raise HandshakeRefused(Reason.WELCOME_VERSION,
                               f"gateway chose protocol version {frame.version}; this agent speaks {list(supported)}")
    return frame


def gateway_side(hello: wire.Hello, welcome: wire.Welcome) -> Agreement:
    """The gateway's session: it grants ``welcome.window`` and opens at most what both sides allow."""
    return Agreement(
        version=welcome.version,
        local_window=welcome.window,
        peer_window=hello.window,
        local_max_streams=welcome.max_streams,
        peer_max_streams=min(hello.max_streams, welcome.max_streams),
        heartbeat_interval=welcome.heartbeat_interval,
        heartbeat_timeout=welcome.heartbeat_timeout,
    )


MIN_HEARTBEAT_INTERVAL = 0.5  # seconds: a gateway cannot make an agent ping in a loop


def agent_side(hello: wire.Hello, welcome: wire.Welcome) -> Agreement:
    """The agent's session: it grants ``hello.window`` and accepts at most ``hello.max_streams``.

    The gateway's heartbeat is taken within bounds: an interval of at least half a second, and a timeout of at
    least twice the interval (a gateway cannot make the agent spin, nor its sessions flap)."""
    interval = max(welcome.heartbeat_interval, MIN_HEARTBEAT_INTERVAL)
    return Agreement(
        version=welcome.version,
        local_window=hello.window,
        peer_window=welcome.window,
        local_max_streams=hello.max_streams,
        peer_max_streams=welcome.max_streams,
        heartbeat_interval=interval,
        heartbeat_timeout=max(welcome.heartbeat_timeout, 2 * interval),
    )


class _Handshake:
    """One side of the HELLO/WELCOME exchange, sans I/O: messages in, ``data_to_send()`` out, and at the end a
    ready :class:`raven.protocol.connection.Connection` (OPEN) or a refusal (ENDED). Its life is the session's first
    state (raven/protocol/state.py)."""

    __slots__ = ("_out", "hello", "limits", "state")

    def __init__(self, limits: wire.Limits) -> None:
        self.limits = limits
        self.state = SessionState.HANDSHAKE
        self.hello: wire.Hello | None = None
        self._out: list[bytes] = []

    def data_to_send(self) -> list[bytes]:
        """The handshake's messages (one frame each, never batched)."""
        out, self._out = self._out, []
        return out

    def _session(self, agreed: Agreement, *, opener: bool, now: float) -> Connection:
        self.state = next_state(self.state, SessionEvent.AGREED)
        return Connection(opener=opener, local_window=agreed.local_window, peer_window=agreed.peer_window,
                       local_max_streams=agreed.local_max_streams, peer_max_streams=agreed.peer_max_streams,
                       limits=self.limits, version=agreed.version, heartbeat_interval=agreed.heartbeat_interval,
                       heartbeat_timeout=agreed.heartbeat_timeout, now=now)

    def _refused(self, err: HandshakeRefused) -> HandshakeRefused:
        self.state = next_state(self.state, SessionEvent.END)
        return err


class ClientHandshake(_Handshake):
    """The agent's side: HELLO is queued at once; :meth:`receive_welcome` gives the session."""

    __slots__ = ()

    def __init__(self, hello: wire.Hello, limits: wire.Limits = wire.DEFAULT_LIMITS) -> None:
        super().__init__(limits)
        self.hello = hello
        self._out.append(wire.encode(hello))

    def receive_welcome(self, message: bytes | bytearray | memoryview, now: float,
                        supported: Sequence[int] = wire.SUPPORTED_VERSIONS) -> tuple[Connection, wire.Welcome]:
        """The gateway's answer: the session on the agreed numbers (heartbeat from ``now``) and the WELCOME.
        Raises :class:`HandshakeRefused` (a GOAWAY, a bad or unexpected frame, a version this agent lacks)."""
        if self.state is not SessionState.HANDSHAKE or self.hello is None:
            raise LocalProtocolError(f"the handshake is over: {self.state.value}")
        try:
            welcome = read_welcome(message, self.limits, supported)
        except HandshakeRefused as err:
            raise self._refused(err) from None
        return self._session(agent_side(self.hello, welcome), opener=False, now=now), welcome

    def fail(self, err: HandshakeRefused) -> HandshakeRefused:
        """The exchange broke before a WELCOME (the connection closed): ENDED; returns ``err`` for the caller to
        raise."""
        return self._refused(err)


class ServerHandshake(_Handshake):
    """The gateway's side: :meth:`receive_hello`, then the gateway's own admission, then :meth:`accept` (WELCOME
    queued, the session returned) or :meth:`refuse` (GOAWAY queued)."""

    __slots__ = ()

    def receive_hello(self, message: bytes | bytearray | memoryview) -> wire.Hello:
        """The session's first message. Raises :class:`HandshakeRefused` (refuse it with that refusal)."""
        if self.state is not SessionState.HANDSHAKE or self.hello is not None:
            raise LocalProtocolError("HELLO was already read")
        self.hello = read_hello(message, self.limits)
        return self.hello

    def accept(self, welcome: wire.Welcome, now: float) -> Connection:
        if self.state is not SessionState.HANDSHAKE or self.hello is None:
            raise LocalProtocolError("accept() needs a HELLO and an unfinished handshake")
        self._out.append(wire.encode(welcome))
        return self._session(gateway_side(self.hello, welcome), opener=True, now=now)

    def refuse(self, err: HandshakeRefused) -> HandshakeRefused:
        """Answer with GOAWAY (the refusal's text, code PROTOCOL); returns ``err`` for the caller to raise."""
        self._out.append(wire.encode(wire.GoAway(wire.ResetCode.PROTOCOL, err.text)))
        return self._refused(err)

    def fail(self, err: HandshakeRefused) -> HandshakeRefused:
        """The exchange broke before a HELLO (none in time, not a binary message): ENDED, nothing sent."""
        return self._refused(err)
