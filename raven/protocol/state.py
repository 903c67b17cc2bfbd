"""A connection's life as named states and the table of what moves it (h11's ``_state.py`` idea: the rules as
data). One object, raven/protocol/connection.py's :class:`Connection`, goes through all of it.

::

    HANDSHAKE --AGREED--> OPEN --PEER_DRAIN--> DRAINING
        |                  |                      |
        +------END---------+---------END----------+--> ENDED --CLOSE--> CLOSED
        +------CLOSE-------+---------CLOSE--------+------------CLOSE-----^

- HANDSHAKE: HELLO and WELCOME are being exchanged; no stream exists yet. The handshake's end takes AGREED
  (WELCOME sent or read), END (refused, or broken) or CLOSE (the local side gives up on it: no WELCOME in time).
- OPEN: streams flow both ways.
- DRAINING: the peer said DRAIN: the streams in flight finish, a gateway picks another agent for new ones.
- ENDED: the protocol is over (GOAWAY either way, a protocol error, a silent peer, a peer that does not read, a
  refused handshake); every stream was aborted and the transport must now be closed (h11's MUST_CLOSE).
- CLOSED: the local side closed the connection; nothing more is sent or received.

A pair not in :data:`SESSION_TRANSITIONS` is refused with :class:`SessionStateError`: a bug in the caller, never
the peer's doing (what a peer sends moves the state only through the legal events).
"""

from __future__ import annotations

import enum
from typing import Final

from mypy_extensions import mypyc_attr

from raven.errors import RavenError


class SessionState(enum.Enum):
    HANDSHAKE = "handshake"
    OPEN = "open"
    DRAINING = "draining"  # the peer is draining
    ENDED = "ended"  # the protocol is over: close the transport
    CLOSED = "closed"


class SessionEvent(enum.Enum):
    AGREED = "agreed"  # the handshake succeeded
    PEER_DRAIN = "peer-drain"  # a DRAIN frame arrived
    END = "end"  # GOAWAY, protocol error, heartbeat timeout, a peer not reading, a refused handshake
    CLOSE = "close"  # the local side closes


S, E = SessionState, SessionEvent

SESSION_TRANSITIONS: Final[dict[tuple[SessionState, SessionEvent], SessionState]] = {
    (S.HANDSHAKE, E.AGREED): S.OPEN,
    (S.HANDSHAKE, E.END): S.ENDED,
    (S.HANDSHAKE, E.CLOSE): S.CLOSED,
    (S.OPEN, E.PEER_DRAIN): S.DRAINING,
    (S.OPEN, E.END): S.ENDED,
    (S.OPEN, E.CLOSE): S.CLOSED,
    (S.DRAINING, E.PEER_DRAIN): S.DRAINING,  # a second DRAIN says nothing new
    (S.DRAINING, E.END): S.ENDED,
    (S.DRAINING, E.CLOSE): S.CLOSED,
    (S.ENDED, E.CLOSE): S.CLOSED,
}

LIVE: Final = frozenset({S.OPEN, S.DRAINING})  # streams may be open
OVER: Final = frozenset({S.ENDED, S.CLOSED})  # nothing more is sent or received

del S, E


@mypyc_attr(native_class=False)  # two exception bases: an ordinary class when compiled
class SessionStateError(RavenError, RuntimeError):
    """The local side asked for a move the session's state does not allow (a bug in the caller)."""

    def __init__(self, state: SessionState, event: SessionEvent) -> None:
        super().__init__(f"session is {state.value}: {event.value} is not allowed there")
        self.state = state
        self.event = event


def next_state(state: SessionState, event: SessionEvent) -> SessionState:
    """Where ``event`` takes a session in ``state``. Raises :class:`SessionStateError`."""
    nxt = SESSION_TRANSITIONS.get((state, event))
    if nxt is None:
        raise SessionStateError(state, event)
    return nxt
