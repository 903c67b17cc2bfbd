"""What the sans-I/O session reports when bytes arrive or time passes (wsproto's pattern: bytes in, events out).

The asyncio layer (raven/transport/) turns each event into a woken waiter; tests drive two sessions against each
other and read the events directly. Events a *local* call causes are not reported: the caller knows what it did,
and asks :meth:`raven.protocol.connection.Connection.alive` whether the stream is still in the table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from raven.protocol import wire


@dataclass(slots=True)
class StreamOpened:
    """The peer opened a stream (acceptor side). ``open.fin``: it sends no request body."""

    stream_id: int
    open: wire.Open


@dataclass(slots=True)
class HeadReceived:
    """The response head arrived (opener side)."""

    stream_id: int
    head: wire.Head


@dataclass(slots=True)
class DataReceived:
    """Data arrived (maybe empty); ``fin``: the peer sends nothing more (END, or FIN on DATA/HEAD)."""

    stream_id: int
    data: memoryview = field(repr=False)
    fin: bool


@dataclass(slots=True)
class CreditReceived:
    """The peer granted send credit: a writer waiting for it may go on."""

    stream_id: int


@dataclass(slots=True)
class StreamAborted:
    """The stream was reset: by the peer (``remote``) or by this side after a protocol error in a peer frame."""

    stream_id: int
    code: int
    reason: str
    remote: bool


@dataclass(slots=True)
class StreamClosed:
    """The stream left the table (both FINs exchanged, or a reset); reported once per stream, after the rest."""

    stream_id: int


@dataclass(slots=True)
class ControlReceived:
    """A control frame for the service: REGISTER, REGISTERED, DRAIN, or a misdirected HELLO/WELCOME."""

    frame: wire.ControlFrame


@dataclass(slots=True)
class DatagramReceived:
    """An IP packet arrived (layer 3)."""

    packet: memoryview = field(repr=False)


@dataclass(slots=True)
class ProtocolViolation:
    """The peer sent something malformed; already answered (RESET or GOAWAY). For the log, rate-limited."""

    stream_id: int
    reason: str


class EndCause(enum.Enum):
    """Why a session ended, as a code (``SessionEnded.reason`` is the text for the log)."""

    CLOSED = "closed"  # this side closed it
    ABORTED = "aborted"  # this side ended the protocol: a peer that does not read
    GOAWAY = "goaway"  # the peer said goodbye
    PROTOCOL = "protocol"  # the peer broke the protocol (answered with GOAWAY)
    HEARTBEAT = "heartbeat"  # the peer fell silent past the heartbeat deadline


@dataclass(slots=True)
class SessionEnded:
    """The session is over: the peer said GOAWAY, broke the protocol, or fell silent. Close the transport."""

    reason: str
    code: int
    cause: EndCause = EndCause.CLOSED


Event = (
    StreamOpened
    | HeadReceived
    | DataReceived
    | CreditReceived
    | StreamAborted
    | StreamClosed
    | ControlReceived
    | DatagramReceived
    | ProtocolViolation
    | SessionEnded
)
