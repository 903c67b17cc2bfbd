"""The session handshake, sans I/O: HELLO (agent) and WELCOME (gateway), the version both speak, and what a
session is then built with on either side (the same numbers, seen from each end).

The gateway's own admission rules (certificate names, caps, rates) are gateway policy and live in
gateway/tunnel.py; this module only reads and checks the two messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raven.errors import RavenError
from raven.protocol import wire


class HandshakeRefused(RavenError):
    """The peer's handshake message cannot start a session; ``reason`` says why (it is logged and, on the
    gateway, sent in GOAWAY). ``label`` is a fixed word for a metric."""

    def __init__(self, reason: str, label: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.label = label or reason.split(":")[0][:40]


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
            f"no common protocol version: agent speaks {list(offered)}, gateway {list(supported)}", "version"
        )
    return max(common)


def read_hello(message: bytes | bytearray | memoryview, limits: wire.Limits) -> wire.Hello:
    """The gateway reads the first message of a session. Raises :class:`HandshakeRefused`."""
    try:
        frame = wire.decode(message, limits)
    except wire.ProtocolError as err:
        raise HandshakeRefused(f"bad HELLO: {err.reason}", "bad-hello") from None
    if not isinstance(frame, wire.Hello):
        raise HandshakeRefused("first frame must be HELLO", "no-hello")
    return frame


def read_welcome(message: bytes | bytearray | memoryview, limits: wire.Limits,
                 supported: Sequence[int] = wire.SUPPORTED_VERSIONS) -> wire.Welcome:
    """The agent reads the gateway's answer to HELLO. Raises :class:`HandshakeRefused`."""
    try:
        frame = wire.decode(message, limits)
    except wire.ProtocolError as err:
        raise HandshakeRefused(f"bad WELCOME: {err.reason}") from None
    if isinstance(frame, wire.GoAway):
        raise HandshakeRefused(f"gateway refused the session: {frame.reason}")
    if not isinstance(frame, wire.Welcome):
        raise HandshakeRefused(f"expected WELCOME, got {type(frame).__name__}")
    if frame.version not in supported:
        raise HandshakeRefused(f"gateway chose protocol version {frame.version}; this agent speaks {list(supported)}")
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
