"""The handshake, sans I/O: HELLO (agent) and WELCOME (gateway), the version both speak, and each side's half of
it on the one :class:`~raven.protocol.connection.Connection` that then carries the streams (websockets'
``ClientProtocol``/``ServerProtocol`` beside its ``Protocol``): :class:`ClientConnection` is the agent's,
:class:`ServerConnection` the gateway's. raven/transport/connect.py runs them over a WebSocket.

A handshake that fails raises :class:`~raven.protocol.errors.RemoteProtocolError` with the core's own
:class:`~raven.protocol.errors.HandshakeCode`; the services map it to a metric label or an HTTP status. The
gateway's own admission rules (certificate names, caps, rates) are gateway policy and live in gateway/tunnel.py;
this module only reads and checks the two messages.
"""

from __future__ import annotations

from collections.abc import Sequence

from raven.protocol import wire
from raven.protocol.connection import Connection
from raven.protocol.errors import HandshakeCode, LocalProtocolError, RemoteProtocolError
from raven.protocol.state import SessionState

MIN_HEARTBEAT_INTERVAL = 0.5  # seconds: a gateway cannot make an agent ping in a loop


def choose_version(offered: Sequence[int], supported: Sequence[int] = wire.SUPPORTED_VERSIONS) -> int:
    """The newest version both sides speak. Raises :class:`RemoteProtocolError` (``VERSION``)."""
    common = set(offered) & set(supported)
    if not common:
        raise RemoteProtocolError(
            HandshakeCode.VERSION,
            f"no common protocol version: agent speaks {list(offered)}, gateway {list(supported)}",
        )
    return max(common)


def read_hello(message: bytes | bytearray | memoryview, limits: wire.Limits) -> wire.Hello:
    """The gateway reads the first message of a connection. Raises :class:`RemoteProtocolError`."""
    try:
        frame = wire.decode(message, limits)
    except wire.ProtocolError as err:
        raise RemoteProtocolError(HandshakeCode.BAD_HELLO, f"bad HELLO: {err.reason}") from None
    if not isinstance(frame, wire.Hello):
        raise RemoteProtocolError(HandshakeCode.NO_HELLO, "first frame must be HELLO")
    return frame


def read_welcome(message: bytes | bytearray | memoryview, limits: wire.Limits,
                 supported: Sequence[int] = wire.SUPPORTED_VERSIONS) -> wire.Welcome:
    """The agent reads the gateway's answer to HELLO. Raises :class:`RemoteProtocolError`."""
    try:
        frame = wire.decode(message, limits)
    except wire.ProtocolError as err:
        raise RemoteProtocolError(HandshakeCode.BAD_WELCOME, f"bad WELCOME: {err.reason}") from None
    if isinstance(frame, wire.GoAway):
        raise RemoteProtocolError(HandshakeCode.GOAWAY, f"gateway refused the session: {frame.reason}")
    if not isinstance(frame, wire.Welcome):
        raise RemoteProtocolError(HandshakeCode.UNEXPECTED_FRAME, f"expected WELCOME, got {type(frame).__name__}")
    if frame.version not in supported:
        raise RemoteProtocolError(
            HandshakeCode.WELCOME_VERSION,
            f"gateway chose protocol version {frame.version}; this agent speaks {list(supported)}",
        )
    return frame


def _under_way(conn: Connection, what: str) -> wire.Hello:
    """The HELLO of a handshake still under way; raises :class:`LocalProtocolError` (``what`` says why)."""
    if conn.state is not SessionState.HANDSHAKE or conn.hello is None:
        raise LocalProtocolError(f"{what}: the connection is {conn.state.value}")
    return conn.hello


class ClientConnection(Connection):
    """The agent's connection: HELLO is queued at once; :meth:`receive_welcome` opens it (or ends it)."""

    __slots__ = ()

    def __init__(self, hello: wire.Hello, limits: wire.Limits = wire.DEFAULT_LIMITS, now: float = 0.0) -> None:
        super().__init__(opener=False, limits=limits, now=now)
        self.hello = hello
        self._greeting = [*(self._greeting or ()), wire.encode(hello)]

    def receive_welcome(self, message: bytes | bytearray | memoryview, now: float,
                        supported: Sequence[int] = wire.SUPPORTED_VERSIONS) -> wire.Welcome:
        """The gateway's answer: OPEN on the agreed numbers (heartbeat from ``now``); returns the WELCOME.
        Raises :class:`RemoteProtocolError` (a GOAWAY, a bad or unexpected frame, a version this agent lacks): ENDED.

        The agent grants ``hello.window`` and accepts at most ``hello.max_streams``; the gateway's heartbeat is
        taken within bounds: an interval of at least half a second, and a timeout of at least twice the interval
        (a gateway cannot make the agent spin, nor its sessions flap)."""
        hello = _under_way(self, "WELCOME needs a handshake under way")
        try:
            welcome = read_welcome(message, self.limits, supported)
        except RemoteProtocolError as err:
            self.fail(err.text)
            raise
        interval = max(welcome.heartbeat_interval, MIN_HEARTBEAT_INTERVAL)
        self._agree(version=welcome.version, local_window=hello.window, peer_window=welcome.window,
                    local_max_streams=hello.max_streams, peer_max_streams=welcome.max_streams,
                    heartbeat_interval=interval, heartbeat_timeout=max(welcome.heartbeat_timeout, 2 * interval),
                    now=now)
        return welcome


class ServerConnection(Connection):
    """The gateway's connection (it opens the streams): :meth:`receive_hello`, then the gateway's own admission,
    then :meth:`accept` (WELCOME queued, OPEN) or :meth:`refuse` (GOAWAY queued, ENDED)."""

    __slots__ = ()

    def __init__(self, limits: wire.Limits = wire.DEFAULT_LIMITS, now: float = 0.0) -> None:
        super().__init__(opener=True, limits=limits, now=now)

    def receive_hello(self, message: bytes | bytearray | memoryview) -> wire.Hello:
        """The connection's first message. Raises :class:`RemoteProtocolError` (answer it with :meth:`refuse`)."""
        if self.state is not SessionState.HANDSHAKE or self.hello is not None:
            raise LocalProtocolError(f"HELLO was already read: the connection is {self.state.value}")
        self.hello = read_hello(message, self.limits)
        return self.hello

    def accept(self, welcome: wire.Welcome, now: float) -> None:
        """Answer WELCOME: OPEN on its numbers (heartbeat from ``now``). The gateway grants ``welcome.window`` and
        opens at most what both sides allow."""
        hello = _under_way(self, "accept() needs a HELLO")
        self._greeting = [*(self._greeting or ()), wire.encode(welcome)]
        self._agree(version=welcome.version, local_window=welcome.window, peer_window=hello.window,
                    local_max_streams=welcome.max_streams,
                    peer_max_streams=min(hello.max_streams, welcome.max_streams),
                    heartbeat_interval=welcome.heartbeat_interval, heartbeat_timeout=welcome.heartbeat_timeout,
                    now=now)

    def refuse(self, text: str) -> None:
        """Answer GOAWAY (code PROTOCOL, ``text`` for people): ENDED."""
        if self.state is not SessionState.HANDSHAKE:
            raise LocalProtocolError(f"refuse() needs a handshake under way: the connection is {self.state.value}")
        self._greeting = [*(self._greeting or ()), wire.encode(wire.GoAway(wire.ResetCode.PROTOCOL, text))]
        self.fail(text)
