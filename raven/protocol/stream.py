"""One stream as the protocol sees it: its two halves as a transition table, its flow accounts, its errors.

Each direction of a stream is a small machine (h11's ``_state.py`` idea: the rules as a table)::

    HEAD --HEAD--> BODY --DATA--> BODY --FIN--> DONE          HEAD --HEAD+FIN--> DONE

The opener's (gateway's) sending half starts in BODY (its OPEN was the head) and its receiving half in HEAD
(the response head comes first); the acceptor's (agent's) halves are the mirror. An OPEN with FIN starts the
request half in DONE. A RESET, sent or received, ends both halves at once. raven/protocol/session.py keeps the
table of these and moves them.
"""

from __future__ import annotations

import enum
from typing import Final

from mypy_extensions import mypyc_attr

from raven.errors import RavenError
from raven.protocol import wire
from raven.protocol.flow import RecvWindow, SendCredit


class Half(enum.IntEnum):
    """Where one direction of a stream is."""

    HEAD = 0  # the head must come first
    BODY = 1  # data may flow
    DONE = 2  # FIN sent or received: nothing more in this direction


class Step(enum.IntEnum):
    HEAD = 0
    HEAD_FIN = 1
    DATA = 2
    FIN = 3  # END, or the FIN flag on DATA (after its data)


# The whole lifecycle of one direction: a (state, step) pair not in the table breaks the protocol.
TRANSITIONS: Final[dict[tuple[Half, Step], Half]] = {
    (Half.HEAD, Step.HEAD): Half.BODY,
    (Half.HEAD, Step.HEAD_FIN): Half.DONE,
    (Half.BODY, Step.DATA): Half.BODY,
    (Half.BODY, Step.FIN): Half.DONE,
}

WHY_NOT: Final[dict[tuple[Half, Step], str]] = {
    (Half.BODY, Step.HEAD): "second HEAD on stream",
    (Half.BODY, Step.HEAD_FIN): "second HEAD on stream",
    (Half.DONE, Step.HEAD): "HEAD after END",
    (Half.DONE, Step.HEAD_FIN): "HEAD after END",
    (Half.HEAD, Step.DATA): "DATA before HEAD",
    (Half.HEAD, Step.FIN): "END before HEAD",
    (Half.DONE, Step.DATA): "DATA after END",
    (Half.DONE, Step.FIN): "END after END",
}


class StreamReset(RavenError):
    """The stream was reset, by the peer or locally. ``code`` is a :class:`wire.ResetCode`."""

    def __init__(self, code: int, reason: str, *, remote: bool) -> None:
        super().__init__(f"{code_name(code)}: {reason}")
        self.code = code
        self.reason = reason
        self.remote = remote


@mypyc_attr(native_class=False)  # two exception bases: an ordinary class when compiled
class LocalProtocolError(RavenError, RuntimeError):
    """This side tried something the protocol does not allow (a bug in the caller, never the peer's doing)."""


def code_name(code: int) -> str:
    try:
        return wire.ResetCode(code).name
    except ValueError:
        return f"code {code}"


class StreamState:
    """The protocol's view of one stream: both halves and both flow-control accounts."""

    __slots__ = ("credit", "id", "local", "open", "recv", "remote")

    def __init__(self, stream_id: int, open_frame: wire.Open, local: Half, remote: Half, window: int,
                 peer_window: int) -> None:
        self.id = stream_id
        self.open = open_frame
        self.local = local
        self.remote = remote
        self.recv = RecvWindow(window)
        self.credit = SendCredit(peer_window)

    def local_next(self, step: Step) -> Half:
        """The half this side's ``step`` leads to (not taken yet); raises :class:`LocalProtocolError`."""
        nxt = TRANSITIONS.get((self.local, step))
        if nxt is None:
            raise LocalProtocolError(f"stream {self.id}: {WHY_NOT.get((self.local, step), 'not allowed')} (local)")
        return nxt

    def remote_step(self, step: Step) -> None:
        """Take the peer's ``step``; a step the table does not allow is the peer's protocol error."""
        nxt = TRANSITIONS.get((self.remote, step))
        if nxt is None:
            raise wire.ProtocolError(WHY_NOT.get((self.remote, step), "frame not allowed here"), self.id)
        self.remote = nxt
